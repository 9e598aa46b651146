"""Grouped expert matmul in Pallas (Triton lowering): y[a] = x[a] @ W[ids[a]] for many
assignments, reading each touched expert's weights once per block of its rows.

    x [n, K] (one row per token-expert assignment), ids [n] int32, W [E, K, F] as held
    (kdj/quant.py: "float", "int4" or "fp8", as in expert_gemv.py)
    ->  y [n, F] float32.

Layout. The assignments are sorted by expert and each expert's rows padded to a multiple of
bm (`blocks`): row block b holds up to bm rows of one expert, block_expert[b]. One program
owns (row block, tile of bf columns) and walks K in tiles of bk: a [bm, bk] tile of the
block's input rows (gathered by row index) times the expert's [bk, bf] weight tile on the
tensor cores, accumulated in float32. An expert with at most bm rows (a 16-token verify at
batch 1: ~1.9 rows per touched expert on Moonlight) is read exactly once; at large batch
the weight tile is reused by all bm rows (bm grows with the rows per expert: `tiles`).
Blocks past the last expert's are empty and skip the K loop. Quantised weights are
dequantised tile by tile in registers:
  * int4: the bk inputs of a tile are 8 interleaved planes of bk / 8 words (input 8 r + j is
    nibble j of word r); the input rows are passed de-interleaved the same way (xt[8 a + j,
    r] = x[a, 8 r + j]), so the tile is 8 dots of K = bk / 8, one per nibble plane, each
    scaled by its words' group scales (contiguous rows, repeated in registers); both dot
    operands are bf16 whatever x's dtype.
  * fp8: a tile never straddles a scale block, so it has one scale.

The MoE layer runs it past the gather threshold (kdj/models/deepseek.py, `local_experts`);
its XLA reference is `jax.lax.ragged_dot` (`expert_swiglu`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdj.pallas.expert_gemv import FORMATS, _nibbles, call, deinterleave


def blocks(ids, num_experts: int, bm: int):
    """Row blocks of the assignments grouped by expert (static sizes, traced values).

    ids [n] int32; an id of -1 marks an assignment computed elsewhere (another shard's
    expert): it gets no row. Returns (rows [nb * bm] int32: the assignment in each padded
    row, -1 for padding; block_expert [nb] int32: each block's expert, -1 for unused
    blocks), with nb = ceil(n / bm) + min(n, E): each expert with rows adds at most one
    partial block."""
    n = ids.shape[0]
    nb = pl.cdiv(n, bm) + min(n, num_experts)
    valid = ids >= 0
    counts = jnp.bincount(jnp.where(valid, ids, 0), valid.astype(jnp.int32), length=num_experts)
    padded = pl.cdiv(counts, bm) * bm
    ends = jnp.cumsum(padded)
    # sorted on the narrowest key that holds 0..E (E: the skipped ones, last): a radix sort
    # makes one pass per key byte, so 8-bit keys take a quarter of int32's passes
    key = jnp.uint8 if num_experts < 255 else jnp.uint16 if num_experts < 65535 else jnp.int32
    order = jnp.argsort(jnp.where(valid, ids, num_experts).astype(key), stable=True)
    sorted_ids = jnp.minimum(ids[order], num_experts - 1)
    first_of_expert = jnp.cumsum(counts) - counts
    rank = jnp.arange(n) - first_of_expert[sorted_ids]  # row within its expert
    dest = jnp.where(valid[order], (ends - padded)[sorted_ids] + rank, nb * bm)
    rows = jnp.full((nb * bm,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    start = jnp.arange(nb) * bm
    # compare_all: one fused compare-and-sum. The default binary search is a while loop, ~28
    # small kernels per MoE layer (~22 us of Moonlight's 16-token verify on an H200)
    expert = jnp.searchsorted(ends, start, side="right", method="compare_all").astype(jnp.int32)
    return rows, jnp.where(start < ends[-1], expert, -1)


def _kernel(be_ref, rows_ref, x_ref, w_ref, *rest, fmt, K, F, bm, bk, bf, wpg, block, cols_first):
    """One (row block, column tile) program; see the module docstring. K: inputs."""
    s_ref, o_ref = (None, rest[0]) if fmt == "float" else rest
    b, j = (
        (pl.program_id(1), pl.program_id(0)) if cols_first else (pl.program_id(0), pl.program_id(1))
    )
    e = be_ref[b]
    rows = rows_ref[pl.ds(b * bm, bm)]
    row_ok = (rows >= 0)[:, None]
    r = jnp.maximum(rows, 0)
    col_ok = ((j * bf + jnp.arange(bf)) < F)[None, :] if F % bf else None
    f0 = j * bf
    ee = jnp.maximum(e, 0)

    def load_w(f0, k0, n_rows):
        ref = w_ref.at[ee, pl.ds(k0, n_rows), pl.ds(f0, bf)]
        return plgpu.load(ref, mask=col_ok, other=0) if col_ok is not None else plgpu.load(ref)

    def body(t, acc):
        if fmt == "int4":
            kw = bk // 8  # words per tile
            G = kw // wpg
            words = t * kw + jnp.arange(kw)
            w = load_w(f0, t * kw, kw).astype(jnp.int32)  # [kw, bf]
            cols = jnp.minimum(f0 + jnp.arange(bf), F - 1)
            scale = s_ref[ee, t * G + jnp.arange(G)[:, None], cols[None, :]]
            scale = jnp.broadcast_to(scale.astype(jnp.float32)[:, None, :], (G, wpg, bf))
            scale = scale.reshape(kw, bf)
            for n in range(8):  # nibble plane n: inputs 8 r + n of the tile's words r
                xn = x_ref[(r * 8 + n)[:, None], words[None, :]]  # [bm, kw]
                xn = jnp.where(row_ok, xn, 0).astype(jnp.bfloat16)
                u = (_nibbles(w, n) * scale).astype(jnp.bfloat16)
                acc += plgpu.dot(xn, u).astype(jnp.float32)
            return acc
        ks = t * bk + jnp.arange(bk)
        xt = jnp.where(row_ok, x_ref[r[:, None], ks[None, :]], 0)  # [bm, bk]
        dt = x_ref.dtype  # bf16 on the tensor cores; float32 (tests) at full precision
        prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
        w = load_w(f0, t * bk, bk).astype(jnp.float32)
        if fmt == "fp8":
            w = w * s_ref[ee, (t * bk) // block, f0 // block].astype(jnp.float32)
        return acc + plgpu.dot(xt, w.astype(dt), precision=prec).astype(jnp.float32)

    # Empty blocks do no work. The trip count stays static (K // bk) and the loop sits under a
    # branch: Triton rejects the scf.for a traced trip count lowers to (bounds i32 vs index).
    zero = jnp.zeros((bm, bf), jnp.float32)
    acc = lax.cond(e >= 0, lambda: lax.fori_loop(0, K // bk, body, zero), lambda: zero)
    o_ref[...] = acc.astype(o_ref.dtype)


def tile_k(K: int, block_k: int = 128) -> int:
    """The K tile: at most block_k, and it must divide K (at most K's largest power-of-two
    factor)."""
    return min(block_k, K & -K)


def supported(fmt: str, K: int, F: int, scale_shape=None, bk: int | None = None) -> bool:
    """Whether the kernel takes a [E, K, F] matrix in `fmt` (K: inputs) with K tiles of bk
    (default `tile_k(K)`). Tensor-core dots need K >= 16 per dot: bk inputs (float, FP8),
    bk / 8 words (INT4)."""
    bk = tile_k(K) if bk is None else bk
    if K % bk or bk < (128 if fmt == "int4" else 16):
        return False
    if fmt == "int4":
        if scale_shape is None or K % scale_shape[1] or (K // scale_shape[1]) % 8:
            return False
        wpg = K // scale_shape[1] // 8
        return wpg & (wpg - 1) == 0 and (bk // 8) % wpg == 0
    if fmt == "fp8":
        b = K // scale_shape[1] if scale_shape is not None else 0
        return b >= bk and b % bk == 0 and F // scale_shape[2] == b
    return fmt == "float"


def tiles(fmt: str, rows_per_expert: float) -> dict:
    """Tile settings for a mean of `rows_per_expert` rows per expert (assignments / E), as
    swept on the H200 over Moonlight's experts. A bigger row block reads each weight tile
    once for more rows but leaves more padding and fewer programs; at many rows per expert
    launching the column tiles first keeps one expert's weights in flight together. FP8 takes
    INT4's settings (tiles of at most 128 fit its scale blocks)."""
    if rows_per_expert < 16:  # bf16 at 1.5 rows (a 16-token verify): 128 x 128 tiles, 8 warps
        bf, warps = (128, 8) if fmt == "float" else (64, 4)
        return dict(block_m=16, block_k=128, block_f=bf, num_warps=warps, cols_first=False)
    if rows_per_expert < 64:
        return dict(block_m=32, block_k=128, block_f=64, num_warps=4, cols_first=False)
    if fmt == "float":
        return dict(block_m=128, block_k=64, block_f=128, num_warps=8, cols_first=True)
    return dict(block_m=64, block_k=128, block_f=64, num_warps=4, cols_first=True)


