"""MoE routing and expert compute: both expert paths agree with a dense per-expert loop, and
with experts kept quantised (INT4, FP8) they compute what their dequantised weights do; the
Pallas kernels, chosen by a KernelPolicy (run interpreted here), compute what the XLA
references do."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdj.kernels import KernelPolicy
from kdj.models import deepseek, layers
from kdj.models.deepseek import ExpertWeight, expert_swiglu, expert_swiglu_gathered
from kdj.pallas import expert_gemv, expert_grouped
from kdj.quant import quant_fp8_stacked, quant_int4_stacked

XLA = KernelPolicy()  # the reference everywhere
GPU = KernelPolicy.default("gpu")  # every Pallas kernel, as on one GPU (interpreted here)
# the gathered path under the XLA gather: the reference the expert GEMV is checked against
gathered = functools.partial(expert_swiglu_gathered, kernels=XLA)


def spy(monkeypatch, module, name):
    """Record each call of module.name (a kernel entry point), still running it."""
    calls, fn = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append((a, k)) or fn(*a, **k))
    return calls


def dense_reference(x, w, idx, wg, wu, wd):
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = jax.nn.silu(x[n] @ wg[e]) * (x[n] @ wu[e])
            out[n] += w[n, j] * np.asarray(h @ wd[e])
    return out


@pytest.mark.parametrize("fn", [expert_swiglu, gathered], ids=["ragged", "gathered"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_expert_paths_match_dense_loop(fn, tokens):
    rng = np.random.default_rng(tokens)
    E, D, I, k = 8, 16, 24, 3
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, D, I)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((E, I, D)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = rng.random((tokens, k)).astype(np.float32)
    wgu = np.stack([wg, wu], axis=2)  # [E, D, 2, I]
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), wgu, wd))
    want = dense_reference(x, w, idx, wg, wu, wd)
    # float32 sums whose terms reach the outputs' scale (~100s): an entry that cancels to near
    # zero keeps their rounding error, so the absolute tolerance follows that scale
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("fn", [expert_swiglu, gathered], ids=["ragged", "gathered"])
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2, 17])  # 3 and 6 assignments touch < E experts; 51 all
def test_quantised_experts_match_their_dequantised_weights(fn, fmt, tokens):
    rng = np.random.default_rng(tokens)
    E, D, I, k = 8, 64, 32, 3
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2, I)), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E, I, D)), jnp.float32)
    if fmt == "int4":
        quant = functools.partial(quant_int4_stacked, scale_dtype=jnp.float32)
    else:
        quant = functools.partial(quant_fp8_stacked, block=16)
    q = [ExpertWeight(*quant(a), fmt) for a in (wgu, wd)]
    dense = [a.dense(jnp.float32) for a in q]
    want = np.asarray(fn(x, w, jnp.asarray(idx), *dense))
    got = np.asarray(jax.jit(fn)(x, w, jnp.asarray(idx), *q))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def quantised(w, fmt):
    """(value, scale) of float experts w [E, in, *out] kept in fmt (FP8 blocks of 16)."""
    if fmt == "int4":
        return quant_int4_stacked(w, scale_dtype=jnp.bfloat16)
    if fmt == "fp8":
        return quant_fp8_stacked(w, block=16)
    return w, None


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("K, F", [(64, 48), (96, 80), (256, 128)])  # ragged and whole tiles
def test_gemv_kernel_matches_the_xla_gather(fmt, K, F):
    """The kernel reads each assignment's expert as stored; tiles smaller than the matrix
    (block_k 32 / 8 words, block_f 32) make K and F run over several tiles, ragged where they
    do not divide."""
    if fmt == "fp8" and (K % 16 or F % 16):
        pytest.skip("fp8 needs whole 16 x 16 blocks")
    rng = np.random.default_rng(K + F)
    E, n = 5, 7
    w = jnp.asarray(rng.standard_normal((E, K, F)) * 0.1, jnp.bfloat16)
    value, scale = quantised(w, fmt)
    x = jnp.asarray(rng.standard_normal((n, K)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, n), jnp.int32)
    tiles = dict(block_k=8 if fmt == "int4" else 32, block_f=32)
    got = expert_gemv.expert_gemv(x, ids, value, scale, fmt, interpret=True, **tiles)
    want = expert_gemv.reference(x, ids, value, scale, fmt)
    assert got.shape == (n, F) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    if scale is None or scale.shape[1] % 2 == 0:  # halves of whole scale groups / blocks
        # K split in two (each half its own program row, partial sums added): the same sums
        got = expert_gemv.expert_gemv(x, ids, value, scale, fmt, splits=2, interpret=True,
                                      **tiles)  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_gemv_k_split_rule():
    """expert_gemv.splits: enough programs for few assignments, whole scale groups and blocks
    per slice, slices of at least 256 inputs; many assignments are not split."""
    s = expert_gemv.splits
    assert s(6, "float", 2048, 2816) == 1 and s(6, "float", 1408, 2048) == 2  # Moonlight experts
    assert s(8, "float", 7168, 4096) == 1 and s(64, "float", 2048, 2816) == 1  # enough already
    assert s(1, "int4", 2048, 2816, (1, 64, 2816)) == 4  # 512 inputs = 16 groups of 32 per slice
    assert s(1, "int4", 1024, 64, (1, 32, 64)) == 4  # at most 256 inputs = 8 groups per slice
    assert s(1, "fp8", 384, 2048, (1, 3, 16)) == 1  # 3 blocks of 128: no whole halves
    assert s(1, "float", 384, 2048) == 1  # halves of 192 inputs: too short
    x, w = jnp.zeros((1, 66)), jnp.zeros((1, 66, 8))
    with pytest.raises(ValueError, match="do not split into 4 K slices"):
        expert_gemv.expert_gemv(x, jnp.zeros(1, jnp.int32), w, splits=4, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_int4_gemv_is_exact_for_wide_ranging_inputs(dtype):
    """The INT4 GEMV on f32 inputs from 1e-3 to 1e4, and on float16 ones, gives the
    dequantised matvec to f32 rounding (nibbles become floats through exponent bits)."""
    rng = np.random.default_rng(3)
    E, n, K, F = 3, 4, 128, 64
    w = jnp.asarray(rng.standard_normal((E, K, F)) * 0.1, jnp.bfloat16)
    value, scale = quantised(w, "int4")
    mag = 10.0 ** rng.uniform(-3, 4 if dtype == jnp.float32 else 3, (n, K))
    x = jnp.asarray(rng.choice([-1.0, 1.0], (n, K)) * mag, dtype)
    ids = jnp.asarray([0, 2, 1, 2], jnp.int32)
    got = expert_gemv.expert_gemv(x, ids, value, scale, "int4", interpret=True, block_k=8)
    want = expert_gemv.reference(x, ids, value, scale, "int4")
    assert np.isfinite(np.asarray(got)).all()
    tol = 1e-5 * float(np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=tol)


def test_one_row_projections_take_the_gemv_split_over_k(monkeypatch):
    """layers.matmul at one row: the GPU policy's window of weight sizes; the Pallas GEMV
    (interpreted here) split over K computes what XLA's dot does, for a Linear and for the
    MLP's [D, 2, I] gate/up, ragged K slices included; more rows keep XLA's dot."""
    takes = GPU.dense_gemv_for
    assert not XLA.dense_gemv_for(1, 2048 * 3072)  # the reference: XLA
    assert takes(1, 2048 * 3072)  # Moonlight's q_proj
    assert not takes(2, 2048 * 3072)  # two rows: XLA's GEMM
    assert takes(1, 2048 * 576)  # MLA's kv_a
    assert takes(1, 2048 * 64)  # Moonlight's router (float32)
    assert not takes(1, 576 * 192)  # small: XLA fuses it
    assert not takes(1, 2048 * 2 * 11264)  # big: XLA's dot is fast
    sharded = KernelPolicy.default("gpu", sharded=True)
    assert not sharded.dense_gemv_for(1, 2048 * 3072)  # split weights stay with XLA
    splits = functools.partial(expert_gemv.splits, 1, "float")
    assert splits(2048, 3072) == 8 and splits(2048, 64 * 512) == 1
    assert splits(2816, 2048) == 8  # 352-row slices: ragged K tiles of 128
    assert splits(2048, 5632) == 4  # its shared experts' gate/up
    assert splits(2048, 3072, programs=512) == 8 and splits(2048, 5632, programs=512) == 8
    ran = spy(monkeypatch, expert_gemv, "expert_gemv")
    every = GPU.replace(gemv_min_weights=1)  # these small matrices too
    rng = np.random.default_rng(5)
    lin = layers.Linear(704, 96, ("embed", "mlp"), dtype=jnp.float32, rngs=nnx.Rngs(0),
                        kernels=every)  # fmt: skip
    mlp = layers.MLP(704, 48, dtype=jnp.float32, rngs=nnx.Rngs(1), kernels=every)
    for x in (rng.standard_normal((1, 1, 704)), rng.standard_normal((2, 3, 704))):
        x = jnp.asarray(x, jnp.float32)
        np.testing.assert_allclose(lin(x), x @ lin.kernel[...], rtol=1e-4, atol=1e-3)
        wgu = mlp.gate_up[...]
        h = jnp.einsum("...d,dci->...ci", x, wgu)
        want = (jax.nn.silu(h[..., 0, :]) * h[..., 1, :]) @ mlp.down.kernel[...]
        np.testing.assert_allclose(mlp(x), want, rtol=1e-4, atol=1e-3)
    # the one-row calls, and only those: the Linear, the MLP's gate/up (flattened to 2I
    # columns, split over K) and its down projection
    shapes = [(a[2].shape[1:], k["splits"]) for a, k in ran]
    assert shapes == [((704, 96), 2), ((704, 96), 2), ((48, 704), 1)]


def test_mla_head_projections_take_the_gemv_at_one_row(monkeypatch):
    """layers.head_matmul, MLA's absorbed per-head projections: at one row per head under
    the GPU policy the Pallas GEMV with the heads as experts (interpreted here), the same
    numbers as XLA's batched dot, at w_uk's and w_uv's shapes; more rows keep XLA's dot."""
    rng = np.random.default_rng(9)
    w_uk = jnp.asarray(rng.standard_normal((4, 128, 64)), jnp.float32)  # [H, nope, C]
    w_uv = jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.float32)  # [H, C, v]
    assert not XLA.head_gemv_for(1)
    assert GPU.head_gemv_for(1) and not GPU.head_gemv_for(6)
    assert not KernelPolicy.default("gpu", sharded=True).head_gemv_for(1)
    ran = spy(monkeypatch, expert_gemv, "expert_gemv")
    for w in (w_uk, w_uv):
        for shape in ((1, 1), (2, 3)):
            x = jnp.asarray(rng.standard_normal((*shape, 4, w.shape[1])), jnp.float32)
            want = np.einsum("bthk,hkf->bthf", np.asarray(x, np.float64), np.asarray(w, np.float64))
            got = layers.head_matmul(x, w, GPU)
            assert got.shape == (*shape, 4, w.shape[2])
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-3)
    assert len(ran) == 2  # the one-row calls, and only those


def test_gemv_kernel_refuses_mismatched_weights():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    ids = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="do not match inputs of width 64"):
        expert_gemv.expert_gemv(x, ids, jnp.zeros((3, 32, 16), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="expert format"):
        expert_gemv.expert_gemv(x, ids, jnp.zeros((3, 64, 16)), None, "int8", interpret=True)


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
def test_gathered_experts_through_the_kernel_match_the_dense_loop(fmt, monkeypatch):
    """expert_swiglu_gathered with ExpertWeight.matvec on the kernel (the GPU policy)
    computes the SwiGLU experts of the dequantised weights: gate/up [E, D, 2, I] flattened to
    2I columns (their scales likewise), down [E, I, D]."""
    ran = spy(monkeypatch, expert_gemv, "expert_gemv")
    rng = np.random.default_rng(3)
    E, D, I, k, tokens = 6, 64, 32, 2, 3
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]), jnp.int32)
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2, I)), jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E, I, D)), jnp.float32)
    q = [ExpertWeight(*quantised(a, fmt), fmt) for a in (wgu, wd)]
    dense = [np.asarray(a.dense(jnp.float32)) for a in q]
    wg, wu = dense[0][:, :, 0], dense[0][:, :, 1]
    want = dense_reference(np.asarray(x), np.asarray(w), np.asarray(idx), wg, wu, dense[1])
    assert all(a.gemv_kernel(GPU) and not a.gemv_kernel(XLA) for a in q)
    got = np.asarray(expert_swiglu_gathered(x, w, idx, *q, kernels=GPU))
    assert len(ran) == 2  # gate/up, then down
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("skipped", [0, 9])
@pytest.mark.parametrize("E", [6, 300])  # sort keys of 8 and 16 bits
def test_row_blocks_hold_each_assignment_once_under_its_expert(skipped, E):
    """blocks(): every assignment in exactly one padded row, each block one expert's, padding
    and unused blocks marked -1; assignments with id -1 (another shard's) in none."""
    rng = np.random.default_rng(0)
    bm = 4
    ids = rng.integers(0, E, 23)
    ids[rng.choice(23, skipped, replace=False)] = -1
    ids = jnp.asarray(ids, jnp.int32)
    rows, be = (np.asarray(a) for a in expert_grouped.blocks(ids, E, bm))
    assert len(be) == -(-23 // bm) + min(23, E) and len(rows) == len(be) * bm
    assert sorted(rows[rows >= 0].tolist()) == np.flatnonzero(np.asarray(ids) >= 0).tolist()
    for b, e in enumerate(be):
        mine = rows[b * bm : (b + 1) * bm]
        if e < 0:
            assert (mine == -1).all()
        else:
            assert (np.asarray(ids)[mine[mine >= 0]] == e).all() and (mine >= 0).any()


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
# a few rows per expert, several blocks of one (16 rows), then 66 per expert: the big tiles
@pytest.mark.parametrize("n", [3, 37, 330])
def test_grouped_kernel_matches_the_dequantised_weights(fmt, n):
    """The grouped kernel (interpreted) computes x @ W[id] per row; dequantised tiles are
    rounded to the input dtype (bf16) before the tensor-core dot, as XLA's path rounds them."""
    rng = np.random.default_rng(n)
    # F not a multiple of the 64-column tile (FP8: whole 128 x 128 blocks); K two 128 tiles
    E, K, F = 5, 256, 128 if fmt == "fp8" else 80
    w = jnp.asarray(rng.standard_normal((E, K, F)) * 0.1, jnp.bfloat16)
    value, scale = quant_fp8_stacked(w, block=128) if fmt == "fp8" else quantised(w, fmt)
    x = jnp.asarray(rng.standard_normal((n, K)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E, n), jnp.int32)
    got = expert_grouped.expert_grouped(x, ids, value, scale, fmt, interpret=True)
    from kdj.quant import dequant_stacked

    wd = dequant_stacked(fmt, value[ids], None if scale is None else scale[ids], jnp.bfloat16)
    want = jnp.einsum("nk,nkf->nf", x.astype(jnp.float32), wd.astype(jnp.float32))
    assert got.shape == (n, F) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
    # the grid launched column tiles first: the same programs, so the same numbers; and a
    # bf16 output is the float32 sums rounded once
    flipped = expert_grouped.expert_grouped(x, ids, value, scale, fmt, interpret=True,
                                            cols_first=True, out_dtype=jnp.bfloat16)  # fmt: skip
    assert flipped.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(flipped), np.asarray(got.astype(jnp.bfloat16)))


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize(
    "kernel, n",
    [
        ("gemv", 24),
        ("gemv-split", 2),
        ("grouped", 24),
        ("grouped", 300),
        ("grouped-cols", 24),
    ],
)
def test_expert_kernels_lower_to_triton_modules_that_verify(kernel, n, fmt, monkeypatch):
    """Lowered for CUDA on this CPU, each Triton module passes MLIR's verifier: what XLA
    checks first on a GPU. Interpreted runs cannot catch this (on the H200 the grouped
    kernel's loop over a traced trip count failed here: scf.for bounds of two types)."""
    from jax._src.pallas.triton import lowering

    verified = []

    def lower_and_verify(*args, **kw):
        out = lower_to_triton(*args, **kw)
        module = getattr(out, "module", out)
        module.operation.verify()  # raises with the verifier's message
        verified.append(True)
        return out

    lower_to_triton = lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    E, K, F = 4, 256, 128  # n = 300: 75 rows per expert, the grouped kernel's big tiles
    w = jnp.zeros((E, K, F), jnp.bfloat16)
    value, scale = quant_fp8_stacked(w, block=128) if fmt == "fp8" else quantised(w, fmt)
    x, ids = jnp.zeros((n, K), jnp.bfloat16), jnp.zeros((n,), jnp.int32)

    def cols_first(*args, **kw):  # the other grid order, bf16 out (the MoE layer's)
        return expert_grouped.expert_grouped(*args, **kw, cols_first=True, out_dtype=x.dtype)

    fn = {"gemv": expert_gemv.expert_gemv, "grouped": expert_grouped.expert_grouped,
          "gemv-split": functools.partial(expert_gemv.expert_gemv, splits=2),
          "grouped-cols": cols_first}[kernel]  # fmt: skip
    run = jax.jit(lambda x, ids, v, s: fn(x, ids, v, s, fmt, interpret=False))
    run.trace(x, ids, value, scale).lower(lowering_platforms=("cuda",))
    assert verified


def swiglu_case(fmt, tokens, seed=5):
    """(x, weights, idx, [gate/up, down] ExpertWeights in fmt, the dense float32 result) for
    E=4 experts of D=I=128, k=2 (FP8 in whole 128 x 128 blocks)."""
    rng = np.random.default_rng(seed)
    E, D, I, k = 4, 128, 128, 2
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]), jnp.int32)
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2, I)) * 0.1, jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((E, I, D)) * 0.1, jnp.bfloat16)
    quant = functools.partial(quant_fp8_stacked, block=128) if fmt == "fp8" else None
    q = [ExpertWeight(*(quant(a) if quant else quantised(a, fmt)), fmt) for a in (wgu, wd)]
    dense = [np.asarray(a.dense(jnp.float32)) for a in q]
    wg, wu = dense[0][:, :, 0], dense[0][:, :, 1]
    xf, wf, idf = np.asarray(x, np.float32), np.asarray(w), np.asarray(idx)
    return x, w, idx, q, dense_reference(xf, wf, idf, wg, wu, dense[1])


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("tokens", [6, 150])  # 3 rows per expert; 75: the big row blocks
def test_the_layer_takes_the_grouped_kernel_for_many_tokens(fmt, tokens, monkeypatch):
    """Past the gather threshold, where the grouped kernel tiles the experts (the GPU policy;
    here interpreted), local_experts runs it and computes the SwiGLU experts of the
    dequantised weights (gate/up flattened to 2I columns, FP8 in whole 128 x 128 blocks)."""
    ran = spy(monkeypatch, expert_grouped, "grouped_matmul")
    x, w, idx, q, want = swiglu_case(fmt, tokens)  # 12 or 300 assignments: grouped GEMMs
    assert 12 > GPU.gather_limit(True) * 4  # past the gather limit even with the GEMV
    got = np.asarray(deepseek.local_experts(x, w, idx, *q, first=0, kernels=GPU), np.float32)
    assert len(ran) == 2  # the kernel ran twice: gate/up, then down
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


