"""Grouped-query attention for the dense Llama / Qwen2 / Qwen3 family."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.models.layers import (
    Linear,
    RMSNorm,
    apply_rope,
    attend,
    matmul,
    param,
    rope_frequencies,
    softmax_scale,
    zeros,
)


class GQAAttention(nnx.Module):
    """Fused q/k/v projection (optional bias, optional per-head q/k RMSNorm), half-split RoPE.

    The qkv kernel is [D, KVH, G + 2, hd]: for each KV head, its G query heads, then its key,
    then its value (HF query head h = kv_head * G + g). One matmul instead of three, and
    sharding the KV-head axis keeps every query head next to the K/V it reads.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, H, KVH, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        axes = ("embed", "kv_heads", None, "head_dim")
        self.qkv = param(rngs, (D, KVH, H // KVH + 2, hd), axes, dtype, D**-0.5)
        self.qkv_bias = zeros((KVH, H // KVH + 2, hd), axes[1:], dtype) if cfg.qkv_bias else None
        self.o = Linear(H * hd, D, ("q_heads", "embed"), bias=cfg.o_bias, dtype=dtype, rngs=rngs,
                        kernels=cfg.kernels)  # fmt: skip
        if cfg.qk_norm:
            self.q_norm = RMSNorm(
                hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",), kernels=cfg.kernels
            )
            self.k_norm = RMSNorm(
                hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",), kernels=cfg.kernels
            )
        else:
            self.q_norm = self.k_norm = None
        self.cfg = cfg

    def __call__(self, x, positions, start, tree, k_cache, v_cache):
        """x [B, T, D] at RoPE positions [B, T]; writes K/V into the caches [B, KVH, S, hd] at
        slots start .. start + T - 1 and attends under (start, tree) (kdj/models/layers.py).
        Returns (out [B, T, D], k_cache, v_cache)."""
        B, T, _ = x.shape
        cfg = self.cfg
        H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = H // KVH
        inv_freq, amp = rope_frequencies(cfg)
        w = self.qkv[...]
        if cfg.kernels.fixed_tiles():  # deterministic: fixed tiles (layers.matmul)
            qkv = matmul(x, w, cfg.kernels)
        else:
            qkv = jnp.einsum("btd,dkgh->btkgh", x, w)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias[...]
        q = qkv[:, :, :, :G].reshape(B, T, H, hd)
        k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq, amp, interleaved=False)
        k = apply_rope(k, positions, inv_freq, amp, interleaved=False)
        k_cache = kvc.write(k_cache, k, start)
        v_cache = kvc.write(v_cache, v, start)
        out = attend(q, k_cache, v_cache, start, tree, softmax_scale(cfg), cfg.kernels)
        return self.o(out.reshape(B, T, H * hd)), k_cache, v_cache