def grouped_matmul(x, rows, block_expert, value, scale=None, fmt: str = "float", *,
                   block_m: int, block_k: int, block_f: int, num_warps: int,
                   num_stages: int = 3, cols_first: bool = False, out_dtype=None,
                   interpret: bool | None = None):  # fmt: skip
    """The kernel on rows already laid out in blocks (`blocks`): padded row p is
    x[rows[p]] @ W[block_expert[p // block_m]] (0 where rows[p] = -1). x [m, K]; rows
    [nb * block_m] int32; value, scale: an expert matrix as stored, 3-D [E, K(/8), F].
    Returns [nb * block_m, F] in out_dtype (default float32; the sums are float32 either way),
    in the padded row order: a second matmul over the same experts (SwiGLU's down projection)
    takes it as is (rows = its own row numbers).
    cols_first: the grid's first (fastest-launched) axis walks the column tiles, so the
    programs running together cover whole rows of one expert's weights; otherwise it walks
    the row blocks, and programs running together share one weight tile across row blocks.
    interpret: run in Pallas' interpreter (default: everywhere but on a GPU)."""
    if fmt not in FORMATS:
        raise ValueError(f"expert format must be one of {FORMATS}, not {fmt!r}")
    K = x.shape[1]
    _, rows_w, F = value.shape
    if rows_w * (8 if fmt == "int4" else 1) != K:
        raise ValueError(f"expert weights {value.shape} ({fmt}) do not match inputs of width {K}")
    bk = tile_k(K, block_k)
    sshape = None if scale is None else scale.shape
    if not supported(fmt, K, F, sshape, bk):
        raise ValueError(f"{fmt} weights {value.shape} do not tile by K tiles of {bk}")
    bm, bf = block_m, min(block_f, bk) if fmt == "fp8" else block_f
    wpg = rows_w // scale.shape[1] if fmt == "int4" else 0
    block = K // scale.shape[1] if fmt == "fp8" else 0
    nb, nf = block_expert.shape[0], pl.cdiv(F, bf)
    xin = deinterleave(x) if fmt == "int4" else x
    kernel = functools.partial(_kernel, fmt=fmt, K=K, F=F, bm=bm, bk=bk, bf=bf, wpg=wpg,
                               block=block, cols_first=cols_first)  # fmt: skip
    ins = [block_expert, rows, xin, value] + ([] if fmt == "float" else [scale])
    y = call(kernel, ins, grid=(nf, nb) if cols_first else (nb, nf), out_block=(bm, bf),
             out_shape=(nb * bm, nf * bf), num_warps=num_warps, num_stages=num_stages,
             interpret=interpret, name=f"expert_grouped_{fmt}",
             dtype=jnp.float32 if out_dtype is None else out_dtype,
             transposed=cols_first)  # fmt: skip
    return y[:, :F]


