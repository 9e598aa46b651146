"""Accepting a drafted chain against the target, greedy or lossless sampling.

For a block [last, d_1 .. d_{b-1}] verified in one target pass, target logits row j is the
target's distribution for the token after block slot j, i.e. the one d_{j+1} guesses.
Both rules return (a, bonus): a = number of leading drafts accepted (0 .. b-1) and the
target's own token at the first unaccepted slot, so every step commits a + 1 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdj.decode.sampling import target_probs


def accept_greedy(drafts, logits, limit=None):
    """drafts [B, b-1] int32, logits [B, b, V] -> (a [B], bonus [B]).

    Longest prefix of drafts equal to the target's argmax (at most `limit` [B] if given), plus
    the target's argmax after it.
    """
    y = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, b]
    match = drafts == y[:, :-1]
    a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    if limit is not None:
        a = jnp.minimum(a, limit)
    return a, jnp.take_along_axis(y, a[:, None], axis=1)[:, 0]


def accept_sampled(drafts, logits, key, temperature, top_p, limit=None):
    """Lossless acceptance of a deterministic draft (speculative sampling with a point-mass
    proposal): accept d_{j+1} with probability p_j(d_{j+1}); at the first rejection draw the
    bonus from p_j with d_{j+1} removed and renormalised; if all are accepted draw it from
    p_{b-1}. Every committed token is then distributed exactly as target sampling.

    limit [B] (optional) caps a (cache end / token budget); a capped chain draws its bonus
    from the plain p at the cap, since the next draft there was never tested.
    """
    B, b, _ = logits.shape
    p = target_probs(logits, temperature, top_p)  # [B, b, V]
    k_u, k_bonus = jax.random.split(key)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, b-1]
    ok = jax.random.uniform(k_u, p_draft.shape) < p_draft
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    rejected = a < b - 1
    if limit is not None:
        rejected &= a < limit
        a = jnp.minimum(a, limit)
    row = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    x = jnp.take_along_axis(drafts, jnp.minimum(a, b - 2)[:, None], axis=1)[:, 0]
    removed = row.at[jnp.arange(B), x].set(0.0)
    residual = removed / jnp.maximum(removed.sum(-1, keepdims=True), 1e-30)
    dist = jnp.where(rejected[:, None], residual, row)
    bonus = jax.random.categorical(k_bonus, jnp.log(dist), axis=-1).astype(jnp.int32)
    return a, bonus
