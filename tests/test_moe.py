"""MoE routing and expert compute: both expert paths agree with a dense per-expert loop, and
with experts kept quantised (INT4, FP8) they compute what their dequantised weights do."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdj.checkpoints.quant import quant_fp8_stacked, quant_int4_stacked
from kdj.models.deepseek import ExpertWeight, expert_swiglu, expert_swiglu_gathered


def dense_reference(x, w, idx, wg, wu, wd):
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = jax.nn.silu(x[n] @ wg[e]) * (x[n] @ wu[e])
            out[n] += w[n, j] * np.asarray(h @ wd[e])
    return out


@pytest.mark.parametrize("fn", [expert_swiglu, expert_swiglu_gathered])
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
    np.testing.assert_allclose(got, dense_reference(x, w, idx, wg, wu, wd), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fn", [expert_swiglu, expert_swiglu_gathered])
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