def positions(rows, n: int):
    """The padded row of each of n assignments (rows [P]: the assignment in each padded row,
    -1 for padding): [n] int32, to take results back to assignment order."""
    slot = jnp.where(rows >= 0, rows, n)  # padding rows point past the end: dropped
    return jnp.zeros((n,), jnp.int32).at[slot].set(jnp.arange(rows.shape[0]), mode="drop")


def expert_grouped(x, ids, value, scale=None, fmt: str = "float", *,
                   interpret: bool | None = None, block_m: int | None = None,
                   block_k: int | None = None, block_f: int | None = None,
                   num_warps: int | None = None, num_stages: int = 3,
                   cols_first: bool | None = None, out_dtype=None):  # fmt: skip
    """y[a] = x[a] @ W[ids[a]] (see the module docstring). x [n, K]; ids [n] int32; value,
    scale: an expert matrix as stored, 3-D [E, K(/8), F]. Returns [n, F] in out_dtype
    (default float32). Tile settings left None come from `tiles` (by the mean rows per
    expert)."""
    n, E = x.shape[0], value.shape[0]
    given = dict(block_m=block_m, block_k=block_k, block_f=block_f, num_warps=num_warps,
                 cols_first=cols_first)  # fmt: skip
    t = tiles(fmt, n / E) | {k: v for k, v in given.items() if v is not None}
    rows, be = blocks(ids, E, t["block_m"])
    y = grouped_matmul(x, rows, be, value, scale, fmt, num_stages=num_stages,
                       out_dtype=out_dtype, interpret=interpret, **t)  # fmt: skip
    return y[positions(rows, n)]


__all__ = [
    "blocks",
    "expert_grouped",
    "grouped_matmul",
    "positions",
    "supported",
    "tile_k",
    "tiles",
]
