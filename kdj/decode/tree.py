"""DDTree's draft tree, built on device: the B most probable prefixes of the drafter's
factorised distribution (a building block of the DDTree method; not yet wired into decoding).

With per-depth log-probabilities lp[d, v] (depth d = 1..L), a prefix t_1..t_d scores
sum_i lp[i, t_i]. Scores only fall along a path, so the global top-B set is prefix-closed and
can be found exactly with a per-depth beam: the top-B prefixes of depth d are among the
top-B of depth d - 1 extended by the top-K tokens of depth d (K = min(B, V)); the answer is
the top-B of all L beams together. Ties prefer the shallower node, which keeps closure.
Static shapes, no host round trip, no heap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _beams(lp, budget: int):
    """lp [L, V] -> per-depth beams: scores [L, B], tokens [L, B], parent beam index [L, B]."""
    L, V = lp.shape
    K = min(budget, V)
    top_lp, top_tok = jax.lax.top_k(lp, K)  # [L, K]
    pad = budget - K  # a beam wider than the vocabulary: pad depth 1 with impossible entries
    s0 = jnp.concatenate([top_lp[0], jnp.full((pad,), -jnp.inf)])
    t0 = jnp.concatenate([top_tok[0], jnp.zeros((pad,), jnp.int32)])

    def extend(carry, x):
        (prev,) = carry
        lp_d, tok_d = x
        cand = (prev[:, None] + lp_d[None, :]).reshape(-1)  # [B * K]
        score, flat = jax.lax.top_k(cand, budget)
        return (score,), (score, tok_d[flat % K], flat // K)

    _, (s, t, p) = jax.lax.scan(extend, (s0,), (top_lp[1:], top_tok[1:]))
    scores = jnp.concatenate([s0[None], s])
    tokens = jnp.concatenate([t0[None], t]).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((1, budget), -1), p]).astype(jnp.int32)
    return scores, tokens, parents


def build_tree(lp, budget: int):
    """The top-`budget` prefixes of one sequence's draft distribution.

    lp [L, V] float32 log-probabilities. Returns a dict of [budget] arrays in parent-before-
    child order (by depth): tokens, depth (1..L), parent (index into these arrays, -1 = the
    root, i.e. the last committed token), score (log-probability of the prefix), valid
    (False where fewer than `budget` prefixes exist), and ancestors [budget, budget] bool
    (ancestors[i, j]: node j is node i or one of its ancestors).
    """
    L, _ = lp.shape
    scores, tokens, parents = _beams(lp.astype(jnp.float32), budget)
    depth = jnp.broadcast_to(jnp.arange(1, L + 1)[:, None], scores.shape)
    flat_s, flat_d = scores.reshape(-1), depth.reshape(-1)
    # global top-B: highest score first, shallower first on ties (keeps the set prefix-closed)
    order = jnp.lexsort((flat_d, -flat_s))[:budget]
    # emit in (depth, beam index) order so a parent always precedes its children
    chosen = jnp.sort(order)
    d_idx, b_idx = chosen // budget, chosen % budget
    where = jnp.full((L, budget), -1, jnp.int32).at[d_idx, b_idx].set(jnp.arange(budget))
    par_beam = parents[d_idx, b_idx]
    parent = jnp.where(d_idx > 0, where[jnp.maximum(d_idx - 1, 0), par_beam], -1)
    valid = jnp.isfinite(scores[d_idx, b_idx])
    ancestors = jnp.eye(budget, dtype=bool)
    node = parent
    for _ in range(L - 1):
        ancestors = ancestors | jax.nn.one_hot(node, budget, dtype=bool)  # -1 -> no bit
        node = jnp.where(node >= 0, parent[jnp.maximum(node, 0)], -1)
    return {
        "tokens": tokens[d_idx, b_idx],
        "depth": d_idx + 1,
        "parent": parent,
        "score": scores[d_idx, b_idx],
        "valid": valid,
        "ancestors": ancestors & valid[:, None] & valid[None, :],
    }


def build_trees(lp, budget: int):
    """Batched build_tree: lp [B, L, V] -> the same dict with a leading batch dimension."""
    return jax.vmap(lambda x: build_tree(x, budget))(lp)
