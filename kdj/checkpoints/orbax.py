"""`kdj convert`: save converted params with Orbax, restore them without re-converting.

Layout of a converted dir: kdj_config.json (the ModelConfig + dtype) and params/ (an Orbax
StandardCheckpointer checkpoint of the NNX parameter state). Restoring goes straight into the
target shardings: Orbax reads each array into the sharding of the abstract target.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from kdj.config import ModelConfig
from kdj.models.transformer import abstract_model
from kdj.sharding import named_sharding, single_device_rules

CONFIG_NAME = "kdj_config.json"
# Bumped when a parameter's stored layout changes. 2: MLA's w_uv is held [H, C, v] (it was
# [H, v, C]; 2026-11-30), so an older DeepSeek-family checkpoint would load transposed.
FORMAT = 2


def is_orbax_dir(path: Path) -> bool:
    return (Path(path) / CONFIG_NAME).exists()


def save(model, path: str | Path) -> Path:
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", state)
    meta = {"config": model.cfg.to_dict(), "dtype": str(model.embed[...].dtype), "format": FORMAT}
    (path / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
    return path


def restore(path: str | Path, dtype=None, mesh=None, rules=None):
    path = Path(path).absolute()
    try:
        meta = json.loads((path / CONFIG_NAME).read_text())
        cfg = ModelConfig.from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt {path / CONFIG_NAME}: {e}") from None
    if not (path / "params").exists():
        raise FileNotFoundError(f"{path} has no params/ checkpoint")
    fmt = meta.get("format", 1)
    if fmt < 2 and cfg.family == "deepseek":
        raise ValueError(f"{path} was converted by an older kdj that held MLA's w_uv as "
                         "[heads, v_head_dim, kv_lora_rank]; convert the source checkpoint "
                         "again with `kdj convert`")  # fmt: skip
    if fmt > FORMAT:
        raise ValueError(f"{path} is checkpoint format {fmt}; this kdj reads up "
                         f"to {FORMAT}")  # fmt: skip
    dtype = jnp.dtype(dtype or meta["dtype"])
    rules = rules or single_device_rules()
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))

    def target(var):
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        value = var.get_value()
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    abstract = jax.tree.map(target, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(path / "params", abstract)
    return nnx.merge(graphdef, state)
