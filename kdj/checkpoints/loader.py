"""Put HF-named float tensors into a kdj model, tensor by tensor, straight into their shardings.

Every checkpoint source (safetensors dir, GGUF file) yields (HF name, numpy array) pairs; this
module maps those names onto kdj's parameter tree (transposing torch [out, in] linears to
[in, out], splitting MLA's kv_b_proj, stacking per-expert weights) and checks that every
parameter was filled with the right shape.

`load_hf(..., quantized_experts=True)` keeps a checkpoint's routed experts as stored (INT4
packed or FP8 block-scaled, see kdj/quant.py): they are transposed into kdj's
layout but never dequantised; everything else is dequantised as usual.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from kdj.checkpoints.hf_safetensors import AUX_SUFFIXES, HFCheckpoint
from kdj.config import ModelConfig
from kdj.models.deepseek import quantize_experts
from kdj.models.transformer import Transformer, abstract_model
from kdj.quant import dequant_fp8, dequant_int4
from kdj.sharding import ShardingRules, check_fits, named_sharding, single_device_rules

_MLA = {"q_proj": "q_proj", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
        "o_proj": "o"}  # fmt: skip
_NORMS = {
    "input_layernorm": ("attn_norm",),
    "post_attention_layernorm": ("mlp_norm",),
    "self_attn.q_norm": ("attn", "q_norm"),
    "self_attn.k_norm": ("attn", "k_norm"),
    "self_attn.q_a_layernorm": ("attn", "q_a_norm"),
    "self_attn.kv_a_layernorm": ("attn", "kv_a_norm"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
ALL = np.index_exp[...]


def _gqa_targets(proj: str, kind: str, x: np.ndarray, cfg: ModelConfig, pre: tuple):
    """q/k/v go into slices of the fused [D, KVH, G + 2, hd] kernel (or its bias)."""
    KVH, hd = cfg.num_kv_heads, cfg.head_dim
    G = cfg.num_heads // KVH
    slot = {"q_proj": slice(0, G), "k_proj": G, "v_proj": G + 1}[proj]
    if kind == "weight":
        w = x.T.reshape(x.shape[1], KVH, G, hd) if proj == "q_proj" else x.T.reshape(-1, KVH, hd)
        return [(pre + ("attn", "qkv"), w, np.index_exp[:, :, slot])]
    b = x.reshape(KVH, G, hd) if proj == "q_proj" else x.reshape(KVH, hd)
    return [(pre + ("attn", "qkv_bias"), b, np.index_exp[:, slot])]


def mlp_targets(proj: str, x: np.ndarray, pre: tuple):
    """gate/up go into the two halves of the fused [D, 2, I] kernel."""
    if proj == "down_proj":
        return [(pre + ("down", "kernel"), x.T, ALL)]
    return [(pre + ("gate_up",), x.T, np.index_exp[:, 0 if proj == "gate_proj" else 1])]


def hf_targets(name: str, x: np.ndarray, cfg: ModelConfig):
    """Map one HF tensor to [(kdj param path, value, index into that param), ...].

    `index` selects the part of the parameter the value fills (ALL, one expert, the q slice
    of the fused qkv kernel, ...). Returns [] for tensors kdj deliberately ignores; raises
    for names it does not know.
    """
    if name.startswith("language_model."):  # Kimi K2.5/K2.6 wrapper
        name = name[len("language_model.") :]
    if not name.startswith(("model.", "lm_head.")) or name.endswith("rotary_emb.inv_freq"):
        return []  # vision tower, projector, buffers
    if name == "model.embed_tokens.weight":
        return [(("embed",), x, ALL)]
    if name == "model.norm.weight":
        return [(("norm", "weight"), x, ALL)]
    if name == "lm_head.weight":
        return [] if cfg.tie_word_embeddings else [(("lm_head", "kernel"), x.T, ALL)]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} for a {cfg.model_type} model")
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        return []  # DeepSeek-V3's multi-token-prediction layer(s) after the main stack
    pre = ("layers", i)
    if rest.endswith(".weight") and rest[: -len(".weight")] in _NORMS:
        return [(pre + _NORMS[rest[: -len(".weight")]] + ("weight",), x, ALL)]
    if rest.startswith("self_attn."):
        proj, _, kind = rest[len("self_attn.") :].rpartition(".")
        if kind in ("weight", "bias"):
            if cfg.family == "llama" and proj in ("q_proj", "k_proj", "v_proj"):
                return _gqa_targets(proj, kind, x, cfg, pre)
            if cfg.family == "llama" and proj == "o_proj":
                return [
                    (
                        pre + ("attn", "o", "kernel" if kind == "weight" else "bias"),
                        x.T if kind == "weight" else x,
                        ALL,
                    )
                ]
            if proj == "kv_b_proj" and kind == "weight":
                H, N = cfg.num_heads, cfg.qk_nope_head_dim
                w = np.asarray(x).reshape(H, N + cfg.v_head_dim, cfg.kv_lora_rank)
                return [
                    (pre + ("attn", "w_uk"), w[:, :N], ALL),
                    (pre + ("attn", "w_uv"), w[:, N:].transpose(0, 2, 1), ALL),  # [H, C, v]
                ]
            if cfg.family == "deepseek" and proj in _MLA and kind == "weight":
                return [(pre + ("attn", _MLA[proj], "kernel"), x.T, ALL)]
    if rest == "mlp.gate.weight":
        return [(pre + ("mlp", "router"), x.T, ALL)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(pre + ("mlp", "bias"), x, ALL)] if cfg.topk_method == "noaux_tc" else []
    m = _EXPERT.fullmatch(rest)
    if m is not None:
        e, proj = int(m.group(1)), m.group(2)
        if proj == "down":
            return [(pre + ("mlp", "w_down"), x.T, np.index_exp[e])]
        return [(pre + ("mlp", "w_gate_up"), x.T, np.index_exp[e, :, 0 if proj == "gate" else 1])]
    if rest == "mlp.experts.gate_up_proj":  # transformers-v5 fused layout [E, 2I, D]
        E, _, D = x.shape
        w = np.swapaxes(x, 1, 2).reshape(E, D, 2, -1)
        return [(pre + ("mlp", "w_gate_up"), w, ALL)]
    if rest == "mlp.experts.down_proj":  # [E, D, I]
        return [(pre + ("mlp", "w_down"), np.swapaxes(x, 1, 2), ALL)]
    for prefix, sub in (("mlp.shared_experts.", ("mlp", "shared")), ("mlp.", ("mlp",))):
        if rest.startswith(prefix) and rest.endswith(".weight"):
            proj = rest[len(prefix) : -len(".weight")]
            if proj in ("gate_proj", "up_proj", "down_proj"):
                return mlp_targets(proj, x, pre + sub)
    raise ValueError(f"unexpected tensor {name!r} for a {cfg.model_type} model")


def load_params(cfg: ModelConfig, tensors, *, dtype=jnp.bfloat16, **kw) -> Transformer:
    """Build a target model from (HF name, array) pairs; every parameter filled exactly once."""
    skeleton = abstract_model(cfg, jnp.dtype(dtype))
    return fill_params(skeleton, tensors, lambda n, x: hf_targets(n, x, cfg), **kw)


# A routed expert's quantised parts: INT4 weight_packed / weight_scale, FP8 weight (+ scale_inv).
_EXPERT_PART = re.compile(
    r"(?:language_model\.)?model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\."
    r"(weight_packed|weight_scale|weight_scale_inv|weight_shape|weight)"
)

_EXPERT_ID = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj")


def expert_format(ckpt: HFCheckpoint) -> tuple[str, dict]:
    """How the checkpoint stores its routed experts: ("int4", {"group", "scale_dtype"}),
    ("fp8", {"block"}) or ("float", {})."""
    for name in ckpt.names():
        m = _EXPERT_PART.fullmatch(name)
        if m is None:
            continue
        if m.group(1) == "weight_packed":
            packed, scale = ckpt.raw(name), ckpt.raw(name[: -len("_packed")] + "_scale")
            group = packed.shape[1] * 8 // scale.shape[1]
            return "int4", {"group": group, "scale_dtype": jnp.dtype(scale.dtype)}
        if m.group(1) == "weight" and name + "_scale_inv" in ckpt.names():
            return "fp8", {"block": ckpt.fp8_block}
    return "float", {}


def quantized_expert_tensors(ckpt: HFCheckpoint):
    """Like `ckpt.tensors()`, but routed experts' quantised parts come out as stored, under
    their own names (INT4 .weight_packed / .weight_scale, FP8 .weight / .weight_scale_inv);
    every other tensor is dequantised as usual. Quantised experts are never dequantised."""
    names = set(ckpt.names())
    for name in ckpt.names():
        m = _EXPERT_PART.fullmatch(name)
        if m is not None and (m.group(1) != "weight" or name + "_scale_inv" in names):
            if m.group(1) != "weight_shape":
                yield name, ckpt.raw(name)
        elif name.endswith(AUX_SUFFIXES):
            continue
        elif name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            shape = ckpt.raw(base + "_shape")
            yield base, dequant_int4(ckpt.raw(name), ckpt.raw(base + "_scale"), shape)
        elif name + "_scale_inv" in names:
            scale = ckpt.raw(name + "_scale_inv")
            yield name, dequant_fp8(ckpt.raw(name), scale, ckpt.fp8_block)
        else:
            yield name, ckpt.raw(name)


def quantized_targets(name: str, x: np.ndarray, cfg: ModelConfig):
    """hf_targets for a routed expert's quantised part: torch [out, in/...] is transposed into
    kdj's [in/..., out] layout (scales alike), gate/up into the two halves of gate_up."""
    m = _EXPERT_PART.fullmatch(name)
    if m is None or m.group(1) == "weight" and x.dtype != ml_dtypes.float8_e4m3fn:
        return hf_targets(name, x, cfg)
    i, e, proj = _EXPERT_ID.search(name).groups()
    pre = ("layers", int(i), "mlp")
    scale = m.group(1) in ("weight_scale", "weight_scale_inv")
    if proj == "down":
        return [(pre + ("down_scale" if scale else "w_down",), x.T, np.index_exp[int(e)])]
    half = 0 if proj == "gate" else 1
    path = pre + ("gate_up_scale" if scale else "w_gate_up",)
    return [(path, x.T, np.index_exp[int(e), :, half])]


