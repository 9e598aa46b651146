"""Static KV caches: preallocated per batch slot, written by scatter, rolled back by length.

One cache type serves both families. GQA layers store keys and values [B, S, KVH, D]
(separate buffers: one interleaved [.., 2, D] buffer measured slower on the H200, because the
attention matmuls then read strided copies). MLA layers store one stream
[B, S, 1, kv_lora_rank + qk_rope_head_dim] (normalised latent ; rotated shared key = 576
values per token per layer for DeepSeek-V3) and no separate values: in the absorbed form the
values are the latent, i.e. the first kv_lora_rank columns.

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
    k: list[jax.Array]  # per layer [B, S, KVH, Dk]
    v: list[jax.Array]  # per layer [B, S, KVH, Dv]; empty for MLA (values = latent)
    lengths: jax.Array  # [B] int32, committed tokens per sequence

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def with_lengths(self, lengths) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.bfloat16) -> KVCache:
    """Zeroed cache for `batch` sequences of up to `capacity` tokens."""
    if cfg.family == "deepseek":
        k = [jnp.zeros((batch, capacity, 1, cfg.latent_dim), dtype) for _ in range(cfg.num_layers)]
        v = []
    else:
        shape = (batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        k = [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]
        v = [jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)]
    return KVCache(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))


def write(layer_cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, T, ...] into layer_cache [B, S, ...] at slots start[b] .. start[b] + T - 1.

    Slots outside [0, S) are dropped (never clamped onto a valid slot); callers check
    capacity up front so only padding can fall there.
    """
    B, T = new.shape[:2]
    slots = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    b = jnp.arange(B)[:, None]
    return layer_cache.at[b, slots].set(new.astype(layer_cache.dtype), mode="drop")


def gather_rows(layer_cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copy rows layer_cache[b, src[b, j]] to slots dst[b, j] ([B, N] int32), all rows read
    before any is written (so overlapping moves are safe). Out-of-range dst are dropped."""
    b = jnp.arange(layer_cache.shape[0])[:, None]
    rows = layer_cache[b, jnp.clip(src, 0, layer_cache.shape[1] - 1)]
    return layer_cache.at[b, dst].set(rows, mode="drop")
