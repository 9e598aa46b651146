"""ShardingRules: logical axis name -> mesh axis (or axes, or None = replicated).

Every parameter carries `axes=(...)` logical names (kdj/models/layers.py); caches and batch
activations use "batch" and "kv_heads". A preset is one instance of this dataclass over the
mesh axes ("data", "expert", "model"); switching tensor parallelism to expert parallelism is
a change of preset in YAML, nothing else. Axes of size 1 are no-ops, so every preset runs on
every mesh.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "expert", "model")
Axis = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    batch: Axis = None
    vocab: Axis = None
    embed: Axis = None
    q_heads: Axis = None
    kv_heads: Axis = None
    heads: Axis = None
    head_dim: Axis = None
    mlp: Axis = None
    moe_mlp: Axis = None
    experts: Axis = None
    q_lora: Axis = None
    kv_lora: Axis = None
    norm: Axis = None
    features: Axis = None

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        return PartitionSpec(*(None if a is None else getattr(self, a) for a in axes))


# Tensor parallel: heads, FFN columns and vocab over "model"; each expert's FFN is split too.
TP = ShardingRules(batch="data", vocab="model", q_heads="model", kv_heads="model",
                   heads="model", mlp="model", moe_mlp="model", experts="expert")  # fmt: skip
# Expert parallel: whole experts over "expert"; attention and dense layers over "model".
EP = dataclasses.replace(TP, moe_mlp=None)
# EP with data-parallel attention: the batch is split over "data" AND "expert" for attention
# and caches; the MoE layer gathers tokens across "expert" to reach every expert shard.
EP_DP_ATTN = dataclasses.replace(EP, batch=("data", "expert"))
PRESETS = {"tp": TP, "ep": EP, "ep_dp_attn": EP_DP_ATTN}


def single_device_rules() -> ShardingRules:
    return ShardingRules()


def named_sharding(mesh: Mesh | None, rules: ShardingRules, axes) -> jax.sharding.Sharding | None:
    """The sharding for an array with logical `axes`, or None for the default device."""
    if mesh is None:
        return None
    return NamedSharding(mesh, rules.spec(tuple(axes)))


def axis_size(mesh: Mesh | None, axis: Axis) -> int:
    """Number of devices a (tuple of) mesh axis spans; 1 without a mesh."""
    if mesh is None or axis is None:
        return 1
    names = (axis,) if isinstance(axis, str) else axis
    n = 1
    for name in names:
        n *= mesh.shape[name]
    return n


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A mesh plus the rules that lay a model out on it (hashable: part of the jit key)."""

    mesh: Mesh
    rules: ShardingRules

    def size(self, logical: str) -> int:
        return axis_size(self.mesh, getattr(self.rules, logical))

    def spec(self, axes) -> PartitionSpec:
        return self.rules.spec(tuple(axes))

    def named(self, axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))
