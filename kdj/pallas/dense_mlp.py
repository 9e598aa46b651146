"""The dense MLP block in two Pallas kernels (Triton lowering): x + down(swiglu(norm(x))).

    x [n, D] (the residual stream, n rows of any batch and T), norm weight [D], gate_up
    [D, 2, I], down [I, D], all one float dtype (bf16, f16 or f32), as the decoder block
    holds them (kdj/models/layers.py: RMSNorm, MLP)  ->  [n, D] in x's dtype.

Why kernels. XLA runs this block as several kernels (the norm, the gate/up GEMM, SwiGLU,
the down GEMM, the residual add, as far as its fusions do not merge them); at decode and
verify sizes (1 to ~64 rows) each moves a few KB of activations besides its weights, so a
small model's step is bound by launches. Here it is two kernels, with float32 accumulation
in registers:

  A  rms_swiglu:     h = silu(g) * u, [g, u] = RMSNorm(x) @ gate_up      -> h [n, I], x's dtype
  B  down_residual:  y = x + h @ down                                    -> y [n, D]

The normalised rows are recomputed by every program of A from x (n x D is a few KB, read
from L2) rather than written out: that would be a third launch.

Work split. A program owns (row block of bm rows, tile of bf output columns): it walks the
reduction axis in tiles of bk, a [bm, bk] tile of rows times a [bk, bf] weight tile on the
tensor cores (bm >= 16, the shortest MMA; rows past n are masked to zero).
  * A first sums the squares of its rows over D (one pass over x), then in a second pass
    normalises each x tile on the fly and multiplies it into the gate and the up tile
    (columns f and I + f of gate_up seen as [D, 2I]: the same program holds both halves,
    so SwiGLU is applied in registers). A cannot split K: SwiGLU needs whole sums. Its
    grid is only row blocks x column tiles, so bf shrinks (64 -> 16) to give more programs:
    SmolLM2's I = 1536 gives 96 at one row.
  * B may split K (I) into `splits` slices (`plan`), a program per (row block, column
    tile, slice), because D is narrow (SmolLM2: 576, 36 tiles of 16): one row would
    otherwise run on a quarter of an H100's SMs. Unsplit, B adds the residual in the
    kernel; split, each slice writes a float32 partial [splits, n, D] and one XLA fusion
    adds them in slice order, rounds and adds the residual (Triton has no grid-wide sync,
    and atomics would make the sum order depend on timing).
Every tile edge that can run past a matrix (D, I not multiples of bk or bf, n not of bm) is
masked; tiles are powers of two, as Triton needs, and all sizes are static.

Rounding follows the XLA path: the normalised row is rounded to x's dtype before the
weight multiply, g and u are rounded to it (the GEMM's output in XLA), SwiGLU runs in
float32 and h is rounded once; B rounds h @ down to the dtype before the residual add.

Width invariance (deterministic mode). bk, bf and splits are chosen from the weights'
shape alone and bm from the row count, so with `fixed_rows` (bm = 64 whatever n) every
program runs the same tiles at any n and a row's bits do not depend on how many rows there
are (a row's sums meet no other row's values, and the slices' partials are added in slice
order): the kernel policy may then run it at every row count in deterministic mode
(KernelPolicy.dense_mlp_for). As for the fixed-tile matmuls, on a GPU this rests on Triton
compiling the same MMA sequence for the same tiles. Without fixed_rows bm follows n (16,
32, 64), and on a GPU the MMA instruction may change with it.

Not covered: quantised weights (the dense MLP is always stored as floats in kdj) and
weights split over devices (a pallas_call has no partitioning rule; kernels.choose refuses
it). On CPU (tests, CI) the same pallas_calls run in interpret mode; see tree_attention.py
for why the Triton flavour and not Mosaic GPU.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdj.kernels import DEFAULT

FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_BLOCK_M = 64  # rows per program; more rows take more row blocks


class Plan(NamedTuple):
    """Tiles of the two kernels: rows per block, A's and B's column tiles and K tiles, and
    B's K slices."""

    bm: int
    bf_a: int
    bf_b: int
    bk: int
    splits: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def column_tile(F: int, programs: int) -> int:
    """The widest column tile of 64, 32 or 16 giving at least `programs` tiles over F
    columns, else 16 (at most ~F / 16 programs: a narrower tile is no longer an MMA)."""
    for bf in (64, 32):
        if pl.cdiv(F, bf) >= programs:
            return bf
    return 16


