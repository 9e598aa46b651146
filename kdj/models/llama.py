"""Grouped-query attention for the dense Llama / Qwen2 / Qwen3 family."""

from __future__ import annotations

from flax import nnx

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.models.layers import Linear, RMSNorm, apply_rope, attend, rope_frequencies, softmax_scale


class GQAAttention(nnx.Module):
    """q/k/v projections (optional bias, optional per-head q/k RMSNorm), half-split RoPE."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, H, KVH, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = Linear(D, H * hd, ("embed", "q_heads"), bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k = Linear(
            D, KVH * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, dtype=dtype, rngs=rngs
        )
        self.v = Linear(
            D, KVH * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, dtype=dtype, rngs=rngs
        )
        self.o = Linear(H * hd, D, ("q_heads", "embed"), bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",))
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",))
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg

    def __call__(self, x, positions, k_cache, v_cache, mask):
        """x [B, T, D] at positions [B, T]; writes K/V at those positions; mask [B, T, S]."""
        B, T, _ = x.shape
        cfg = self.cfg
        H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq, amp = rope_frequencies(cfg)
        q = self.q(x).reshape(B, T, H, hd)
        k = self.k(x).reshape(B, T, KVH, hd)
        v = self.v(x).reshape(B, T, KVH, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq, amp, interleaved=False)
        k = apply_rope(k, positions, inv_freq, amp, interleaved=False)
        k_cache = kvc.write(k_cache, k, positions)
        v_cache = kvc.write(v_cache, v, positions)
        out = attend(q, k_cache, v_cache, mask, softmax_scale(cfg))
        return self.o(out.reshape(B, T, H * hd)), k_cache, v_cache
