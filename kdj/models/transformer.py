"""The decoder stack shared by both target families, and `build_model`.

    tokens [B, T] -> embed -> L x (x += attn(norm(x)); x += mlp_or_moe(norm(x))) -> norm -> lm_head

Attention is GQA (kdj/models/llama.py) or MLA (kdj/models/deepseek.py); the MLP is dense
SwiGLU or MoE per layer (`ModelConfig.is_moe_layer`). Layers are a Python list, unrolled
under jit: the step is one XLA program either way, and per-layer caches stay separate
buffers that XLA updates in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.cache import KVCache, init_cache
from kdj.config import ModelConfig
from kdj.models.deepseek import MLAAttention, MoE
from kdj.models.layers import MLP, Linear, RMSNorm, causal_tree, fixed_tile_matmul, param
from kdj.models.llama import GQAAttention


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, dtype, rngs):
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(D, eps, dtype=dtype, kernels=cfg.kernels)
        self.attn = (MLAAttention if cfg.family == "deepseek" else GQAAttention)(
            cfg, dtype=dtype, rngs=rngs
        )
        self.mlp_norm = RMSNorm(D, eps, dtype=dtype, kernels=cfg.kernels)
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, dtype=dtype, rngs=rngs, kernels=cfg.kernels)

    def __call__(self, x, positions, start, tree, k_cache, v_cache):
        h, k_cache, v_cache = self.attn(self.attn_norm(x), positions, start, tree, k_cache, v_cache)
        x = x + h
        if isinstance(self.mlp, MLP):  # the norm and residual may fuse into its kernels
            return self.mlp.residual(x, self.mlp_norm), k_cache, v_cache
        return x + self.mlp(self.mlp_norm(x)), k_cache, v_cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = param(rngs, (V, D), ("vocab", "embed"), dtype, scale=1.0)
        self.layers = nnx.List(
            [Block(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, kernels=cfg.kernels)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(D, V, ("embed", "vocab"), dtype=dtype, rngs=rngs, kernels=cfg.kernels)
        )
        self.cfg = cfg

    def __call__(
        self, tokens, start, cache: KVCache, *, positions=None, tree=None, taps=(), logits_at=None
    ):
        """Run T new tokens per sequence on top of the cache (see `hidden`). logits_at: [B, K]
        indices into T to compute logits for (default: all T).
        Returns (logits [B, T or K, V] float32, cache with K/V written, taps [B, T, len, D] or
        None). `cache.lengths` is left for the caller to advance.
        """
        h, cache, tapped = self.hidden(tokens, start, cache, positions=positions, tree=tree,
                                       taps=taps)  # fmt: skip
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, :, None], axis=1)
        return self.logits(h), cache, tapped

    def hidden(self, tokens, start, cache: KVCache, *, positions=None, tree=None, taps=()):
        """The layers and the final norm, without the lm_head.

        tokens [B, T] int32 are written to cache slots start[b] .. start[b] + T - 1 (start [B]
        int32). positions [B, T]: RoPE positions, default start + 0..T-1 (a DDTree passes
        start + depth). tree [B, T, T] bool: which new tokens each new token sees (default
        causal); every token sees all slots < start. taps: layer ids whose OUTPUT hidden state
        (HF `hidden_states[id + 1]`) is returned, in the order given (a DFlash drafter's
        target_layer_ids: its fc takes the features in that order).
        Returns (final normed hidden [B, T, D], cache with K/V written, taps [B, T, len, D] or
        None).
        """
        B, T = tokens.shape
        if any(not 0 <= i < len(self.layers) for i in taps):
            raise ValueError(f"tap layer ids {tuple(taps)} must lie in 0..{len(self.layers) - 1}"
                             f" (the target has {len(self.layers)} layers)")  # fmt: skip
        x = self.embed[...][tokens]
        if positions is None:
            positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
        if tree is None:
            tree = causal_tree(B, T)
        ks, vs, tapped = [], [], {}
        for i, layer in enumerate(self.layers):
            v_in = cache.v[i] if cache.v else None
            x, k, v = layer(x, positions, start, tree, cache.k[i], v_in)
            ks.append(k)
            if cache.v:
                vs.append(v)
            if i in taps:
                tapped[i] = x
        cache = dataclasses.replace(cache, k=ks, v=vs)
        return self.norm(x), cache, (jnp.stack([tapped[i] for i in taps], axis=2) if taps else None)

    def head_weight(self):
        """The final projection's weight [D, V]: the lm_head's, or the tied embedding's."""
        return self.embed[...].T if self.lm_head is None else self.lm_head.kernel[...]

    def logits(self, h):
        """Final projection [..., D] -> [..., V] in float32 (tied embeddings or lm_head)."""
        w = self.head_weight()
        if self.cfg.kernels.fixed_tiles():  # deterministic mode on the GPU
            rows = h.reshape(-1, w.shape[0])
            y = fixed_tile_matmul(rows, w, splits=self.cfg.kernels.fixed_splits(*w.shape))
            return y.reshape(*h.shape[:-1], -1)
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)


def build_model(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> Transformer:
    """A randomly initialised model (tests, benchmarks); checkpoints overwrite the params."""
    return Transformer(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16) -> Transformer:
    """Shapes and dtypes only (no memory): the skeleton a checkpoint is loaded into."""
    return nnx.eval_shape(lambda: build_model(cfg, dtype))


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def full_sequence(graphdef, state, tokens, taps=()):
    """Full-sequence pass from an empty cache: (logits [B, T, V], taps [B, T, K, D] or None).
    For parity checks; decoding goes through kdj/decode/."""
    h, tapped = full_hidden(graphdef, state, tokens, taps)
    return nnx.merge(graphdef, state).logits(h), tapped


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def full_hidden(graphdef, state, tokens, taps=()):
    """Full-sequence pass from an empty cache without the lm_head: (final normed hidden
    [B, T, D], taps [B, T, K, D] or None). Drafter training's frozen target pass."""
    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    cache = init_cache(model.cfg, B, T, model.embed[...].dtype)
    h, _, tapped = model.hidden(tokens, jnp.zeros((B,), jnp.int32), cache, taps=taps)
    return h, tapped
