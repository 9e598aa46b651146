"""The frozen target's lm_head over many rows, one chunk of rows at a time: no [rows, V]
float32 array is ever alive whole.

A training step scores B x N x (b - 1) draft slots (61,440 at 32 x 128 x 15) against the
target's vocabulary (49,152 for SmolLM2): their float32 logits alone are 12 GB. Here each
chunk's logits [chunk, V] are made, reduced to a few numbers per row and dropped.

    head_cross_entropy   sum_r w_r CE_r and the argmax hits per row. Differentiated, it also
                         makes the gradient w.r.t. the rows' hidden states in the SAME pass:
                         the loss is linear in each row's CE, so its gradient
                         w_r (softmax_r - p_r) @ W^T is known in the forward and kept
                         ([rows, D], small) instead of the logits; the backward only scales it
                         by the incoming cotangent. Two matmuls per row in all (the logits and
                         the input gradient), as the unchunked autodiff does, and no
                         recompute. The label distribution p_r is onehot(label_r), or, given
                         the target's own hidden state per row, its softmax(h_t @ W): the
                         target's whole next-token distribution (a third matmul per row).
    head_argmax          each row's argmax token (the target's greedy labels).
    head_top_k           each row's k best tokens and their logits (a DFlash2 selector's
                         candidates).

A drafter whose logits are a map of the head's (DFlash2: scaled, then soft-capped) passes
that elementwise map as `logit_map`: the loss is then the cross-entropy of the mapped
logits, and the gradient goes through the map (its vector-Jacobian product, per chunk).

The head W [D, V] is the frozen target's: it gets no gradient (stop_gradient on entry).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class HeadLoss(NamedTuple):
    loss_sum: jax.Array  # float32 scalar: sum_r weights_r * CE_r
    hit: jax.Array  # [...] bool: the head's argmax equals the label


def chunk_layout(rows: int, chunk: int) -> tuple[int, int]:
    """(chunks, rows per chunk): the fewest chunks of at most `chunk` rows, evened out so the
    padding stays under one row per chunk (61,440 rows at chunk 8,192: 8 x 7,680)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"the lm_head chunk must be a positive number of rows, not {chunk!r}")
    n = max(1, -(-rows // chunk))
    return n, max(1, -(-rows // n))


def _chunked(x, n: int, c: int):
    """Rows of x [R, ...] as [n, c, ...], zero-padded at the end."""
    x = jnp.pad(x, [(0, n * c - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(n, c, *x.shape[1:])


def _logits(h, w):
    return jnp.einsum("rd,dv->rv", h, w, preferred_element_type=jnp.float32)


def _scan(h, w, labels, weights, chunk: int, grad: bool, logit_map=None):
    """(loss_sum, hit [R], dh [R, D] or None) over chunks of the rows h [R, D]; labels [R]
    token ids, or [R, D] the target's hidden states (soft labels); logit_map: None, or the
    elementwise map from the head's logits to the rows' (the target's are never mapped)."""
    R, D = h.shape
    n, c = chunk_layout(R, chunk)
    soft = labels.ndim == 2

    def one(xs):
        hc, lc, wc = xs
        logits = _logits(hc, w)  # [c, V] float32 (and the target's, with soft labels)
        if logit_map is not None:
            logits, pullback = jax.vjp(logit_map, logits)
        logz = jax.nn.logsumexp(logits, axis=-1)
        if soft:  # CE against the target's distribution: KL to it plus its (constant) entropy
            t_logits = _logits(lc, w)
            p = jax.nn.softmax(t_logits, axis=-1)
            gold = jnp.sum(p * logits, axis=-1)
            hit = jnp.argmax(logits, axis=-1) == jnp.argmax(t_logits, axis=-1)
        else:
            gold = jnp.take_along_axis(logits, lc[:, None], axis=-1)[:, 0]
            hit = jnp.argmax(logits, axis=-1) == lc
        loss = jnp.sum(wc * (logz - gold))
        if not grad:
            return loss, hit
        if not soft:
            p = jnp.arange(w.shape[1], dtype=lc.dtype) == lc[:, None]
        dlogits = wc[:, None] * (jnp.exp(logits - logz[:, None]) - p)
        if logit_map is not None:
            (dlogits,) = pullback(dlogits)
        dh = jnp.einsum("rv,dv->rd", dlogits.astype(hc.dtype), w,
                        preferred_element_type=jnp.float32)  # fmt: skip
        return loss, hit, dh.astype(hc.dtype)

    # padded rows have weight 0: they add nothing to the loss, and their outputs are cut
    out = jax.lax.map(one, (_chunked(h, n, c), _chunked(labels, n, c), _chunked(weights, n, c)))
    loss, hit = jnp.sum(out[0]), out[1].reshape(-1)[:R]
    return loss, hit, (out[2].reshape(-1, D)[:R] if grad else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_ce(h, w, labels, weights, chunk, logit_map):
    return _scan(h, w, labels, weights, chunk, False, logit_map)[:2]


def _head_ce_fwd(h, w, labels, weights, chunk, logit_map):
    loss, hit, dh = _scan(h, w, labels, weights, chunk, True, logit_map)
    return (loss, hit), dh


def _head_ce_bwd(chunk, logit_map, dh, cotangents):
    g_loss, _ = cotangents  # the hits are booleans: no cotangent
    return (g_loss * dh).astype(dh.dtype), None, None, None  # W, labels, weights: none


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)


def head_cross_entropy(h, head, labels, weights, chunk: int, logit_map=None) -> HeadLoss:
    """Weighted cross-entropy of the rows' logits h @ head against labels, chunk rows at a
    time. h [..., D] (its dtype feeds the matmuls; float32 accumulation), head [D, V],
    weights [...] (no gradient); labels [...] int32 token ids, or [..., D] the target's own
    hidden states, whose distribution softmax(labels @ head) each row then learns (hits:
    the two argmaxes agree). logit_map: None, or an elementwise, increasing map of the rows'
    logits (hashable: DFlash2Config.logits), applied before the cross-entropy.
    Differentiable w.r.t. h only."""
    D = h.shape[-1]
    soft = jnp.issubdtype(labels.dtype, jnp.floating)
    if labels.shape != (h.shape if soft else h.shape[:-1]):
        kind = "hidden states" if soft else "token ids"
        raise ValueError(f"labels ({kind}) of shape {labels.shape} do not fit rows {h.shape}")
    out = _head_ce(
        h.reshape(-1, D),
        jax.lax.stop_gradient(head),
        jax.lax.stop_gradient(labels).reshape(-1, D).astype(h.dtype)
        if soft
        else labels.reshape(-1).astype(jnp.int32),
        jax.lax.stop_gradient(weights).reshape(-1).astype(jnp.float32),
        chunk,
        logit_map,
    )
    return HeadLoss(out[0], out[1].reshape(h.shape[:-1]))


def head_argmax(h, head, chunk: int) -> jax.Array:
    """argmax_v (h @ head)[..., v] as int32 [...], chunk rows at a time (h [..., D])."""
    D = h.shape[-1]
    rows = jax.lax.stop_gradient(h).reshape(-1, D)
    n, c = chunk_layout(rows.shape[0], chunk)
    w = jax.lax.stop_gradient(head)
    best = jax.lax.map(lambda hc: jnp.argmax(_logits(hc, w), axis=-1), _chunked(rows, n, c))
    return best.reshape(-1)[: rows.shape[0]].astype(jnp.int32).reshape(h.shape[:-1])


def head_top_k(h, head, k: int, chunk: int, logit_map=None):
    """The k largest logits of each row h [..., D] against head [D, V] and their token ids
    (lax.top_k's order: descending, lower id first on ties), chunk rows at a time:
    (values [..., k] float32, after logit_map if given, ids [..., k] int32). No gradient."""
    D = h.shape[-1]
    rows = jax.lax.stop_gradient(h).reshape(-1, D)
    n, c = chunk_layout(rows.shape[0], chunk)
    w = jax.lax.stop_gradient(head)

    def one(hc):
        logits = _logits(hc, w)
        return jax.lax.top_k(logits if logit_map is None else logit_map(logits), k)

    values, ids = jax.lax.map(one, _chunked(rows, n, c))
    R = rows.shape[0]
    shape = (*h.shape[:-1], k)
    return values.reshape(-1, k)[:R].reshape(shape), ids.reshape(-1, k)[:R].reshape(shape)
