"""Turning target logits into tokens: greedy, or temperature + top-p sampling.

A sampled token is keyed by (its sequence's key, its absolute position in the sequence):
the token at position p of sequence b is the argmax of log p + Gumbel noise drawn with
fold_in(keys[b], p) (Gumbel-max: a draw from p). The noise depends on neither the batch row,
the step nor how many tokens a pass verifies, so a speculative step's token at p, given the
same prefix and logits, IS plain decoding's token at p: the emitted sequence is AR's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SEED_STRIDE = 0x9E3779B9  # odd: seed + i * stride differs for every i < 2**32


def spread_seeds(seed: int, n: int) -> list[int]:
    """One seed for n sequences -> a seed each: sequence i draws with seed + i * SEED_STRIDE
    (mod 2**32), so equal prompts sample apart, and the first draws with `seed` itself, as
    one prompt given `seed` alone does (kdj.generate, kdj generate and the server's n choices
    all spread a seed so)."""
    return [(seed + i * SEED_STRIDE) % 2**32 for i in range(n)]


def request_keys(seeds) -> jax.Array:
    """Per-sequence PRNG keys [B] from `seeds` (one int per sequence): key(seeds[b]),
    whatever the row."""
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def position_keys(keys, positions) -> jax.Array:
    """keys [B] (one per sequence), positions [B, ...] int32 absolute positions of the tokens
    to sample -> keys [B, ...]: fold_in(keys[b], position)."""
    B = positions.shape[0]
    rows = jnp.broadcast_to(jnp.arange(B).reshape(B, *[1] * (positions.ndim - 1)), positions.shape)
    flat = jax.vmap(jax.random.fold_in)(keys[rows.reshape(-1)], positions.reshape(-1))
    return flat.reshape(positions.shape)


def target_probs(logits, temperature, top_p):
    """The distribution p the target samples from: softmax(logits / T) restricted to the top-p
    nucleus and renormalised. logits [B, ..., V] float32 -> probs [B, ..., V] float32;
    temperature [] or [B] (one per sequence, as the engine's pool has).
    """
    t = jnp.asarray(temperature)
    probs = jax.nn.softmax(logits / t.reshape(t.shape + (1,) * (logits.ndim - t.ndim)), axis=-1)

    def nucleus(probs):
        sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
        # Keep the smallest prefix of the sorted distribution whose mass reaches top_p: token
        # k is kept when the mass strictly before it is < top_p; the top token always is,
        # also where a top_p below float32's smallest normal has been flushed to 0.
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
        kept = jnp.where(probs >= threshold, probs, 0.0)
        return kept / kept.sum(-1, keepdims=True)

    # top_p = 1 keeps everything: skip the vocabulary sort (per node of a tree, per step)
    return jax.lax.cond(top_p >= 1.0, lambda p: p, nucleus, probs)


def perturbed(logits, keys, temperature, top_p):
    """log p + Gumbel noise, one draw per key: its argmax over V is a sample from p.
    logits [..., V] float32, keys [...] (from position_keys) -> [..., V] float32."""
    V = logits.shape[-1]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys.reshape(-1))
    return jnp.log(target_probs(logits, temperature, top_p)) + noise.reshape(logits.shape)


def sample(logits, keys, temperature, top_p, greedy: bool):
    """logits [..., V] float32 -> tokens [...] int32; keys [...] from position_keys (unused
    when `greedy`, static: T = 0)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.argmax(perturbed(logits, keys, temperature, top_p), axis=-1).astype(jnp.int32)
