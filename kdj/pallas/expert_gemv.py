"""Gathered expert matvec in Pallas (Triton lowering): y[i] = x[i] @ W[ids[i]].

For a handful of token-expert assignments (decode at small batch), each assignment reads its
expert's weight matrix once, straight from HBM as stored, and dequantises it in registers:

    x [n, K] (one row per assignment), ids [n] int32, W [E, K, F] as held (kdj/checkpoints/
    quant.py): "float" (any float dtype), "int4" (int32 [E, K/8, F], 8 consecutive inputs per
    word, + scale [E, K/g, F]), "fp8" (float8_e4m3fn [E, K, F] + float32 scale
    [E, K/b, F/b]).  ->  y [n, F] float32.

Why a kernel. XLA has no gathered GEMV: it either writes the gathered experts out and reads
them back (3x the bytes), or fuses the gather into its one-row matmul rewrite (multiply +
reduce), which streams at a fraction of HBM bandwidth; quantised experts are worse, since XLA
dequantises into HBM first. The dense one-row projections (kdj/models/layers.py) run it too,
as one "expert".

Work split. One program owns (assignment i, a tile of bf output columns): it walks the K
axis in tiles, keeping a [bk, bf] float32 partial product in registers and reducing it once
at the end (a reduction per tile would cost a cross-thread shuffle every step). Tiles are
contiguous along F, so every row of a weight tile is one coalesced read.
  * int4: a tile is bk words (whole scale groups of g / 8 words) x bf columns; its scale
    rows are one contiguous load, repeated to the word rows in registers. The input
    vector is passed de-interleaved (xt [8 n, K/8], xt[8 i + j, r] = x[i, 8 r + j]) so
    nibble j of every word meets its input without shuffles, and nibbles become floats by
    exponent bits (_MAGIC), not by int-to-float converts.
  * fp8: tiles never straddle a scale block (bk and bf divide b), so a tile has one scale.
On CPU (tests, CI) the same pallas_call runs in interpret mode; see tree_attention.py for why
the Triton flavour and not Mosaic GPU.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdj.kernels import DEFAULT

FORMATS = ("float", "int4", "fp8")


def _load(ref, mask):
    """A tile load, masked (out-of-range reads as 0) only where a mask is needed."""
    return plgpu.load(ref, mask=mask, other=0) if mask is not None else plgpu.load(ref)


def _slice_of(ids_ref, i, splits: int):
    """The expert matrix program row i reads: with K cut into `splits` slices (each expert's
    weights reshaped [E * splits, K / splits, F]), row i is slice i % splits of assignment
    i // splits."""
    return ids_ref[i] if splits == 1 else ids_ref[i // splits] * splits + i % splits


def _kernel(ids_ref, x_ref, w_ref, *rest, fmt, K, F, bk, bf, block, splits):
    """One (assignment and K slice, column tile) program over float or FP8 weights [E, K, F]
    (K: one slice's inputs); block: the FP8 scale block."""
    s_ref, o_ref = (None, rest[0]) if fmt == "float" else rest
    i, j = pl.program_id(0), pl.program_id(1)
    e = _slice_of(ids_ref, i, splits)
    f0 = j * bf
    cols = f0 + jnp.arange(bf)
    # Static: masks only where a tile can run past the matrix edge.
    col_ok = (cols < F)[None, :] if F % bf else None
    ragged = K % bk != 0

    def body(t, acc):
        rows = t * bk + jnp.arange(bk)
        row_ok = rows < K if ragged else None
        ok = row_ok[:, None] if ragged else None
        if col_ok is not None:
            ok = col_ok if ok is None else ok & col_ok
        w = _load(w_ref.at[e, pl.ds(t * bk, bk), pl.ds(f0, bf)], ok)
        xv = _load(x_ref.at[i, pl.ds(t * bk, bk)], row_ok)
        w = w.astype(jnp.float32)
        if fmt == "fp8":  # one scale for the whole tile (bk, bf divide the block)
            w = w * s_ref[e, (t * bk) // block, f0 // block].astype(jnp.float32)
        return acc + xv.astype(jnp.float32)[:, None] * w

    acc = lax.fori_loop(0, pl.cdiv(K, bk), body, jnp.zeros((bk, bf), jnp.float32))
    o_ref[...] = acc.sum(axis=0)


# 2**23 + u as float32 has u in its low mantissa bits: OR-ing a nibble into this exponent and
# subtracting 2**23 + 8 gives u - 8 exactly, two full-rate ops where an int-to-float convert
# runs at 1/8 of the FMA rate on Hopper.
_MAGIC, _MAGIC_BIAS = 0x4B000000, float(2**23 + 8)


def _nibbles(w, n: int):
    """Nibble n of int32 words w as float32 values u - 8 (the stored +8 offset removed)."""
    bits = ((w >> (4 * n)) & 0xF) | _MAGIC
    return lax.bitcast_convert_type(bits, jnp.float32) - _MAGIC_BIAS


def deinterleave(x):
    """x [n, K] -> [8 n, K / 8] with row 8 i + j = x[i, 8 r + j] over words r: the input
    planes that meet nibble j of every INT4 word."""
    n, K = x.shape
    return x.reshape(n, K // 8, 8).transpose(0, 2, 1).reshape(n * 8, K // 8)


def call(kernel, ins, *, grid, out_block, out_shape, num_warps, num_stages, interpret, name,
         dtype=jnp.float32, transposed=False):  # fmt: skip
    """The Triton-flavoured pallas_call of the expert kernels: every input whole (the kernel
    indexes it), one output block per program, `dtype` out; interpret=None: interpreted
    everywhere but on a GPU. Program (i, j) writes output block (i, j), or (j, i) when
    `transposed` (a grid whose first axis walks the output's columns)."""
    full = [pl.BlockSpec(a.shape, lambda i, j, d=a.ndim: (0,) * d) for a in ins]
    with warnings.catch_warnings():
        # jax 0.11 deprecates the Triton lowering (see tree_attention.py's docstring)
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=full,
            out_specs=pl.BlockSpec(
                out_block, (lambda i, j: (j, i)) if transposed else (lambda i, j: (i, j))
            ),
            out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
            name=name,
        )(*ins)


def _int4_kernel(ids_ref, x_ref, w_ref, s_ref, o_ref, *, words, wpg, bk, F, bf, splits):
    """One (assignment, column tile) program over INT4 words [E, words, F]: a scale group is
    wpg words (8 wpg inputs) sharing scale row s[e, g, :]; a tile is bk words (bk / wpg whole
    groups) x bf columns. The tile's scale rows are one contiguous [bk / wpg, bf] load,
    repeated to the tile's rows in registers (a gather of one scale per word would cost as
    many load instructions as the weights)."""
    i, j = pl.program_id(0), pl.program_id(1)
    e = _slice_of(ids_ref, i, splits)
    f0 = j * bf
    cols = f0 + jnp.arange(bf)
    G = bk // wpg
    col_ok = (cols < F)[None, :] if F % bf else None
    ragged = words % bk != 0

    def tile_mask(row_ok):
        if row_ok is None:
            return col_ok
        return row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok

    def body(t, acc):
        rows = t * bk + jnp.arange(bk)
        row_ok = rows < words if ragged else None
        w = _load(w_ref.at[e, pl.ds(t * bk, bk), pl.ds(f0, bf)], tile_mask(row_ok))
        w = w.astype(jnp.int32)
        part = jnp.zeros((bk, bf), jnp.float32)
        for n in range(8):  # nibble n of word r is input 8 r + n, stored with a +8 offset
            xn = _load(x_ref.at[i * 8 + n, pl.ds(t * bk, bk)], row_ok)
            part += xn.astype(jnp.float32)[:, None] * _nibbles(w, n)
        g_ok = (t * G + jnp.arange(G)) < words // wpg if ragged else None
        scale = _load(s_ref.at[e, pl.ds(t * G, G), pl.ds(f0, bf)], tile_mask(g_ok))
        scale = jnp.broadcast_to(scale.astype(jnp.float32)[:, None, :], (G, wpg, bf))
        return acc + part * scale.reshape(bk, bf)

    acc = lax.fori_loop(0, pl.cdiv(words, bk), body, jnp.zeros((bk, bf), jnp.float32))
    o_ref[...] = acc.sum(axis=0)


def supported(fmt: str, K: int, F: int, scale_shape=None) -> bool:
    """Whether the kernel takes a [E, K, F] matrix in `fmt` (K: inputs)."""
    if fmt == "int4":  # a scale group: a power-of-two number of whole words (Triton tiles)
        if scale_shape is None or K % 8 or K % scale_shape[1] or (K // scale_shape[1]) % 8:
            return False
        wpg = K // scale_shape[1] // 8
        return wpg & (wpg - 1) == 0
    if fmt == "fp8":
        b = K // scale_shape[1] if scale_shape is not None else 0
        return b >= 16 and b & (b - 1) == 0 and F // scale_shape[2] == b
    return fmt == "float"


def splits(n: int, fmt: str, K: int, F: int, scale_shape=None, *,
           programs: int = DEFAULT.gemv_programs) -> int:  # fmt: skip
    """How many K slices `expert_gemv` takes for n assignments of [K, F] matrices in fmt: a
    power of two that fills `programs` programs (the kernel policy's gemv_programs), each
    slice >= 256 inputs and whole scale groups (INT4) or blocks (FP8). One row of
    Moonlight's q_proj [2048, 3072]: 8."""
    unit = 1 if fmt == "float" else K // scale_shape[1]  # inputs per scale group / block
    tiles = n * -(-F // (32 if fmt == "int4" else 64))  # the default column tiles below
    s = 1
    while s * tiles < programs and K % (2 * s * unit) == 0 and K // (2 * s) >= 256:
        s *= 2
    return s


def expert_gemv(x, ids, value, scale=None, fmt: str = "float", *, splits: int = 1,
                interpret: bool | None = None, block_k: int | None = None,
                block_f: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None):  # fmt: skip
    """y[i] = x[i] @ W[ids[i]] (see the module docstring). x [n, K]; ids [n] int32; value,
    scale: an expert matrix as stored, 3-D [E, K(/8), F]. Returns [n, F] float32. Tiles default
    to what measured best on the H200: block_k counts rows of
    `value`, i.e. inputs for float/FP8 and 8-input words for INT4 (whole scale groups).
    splits: K cut into this many slices (`splits` picks it), each slice of each assignment a
    program row of its own, the slices' float32 partial sums added at the end: a handful of
    assignments then still fills the GPU. The slices are free reshapes of the stored arrays.
    interpret: run the kernel in Pallas' interpreter (default: everywhere but on a GPU)."""
    if fmt not in FORMATS:
        raise ValueError(f"expert format must be one of {FORMATS}, not {fmt!r}")
    n, K = x.shape
    E, rows, F = value.shape
    if not supported(fmt, K, F, None if scale is None else scale.shape):
        raise ValueError(f"{fmt} expert weights {value.shape} (scale "
                         f"{None if scale is None else scale.shape}) are a layout this kernel "
                         "does not take (expert_gemv.supported)")  # fmt: skip
    if splits > 1:
        whole = [rows] + ([] if scale is None else [scale.shape[1]])
        if K % splits or any(r % splits for r in whole):
            raise ValueError(f"{fmt} weights {value.shape} do not split into {splits} K slices")
        value = value.reshape(E * splits, rows // splits, F)
        if scale is not None:
            scale = scale.reshape(E * splits, scale.shape[1] // splits, *scale.shape[2:])
        x, n, K, rows = x.reshape(n * splits, K // splits), n * splits, K // splits, rows // splits
    block = 0
    bf = block_f or 64
    if fmt == "int4":
        if rows * 8 != K:
            raise ValueError(f"int4 weights {value.shape} do not match inputs of width {K}")
        wpg = rows // scale.shape[1]  # words per scale group (group 32: 4)
        bk = max(wpg, (block_k or 128) // wpg * wpg)  # words, whole groups
        bf = block_f or 32
        kernel = functools.partial(_int4_kernel, words=rows, wpg=wpg, bk=bk, F=F, bf=bf,
                                   splits=splits)  # fmt: skip
        xin = deinterleave(x)
    else:
        if rows != K:
            raise ValueError(f"expert weights {value.shape} do not match inputs of width {K}")
        bk = block_k or 128
        if fmt == "fp8":
            block = K // scale.shape[1]
            bk, bf = min(bk, block), min(bf, block)
        kernel = functools.partial(_kernel, fmt=fmt, K=K, F=F, bk=bk, bf=bf, block=block,
                                   splits=splits)  # fmt: skip
        xin = x
    nf = pl.cdiv(F, bf)
    ins = [ids.astype(jnp.int32), xin, value] + ([] if fmt == "float" else [scale])
    y = call(kernel, ins, grid=(n, nf), out_block=(None, bf), out_shape=(n, nf * bf),
             num_warps=num_warps or 4, num_stages=num_stages or 3, interpret=interpret,
             name=f"expert_gemv_{fmt}")  # fmt: skip
    return y[:, :F].reshape(-1, splits, F).sum(1) if splits > 1 else y[:, :F]


def reference(x, ids, value, scale=None, fmt: str = "float"):
    """The XLA oracle: dequantise the selected experts, then one matvec each. [n, F] f32."""
    from kdj.quant import dequant_stacked

    w = dequant_stacked(fmt, value[ids], None if scale is None else scale[ids], jnp.float32)
    return jnp.einsum("nk,nkf->nf", x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)


__all__ = ["expert_gemv", "reference", "supported"]
