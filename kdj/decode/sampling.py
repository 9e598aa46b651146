"""Turning target logits into tokens: greedy, or temperature + top-p sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_probs(logits, temperature, top_p):
    """The distribution p the target samples from: softmax(logits / T) restricted to the top-p
    nucleus and renormalised. logits [..., V] float32 -> probs [..., V] float32.
    """
    probs = jax.nn.softmax(logits / temperature, axis=-1)

    def nucleus(probs):
        sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: token
        # k is kept when the mass strictly before it is < top_p (the top token always is).
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
        kept = jnp.where(probs >= threshold, probs, 0.0)
        return kept / kept.sum(-1, keepdims=True)

    # top_p = 1 keeps everything: skip the vocabulary sort (per node of a tree, per step)
    return jax.lax.cond(top_p >= 1.0, lambda p: p, nucleus, probs)


def sample(logits, key, temperature, top_p, greedy: bool):
    """logits [B, V] float32 -> tokens [B] int32. `greedy` is static (T = 0)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    p = target_probs(logits, temperature, top_p)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)
