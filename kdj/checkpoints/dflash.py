"""The published DFlash drafter checkpoint format, read and written.

A drafter directory holds config.json (`architectures: ["DFlashDraftModel"]`, the usual Qwen3
fields, `block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`)
and safetensors weights named without a "model." prefix: fc.weight, hidden_norm.weight,
norm.weight, layers.{i}.{input_layernorm,post_attention_layernorm}.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight. Embedding and lm_head come from the target.
DFlash2 (`architectures: ["DFlash2DraftModel"]`) adds its convolutions and selector:
kdj/checkpoints/dflash2.py. The architecture picks the format on load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from kdj.checkpoints import dflash2, staging
from kdj.checkpoints.hf_safetensors import HFCheckpoint
from kdj.checkpoints.loader import ALL, fill_params, mlp_targets
from kdj.config import ModelConfig
from kdj.models.drafter import (
    DFlashDrafter,
    DrafterConfig,
    build_drafter,
    default_target_layer_ids,
)

ARCHITECTURE = "DFlashDraftModel"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_NAMES = {
    "input_layernorm.weight": ("attn_norm", "weight"),
    "post_attention_layernorm.weight": ("mlp_norm", "weight"),
    "self_attn.q_norm.weight": ("attn", "q_norm", "weight"),
    "self_attn.k_norm.weight": ("attn", "k_norm", "weight"),
}


def drafter_config_from_hf(cfg: dict) -> DrafterConfig:
    """Parse a DFlash config.json dict; unknown or inconsistent fields raise ValueError."""
    archs = cfg.get("architectures") or []
    is_v2 = dflash2.ARCHITECTURE in archs
    if not is_v2 and ARCHITECTURE not in archs:
        raise ValueError(f"not a DFlash or DFlash2 drafter config (architectures={archs})")
    model_type = cfg.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise ValueError(f"DFlash drafter model_type {model_type!r} is not supported: a DFlash "
                         'drafter\'s layers are Qwen3 layers (model_type "qwen3")')  # fmt: skip
    if cfg.get("attention_bias"):
        raise NotImplementedError("DFlash drafters with attention bias are not supported")
    extra = cfg.get("dflash_config") or {}
    if is_v2 and cfg.get("is_causal"):  # kdj's block attention is bidirectional, as published
        raise ValueError("DFlash2 config sets is_causal: a causal block is not supported")
    mask = extra.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ValueError("DFlash config has no mask_token_id (dflash_config.mask_token_id)")
    layer_types = tuple(cfg.get("layer_types") or ())
    layers_cfg = {k: v for k, v in cfg.items() if k not in ("use_sliding_window", "layer_types")}
    layers_cfg["model_type"] = "qwen3"  # the drafter's layers are Qwen3 layers
    layers = ModelConfig.from_hf(layers_cfg)
    n = layers.num_layers
    if layer_types and len(layer_types) != n:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
    ids = extra.get("target_layer_ids")
    num_target = cfg.get("num_target_layers")
    if ids is None:
        if num_target is None:
            raise ValueError("DFlash config needs target_layer_ids or num_target_layers")
        ids = default_target_layer_ids(num_target, n)
    return DrafterConfig(
        layers=layers,
        block_size=extra.get("block_size", cfg.get("block_size", 16)),
        mask_token_id=mask,
        target_layer_ids=tuple(ids),
        num_target_layers=num_target if num_target is not None else -1,
        layer_types=layer_types,
        sliding_window=cfg.get("sliding_window") if "sliding_attention" in layer_types else None,
        dflash2=dflash2.config_from_hf(extra) if is_v2 else None,
    )


def drafter_config_to_hf(cfg: DrafterConfig) -> dict:
    lc = cfg.layers
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": lc.num_layers,
        "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "rope_scaling": lc.rope,
        "max_position_embeddings": lc.max_position_embeddings,
        "vocab_size": lc.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    if cfg.dflash2 is not None:  # DFlash2 keeps block_size in dflash_config, as published
        out["architectures"] = [dflash2.ARCHITECTURE]
        out["is_causal"] = False
        del out["block_size"]
        out["dflash_config"] = {"block_size": cfg.block_size, **out["dflash_config"],
                                **dflash2.config_to_hf(cfg.dflash2)}  # fmt: skip
    if cfg.layer_types:
        out["layer_types"] = list(cfg.layer_types)
        out["sliding_window"] = cfg.sliding_window
        out["use_sliding_window"] = "sliding_attention" in cfg.layer_types
    return out


def drafter_targets(name: str, x: np.ndarray):
    """Map one published DFlash tensor name to [(param path, value, index)]."""
    if name.startswith("model."):
        name = name[len("model.") :]  # tolerate a prefixed variant
    if name == "fc.weight":
        return [(("fc", "kernel"), x.T, ALL)]
    v2 = dflash2.targets(name, x)
    if v2 is not None:  # a DFlash drafter's skeleton has no place for these: fill_params says so
        return v2
    if name in ("hidden_norm.weight", "norm.weight"):
        return [((name.split(".")[0], "weight"), x, ALL)]
    m = _LAYER.fullmatch(name)
    if m is not None:
        pre, rest = ("layers", int(m.group(1))), m.group(2)
        if rest in _NAMES:
            return [(pre + _NAMES[rest], x, ALL)]
        proj = rest.removeprefix("self_attn.").removesuffix("_proj.weight")
        if rest.startswith("self_attn.") and proj in ("q", "k", "v", "o"):
            return [(pre + ("attn", proj, "kernel"), x.T, ALL)]
        if rest.startswith("mlp.") and rest.endswith(".weight"):
            return mlp_targets(rest[len("mlp.") : -len(".weight")], x, pre + ("mlp",))
    if name.startswith(("embed_tokens.", "lm_head.")):
        return []  # some exports carry the target's tables; kdj always uses the target's own
    raise ValueError(f"unexpected tensor {name!r} in a DFlash drafter checkpoint")


def read_drafter_config(ckpt: HFCheckpoint) -> DrafterConfig:
    """The checkpoint's drafter config, checked (ValueError naming the file), weights unread."""
    try:
        return drafter_config_from_hf(json.loads(ckpt.config_path.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt {ckpt.config_path}: {e}") from None
    except (ValueError, TypeError) as e:  # the message names the field; this names the file
        raise ValueError(f"{ckpt.config_path}: {e}") from None


def load_drafter_checkpoint(path, dtype=jnp.bfloat16) -> DFlashDrafter:
    ckpt = HFCheckpoint(path)
    cfg = read_drafter_config(ckpt)
    skeleton = nnx.eval_shape(lambda: build_drafter(cfg, dtype))
    return fill_params(
        skeleton, ckpt.tensors(), drafter_targets, total=len(ckpt),
        desc=f"loading drafter {Path(path).name}",
    )  # fmt: skip


CALIBRATION = "calibration.json"  # written by kdj.train.calibrate (kdj calibrate --save)
FILES = ("model.safetensors", CALIBRATION, "config.json")  # what a drafter save writes


def load_calibration(drafter_dir) -> tuple[float, float, dict]:
    """(forecast temperature, prior tau, tau by menu entry) saved beside a drafter: the
    fitted temperature (1.0 when there is no calibration file), the mean tau the calibration
    run realised (its method and budget are in the file; 0.0 = unknown) and that of each
    measured menu entry ({} = unknown)."""
    path = Path(drafter_dir) / CALIBRATION
    if not path.exists():
        return 1.0, 0.0, {}
    try:
        data = json.loads(path.read_text())
        t = float(data["temperature"])
        tau = data.get("realised_acceptance")
        if tau is None and data.get("candidates"):  # files written before the field existed
            tau = data["candidates"][0]["mean_realised"]
        by_entry = {str(k): float(v) for k, v in data.get("realised_by_entry", {}).items()}
        tau = float(tau or 0.0)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"corrupt {path}: {e!r}; run kdj calibrate --save again, or delete "
                         "it (the drafter then runs uncalibrated)") from None  # fmt: skip
    if not t > 0:
        raise ValueError(f"{path}: temperature must be positive (got {t})")
    return t, tau, by_entry


def save_drafter(drafter: DFlashDrafter, path, *, calibration: dict | None = None,
                 overwrite: bool = False) -> Path:  # fmt: skip
    """Write `drafter` in the published DFlash (or DFlash2) format (float32 weights keep full
    precision), with its `calibration` ({"temperature", "realised_acceptance",
    "realised_by_entry"}, as kdj.train.calibrate writes it) when given.

    A non-empty `path` is refused unless `overwrite`, which replaces only the drafter's own
    files (FILES; a stale calibration.json goes) and keeps the rest. The files are written
    into a temporary sibling directory first (kdj.checkpoints.staging): an interrupted save
    leaves nothing that loads."""
    path = Path(path).absolute()
    with staging.staged(path, overwrite=overwrite, replaces=FILES, last="config.json") as tmp:
        _write_drafter(drafter, tmp, calibration)
    return path


def _write_drafter(drafter: DFlashDrafter, path: Path, calibration: dict | None) -> None:
    tensors = {
        "fc.weight": drafter.fc.kernel[...].T,
        "hidden_norm.weight": drafter.hidden_norm.weight[...],
        "norm.weight": drafter.norm.weight[...],
    }
    for i, layer in enumerate(drafter.layers):
        p = f"layers.{i}."
        tensors[p + "input_layernorm.weight"] = layer.attn_norm.weight[...]
        tensors[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight[...]
        for proj in ("q", "k", "v", "o"):
            tensors[p + f"self_attn.{proj}_proj.weight"] = getattr(layer.attn, proj).kernel[...].T
        tensors[p + "self_attn.q_norm.weight"] = layer.attn.q_norm.weight[...]
        tensors[p + "self_attn.k_norm.weight"] = layer.attn.k_norm.weight[...]
        gate_up = layer.mlp.gate_up[...]
        tensors[p + "mlp.gate_proj.weight"] = gate_up[:, 0].T
        tensors[p + "mlp.up_proj.weight"] = gate_up[:, 1].T
        tensors[p + "mlp.down_proj.weight"] = layer.mlp.down.kernel[...].T
    if drafter.cfg.dflash2 is not None:
        tensors.update(dflash2.tensors(drafter))
    arrays = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    save_file(arrays, str(path / "model.safetensors"))
    if calibration is not None:
        (path / CALIBRATION).write_text(json.dumps(calibration, indent=2))
    (path / "config.json").write_text(json.dumps(drafter_config_to_hf(drafter.cfg), indent=2))
