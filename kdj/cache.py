"""Static KV caches: preallocated per batch slot, written by scatter, rolled back by length.

One cache type serves both families. GQA layers store keys and values [B, KVH, S, D]
(separate buffers: one interleaved [.., 2, D] buffer measured slower on the H200, because the
attention matmuls then read strided copies). MLA layers store one stream
[B, 1, S, kv_lora_rank + qk_rope_head_dim] (normalised latent ; rotated shared key = 576
values per token per layer for DeepSeek-V3) and no separate values: in the absorbed form the
values are the latent, i.e. the first kv_lora_rank columns.

Why heads before slots: the one-token decode attention is an XLA batched matmul over (B, KVH)
that wants its operand laid out [B, KVH, S, D], and the tree-attention kernel (a custom call,
which takes the array as it is) reads contiguous [slots, D] tiles from it. Stored
[B, S, KVH, D], XLA transposed every layer's cache wherever the two met: once per call of the
plain decode loop, and at every boundary between method="auto"'s plain and drafted inner
loops, 4.4 ms per boundary at batch 256 on SmolLM2 (bench/results/profile_auto_skip_*.json).

`lengths[b]` counts the committed tokens of sequence b. Entries at or beyond it may hold
stale data (rejected drafts, prompt padding); attention masks them by position, and later
writes overwrite them, so "rollback" is just setting a smaller length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kdj.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, KVH, S, Dk]
    v: list[jax.Array]  # per layer [B, KVH, S, Dv]; empty for MLA (values = latent)
    lengths: jax.Array  # [B] int32, committed tokens per sequence

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def with_lengths(self, lengths) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """Zeroed cache for `batch` sequences of up to `capacity` tokens."""
    if cfg.family == "deepseek":
        k = [jnp.zeros((batch, 1, capacity, cfg.latent_dim), dtype) for _ in range(cfg.num_layers)]
        v = []
    else:
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        k = [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]
        v = [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))


def write(layer_cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, KVH, D] into layer_cache [B, KVH, S, D] at slots start[b] ..
    start[b] + T - 1.

    Slots outside [0, S) are dropped (never clamped onto a valid slot); callers check
    capacity up front so only padding can fall there.
    """
    B, T = new.shape[:2]
    slots = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    b = jnp.arange(B)[:, None]
    # numpy indexing: with a slice between the two index arrays, their broadcast [B, T] dims
    # come first, so the indexed view is [B, T, KVH, D], the shape of `new`
    return layer_cache.at[b, :, slots].set(new.astype(layer_cache.dtype), mode="drop")


def gather_rows(layer_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy slot src[b, j] of layer_cache [B, KVH, S, D] to slot dst[b, j] ([B, N] int32),
    all read before any is written (so overlapping moves are safe). Out-of-range dst are
    dropped."""
    b = jnp.arange(layer_cache.shape[0])[:, None]
    rows = layer_cache[b, :, jnp.clip(src, 0, layer_cache.shape[2] - 1)]  # [B, N, KVH, D]
    return layer_cache.at[b, :, dst].set(rows, mode="drop")
