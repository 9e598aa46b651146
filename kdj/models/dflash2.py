"""DFlash2's two additions to the DFlash drafter (kdj/models/drafter.py).

Grouped dynamic causal convolution, one around each sublayer (attention_conv, mlp_conv).
With u the sublayer's normed input [B, b, D] (b = the block's slots), K taps and G groups
of D / G channels:

    delta = kernel_projection(u) as [B, b, 2, K, G]     (side 0 before, side 1 after)
    conv_s(y)[t, c] = sum_k (base_kernel[s, k, c] + delta[t, s, k, group(c)]) * y[t - k, c]
    layer:  x += conv_1(attn(conv_0(u)))    u = input_layernorm(x); the same for the MLP

y[t - k] is 0 before the block's first slot: the convolution never crosses the block, and a
slot sees only earlier slots, so lowering the block size leaves the first slots unchanged.

Candidate selector (the chain a step verifies). At draft slot p (h_p the final hidden state,
logits_p the head's logits after output_multiplier and the softcap):

    candidates_p = top_k(logits_p)   unary = logits_p at them   z_p = hidden_projection(h_p)
    score_p(prev, c) = unary_p[c] + sum_r predecessor[prev, r] z_p[r] successor[c, r]
    walk: prev = the block's first token; at each depth take argmax_c score_p(prev, c)
          (T = 0) or sample softmax(score_p(prev, .) / T); prev = the chosen candidate

Verification is unchanged: any path is lossless, the selector only raises acceptance.
Training (kdj/train/forward.py: selector_loss) teaches the scorer the target's choices.
Facts from the published implementations: z-lab/dflash dflash/model_mlx.py, vLLM
vllm/model_executor/models/qwen3_dflash2.py and v1/worker/gpu/spec_decode/dflash2.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.kernels import KernelPolicy
from kdj.models.layers import Linear, param


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """The dflash_config fields DFlash2 adds (all static: part of the jit key)."""

    conv_kernel_size: int  # taps of each convolution (2 in the published drafters)
    conv_group_size: int  # channels per group; D / conv_group_size groups share one delta
    selector_rank: int  # r of the pair scorer's codebooks
    selector_top_k: int  # candidates per draft slot
    output_multiplier: float = 1.0  # the head's logits are scaled by this ...
    final_logit_softcapping: float | None = None  # ... then capped: cap * tanh(x / cap)
    input_embedding_scale: float = 1.0  # the block's embeddings are scaled by this

    def check(self, hidden_size: int, vocab_size: int, section: str = "dflash_config") -> None:
        """ValueError naming the field (as `section`.field) when these numbers cannot build a
        drafter."""
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{section}.{name} must be a positive integer (got {v!r})")
        if hidden_size % self.conv_group_size:
            raise ValueError(f"{section}.conv_group_size {self.conv_group_size} does not "
                             f"divide hidden_size {hidden_size}")  # fmt: skip
        if self.selector_top_k > vocab_size:
            raise ValueError(f"{section}.selector_top_k {self.selector_top_k} exceeds the "
                             f"vocabulary ({vocab_size})")  # fmt: skip
        cap = self.final_logit_softcapping
        if cap is not None and not _positive(cap):
            raise ValueError(f"{section}.final_logit_softcapping must be positive (got {cap!r})")
        for name in ("output_multiplier", "input_embedding_scale"):
            if not _positive(getattr(self, name)):
                raise ValueError(f"{section}.{name} must be positive (got "
                                 f"{getattr(self, name)!r})")  # fmt: skip

    def logits(self, logits):
        """The target head's logits -> the drafter's (float32)."""
        x = jnp.asarray(logits, jnp.float32) * self.output_multiplier
        cap = self.final_logit_softcapping
        return x if cap is None else cap * jnp.tanh(x / cap)


def _positive(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and 0 < x < float("inf")


class GroupedConv(nnx.Module):
    """One sublayer's convolution pair: `prepare` (side 0, on the normed input, also returning
    the side-1 deltas) and `finish` (side 1, on the sublayer's output)."""

    def __init__(self, dim: int, cfg: DFlash2Config, *, dtype, rngs, kernels: KernelPolicy):
        K, groups = cfg.conv_kernel_size, dim // cfg.conv_group_size
        self.base_kernel = param(rngs, (2, K, dim), (None, None, "norm"), dtype, scale=0.1)
        self.kernel_projection = Linear(dim, 2 * K * groups, ("embed", None), dtype=dtype,
                                        rngs=rngs, kernels=kernels)  # fmt: skip
        self.taps, self.groups = K, groups

    def prepare(self, u):
        """u [..., b, D] -> (conv_0(u), side-1 deltas [..., b, K, G])."""
        delta = self.kernel_projection(u).reshape(*u.shape[:-1], 2, self.taps, self.groups)
        return self._convolve(u, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y, delta):
        return self._convolve(y, delta, 1)

    def _convolve(self, y, delta, side: int):
        """y [..., b, D] (one block per leading index), delta [..., b, K, G] -> conv_side(y)."""
        *lead, b, D = y.shape
        G = self.groups
        blocks = y.astype(jnp.float32).reshape(*lead, b, G, D // G)
        base = self.base_kernel[...][side].astype(jnp.float32).reshape(self.taps, G, D // G)
        coef = base + delta.astype(jnp.float32)[..., None]  # [..., b, K, G, D/G]
        out = coef[..., 0, :, :] * blocks
        keep = [(0, 0)] * len(lead)
        for k in range(1, self.taps):  # tap k reads the slot k earlier (zero before slot 0)
            shifted = jnp.pad(
                blocks[..., : max(b - k, 0), :, :], keep + [(min(k, b), 0), (0, 0), (0, 0)]
            )
            out = out + coef[..., k, :, :] * shifted
        return out.reshape(*lead, b, D).astype(y.dtype)


class CandidateSelector(nnx.Module):
    """The low-rank pair scorer over each draft slot's top-k tokens, and the walk."""

    def __init__(self, dim: int, vocab: int, cfg: DFlash2Config, *, dtype, rngs,
                 kernels: KernelPolicy):  # fmt: skip
        r = cfg.selector_rank
        self.predecessor_codebook = param(rngs, (vocab, r), ("vocab", None), dtype, scale=0.3)
        self.successor_codebook = param(rngs, (vocab, r), ("vocab", None), dtype, scale=0.3)
        self.hidden_projection = Linear(dim, r, ("embed", None), dtype=dtype, rngs=rngs,
                                        kernels=kernels)  # fmt: skip
        self.top_k = cfg.selector_top_k

    def scores(self, h, logits, anchor):
        """h [B, L, D] final hidden states of the draft slots, logits [B, L, V] (the drafter's),
        anchor [B] the block's first token -> (candidates [B, L, k] int32, pair scores
        [B, L, k, k] float32: row i = the previous slot's candidate i, at slot 0 every row
        the anchor)."""
        unary, cand = jax.lax.top_k(logits, self.top_k)  # descending, lower id first on ties
        return cand.astype(jnp.int32), self.pair_scores(h, unary, cand, anchor)

    def pair_scores(self, h, unary, cand, anchor):
        """The walk's scores from the candidates: h [..., L, D], unary and cand [..., L, k]
        (each slot's top-k logits and tokens), anchor [...] -> [..., L, k, k] (row i: the
        previous slot's candidate i; at slot 0 every row the anchor)."""
        k = cand.shape[-1]
        first = jnp.broadcast_to(anchor[..., None, None], (*cand.shape[:-2], 1, k))
        prev = jnp.concatenate([first.astype(cand.dtype), cand[..., :-1, :]], axis=-2)
        return self.score(h, unary, cand, prev)

    def score(self, h, unary, cand, prev):
        """score(p, c) = unary[c] + sum_r predecessor[p, r] z[r] successor[c, r] at each slot:
        h [..., L, D], unary and cand [..., L, k], prev [..., L, m] previous tokens ->
        [..., L, m, k] float32. The one scorer of the walk and of training's selector loss."""
        z = self.hidden_projection(h).astype(jnp.float32)  # [..., L, r]
        pred = self.predecessor_codebook[...][prev].astype(jnp.float32)  # [..., L, m, r]
        succ = self.successor_codebook[...][cand].astype(jnp.float32)  # [..., L, k, r]
        edges = jnp.einsum("...ir,...r,...jr->...ij", pred, z, succ)
        return unary.astype(jnp.float32)[..., None, :] + edges

    def walk(self, h, logits, anchor, keys, temperature):
        """The draft chain [B, L] int32: from the anchor, each slot's best candidate given the
        one before (temperature 0), or a sample of softmax(score / T) keyed by keys [B, L]
        (temperature [] or [B]; 0 rows walk greedily)."""
        cand, s = self.scores(h, logits, anchor)
        B, L, k = cand.shape
        t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
        noise = jax.vmap(lambda key: jax.random.gumbel(key, (k,), jnp.float32))(
            keys.reshape(-1)
        ).reshape(B, L, k)
        return jnp.take_along_axis(cand, follow(s, t, noise)[:, :, None], axis=2)[..., 0]


def follow(s, t, noise):
    """The candidate index [B, L] int32 the walk picks at each slot, from pair scores
    s [B, L, k, k]: argmax of the row of the previous pick where t [B] is 0, else argmax of
    row / t + noise [B, L, k] (a Gumbel sample of softmax(row / t))."""
    B, L, _, _ = s.shape
    rows = jnp.arange(B)

    def body(i, p):
        row = s[rows, p, i]  # [B, k] scores given the previous slot's choice i
        noisy = row / jnp.where(t > 0, t, 1.0)[:, None] + noise[:, p]
        j = jnp.where(t > 0, jnp.argmax(noisy, -1), jnp.argmax(row, -1)).astype(jnp.int32)
        return j, j

    _, picks = jax.lax.scan(body, jnp.zeros((B,), jnp.int32), jnp.arange(L), unroll=True)
    return picks.T