def test_grouped_experts_skip_other_shards_assignments(monkeypatch):
    """Under expert parallelism (first > 0, experts held here 2..5 of 8) the grouped path
    gives other shards' assignments no rows, and the result is the local experts' share."""
    real_rows = []
    kernel = expert_grouped.grouped_matmul
    monkeypatch.setattr(expert_grouped, "grouped_matmul", lambda x, rows, *a, **kw: (
        real_rows.append(int((rows >= 0).sum())) or kernel(x, rows, *a, **kw)))  # fmt: skip
    rng = np.random.default_rng(9)
    E, first, E_local, D, I, k, tokens = 8, 2, 4, 128, 128, 2, 12
    x = jnp.asarray(rng.standard_normal((tokens, D)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]), jnp.int32)
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    wgu = jnp.asarray(rng.standard_normal((E_local, D, 2, I)) * 0.1, jnp.float32)
    wd = jnp.asarray(rng.standard_normal((E_local, I, D)) * 0.1, jnp.float32)
    local = np.asarray(idx) - first
    mine = (local >= 0) & (local < E_local)
    assert mine.any() and not mine.all()
    wg, wu = np.asarray(wgu)[:, :, 0], np.asarray(wgu)[:, :, 1]
    want = dense_reference(np.asarray(x), np.where(mine, np.asarray(w), 0.0),
                           np.where(mine, local, 0), wg, wu, np.asarray(wd))  # fmt: skip
    got = np.asarray(deepseek.local_experts(x, w, idx, wgu, wd, first=first, kernels=GPU))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert real_rows == [int(mine.sum())] * 2  # both matmuls: the local assignments only
