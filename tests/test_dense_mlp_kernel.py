"""The fused dense MLP (kdj/pallas/dense_mlp.py, interpreted here): both kernels compute what
the XLA path does, at decode and verify row counts, ragged tiles and K splits included; the
kernel policy's dense_mlp field picks it per row count and keys the jit; a tiny Llama gives
the same greedy tokens on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdj
from kdj.config import ModelConfig
from kdj.kernels import FAMILIES, KernelPolicy, choose
from kdj.models import layers
from kdj.models.drafter import DrafterConfig, DrafterLayer
from kdj.models.transformer import build_model
from kdj.pallas import dense_mlp
from kdj.sharding import MeshConfig, make_mesh
from tests.test_deterministic import rows_match_steps

FUSED = KernelPolicy(dense_mlp="pallas")
TINY_LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=80,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, max_position_embeddings=256)  # fmt: skip


def block(n, D, I, dtype, seed=0):
    """(x [n, D], norm weight [D], gate_up [D, 2, I], down [I, D]) at the scales of a
    trained model's residual stream and weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)) * 2.0
    norm = 1.0 + 0.1 * rng.standard_normal(D)
    gate_up = rng.standard_normal((D, 2, I)) / np.sqrt(D)
    down = rng.standard_normal((I, D)) / np.sqrt(I)
    return tuple(jnp.asarray(a, dtype) for a in (x, norm, gate_up, down))


def check(got, inputs, eps):
    """The fused block against the XLA path on the same inputs. float32: equal up to
    summation order. bf16: within 2 bf16 steps of the output's scale (the kernel runs SwiGLU
    in float32 and rounds h once, XLA rounds each of its bf16 ops), and on average no
    further than the XLA path from the block computed in float32 from the same values."""
    want = np.asarray(dense_mlp.reference(*inputs[:2], eps, *inputs[2:]), np.float32)
    got = np.asarray(got, np.float32)
    scale = float(np.abs(want).max())
    if inputs[0].dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
        return
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * 2.0**-8 * scale)
    f32 = [a.astype(jnp.float32) for a in inputs]
    exact = np.asarray(dense_mlp.reference(*f32[:2], eps, *f32[2:]))
    assert np.abs(got - exact).mean() <= 1.05 * np.abs(want - exact).mean()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_kernels_match_the_xla_path_at_smollm2_shape(rows, dtype):
    """SmolLM2's block: D = 576 (9 K tiles of 64), I = 1536; B split into 4 K slices."""
    inputs = block(rows, 576, 1536, dtype, seed=rows)
    assert dense_mlp.plan(rows, 576, 1536).splits == 4
    got = dense_mlp.dense_mlp(*inputs[:2], 1e-5, *inputs[2:], interpret=True)
    assert got.dtype == dtype and got.shape == (rows, 576)
    check(got, inputs, 1e-5)


@pytest.mark.parametrize(
    "n, D, I, tiles",
    [
        (5, 72, 200, None),  # D, I not multiples of the K or column tiles; B unsplit
        (70, 80, 100, None),  # two row blocks, the second ragged
        (2, 88, 520, dense_mlp.Plan(bm=16, bf_a=32, bf_b=16, bk=32, splits=2)),  # ragged slices
        (3, 48, 1024, dense_mlp.Plan(bm=32, bf_a=64, bf_b=64, bk=16, splits=8)),  # tile > D
    ],
)
def test_ragged_tiles_and_splits(n, D, I, tiles):
    inputs = block(n, D, I, jnp.float32, seed=D)
    got = dense_mlp.dense_mlp(*inputs[:2], 1e-6, *inputs[2:], tiles=tiles, interpret=True)
    check(got, inputs, 1e-6)


def test_each_kernel_alone():
    """A alone is RMSNorm + gate/up + SwiGLU; B alone adds h @ down to any residual, split
    or not."""
    x, norm, gate_up, down = block(3, 64, 160, jnp.float32)
    tiles = dense_mlp.plan(3, 64, 160)
    h = dense_mlp.rms_swiglu(x, norm, 1e-5, gate_up, tiles, interpret=True)
    xn = layers.RMSNorm(64, 1e-5, dtype=jnp.float32)
    xn.weight[...] = norm
    gu = jnp.tensordot(xn(x), gate_up, axes=1)
    want = jax.nn.silu(gu[:, 0]) * gu[:, 1]
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-5)
    res = jnp.ones((3, 64)) * 0.5
    for splits in (1, 2):
        y = dense_mlp.down_residual(h, down, res, tiles._replace(splits=splits), interpret=True)
        np.testing.assert_allclose(y, res + want @ down, rtol=1e-5, atol=1e-5)


