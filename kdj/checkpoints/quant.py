"""Quantised checkpoint formats, dequantised to float at load time.

- FP8 e4m3 with one float32 `weight_scale_inv` per 128 x 128 block (DeepSeek-V3, Kimi-K2):
  w = fp8 * scale_inv[row // 128, col // 128].
- INT4 compressed-tensors "pack-quantized" (Kimi K2.5/K2.6 routed experts): symmetric, group
  32 along the input dim; `weight_packed` int32 [out, in / 8] holds 8 values per word, value j
  in bits 4j..4j+3 stored with a +8 offset; `weight_scale` [out, in / 32]; w = (u - 8) * scale.

The quantisers here exist so tests can write real-format checkpoints.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_BLOCK = 128
INT4_GROUP = 32


def dequant_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """weight [out, in] float8_e4m3fn, scale_inv [ceil(out/b), ceil(in/b)] -> float32 [out, in]."""
    out, inp = weight.shape
    want = (-(-out // block), -(-inp // block))
    if scale_inv.shape != want:
        raise ValueError(
            f"fp8 weight {weight.shape} needs weight_scale_inv {want}, got {scale_inv.shape}"
        )
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), block, 0), block, 1)[:out, :inp]
    return weight.astype(np.float32) * s


def quant_fp8(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (float8_e4m3fn weight, float32 scale_inv per block); max |q| = 448."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros_like(w, dtype=ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = max(float(np.abs(blk).max()) / 448.0, 1e-12)
            scale[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / s).astype(q.dtype)
    return q, scale


def dequant_int4(
    packed: np.ndarray, scale: np.ndarray, shape, group: int = INT4_GROUP
) -> np.ndarray:
    """weight_packed int32 [out, in/8], weight_scale [out, in/group] -> float32 [out, in]."""
    out, inp = (int(x) for x in shape)
    if packed.shape != (out, -(-inp // 8)) or scale.shape != (out, -(-inp // group)):
        raise ValueError(
            f"int4 weight of shape {(out, inp)} needs weight_packed {(out, -(-inp // 8))} and "
            f"weight_scale {(out, -(-inp // group))}; got {packed.shape} and {scale.shape}"
        )
    words = packed.astype(np.int64) & 0xFFFFFFFF
    nibbles = (words[:, :, None] >> (4 * np.arange(8))) & 0xF  # [out, in/8, 8], low nibble first
    values = nibbles.reshape(out, -1)[:, :inp].astype(np.float32) - 8.0
    s = np.repeat(scale.astype(np.float32), group, axis=1)[:, :inp]
    return values * s


def quant_int4(w: np.ndarray, group: int = INT4_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] (in % group == 0) -> (weight_packed int32, weight_scale float32)."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    scale = np.maximum(np.abs(g).max(-1) / 7.0, 1e-12).astype(np.float32)
    q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int64).reshape(out, inp) + 8
    q = q.reshape(out, inp // 8, 8) << (4 * np.arange(8))
    packed = q.sum(-1).astype(np.uint32).view(np.int32)
    return packed, scale
