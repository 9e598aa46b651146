"""What the published DFlash2 drafter format adds to DFlash's (kdj/checkpoints/dflash.py).

config.json: `architectures: ["DFlash2DraftModel"]`; `dflash_config` also carries
block_size, conv_kernel_size, conv_group_size, selector_rank, selector_top_k (required) and
output_multiplier, final_logit_softcapping, input_embedding_scale (optional; 1.0, none, 1.0).
Weights, beside DFlash's (D hidden, K taps, G = D / conv_group_size, r rank, V vocabulary):

    layers.{i}.{attention_conv,mlp_conv}.base_kernel                 [2, K, D]
    layers.{i}.{attention_conv,mlp_conv}.kernel_projection.weight    [2 * K * G, D]
    candidate_selector.hidden_projection.weight                      [r, D]
    candidate_selector.{predecessor,successor}_codebook              [V, r]  (no ".weight")

As z-lab/dflash's tests/fixtures/dflash2-{config,safetensors-header}.json (a published
drafter's own config and header) spell them; vLLM's qwen3_dflash2.py reads the same.
"""

from __future__ import annotations

import re

import numpy as np

from kdj.checkpoints.loader import ALL
from kdj.models.dflash2 import DFlash2Config

ARCHITECTURE = "DFlash2DraftModel"
_CONV = re.compile(
    r"layers\.(\d+)\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)"
)
_SELECTOR = "candidate_selector."
_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def config_from_hf(extra: dict) -> DFlash2Config:
    """DFlash2's fields of a dflash_config dict; a missing or bad one raises ValueError."""
    for name in _REQUIRED:
        if name not in extra:
            raise ValueError(f"DFlash2 config has no dflash_config.{name}")
    cap = extra.get("final_logit_softcapping")
    try:
        d2 = DFlash2Config(
            **{name: extra[name] for name in _REQUIRED},
            output_multiplier=float(extra.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(cap) if cap else None,  # 0 / null: no cap
            input_embedding_scale=float(extra.get("input_embedding_scale", 1.0)),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"DFlash2 dflash_config has a non-numeric scale: {e}") from None
    return d2


def config_to_hf(d2: DFlash2Config) -> dict:
    out = {name: getattr(d2, name) for name in _REQUIRED}
    out["output_multiplier"] = d2.output_multiplier
    out["input_embedding_scale"] = d2.input_embedding_scale
    if d2.final_logit_softcapping is not None:
        out["final_logit_softcapping"] = d2.final_logit_softcapping
    return out


def targets(name: str, x: np.ndarray):
    """[(param path, value, index)] of a DFlash2-only tensor; None for any other name."""
    m = _CONV.fullmatch(name)
    if m is not None:
        pre = ("layers", int(m.group(1)), m.group(2))
        if m.group(3) == "base_kernel":
            return [(pre + ("base_kernel",), x, ALL)]
        return [(pre + ("kernel_projection", "kernel"), x.T, ALL)]
    if name.startswith(_SELECTOR):
        rest = name[len(_SELECTOR) :]
        if rest in ("predecessor_codebook", "successor_codebook"):
            return [(("selector", rest), x, ALL)]
        if rest == "hidden_projection.weight":
            return [(("selector", "hidden_projection", "kernel"), x.T, ALL)]
    return None


def tensors(drafter) -> dict:
    """The DFlash2-only tensors of `drafter`, by published name (torch [out, in] layout)."""
    out = {}
    for i, layer in enumerate(drafter.layers):
        for conv in ("attention_conv", "mlp_conv"):
            c = getattr(layer, conv)
            out[f"layers.{i}.{conv}.base_kernel"] = c.base_kernel[...]
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = c.kernel_projection.kernel[...].T
    sel = drafter.selector
    out[_SELECTOR + "hidden_projection.weight"] = sel.hidden_projection.kernel[...].T
    out[_SELECTOR + "predecessor_codebook"] = sel.predecessor_codebook[...]
    out[_SELECTOR + "successor_codebook"] = sel.successor_codebook[...]
    return out