def down_splits(I: int, tiles: int, programs: int) -> int:
    """K slices of B over I inputs with `tiles` programs per slice: a power of two, doubled
    while there are fewer than `programs` programs and each slice keeps >= 256 inputs (a
    shorter slice spends more on its partial's write and sum than it saves)."""
    s = 1
    while s * tiles < programs and I % (2 * s) == 0 and I // (2 * s) >= 256:
        s *= 2
    return s


def plan(n: int, D: int, I: int, *, programs: int = DEFAULT.gemv_programs,
         fixed_rows: bool = False, block_k: int = 64) -> Plan:  # fmt: skip
    """The tiles for n rows of a [D, 2, I] / [I, D] MLP (see the module docstring): all from
    the weights' shape and `programs` (the kernel policy's gemv_programs) but bm, which is
    the power of two >= n in 16..64, or 64 with fixed_rows."""
    bm = MAX_BLOCK_M if fixed_rows else min(MAX_BLOCK_M, max(16, _pow2_at_least(n)))
    bf_b = column_tile(D, programs)
    return Plan(bm, column_tile(I, programs), bf_b, block_k,
                down_splits(I, pl.cdiv(D, bf_b), programs))  # fmt: skip


def supported(x, norm_weight, gate_up, down) -> bool:
    """Whether the kernels take this block (arrays, or anything with .shape and .dtype):
    one float dtype throughout, x [..., D], gate_up [D, 2, I] and down [I, D]."""
    dtypes = {jnp.dtype(a.dtype) for a in (x, norm_weight, gate_up, down)}
    if len(dtypes) != 1 or dtypes.pop() not in [jnp.dtype(f) for f in FLOATS]:
        return False
    if gate_up.ndim != 3 or gate_up.shape[1] != 2 or down.ndim != 2:
        return False
    D, _, I = gate_up.shape
    return x.shape[-1] == D and norm_weight.shape == (D,) and down.shape == (I, D)


def _mask(*parts):
    """The AND of the masks given (None: that edge needs none); None if all are None."""
    parts = [p for p in parts if p is not None]
    return functools.reduce(jnp.logical_and, parts) if parts else None


def _load(ref, mask):
    """A tile load, masked (out-of-range reads as 0) only where a mask is needed."""
    return plgpu.load(ref, mask=mask, other=0) if mask is not None else plgpu.load(ref)


def _store(ref, value, mask):
    if mask is None:
        plgpu.store(ref, value)
    else:
        plgpu.store(ref, value, mask=mask)


def _edge(start, size: int, limit: int, whole: bool):
    """[size] bool: which of start .. start + size - 1 lie below limit; None when every tile
    is whole (static)."""
    return None if whole else (start + jnp.arange(size)) < limit


def _rms_swiglu_kernel(x_ref, nw_ref, w_ref, h_ref, *, n, D, I, eps, bm, bk, bf, precision):
    """One (row block, column tile) program of A; w_ref is gate_up as [D, 2I]."""
    dt = h_ref.dtype
    r0, f0 = pl.program_id(0) * bm, pl.program_id(1) * bf
    row_ok = _edge(r0, bm, n, n % bm == 0)
    col_ok = _edge(f0, bf, I, I % bf == 0)
    row_ok = None if row_ok is None else row_ok[:, None]
    col_ok = None if col_ok is None else col_ok[None, :]
    nk = pl.cdiv(D, bk)

    def x_tile(t):
        k_ok = _edge(t * bk, bk, D, D % bk == 0)
        ok = _mask(row_ok, None if k_ok is None else k_ok[None, :])
        return _load(x_ref.at[pl.ds(r0, bm), pl.ds(t * bk, bk)], ok).astype(jnp.float32), k_ok

    def squares(t, acc):
        xt, _ = x_tile(t)
        return acc + jnp.sum(xt * xt, axis=1)

    ss = lax.fori_loop(0, nk, squares, jnp.zeros((bm,), jnp.float32))
    inv = lax.rsqrt(ss / D + eps)[:, None]

    def body(t, acc):
        g, u = acc
        xt, k_ok = x_tile(t)
        scale = _load(nw_ref.at[pl.ds(t * bk, bk)], k_ok).astype(jnp.float32)
        # as RMSNorm: the normalised row rounded to the dtype, then times the weight
        xn = (scale[None, :] * (xt * inv).astype(dt).astype(jnp.float32)).astype(dt)
        ok = _mask(None if k_ok is None else k_ok[:, None], col_ok)
        wg = _load(w_ref.at[pl.ds(t * bk, bk), pl.ds(f0, bf)], ok).astype(dt)
        wu = _load(w_ref.at[pl.ds(t * bk, bk), pl.ds(I + f0, bf)], ok).astype(dt)
        return (g + plgpu.dot(xn, wg, precision=precision),
                u + plgpu.dot(xn, wu, precision=precision))  # fmt: skip

    zero = jnp.zeros((bm, bf), jnp.float32)
    g, u = lax.fori_loop(0, nk, body, (zero, zero))
    g = g.astype(dt).astype(jnp.float32)  # XLA's gate/up GEMM writes the dtype
    u = u.astype(dt).astype(jnp.float32)
    h = g * jax.nn.sigmoid(g) * u
    _store(h_ref.at[pl.ds(r0, bm), pl.ds(f0, bf)], h.astype(dt), _mask(row_ok, col_ok))


