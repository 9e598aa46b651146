"""kdj/train/head.py: the chunked lm_head + cross-entropy and argmax against the full
[rows, V] logits, row by row, at chunk sizes that do and do not divide the rows. Float32 on
CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdj.train.config import OptimConfig
from kdj.train.head import chunk_layout, head_argmax, head_cross_entropy

R, D, V = 23, 16, 50


def problem(seed=0):
    """Rows h [R, D], head [D, V], labels (a third of them the argmax, so hits and misses
    both occur) and ragged weights (some rows masked out)."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(R, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) / 4, jnp.float32)
    labels = rng.integers(0, V, R)
    best = np.asarray(jnp.argmax(h @ w, -1))
    labels[::3] = best[::3]
    weights = rng.uniform(0.2, 1.0, R) * (rng.uniform(size=R) > 0.25)
    return h, w, jnp.asarray(labels, jnp.int32), jnp.asarray(weights, jnp.float32)


def reference(h, w, labels, weights):
    """The full-logits form: (sum_r w_r CE_r, hit [R])."""
    logp = jax.nn.log_softmax(jnp.einsum("rd,dv->rv", h, w), -1)
    ce = -jnp.take_along_axis(logp, labels[:, None], -1)[:, 0]
    return jnp.sum(weights * ce), jnp.argmax(logp, -1) == labels


def chunked_loss(h, w, labels, weights, chunk, scale=1.0):
    out = head_cross_entropy(h, w, labels, weights, chunk)
    return scale * out.loss_sum, out.hit


def reference_loss(h, w, labels, weights, scale=1.0):
    loss, hit = reference(h, w, labels, weights)
    return scale * loss, hit


@pytest.mark.parametrize("chunk", [1, 5, 8, R, 64])
def test_chunked_loss_hits_and_gradient_equal_full_logits(chunk):
    """Chunks of 5 and 8 leave a padded last chunk; 1, R and 64 are the edge layouts. The
    cotangent 0.37 checks that the backward scales the gradient made in the forward."""
    h, w, labels, weights = problem()
    ref = jax.value_and_grad(reference_loss, has_aux=True)
    run = jax.jit(jax.value_and_grad(chunked_loss, has_aux=True), static_argnums=4)
    (want, want_hit), want_dh = ref(h, w, labels, weights, 0.37)
    (got, got_hit), got_dh = run(h, w, labels, weights, chunk, 0.37)
    assert bool(want_hit.any()) and not bool(want_hit.all())
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got_hit, want_hit)
    np.testing.assert_allclose(got_dh, want_dh, rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(got_dh[weights == 0]).max()) == 0.0  # masked rows: no gradient
    # without differentiation (the primal path) the same loss and hits
    loss, hit = jax.jit(chunked_loss, static_argnums=4)(h, w, labels, weights, chunk)
    np.testing.assert_allclose(loss, want / 0.37, rtol=1e-6)
    np.testing.assert_array_equal(hit, want_hit)


def test_perturbing_one_chunk_moves_only_its_rows():
    """Rows 10-14 (the third chunk of 5) get new states: the loss moves by exactly their
    change, their gradient follows the reference, every other row's gradient is untouched.
    A chunk mapped to the wrong rows, or padding rows counted, would show here."""
    h, w, labels, weights = problem(1)
    grad = jax.jit(jax.grad(lambda h: chunked_loss(h, w, labels, weights, 5)[0]))
    moved = h.at[10:15].set(h[10:15] * -1.5 + 0.3)
    before, after = grad(h), grad(moved)
    np.testing.assert_array_equal(after[:10], before[:10])
    np.testing.assert_array_equal(after[15:], before[15:])
    want = jax.grad(lambda h: reference(h, w, labels, weights)[0])(moved)
    np.testing.assert_allclose(after[10:15], want[10:15], rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(after[10:15] - before[10:15]).max()) > 1e-3
    delta = (
        chunked_loss(moved, w, labels, weights, 5)[0] - chunked_loss(h, w, labels, weights, 5)[0]
    )
    want_delta = reference(moved, w, labels, weights)[0] - reference(h, w, labels, weights)[0]
    np.testing.assert_allclose(delta, want_delta, rtol=1e-5)


