"""Plain autoregressive decoding: prefill, then the whole decode loop as one on-device
`lax.while_loop`. Nothing runs in Python per token.

Batch layout: B sequences with ragged prompts, right-padded to P. Sequence b's tokens sit at
cache positions 0..len_b-1; each decode step feeds every sequence's last token at its own
position `cache.lengths[b]`. Finished sequences keep riding along (static shapes) but stop
advancing, writing output or counting tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.cache import KVCache
from kdj.decode.sampling import sample


def prefill(model, tokens, prompt_lens, cache: KVCache):
    """tokens [B, P] right-padded, prompt_lens [B] -> (logits at each prompt's last token
    [B, V], cache with the prompts written and lengths = prompt_lens)."""
    B, P = tokens.shape
    start = jnp.zeros((B,), jnp.int32)
    logits, cache, _ = model(tokens, start, cache, logits_at=(prompt_lens - 1)[:, None])
    return logits[:, 0], cache.with_lengths(prompt_lens)


def is_stop(tokens, stop_ids):
    """tokens [B], stop_ids [B, K] (-1 = unused) -> [B] bool."""
    return jnp.any(tokens[:, None] == stop_ids, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
def prefill_and_sample(
    graphdef, state, tokens, prompt_lens, cache, key, temperature, top_p, *, greedy
):
    """Prefill the prompts and sample each sequence's first new token (step 0)."""
    model = nnx.merge(graphdef, state)
    logits, cache = prefill(model, tokens, prompt_lens, cache)
    first = sample(logits, jax.random.fold_in(key, 0), temperature, top_p, greedy)
    return first, cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "greedy", "max_steps"), donate_argnames=("cache",)
)
def decode_loop(
    graphdef, state, cache, first, max_new, stop_ids, key, temperature, top_p, *, greedy, max_steps
):
    """Generate until every sequence hit a stop token or its own max_new.

    first [B]: token sampled after prefill. max_new [B] int32 (>= 1). stop_ids [B, K].
    Returns (out [B, max_steps] int32, n_out [B], steps, cache).
    """
    model = nnx.merge(graphdef, state)
    B = first.shape[0]
    out = jnp.zeros((B, max_steps), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((B,), jnp.int32)
    done = is_stop(first, stop_ids) | (n >= max_new)

    def cond(carry):
        _, _, _, done, step, _ = carry
        return (step < max_steps - 1) & ~jnp.all(done)

    def body(carry):
        cache, out, n, done, step, tok = carry
        logits, cache, _ = model(tok[:, None], cache.lengths, cache)
        active = ~done
        cache = cache.with_lengths(cache.lengths + active)
        nxt = sample(logits[:, 0], jax.random.fold_in(key, step + 1), temperature, top_p, greedy)
        col = jnp.where(active, n, max_steps)  # out-of-range column = dropped write
        out = out.at[jnp.arange(B), col].set(nxt, mode="drop")
        n = n + active
        done = done | (active & (is_stop(nxt, stop_ids) | (n >= max_new)))
        tok = jnp.where(active, nxt, tok)
        return cache, out, n, done, step + 1, tok

    carry = (cache, out, n, done, jnp.int32(0), first)
    cache, out, n, done, steps, _ = jax.lax.while_loop(cond, body, carry)
    return out, n, steps, cache