def _down_kernel(h_ref, w_ref, *rest, n, I, D, bm, bk, bf, splits, precision):
    """One (row block, column tile, K slice) program of B: unsplit, y = x + h @ down into
    out [n, D]; split, slice s's float32 partial into out [splits, n, D]."""
    r_ref, o_ref = rest if splits == 1 else (None, rest[0])
    dt = h_ref.dtype
    r0, f0, s = pl.program_id(0) * bm, pl.program_id(1) * bf, pl.program_id(2)
    Ks = I // splits
    k0 = s * Ks
    row_ok = _edge(r0, bm, n, n % bm == 0)
    col_ok = _edge(f0, bf, D, D % bf == 0)
    row_ok = None if row_ok is None else row_ok[:, None]
    col_ok = None if col_ok is None else col_ok[None, :]

    def body(t, acc):
        k_ok = _edge(t * bk, bk, Ks, Ks % bk == 0)  # within this slice
        ht = _load(h_ref.at[pl.ds(r0, bm), pl.ds(k0 + t * bk, bk)],
                   _mask(row_ok, None if k_ok is None else k_ok[None, :]))  # fmt: skip
        wt = _load(w_ref.at[pl.ds(k0 + t * bk, bk), pl.ds(f0, bf)],
                   _mask(None if k_ok is None else k_ok[:, None], col_ok))  # fmt: skip
        return acc + plgpu.dot(ht, wt.astype(dt), precision=precision)

    acc = lax.fori_loop(0, pl.cdiv(Ks, bk), body, jnp.zeros((bm, bf), jnp.float32))
    ok = _mask(row_ok, col_ok)
    if splits > 1:
        _store(o_ref.at[s, pl.ds(r0, bm), pl.ds(f0, bf)], acc, ok)
        return
    res = _load(r_ref.at[pl.ds(r0, bm), pl.ds(f0, bf)], ok).astype(jnp.float32)
    # as XLA: the down GEMM's output rounded to the dtype, then the residual add
    y = acc.astype(dt).astype(jnp.float32) + res
    _store(o_ref.at[pl.ds(r0, bm), pl.ds(f0, bf)], y.astype(o_ref.dtype), ok)


def _whole(shape):
    """A block that is the whole array, the same for every program."""
    origin = (0,) * len(shape)
    return pl.BlockSpec(shape, lambda *_: origin)


def _call(kernel, ins, grid, out_shape, dtype, *, num_warps, num_stages, interpret, name):
    """A Triton-flavoured pallas_call whose inputs and output are whole arrays: each program
    indexes them itself and writes its own masked tile of the output."""
    with warnings.catch_warnings():
        # jax 0.11 deprecates the Triton lowering (see tree_attention.py's docstring)
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[_whole(a.shape) for a in ins],
            out_specs=_whole(out_shape),
            out_shape=jax.ShapeDtypeStruct(out_shape, dtype),
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
            name=name,
        )(*ins)