def test_head_gets_no_gradient_and_batch_shape_is_kept():
    """The head is the frozen target's: its gradient is zero by construction (stop_gradient),
    and rows may come as [B, N, k, D] with labels [B, N, k]."""
    h, w, labels, weights = problem()
    dw = jax.grad(lambda w: head_cross_entropy(h, w, labels, weights, 5).loss_sum)(w)
    assert float(jnp.abs(dw).max()) == 0.0
    out = head_cross_entropy(h[:18].reshape(2, 3, 3, D), w, labels[:18].reshape(2, 3, 3),
                             weights[:18].reshape(2, 3, 3), 4)  # fmt: skip
    want_loss, want_hit = reference(h[:18], w, labels[:18], weights[:18])
    assert out.hit.shape == (2, 3, 3)
    np.testing.assert_array_equal(out.hit.reshape(-1), want_hit)
    np.testing.assert_allclose(out.loss_sum, want_loss, rtol=1e-6)


def soft_reference(h, w, target_h, weights, scale=1.0):
    """Soft labels, full logits: sum_r w_r CE(softmax(target_h_r W), softmax(h_r W)); hits
    where the two argmaxes agree."""
    logp = jax.nn.log_softmax(jnp.einsum("rd,dv->rv", h, w), -1)
    t_logits = jnp.einsum("rd,dv->rv", target_h, w)
    ce = -jnp.sum(jax.nn.softmax(t_logits, -1) * logp, -1)
    return scale * jnp.sum(weights * ce), jnp.argmax(logp, -1) == jnp.argmax(t_logits, -1)


@pytest.mark.parametrize("chunk", [1, 5, R, 64])
def test_soft_labels_equal_the_full_logits_form(chunk):
    """Labels given as the target's hidden states: the chunked loss, hits and input gradient
    equal the full-logits cross-entropy against the target's softmax. The target rows are
    the drafter's rows nudged (some argmaxes agree, some not); the loss minus the target's
    entropy is a KL, so it is smallest where the rows equal the target's."""
    h, w, _, weights = problem(3)
    rng = np.random.default_rng(4)
    target_h = h + jnp.asarray(rng.normal(size=h.shape) * 0.6, jnp.float32)
    run = jax.jit(jax.value_and_grad(chunked_loss, has_aux=True), static_argnums=4)
    (got, got_hit), got_dh = run(h, w, target_h, weights, chunk, 0.37)
    (want, want_hit), want_dh = jax.value_and_grad(soft_reference, has_aux=True)(
        h, w, target_h, weights, 0.37
    )
    assert bool(want_hit.any()) and not bool(want_hit.all())
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got_hit, want_hit)
    np.testing.assert_allclose(got_dh, want_dh, rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(got_dh[weights == 0]).max()) == 0.0
    at_target = head_cross_entropy(target_h, w, target_h, weights, chunk)
    assert float(at_target.loss_sum) < float(got) / 0.37
    assert bool(at_target.hit.all())
    # the target's states get no gradient (they are labels)
    dt = jax.grad(lambda t: head_cross_entropy(h, w, t, weights, chunk).loss_sum)(target_h)
    assert float(jnp.abs(dt).max()) == 0.0


def test_labels_that_do_not_fit_the_rows_are_refused():
    h, w, labels, weights = problem()
    with pytest.raises(ValueError, match="token ids"):
        head_cross_entropy(h, w, labels[:5], weights, 4)
    with pytest.raises(ValueError, match="hidden states"):
        head_cross_entropy(h, w, h[:, :3], weights, 4)


@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
def test_head_argmax_equals_argmax_of_full_logits(chunk):
    h, w, _, _ = problem(2)
    h3 = h[:21].reshape(3, 7, D)
    got = jax.jit(head_argmax, static_argnums=2)(h3, w, chunk)
    assert got.dtype == jnp.int32 and got.shape == (3, 7)
    np.testing.assert_array_equal(got, jnp.argmax(jnp.einsum("btd,dv->btv", h3, w), -1))


def test_chunk_layout_evens_out_and_rejects_bad_sizes():
    assert chunk_layout(61_440, 8192) == (8, 7680)  # 32 x 128 x 15 draft slots: no padding
    assert chunk_layout(20_480, 8192) == (3, 6827)
    assert chunk_layout(23, 5) == (5, 5)
    assert chunk_layout(4, 100) == (1, 4)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk must be a positive"):
            chunk_layout(10, bad)
        with pytest.raises(ValueError, match="optim.head_chunk"):
            OptimConfig(head_chunk=bad)
