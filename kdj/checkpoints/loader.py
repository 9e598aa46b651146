"""Put HF-named float tensors into a kdj model, tensor by tensor, straight into their shardings.

Every checkpoint source (safetensors dir, GGUF file) yields (HF name, numpy array) pairs; this
module maps those names onto kdj's parameter tree (transposing torch [out, in] linears to
[in, out], splitting MLA's kv_b_proj, stacking per-expert weights) and checks that every
parameter was filled with the right shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kdj.config import ModelConfig
from kdj.models.transformer import Transformer, abstract_model
from kdj.sharding import ShardingRules, named_sharding, single_device_rules

_ATTN = {
    "q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",),
    "q_a_proj": ("q_a",), "q_b_proj": ("q_b",), "kv_a_proj_with_mqa": ("kv_a",),
}  # fmt: skip
_NORMS = {
    "input_layernorm": ("attn_norm",),
    "post_attention_layernorm": ("mlp_norm",),
    "self_attn.q_norm": ("attn", "q_norm"),
    "self_attn.k_norm": ("attn", "k_norm"),
    "self_attn.q_a_layernorm": ("attn", "q_a_norm"),
    "self_attn.kv_a_layernorm": ("attn", "kv_a_norm"),
}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def hf_targets(name: str, x: np.ndarray, cfg: ModelConfig):
    """Map one HF tensor to [(kdj param path, value, expert index or None), ...].

    Returns [] for tensors kdj deliberately ignores; raises for names it does not know.
    """
    if name.startswith("language_model."):  # Kimi K2.5/K2.6 wrapper
        name = name[len("language_model.") :]
    if not name.startswith(("model.", "lm_head.")) or name.endswith("rotary_emb.inv_freq"):
        return []  # vision tower, projector, buffers
    if name == "model.embed_tokens.weight":
        return [(("embed",), x, None)]
    if name == "model.norm.weight":
        return [(("norm", "weight"), x, None)]
    if name == "lm_head.weight":
        return [] if cfg.tie_word_embeddings else [(("lm_head", "kernel"), x.T, None)]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise ValueError(f"unexpected tensor {name!r} for a {cfg.model_type} model")
    i, rest = int(m.group(1)), m.group(2)
    if i >= cfg.num_layers:
        return []  # DeepSeek-V3's multi-token-prediction layer(s) after the main stack
    pre = ("layers", i)
    if rest.endswith(".weight") and rest[: -len(".weight")] in _NORMS:
        return [(pre + _NORMS[rest[: -len(".weight")]] + ("weight",), x, None)]
    if rest.startswith("self_attn."):
        proj, _, kind = rest[len("self_attn.") :].rpartition(".")
        if proj == "kv_b_proj" and kind == "weight":
            H, N = cfg.num_heads, cfg.qk_nope_head_dim
            w = np.asarray(x).reshape(H, N + cfg.v_head_dim, cfg.kv_lora_rank)
            return [
                (pre + ("attn", "w_uk"), w[:, :N], None),
                (pre + ("attn", "w_uv"), w[:, N:], None),
            ]
        if proj in _ATTN and kind in ("weight", "bias"):
            if proj == "q_proj" and cfg.family == "deepseek":
                path = ("q_proj",)
            else:
                path = _ATTN[proj]
            value = x.T if kind == "weight" else x
            return [
                (pre + ("attn",) + path + ("kernel" if kind == "weight" else "bias",), value, None)
            ]
    if rest == "mlp.gate.weight":
        return [(pre + ("mlp", "router"), x.T, None)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(pre + ("mlp", "bias"), x, None)] if cfg.topk_method == "noaux_tc" else []
    m = _EXPERT.fullmatch(rest)
    if m is not None:
        return [(pre + ("mlp", "w_" + m.group(2)), x.T, int(m.group(1)))]
    if rest == "mlp.experts.gate_up_proj":  # transformers-v5 fused layout [E, 2I, D]
        I = cfg.moe_intermediate_size
        return [
            (pre + ("mlp", "w_gate"), np.swapaxes(x[:, :I], 1, 2), None),
            (pre + ("mlp", "w_up"), np.swapaxes(x[:, I:], 1, 2), None),
        ]
    if rest == "mlp.experts.down_proj":  # [E, D, I]
        return [(pre + ("mlp", "w_down"), np.swapaxes(x, 1, 2), None)]
    for prefix, sub in (("mlp.shared_experts.", ("mlp", "shared")), ("mlp.", ("mlp",))):
        if rest.startswith(prefix) and rest.endswith(".weight"):
            proj = rest[len(prefix) : -len(".weight")]
            if proj in _MLP:
                return [(pre + sub + (_MLP[proj], "kernel"), x.T, None)]
    raise ValueError(f"unexpected tensor {name!r} for a {cfg.model_type} model")


def load_params(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    dtype=jnp.bfloat16,
    mesh=None,
    rules: ShardingRules | None = None,
    total: int | None = None,
    desc: str = "loading",
) -> Transformer:
    """Build the model from (HF name, array) pairs; every parameter must be filled exactly once."""
    rules = rules or single_device_rules()
    graphdef, state = nnx.split(abstract_model(cfg, jnp.dtype(dtype)))
    slots = dict(nnx.to_flat_state(state))
    filled: set[tuple] = set()
    experts: dict[tuple, tuple[np.ndarray, set[int]]] = {}

    def put(path, value):
        var = slots[path]
        target = var.get_value()
        if value.shape != target.shape:
            raise ValueError(
                f"tensor shape mismatch for {'.'.join(map(str, path))}: checkpoint has "
                f"{value.shape}, the model config expects {target.shape}"
            )
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        arr = np.asarray(value, dtype=target.dtype)
        var.set_value(jax.device_put(arr, sharding) if sharding else jnp.asarray(arr))
        filled.add(path)

    for name, x in tqdm(tensors, total=total, desc=desc, unit="tensor", leave=False):
        for path, value, expert in hf_targets(name, x, cfg):
            if path not in slots:
                raise ValueError(
                    f"tensor {name!r} has no place in a {cfg.model_type} model "
                    f"with this config (looked for {'.'.join(map(str, path))})"
                )
            if expert is None:
                put(path, value)
                continue
            # Per-expert tensors are gathered into one host buffer per layer, then placed.
            shape = slots[path].get_value().shape
            buf, seen = experts.setdefault(path, (np.zeros(shape, np.float32), set()))
            if value.shape != shape[1:]:
                raise ValueError(f"tensor shape mismatch for {name}: {value.shape} vs {shape[1:]}")
            buf[expert] = value
            seen.add(expert)
            if len(seen) == shape[0]:
                put(path, buf)
                del experts[path]
    missing = [".".join(map(str, p)) for p in slots if p not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing {len(missing)} tensors: {missing[:5]}{more}")
    return nnx.merge(graphdef, state)
