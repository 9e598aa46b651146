"""The DFlash block-diffusion drafter (Qwen3-style layers with KV injection).

One draft step proposes b - 1 tokens in one forward pass:

    context c = hidden_norm(fc(concat of target hidden states at target_layer_ids))   [B, C, D]
    block   x = target_embed([last committed token, mask, ..., mask])                 [B, b, D]
    every layer:  q = q_norm(Wq norm(x))            (block only, RoPE at start + j)
                  k = k_norm(Wk [c ; norm(x)]), v = Wv [c ; norm(x)]   (RoPE at absolute positions)
                  x += o(attn(q, k, v))  -- block sees all visible context and the whole block
                  x += mlp(norm(x))
    draft logits = target_lm_head(norm(x))[:, 1:]   (slot j predicts the token at start + j)

DFlash2 (cfg.dflash2 set; kdj/models/dflash2.py) adds a grouped dynamic convolution around
each sublayer and a candidate selector (self.selector) whose walk is the draft chain.

The context's K/V are cached per layer (appended once per committed token, never
recomputed); the block's K/V are used in the step and discarded. The drafter owns no embedding
or lm_head: it borrows the target's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.models.dflash2 import CandidateSelector, DFlash2Config, GroupedConv
from kdj.models.layers import (
    MLP,
    NEG_INF,
    Linear,
    RMSNorm,
    apply_rope,
    rope_frequencies,
    softmax_scale,
)


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    layers: ModelConfig  # the Qwen3-style layer stack (hidden size = the target's)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    dflash2: DFlash2Config | None = None  # DFlash2's convolutions and selector; None = DFlash

    def __post_init__(self):
        # The target taps each layer once: a repeated id would give fewer features than fc
        # takes. (Whether the ids exist in the target is checked when a pair is formed,
        # kdj.handles.check_pair: the target may not be the one this config was made for.)
        ids, L = tuple(self.target_layer_ids), self.num_target_layers
        _check_int("block_size", self.block_size, 2)  # the last token + at least one draft
        _check_int("mask_token_id", self.mask_token_id, 0)
        if L != -1:  # -1: the config does not say
            _check_int("num_target_layers", L, 1)
        if not ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one tap")
        for i in ids:
            _check_int("target_layer_ids", i, 0, entry=True)
        if len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids {ids} repeat a layer (a {L}-layer target is too "
                             "shallow for this many distinct taps at the default spacing: "
                             "give target_layer_ids, or fewer drafter layers)")  # fmt: skip
        if self.dflash2 is not None:
            self.dflash2.check(self.layers.hidden_size, self.layers.vocab_size)

    def with_kernels(self, kernels) -> DrafterConfig:
        return dataclasses.replace(self, layers=self.layers.with_kernels(kernels))

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def window(self, i: int) -> int | None:
        """Context window of layer i (None = all context)."""
        if self.layer_types and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None


def _check_int(name: str, value, minimum: int, entry: bool = False) -> None:
    """The field `name` (quoted: a key of a config file, never a command's flag) or, with
    `entry`, each of its entries is an integer >= minimum."""
    ok = not isinstance(value, bool) and hasattr(value, "__index__") and value >= minimum
    if not ok:
        what = f"each '{name}' entry" if entry else f"'{name}'"
        raise ValueError(f"drafter {what} must be an integer >= {minimum} (got {value!r})")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The published default: [L // 2] for one draft layer, else round(1 + i (L - 4) / (n - 1))."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return (L // 2,)
    return tuple(int(round(1 + i * (L - 4) / (n - 1))) for i in range(n))


class DrafterAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, H, KVH, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        lin = dict(dtype=dtype, rngs=rngs, kernels=cfg.kernels)
        self.q = Linear(D, H * hd, ("embed", "q_heads"), **lin)
        self.k = Linear(D, KVH * hd, ("embed", "kv_heads"), **lin)
        self.v = Linear(D, KVH * hd, ("embed", "kv_heads"), **lin)
        self.o = Linear(H * hd, D, ("q_heads", "embed"), **lin)
        self.q_norm = RMSNorm(
            hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",), kernels=cfg.kernels
        )
        self.k_norm = RMSNorm(
            hd, cfg.rms_norm_eps, dtype=dtype, axes=("head_dim",), kernels=cfg.kernels
        )
        self.cfg = cfg

    def keys_values(self, h, positions):
        """h [B, T, D] at positions [B, T] -> rotated, normed keys and values [B, T, KVH, hd]."""
        cfg = self.cfg
        B, T, _ = h.shape
        inv_freq, amp = rope_frequencies(cfg)
        k = self.k_norm(self.k(h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim))
        k = apply_rope(k, positions, inv_freq, amp, interleaved=False)
        return k, self.v(h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)

    def __call__(self, x, positions, k_cache, v_cache, ctx_len, window):
        """Block x [B, b, D] at positions [B, b] attends the cached context (slots < ctx_len,
        within `window` of the block start if set) and the whole block."""
        cfg = self.cfg
        B, b, _ = x.shape
        H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        inv_freq, amp = rope_frequencies(cfg)
        q = self.q_norm(self.q(x).reshape(B, b, H, hd))
        q = apply_rope(q, positions, inv_freq, amp, interleaved=False)
        kb, vb = self.keys_values(x, positions)
        slot = jnp.arange(k_cache.shape[2])[None, None, :]  # context slot = its position
        ctx_ok = slot < ctx_len[:, None, None]
        blk_ok = jnp.ones((B, b, b), bool)
        if window is not None:
            # Sliding-window layers follow flash-attention's non-causal window, which is how
            # the reference runs them: a query at p sees keys at p - (w-1) .. p + (w-1).
            ctx_ok = ctx_ok & (slot > positions[:, :, None] - window)
            blk_ok = jnp.abs(positions[:, :, None] - positions[:, None, :]) < window
        # Scores against the cached context and against the block are computed separately and
        # share one softmax, so the cache is read in place instead of copied into [ctx ; block].
        G = H // KVH
        qg = q.reshape(B, b, KVH, G, hd)

        def scores(spec, keys, ok):
            s = jnp.einsum(spec, qg, keys, preferred_element_type=jnp.float32)
            return jnp.where(ok[:, None, None], s * softmax_scale(cfg), NEG_INF)

        s_ctx = scores("btkgd,bksd->bkgts", k_cache, ctx_ok)  # cache [B, KVH, S, hd]
        s_blk = scores("btkgd,bskd->bkgts", kb.astype(k_cache.dtype), blk_ok)  # [B, b, KVH, hd]
        s = jnp.concatenate([s_ctx, s_blk], -1)
        p = jax.nn.softmax(s, axis=-1).astype(v_cache.dtype)
        S = k_cache.shape[2]
        out = jnp.einsum("bkgts,bksd->btkgd", p[..., :S], v_cache)
        out = out + jnp.einsum("bkgts,bskd->btkgd", p[..., S:], vb.astype(v_cache.dtype))
        out = out.reshape(B, b, H * hd)
        return self.o(out)


class DrafterLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs, dflash2: DFlash2Config | None = None):
        self.attn_norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, kernels=cfg.kernels
        )
        self.attn = DrafterAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, kernels=cfg.kernels)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs,
                       kernels=cfg.kernels)  # fmt: skip
        conv = dict(dtype=dtype, rngs=rngs, kernels=cfg.kernels)
        self.attention_conv = None if dflash2 is None else GroupedConv(cfg.hidden_size, dflash2,
                                                                       **conv)  # fmt: skip
        self.mlp_conv = None if dflash2 is None else GroupedConv(cfg.hidden_size, dflash2, **conv)

    def __call__(self, x, attend):
        """One layer over blocks x [..., b, D]: attention then MLP, each a residual branch
        (DFlash2: each inside its convolution pair). attend(u): the attention sublayer's
        output for its normed input u (inference reads the cache, training many blocks)."""
        u = self.attn_norm(x)
        if self.attention_conv is None:
            x = x + attend(u)
            return self.mlp.residual(x, self.mlp_norm)
        u, delta = self.attention_conv.prepare(u)
        x = x + self.attention_conv.finish(attend(u), delta)
        u, delta = self.mlp_conv.prepare(self.mlp_norm(x))
        return x + self.mlp_conv.finish(self.mlp(u), delta)


class DFlashDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        lc = cfg.layers
        D = lc.hidden_size
        self.fc = Linear(cfg.num_features * D, D, ("features", "embed"), dtype=dtype, rngs=rngs,
                         kernels=lc.kernels)  # fmt: skip
        self.hidden_norm = RMSNorm(D, lc.rms_norm_eps, dtype=dtype, kernels=lc.kernels)
        self.layers = nnx.List([DrafterLayer(lc, dtype=dtype, rngs=rngs, dflash2=cfg.dflash2)
                                for _ in range(lc.num_layers)])  # fmt: skip
        self.norm = RMSNorm(D, lc.rms_norm_eps, dtype=dtype, kernels=lc.kernels)
        self.selector = None if cfg.dflash2 is None else CandidateSelector(
            D, lc.vocab_size, cfg.dflash2, dtype=dtype, rngs=rngs, kernels=lc.kernels
        )  # fmt: skip
        self.cfg = cfg

    def add_context(self, feats, start, cache: kvc.KVCache) -> kvc.KVCache:
        """Write context K/V for target features feats [B, C, K*D] of positions start[b] ..
        start[b] + C - 1 into every layer's cache (slots outside the cache are dropped).
        Lengths untouched."""
        c = self.hidden_norm(self.fc(feats.astype(self.fc.kernel.dtype)))
        positions = start[:, None] + jnp.arange(feats.shape[1], dtype=jnp.int32)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.attn.keys_values(c, positions)
            ks.append(kvc.write(cache.k[i], k, start))
            vs.append(kvc.write(cache.v[i], v, start))
        return dataclasses.replace(cache, k=ks, v=vs)

    def __call__(self, x, positions, cache: kvc.KVCache):
        """Block embeddings x [B, b, D] at positions [B, b] -> final hidden [B, b, D] (the
        caller applies the target's lm_head). Context visible: slots < cache.lengths."""

        def attend(i, attn, u):
            return attn(u, positions, cache.k[i], cache.v[i], cache.lengths, self.cfg.window(i))

        return self.blocks(x, attend)

    def blocks(self, x, attend):
        """Block embeddings x [..., b, D] -> final hidden states [..., b, D], with
        attend(i, attn, u) layer i's attention (module attn) over its normed input u: the one
        layer stack inference (__call__) and training (kdj/train/forward.py) both run."""
        if self.cfg.dflash2 is not None:
            x = x * self.cfg.dflash2.input_embedding_scale
        x = x.astype(self.fc.kernel.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, functools.partial(attend, i, layer.attn))
        return self.norm(x)

    def logits(self, head_logits):
        """The target head's logits at the draft slots -> the drafter's, float32 (DFlash2
        scales and caps them)."""
        if self.cfg.dflash2 is None:
            return jnp.asarray(head_logits, jnp.float32)
        return self.cfg.dflash2.logits(head_logits)


def build_drafter(cfg: DrafterConfig, dtype=jnp.bfloat16, seed: int = 0) -> DFlashDrafter:
    return DFlashDrafter(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))