def test_tiles_are_powers_of_two_fixed_by_the_weights():
    """bk, bf and splits follow the weights' shape only; bm the row count, or 64 with
    fixed_rows (deterministic mode)."""
    assert dense_mlp.plan(1, 576, 1536) == dense_mlp.Plan(16, 16, 16, 64, 4)  # SmolLM2
    assert dense_mlp.plan(1, 4096, 14336) == dense_mlp.Plan(16, 32, 16, 64, 1)  # Llama-3-8B
    assert dense_mlp.plan(1, 1024, 3072).splits == 4  # Qwen3-0.6B: 64 tiles x 4 slices
    assert [dense_mlp.plan(n, 576, 1536).bm for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 64]
    assert {dense_mlp.plan(n, 576, 1536, fixed_rows=True) for n in (1, 9, 200)} == {
        dense_mlp.Plan(64, 16, 16, 64, 4)
    }
    for n, D, I in [(1, 576, 1536), (40, 896, 4864), (7, 2048, 8192), (3, 72, 200)]:
        assert all(v & (v - 1) == 0 for v in dense_mlp.plan(n, D, I)), (D, I)  # as Triton needs
    assert dense_mlp.down_splits(1536, 36, programs=1 << 20) == 4  # slices keep >= 256 inputs
    assert dense_mlp.down_splits(1000, 1, programs=256) == 2  # 500-input slices, not 250


def test_a_row_does_not_depend_on_how_many_rows_there_are():
    """With fixed_rows every program runs the same tiles at any row count, so each row's
    bits are the same alone, in a verify-sized block and past one row block (B split in 2)."""
    x, norm, gate_up, down = block(70, 64, 512, jnp.bfloat16)
    assert dense_mlp.plan(1, 64, 512, fixed_rows=True).splits == 2
    runs = [
        dense_mlp.dense_mlp(x[:n], norm, 1e-5, gate_up, down, fixed_rows=True, interpret=True)
        for n in (1, 5, 70)
    ]
    np.testing.assert_array_equal(runs[0], runs[1][:1])
    np.testing.assert_array_equal(runs[1], runs[2][:5])


@pytest.mark.parametrize(
    "dtype, n, D, I, fixed_rows",
    [
        (jnp.bfloat16, 1, 576, 1536, False),  # SmolLM2 at one row: B split in 4
        (jnp.float32, 70, 72, 200, True),  # ragged everywhere, two row blocks, B unsplit
    ],
)
def test_both_kernels_lower_to_triton_modules_that_verify(dtype, n, D, I, fixed_rows,
                                                          monkeypatch):  # fmt: skip
    """Lowered for CUDA on this CPU, each Triton module passes MLIR's verifier (as the expert
    kernels' test in test_moe.py): what XLA checks first on a GPU, and what an interpreted
    run cannot catch."""
    from jax._src.pallas.triton import lowering

    verified, lower_to_triton = [], lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kw):
        out = lower_to_triton(*args, **kw)
        getattr(out, "module", out).operation.verify()  # raises with the verifier's message
        verified.append(True)
        return out

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    inputs = [jnp.zeros(s, dtype) for s in ((n, D), (D,), (D, 2, I), (I, D))]
    run = jax.jit(lambda x, w, gu, dn: dense_mlp.dense_mlp(x, w, 1e-5, gu, dn,
                                                           fixed_rows=fixed_rows,
                                                           interpret=False))  # fmt: skip
    run.trace(*inputs).lower(lowering_platforms=("cuda",))
    assert len(verified) == 2


def test_unsupported_blocks_are_refused():
    x, norm, gate_up, down = block(2, 32, 48, jnp.float32)
    assert dense_mlp.supported(x, norm, gate_up, down)
    assert not dense_mlp.supported(x.astype(jnp.bfloat16), norm, gate_up, down)  # mixed dtypes
    assert not dense_mlp.supported(*(a.astype(jnp.int32) for a in (x, norm, gate_up, down)))
    assert not dense_mlp.supported(x, norm, gate_up, down.T)
    with pytest.raises(ValueError, match="dense_mlp.supported"):
        dense_mlp.dense_mlp(x, norm, 1e-5, gate_up.reshape(32, 1, 96), down, interpret=True)


