"""DFlash block speculative decoding: draft -> verify -> accept -> commit, one jitted step,
the whole generation one on-device `lax.while_loop`.

Per sequence b, `L[b]` (= both caches' `lengths`) counts committed tokens whose K/V are in the
target cache; `last[b]` is the newest committed token (not yet in the cache), so the block of
a step starts at position L:

    draft   drafter context += pending target features (positions L - n_pend .. L - 1);
            block [last, MASK x (k - 1)] at L .. L + k - 1 -> drafts d_1 .. d_{k-1} (argmax)
    verify  target over [last, d_1 .. d_{k-1}] at L .. L + k - 1 (causal), taps features
    accept  a drafts + bonus (greedy or lossless sampling), capped by cache and token budget
    commit  L += a + 1; last = bonus; pending = features of positions L .. L + a

Rejected entries stay in both caches past L and are overwritten later ("rollback by length").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.cache import KVCache
from kdj.decode.accept import accept_greedy, accept_sampled
from kdj.decode.autoregressive import is_stop
from kdj.decode.sampling import sample


def _features(taps):
    """[B, T, K, D] tapped target states -> [B, T, K * D] drafter context features."""
    B, T, K, D = taps.shape
    return taps.reshape(B, T, K * D)


@functools.partial(
    jax.jit, static_argnames=("tgraph", "dgraph", "greedy"), donate_argnames=("tcache", "dcache")
)
def prefill(tgraph, tstate, dgraph, dstate, tokens, prompt_lens, tcache, dcache, key, temperature,
            top_p, *, greedy):  # fmt: skip
    """Target prefill (tapping the drafter's feature layers), first token, and the drafter's
    context cache for every prompt position. Returns (first [B], tcache, dcache)."""
    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    B, P = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    logits, tcache, taps = target(
        tokens, positions, tcache, taps=drafter.cfg.target_layer_ids,
        logits_at=(prompt_lens - 1)[:, None],
    )  # fmt: skip
    first = sample(logits[:, 0], jax.random.fold_in(key, 0), temperature, top_p, greedy)
    dcache = drafter.add_context(_features(taps), positions, dcache)
    return first, tcache.with_lengths(prompt_lens), dcache.with_lengths(prompt_lens)


def draft(target, drafter, dcache: KVCache, last, pending, n_pend, k: int):
    """Add pending context, then propose k - 1 tokens per sequence. Returns (drafts
    [B, k - 1] int32, dcache). pending [B, P, K*D] holds features of positions L - n_pend ..;
    slots >= n_pend are padding (written past L, masked, overwritten later)."""
    B, P, _ = pending.shape
    L = dcache.lengths
    ctx_pos = (L - n_pend)[:, None] + jnp.arange(P, dtype=jnp.int32)
    dcache = drafter.add_context(pending, ctx_pos, dcache)
    block = jnp.full((B, k), drafter.cfg.mask_token_id, jnp.int32).at[:, 0].set(last)
    positions = L[:, None] + jnp.arange(k, dtype=jnp.int32)
    h = drafter(target.embed[...][block], positions, dcache)
    logits = target.logits(h[:, 1:])
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), dcache


@functools.partial(
    jax.jit,
    static_argnames=("tgraph", "dgraph", "greedy", "max_steps", "block_size"),
    donate_argnames=("tcache", "dcache"),
)
def decode_loop(tgraph, tstate, dgraph, dstate, tcache, dcache, first, max_new, stop_ids, key,
                temperature, top_p, *, greedy, max_steps, block_size):  # fmt: skip
    """Speculative generation until every sequence hit a stop token or its own max_new.

    max_steps = max(max_new). Returns (out [B, max_steps] int32, n_out [B], taus
    [B, max_steps] (tokens committed per step, 0 once finished), steps, tcache, dcache).
    """
    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    k = block_size
    B = first.shape[0]
    S = tcache.capacity
    N = max_steps  # = max(max_new): each step commits >= 1 token and never passes max_new
    D = target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)
    out = jnp.zeros((B, N), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((B,), jnp.int32)
    done = is_stop(first, stop_ids) | (n >= max_new)
    taus = jnp.zeros((B, max_steps), jnp.int32)
    pending = jnp.zeros((B, k, D), tcache.k[0].dtype)
    n_pend = jnp.zeros((B,), jnp.int32)

    def cond(c):
        return (c["step"] < max_steps) & ~jnp.all(c["done"])

    def body(c):
        tcache, dcache, last = c["tcache"], c["dcache"], c["last"]
        L = tcache.lengths
        drafts, dcache = draft(target, drafter, dcache, last, c["pending"], c["n_pend"], k)
        block = jnp.concatenate([last[:, None], drafts], axis=1)
        positions = L[:, None] + jnp.arange(k, dtype=jnp.int32)
        logits, tcache, taps = target(block, positions, tcache, taps=drafter.cfg.target_layer_ids)
        # Commit at most up to the cache end (positions L .. L + a must exist) and the budget.
        limit = jnp.maximum(jnp.minimum(S - 1 - L, max_new - c["n"] - 1), 0)
        if greedy:
            a, bonus = accept_greedy(drafts, logits, limit)
        else:
            step_key = jax.random.fold_in(key, c["step"] + 1)
            a, bonus = accept_sampled(drafts, logits, step_key, temperature, top_p, limit)
        # Emitted this step: d_1 .. d_a, bonus; cut after the first stop token.
        j = jnp.arange(k)
        emitted = jnp.where(j[None] < a[:, None], jnp.roll(block, -1, axis=1), bonus[:, None])
        valid = j[None] <= a[:, None]
        stop_at = valid & jnp.any(emitted[..., None] == stop_ids[:, None, :], axis=-1)
        first_stop = jnp.argmax(stop_at, axis=1)
        count = jnp.where(stop_at.any(1), first_stop + 1, a + 1)
        active = ~c["done"]
        count = jnp.where(active, count, 0)
        cols = jnp.where(j[None] < count[:, None], c["n"][:, None] + j[None], N)
        out = c["out"].at[jnp.arange(B)[:, None], cols].set(emitted, mode="drop")
        n = c["n"] + count
        done = c["done"] | (active & (stop_at.any(1) | (n >= max_new)))
        L_new = jnp.where(active, L + a + 1, L)
        return {
            "tcache": tcache.with_lengths(L_new),
            "dcache": dcache.with_lengths(L_new),
            "last": jnp.where(active, bonus, last),
            "pending": _features(taps).astype(c["pending"].dtype),
            "n_pend": jnp.where(active, a + 1, 0),
            "out": out,
            "n": n,
            "done": done,
            "taus": c["taus"].at[:, c["step"]].set(count),
            "step": c["step"] + 1,
        }

    carry = {
        "tcache": tcache, "dcache": dcache, "last": first, "pending": pending, "n_pend": n_pend,
        "out": out, "n": n, "done": done, "taus": taus, "step": jnp.int32(0),
    }  # fmt: skip
    c = jax.lax.while_loop(cond, body, carry)
    return c["out"], c["n"], c["taus"], c["step"], c["tcache"], c["dcache"]
