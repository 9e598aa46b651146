"""Quantised checkpoint formats: dequantised to float at load time (numpy), or kept as stored
in HBM and dequantised inside the expert compute (the jnp functions at the end).

- FP8 e4m3 with one float32 `weight_scale_inv` per 128 x 128 block (DeepSeek-V3, Kimi-K2):
  w = fp8 * scale_inv[row // 128, col // 128].
- INT4 compressed-tensors "pack-quantized" (Kimi K2.5/K2.6 routed experts): symmetric, group
  32 along the input dim; `weight_packed` int32 [out, in / 8] holds 8 values per word, value j
  in bits 4j..4j+3 stored with a +8 offset; `weight_scale` [out, in / 32]; w = (u - 8) * scale.

The numpy quantisers exist so tests can write real-format checkpoints.

Kept in HBM, a stacked expert matrix [E, in, *out] (kdj's [in, out] layout: the transpose of
torch's) is stored as
- "int4": int32 [E, in / 8, *out], the 8 nibbles of a word are 8 consecutive inputs (the
  checkpoint's words, transposed), plus scale [E, in / group, *out] in the checkpoint's dtype;
- "fp8": float8_e4m3fn [E, in, *out], plus float32 scale [E, in / b, *out[:-1], out[-1] / b].
Group and block sizes are read back from the shapes, so they need no configuration.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


# ------------------------------------------------------------------ kept quantised in HBM (jnp)
EXPERT_FORMATS = ("float", "int4", "fp8")
FP8_MAX = 448.0


def dequant_int4_stacked(packed, scale, dtype):
    """packed int32 [n, in/8, *out], scale [n, in/g, *out] -> dtype [n, in, *out].

    The product is formed in float32 and rounded once, exactly as `dequant_int4` at load."""
    n, words, *out = packed.shape
    group = words * 8 // scale.shape[1]
    shifts = (4 * jnp.arange(8, dtype=jnp.int32)).reshape(1, 1, 8, *(1,) * len(out))
    nib = (packed[:, :, None] >> shifts) & 0xF  # [n, in/8, 8, *out]; & undoes the sign shift
    vals = nib.reshape(n, scale.shape[1], group, *out).astype(jnp.float32) - 8.0
    w = vals * scale[:, :, None].astype(jnp.float32)
    return w.reshape(n, words * 8, *out).astype(dtype)


def dequant_fp8_stacked(q, scale, dtype):
    """q float8_e4m3fn [n, in, *mid, out], scale [n, in/b, *mid, out/b] -> dtype, q's shape."""
    n, inp, *mid, out = q.shape
    b = inp // scale.shape[1]
    if out // scale.shape[-1] != b:
        raise ValueError(f"fp8 blocks must be square: weight {q.shape}, scale {scale.shape}")
    blocks = q.reshape(n, inp // b, b, *mid, out // b, b).astype(jnp.float32)
    s = scale.astype(jnp.float32)[:, :, None, ..., None]
    return (blocks * s).reshape(q.shape).astype(dtype)


def dequant_stacked(fmt: str, value, scale, dtype):
    """Float weights [n, in, *out] from a stacked expert matrix kept in `fmt`."""
    if fmt == "int4":
        return dequant_int4_stacked(value, scale, dtype)
    if fmt == "fp8":
        return dequant_fp8_stacked(value, scale, dtype)
    return value.astype(dtype)


def quant_int4_stacked(w, group: int = INT4_GROUP, scale_dtype=jnp.bfloat16):
    """float [E, in, *out] -> (int32 [E, in/8, *out], scale [E, in/group, *out]); the jnp twin of
    `quant_int4` (one expert at a time, so a large stack never needs a float32 copy)."""

    def one(w):  # [in, *out]
        inp, *out = w.shape
        g = w.astype(jnp.float32).reshape(inp // group, group, *out)
        scale = jnp.maximum(jnp.abs(g).max(1) / 7.0, 1e-12).astype(scale_dtype)
        u = jnp.clip(jnp.round(g / scale[:, None].astype(jnp.float32)), -8, 7).astype(jnp.int32)
        u = (u + 8).reshape(inp // 8, 8, *out) << (4 * jnp.arange(8, dtype=jnp.int32)).reshape(
            1, 8, *(1,) * len(out)
        )
        packed = jax.lax.reduce(u, np.int32(0), jax.lax.bitwise_or, (1,))  # disjoint nibbles
        return packed, scale

    return jax.lax.map(one, w)


def quant_fp8_stacked(w, block: int = FP8_BLOCK):
    """float [E, in, *mid, out] -> (float8_e4m3fn [E, in, *mid, out], float32 scale
    [E, in/block, *mid, out/block]); the jnp twin of `quant_fp8`."""

    def one(w):  # [in, *mid, out]
        inp, *mid, out = w.shape
        blocks = w.astype(jnp.float32).reshape(inp // block, block, *mid, out // block, block)
        scale = jnp.maximum(jnp.abs(blocks).max((1, -1)) / FP8_MAX, 1e-12)
        q = (blocks / scale[:, None, ..., None]).astype(jnp.float8_e4m3fn)
        return q.reshape(w.shape), scale

    return jax.lax.map(one, w)
