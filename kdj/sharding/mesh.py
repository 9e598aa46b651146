"""Meshes from config, and the checks that a model fits a mesh, before anything compiles.

YAML (configs/meshes/*.yaml):

    mesh: {data: 1, expert: 4, model: 2}   # product = number of devices
    rules: ep                               # tp | ep | ep_dp_attn

Multi-host: call `jax.distributed.initialize()` (JAX's own runtime; coordinator address,
process count and id from its arguments or the cluster environment) in every process before
`make_mesh`; the mesh then spans every process's devices (`jax.devices()` is global).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kdj.sharding.rules import MESH_AXES, PRESETS, Sharding, ShardingRules, axis_size


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    expert: int = 1
    model: int = 1
    rules: str = "tp"

    @property
    def size(self) -> int:
        return self.data * self.expert * self.model

    @staticmethod
    def from_dict(d: dict) -> MeshConfig:
        unknown = set(d) - {"mesh", "rules"}
        if unknown:  # a typo would silently run the defaults
            raise ValueError(f"unknown keys {sorted(unknown)} in the mesh config; expected "
                             "'mesh' (axis sizes) and 'rules' (a preset)")  # fmt: skip
        mesh = dict(d.get("mesh") or {})
        unknown = set(mesh) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; kdj meshes use {MESH_AXES}")
        rules = d.get("rules", "tp")
        if rules not in PRESETS:
            raise ValueError(f"unknown sharding rules {rules!r}; choose from {sorted(PRESETS)}")
        sizes = {k: int(v) for k, v in mesh.items()}
        if any(v < 1 for v in sizes.values()):
            raise ValueError(f"mesh axis sizes must be >= 1, got {sizes}")
        return MeshConfig(rules=rules, **sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Sharding:
    """Build the ("data", "expert", "model") mesh over all devices (all processes)."""
    devices = jax.devices() if devices is None else devices
    if cfg.size != len(devices):
        raise ValueError(
            f"mesh data={cfg.data} x expert={cfg.expert} x model={cfg.model} needs {cfg.size} "
            f"devices, but {len(devices)} are available"
        )
    grid = np.asarray(devices).reshape(cfg.data, cfg.expert, cfg.model)
    return Sharding(Mesh(grid, MESH_AXES), PRESETS[cfg.rules])


def check_fits(model, mesh: Mesh, rules: ShardingRules) -> None:
    """Every sharded parameter dimension must divide by its mesh axes: raise naming the first
    that does not (e.g. 9 attention heads over model=8)."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        for dim, logical in zip(shape, var.get_metadata()["axes"]):
            n = axis_size(mesh, None if logical is None else getattr(rules, logical))
            if dim % n:
                name = ".".join(map(str, path))
                raise ValueError(
                    f"{name}: its {logical!r} dimension ({dim}) does not divide over {n} devices "
                    f"({getattr(rules, logical)!r}); pick a mesh whose axis sizes divide it"
                )