def _precision(dtype):
    # float32 weights (tests) at full precision; bf16 / f16 on the tensor cores as they are
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def rms_swiglu(x, norm_weight, eps: float, gate_up, tiles: Plan, *,
               interpret: bool | None = None, num_warps: int = 4,
               num_stages: int = 3):  # fmt: skip
    """Kernel A: silu(g) * u with [g, u] = RMSNorm(x) @ gate_up. x [n, D]; norm_weight [D];
    gate_up [D, 2, I]. Returns h [n, I] in x's dtype."""
    n, D = x.shape
    I = gate_up.shape[2]
    bm, bf = tiles.bm, tiles.bf_a
    kernel = functools.partial(_rms_swiglu_kernel, n=n, D=D, I=I, eps=float(eps), bm=bm,
                               bk=tiles.bk, bf=bf, precision=_precision(x.dtype))  # fmt: skip
    ins = [x, norm_weight, gate_up.reshape(D, 2 * I)]  # a free reshape: gate | up columns
    return _call(kernel, ins, (pl.cdiv(n, bm), pl.cdiv(I, bf)), (n, I), x.dtype,
                 num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                 name="dense_mlp_rms_swiglu")  # fmt: skip


def down_residual(h, down, residual, tiles: Plan, *, interpret: bool | None = None,
                  num_warps: int = 4, num_stages: int = 3):  # fmt: skip
    """Kernel B: residual + h @ down. h [n, I]; down [I, D]; residual [n, D]. Returns [n, D]
    in residual's dtype; with tiles.splits > 1 the slices' partials are added by XLA."""
    n, I = h.shape
    D = down.shape[1]
    bm, bf, splits = tiles.bm, tiles.bf_b, tiles.splits
    if I % splits:
        raise ValueError(f"the down projection's {I} inputs do not split into {splits} slices")
    kernel = functools.partial(_down_kernel, n=n, I=I, D=D, bm=bm, bk=tiles.bk, bf=bf,
                               splits=splits, precision=_precision(h.dtype))  # fmt: skip
    grid = (pl.cdiv(n, bm), pl.cdiv(D, bf), splits)
    opts = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                name="dense_mlp_down_residual")  # fmt: skip
    if splits == 1:
        return _call(kernel, [h, down, residual], grid, (n, D), residual.dtype, **opts)
    parts = _call(kernel, [h, down], grid, (splits, n, D), jnp.float32, **opts)
    acc = parts[0]
    for part in parts[1:]:  # one order whatever n: slice 0 + slice 1 + ...
        acc = acc + part
    return residual + acc.astype(residual.dtype)


def dense_mlp(x, norm_weight, eps: float, gate_up, down, *, tiles: Plan | None = None,
              programs: int = DEFAULT.gemv_programs, fixed_rows: bool = False,
              interpret: bool | None = None):  # fmt: skip
    """x + down(silu(g) * u), [g, u] = RMSNorm(x) @ gate_up: the decoder block's MLP half
    (see the module docstring). x [n, D]; norm_weight [D]; gate_up [D, 2, I]; down [I, D].
    Returns [n, D] in x's dtype. tiles: default `plan(n, D, I, programs=, fixed_rows=)`.
    interpret: run in Pallas' interpreter (default: everywhere but on a GPU)."""
    if not supported(x, norm_weight, gate_up, down):
        raise ValueError(f"the fused MLP does not take x {x.dtype}, norm {norm_weight.dtype}, "
                         f"gate_up {gate_up.shape} {gate_up.dtype}, down {down.shape} "
                         f"{down.dtype} (dense_mlp.supported)")  # fmt: skip
    n, D = x.shape
    I = gate_up.shape[2]
    tiles = tiles or plan(n, D, I, programs=programs, fixed_rows=fixed_rows)
    h = rms_swiglu(x, norm_weight, eps, gate_up, tiles, interpret=interpret)
    return down_residual(h, down, x, tiles, interpret=interpret)


def reference(x, norm_weight, eps: float, gate_up, down):
    """The XLA oracle, the same ops as the decoder block's XLA path (layers.RMSNorm, MLP):
    x + down(silu(g) * u) in x's dtype."""
    dt = x.dtype
    xf = x.astype(jnp.float32)
    xn = norm_weight * (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(dt)
    gu = jnp.tensordot(xn, gate_up, axes=1)  # [n, 2, I]
    return x + jnp.tensordot(jax.nn.silu(gu[:, 0]) * gu[:, 1], down, axes=1)


__all__ = ["dense_mlp", "down_residual", "plan", "reference", "rms_swiglu", "supported"]