def test_the_policy_picks_it_per_row_count():
    assert "dense_mlp" in FAMILIES
    assert KernelPolicy().dense_mlp == "xla" and not KernelPolicy().dense_mlp_for(1)
    assert FUSED.dense_mlp_for(1) and FUSED.dense_mlp_for(64) and not FUSED.dense_mlp_for(65)
    assert FUSED.replace(dense_mlp_max_rows=256).dense_mlp_for(200)
    assert FUSED.as_deterministic().dense_mlp_for(4096)  # width-invariant: every row count
    with pytest.raises(ValueError, match="dense_mlp must be 'xla' or 'pallas'"):
        KernelPolicy(dense_mlp="triton")
    with pytest.raises(ValueError, match="dense_mlp_max_rows"):
        KernelPolicy(dense_mlp_max_rows=0)
    two = make_mesh(MeshConfig(model=2), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="fused dense MLP cannot take weights split"):
        choose(FUSED, two)


def spy(monkeypatch):
    """Count calls of the fused entry point (traces, under jit), still running it."""
    calls, fn = [], dense_mlp.dense_mlp
    monkeypatch.setattr(dense_mlp, "dense_mlp", lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


def test_the_policy_keys_the_jit_and_the_row_threshold_holds(monkeypatch):
    """The policy is in the graphdef: a forward traces again for dense_mlp and for its
    threshold, once each; every dense layer takes the kernels up to the threshold, none
    beyond; the logits are the XLA path's."""
    calls = spy(monkeypatch)
    ref = kdj.Target.from_model(build_model(ModelConfig.from_hf(TINY_LLAMA), jnp.float32))
    fused = ref.with_kernels(FUSED)
    assert fused.graphdef != ref.graphdef and hash(fused.graphdef) != hash(ref.graphdef)
    ids = np.array([[5, 7, 1, 2]])
    want = kdj.forward(ref, ids)
    assert not calls
    np.testing.assert_allclose(kdj.forward(fused, ids), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # one per layer
    kdj.forward(fused, ids)
    assert len(calls) == 2  # the same key: no new trace
    low = fused.with_kernels(FUSED.replace(dense_mlp_max_rows=3))
    assert low.graphdef != fused.graphdef
    np.testing.assert_allclose(kdj.forward(low, ids), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # 4 rows > 3: XLA
    kdj.forward(low, ids[:, :3])
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_tiny_llama_gives_the_xla_paths_logits_and_tokens(dtype, monkeypatch):
    """Logits over a 6-token block on the fused kernels: the XLA path's (bf16: up to its
    rounding, the same argmax nearly everywhere); in float32 greedy decoding (prefill, then
    one-row steps) gives the XLA path's tokens."""
    calls = spy(monkeypatch)
    ref = kdj.Target.from_model(build_model(ModelConfig.from_hf(TINY_LLAMA), dtype, seed=3))
    fused = ref.with_kernels(FUSED)
    ids = np.array([[5, 7, 1, 2, 9, 4], [3, 3, 8, 0, 1, 6]])
    want, got = kdj.forward(ref, ids), kdj.forward(fused, ids)
    assert len(calls) == 2
    if dtype == jnp.bfloat16:
        np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * float(np.abs(want).max()))
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
        return
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    run = dict(method="ar", max_new_tokens=8, stop_tokens=[])
    prompts = [[5, 7, 1], [2]]
    assert kdj.generate(fused, prompts, **run).tokens == kdj.generate(ref, prompts, **run).tokens
    assert len(calls) > 2  # prefill and the decode step


def test_the_drafter_layer_takes_it(monkeypatch):
    """A DFlash drafter layer's MLP half (blocks of b rows per sequence) runs the kernels
    under the fused policy and computes what the XLA path does."""
    calls = spy(monkeypatch)
    lc = ModelConfig.from_hf(TINY_LLAMA).replace(num_layers=1)
    cfg = DrafterConfig(layers=lc, block_size=4, mask_token_id=63, target_layer_ids=(1,),
                        num_target_layers=2)  # fmt: skip
    layer = DrafterLayer(cfg.layers, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 4, 48))
    want = layer(x, lambda u: u)
    layers.set_kernels(layer, FUSED)
    np.testing.assert_allclose(layer(x, lambda u: u), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_deterministic_mode_keeps_rows_equal_on_it():
    """Deterministic mode runs the kernels at every row count on fixed row tiles: a k-token
    pass gives each row the bits of k one-token passes (bf16, interpreted here)."""
    cfg = ModelConfig.from_hf(dict(TINY_LLAMA, num_hidden_layers=1))
    target = kdj.Target.from_model(build_model(cfg, jnp.bfloat16, seed=1))
    assert rows_match_steps(target.with_kernels(FUSED.as_deterministic()))