def load_hf(ckpt: HFCheckpoint, cfg: ModelConfig, *, dtype=jnp.bfloat16,
            quantized_experts: bool = False, **kw) -> Transformer:  # fmt: skip
    """Load an HF safetensors checkpoint. With quantized_experts, routed experts stay INT4 or
    FP8 in device memory (MoE.quantize); the checkpoint must store them quantised."""
    if not quantized_experts:
        return load_params(cfg, ckpt.tensors(), dtype=dtype, total=len(ckpt), **kw)
    fmt, opts = expert_format(ckpt)
    if fmt == "float":
        raise ValueError(
            f"quantized_experts=True, but {ckpt.dir} stores its routed experts unquantised; "
            "it applies to INT4 (compressed-tensors) and FP8 block-scaled checkpoints"
        )
    skeleton = abstract_model(cfg, jnp.dtype(dtype))
    quantize_experts(skeleton, fmt, **opts)
    return fill_params(skeleton, quantized_expert_tensors(ckpt),
                       lambda n, x: quantized_targets(n, x, cfg), **kw)  # fmt: skip


def fill_params(
    skeleton,
    tensors: Iterable[tuple[str, np.ndarray]],
    targets,
    *,
    mesh=None,
    rules: ShardingRules | None = None,
    total: int | None = None,
    desc: str = "loading",
):
    """Fill an abstract NNX module (from nnx.eval_shape) with checkpoint tensors.

    targets(name, array) -> [(param path, value, index), ...] says where each tensor goes.
    Each finished parameter is placed on device (in its sharding) as soon as it is complete.
    """
    kind = type(skeleton).__name__
    rules = rules or single_device_rules()
    if mesh is not None:
        check_fits(skeleton, mesh, rules)  # before reading a single tensor
    graphdef, state = nnx.split(skeleton)
    slots = dict(nnx.to_flat_state(state))
    filled: set[tuple] = set()
    partial: dict[tuple, tuple[np.ndarray, int]] = {}  # path -> (host buffer, elements written)

    def put(path, value):
        var = slots[path]
        target = var.get_value()
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        arr = np.asarray(value, dtype=target.dtype)
        var.set_value(jax.device_put(arr, sharding) if sharding else jnp.asarray(arr))
        filled.add(path)

    for name, x in tqdm(tensors, total=total, desc=desc, unit="tensor", leave=False):
        for path, value, index in targets(name, x):
            if path not in slots:
                raise ValueError(
                    f"tensor {name!r} has no place in this {kind} "
                    f"(looked for {'.'.join(map(str, path))})"
                )
            target = slots[path].get_value()
            want = np.broadcast_to(np.empty((), bool), target.shape)[index].shape  # no copy
            if value.shape != want:
                raise ValueError(
                    f"tensor shape mismatch for {name} -> {'.'.join(map(str, path))}: checkpoint "
                    f"has {value.shape}, the model config expects {want}"
                )
            if index is ALL:
                put(path, value)
                continue
            # Parts of one parameter (experts, fused q/k/v, gate/up) gather in a host buffer
            # of the parameter's dtype, placed on device once every element is written.
            buf, done = partial.get(path) or (np.zeros(target.shape, target.dtype), 0)
            buf[index] = value
            done += value.size
            if done == buf.size:
                put(path, buf)
                partial.pop(path, None)
            else:
                partial[path] = (buf, done)
    missing = [".".join(map(str, p)) for p in slots if p not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {missing[:5]}{more}")
    return nnx.merge(graphdef, state)
