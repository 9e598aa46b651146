"""The drafter's training forward: many draft blocks per sequence in one pass.

    tokens [B, S] -> frozen target -> features f [B, S, K*D]         (stop_gradient)
    context c = hidden_norm(fc(f))                                    [B, S, D]
    anchors a [B, N]: random loss-masked positions <= S - b
    block n = target_embed([tok[a_n], MASK x (b - 1)]) at positions a_n + j     [B, N, b, D]
    every layer: the queries of block n see the context keys at positions < a_n (STRICTLY
                 before the anchor: at draft time the anchor token is the newest committed
                 token and its own features are not known yet) and the keys of their own
                 block in both directions; other blocks are invisible.
    logits = target_lm_head(norm(x))[:, :, 1:]    slot k predicts tok[a_n + k] (no shift)
    loss = sum(w_k CE_k) / sum(w_k) over valid slots,  w_k = exp(-(k - 1) / gamma)

The logits of the draft slots (and the target's, for greedy labels) are never made whole:
kdj/train/head.py runs the lm_head and the cross-entropy a chunk of rows at a time.

The label of slot k is the data's token tok[a_n + k] (labels "tokens"), or the target's own
greedy choice there, argmax p_target(. | tok[<= a_n + k - 1]) (labels "target"): what a
greedy verify accepts. They differ where the data was sampled (T > 0). With labels
"distribution" slot k learns the whole p_target(. | tok[<= a_n + k - 1]) (cross-entropy
against it: its KL plus the target's entropy), which also ranks the near-misses a tree drafts.

This is exactly what inference computes for a block starting at a_n with the context cache
filled up to a_n (tests/test_train.py checks it against Drafter.add_context + Drafter.__call__),
with the N blocks of a sequence sharing one context K/V computation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.models.drafter import DFlashDrafter, DrafterAttention
from kdj.models.layers import NEG_INF, apply_rope, rope_frequencies, softmax_scale
from kdj.models.transformer import full_hidden
from kdj.train.head import head_argmax, head_cross_entropy


class TargetPass(NamedTuple):
    """What the frozen target gives the drafter's training step (gradient stopped)."""

    features: jax.Array  # [B, S, K*D]: the OUTPUT of each tapped layer, concatenated
    greedy: jax.Array | None  # [B, S] int32: its argmax next token after each position
    hidden: jax.Array | None  # [B, S, D]: its final normed states (labels "distribution")


def head_weight(target_model) -> jax.Array:
    """The target's lm_head weight [D, V] for training's chunked head (kdj/train/head.py),
    which runs XLA's matmuls: a target in deterministic mode (fixed-tile Pallas matmuls,
    whose gradient is not defined) is refused rather than trained on other kernels."""
    if target_model.cfg.kernels.fixed_tiles():
        raise ValueError(
            "drafter training does not run in deterministic mode: the target's kernel policy "
            "has fixed tiles (deterministic=True with Pallas dense matmuls); load the target "
            "with the default kernels to train"
        )
    return target_model.head_weight()


def _frozen_target(target_graphdef, target_state, tokens, layer_ids):
    """(final normed hidden [B, S, D], features [B, S, K*D]) of the frozen target."""
    h, taps = full_hidden(target_graphdef, target_state, tokens, taps=tuple(layer_ids))
    B, S, K, D = taps.shape
    return jax.lax.stop_gradient(h), jax.lax.stop_gradient(taps.reshape(B, S, K * D))


def target_pass(
    target_graphdef, target_state, tokens, layer_ids, labels: str, head_chunk: int
) -> TargetPass:
    """Frozen target pass over tokens [B, S] for a loss on `labels` (OptimConfig.labels):
    with "tokens" the layers after the last tap are dead code under jit; with "target" the
    argmax runs head_chunk rows at a time; "distribution" keeps the final states."""
    h, feats = _frozen_target(target_graphdef, target_state, tokens, layer_ids)
    nxt = None
    if labels == "target":
        w = head_weight(nnx.merge(target_graphdef, target_state))
        nxt = head_argmax(h, w, head_chunk)
    return TargetPass(feats, nxt, h if labels == "distribution" else None)


def target_features(target_graphdef, target_state, tokens, layer_ids) -> jax.Array:
    """Frozen target pass: tokens [B, S] -> drafter context features [B, S, K*D]."""
    return _frozen_target(target_graphdef, target_state, tokens, layer_ids)[1]


def block_attention(attn: DrafterAttention, h, positions, anchors, ctx_k, ctx_v, window):
    """Attention of N blocks per sequence.

    h [B, N, b, D] normed block states at positions [B, N, b]; anchors [B, N] (block starts);
    ctx_k, ctx_v [B, S, KVH, hd]: context keys/values of positions 0..S-1. Returns [B, N, b, D].
    """
    cfg = attn.cfg
    B, N, b, D = h.shape
    H, KVH, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // KVH
    inv_freq, amp = rope_frequencies(cfg)
    flat = h.reshape(B, N * b, D)
    pos = positions.reshape(B, N * b)
    q = attn.q_norm(attn.q(flat).reshape(B, N * b, H, hd))
    q = apply_rope(q, pos, inv_freq, amp, interleaved=False).reshape(B, N, b, KVH, G, hd)
    kb, vb = attn.keys_values(flat, pos)
    kb, vb = kb.reshape(B, N, b, KVH, hd), vb.reshape(B, N, b, KVH, hd)

    S = ctx_k.shape[1]
    ctx_pos = jnp.arange(S, dtype=jnp.int32)
    ctx_ok = ctx_pos[None, None, None, :] < anchors[:, :, None, None]  # [B, N, 1, S]
    blk_ok = jnp.ones((B, N, b, b), bool)
    if window is not None:  # the same non-causal window the inference attention applies
        ctx_ok = ctx_ok & (ctx_pos[None, None, None, :] > positions[..., None] - window)
        blk_ok = jnp.abs(positions[..., :, None] - positions[..., None, :]) < window
    scale = softmax_scale(cfg)
    s_ctx = jnp.einsum("bnjkgd,bskd->bkgnjs", q, ctx_k, preferred_element_type=jnp.float32)
    s_blk = jnp.einsum("bnjkgd,bnlkd->bkgnjl", q, kb, preferred_element_type=jnp.float32)
    s_ctx = jnp.where(ctx_ok[:, None, None], s_ctx * scale, NEG_INF)
    s_blk = jnp.where(blk_ok[:, None, None], s_blk * scale, NEG_INF)
    # One softmax over [context ; own block], as in DrafterAttention.__call__.
    p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(ctx_v.dtype)
    out = jnp.einsum("bkgnjs,bskd->bnjkgd", p[..., :S], ctx_v)
    out = out + jnp.einsum("bkgnjl,bnlkd->bnjkgd", p[..., S:], vb.astype(ctx_v.dtype))
    return attn.o(out.reshape(B, N, b, H * hd))


def drafter_blocks(drafter: DFlashDrafter, embed, feats, tokens, anchors) -> jax.Array:
    """The training pass of the drafter: final hidden states [B, N, b, D] (after the final
    norm) of N blocks per sequence.

    embed [V, D]: the target's embedding table (frozen); feats [B, S, K*D]: target features of
    every position; tokens [B, S]; anchors [B, N] int32 with anchors <= S - b.
    """
    cfg = drafter.cfg
    if cfg.dflash2 is not None:  # this pass has no convolutions: it would train another model
        raise NotImplementedError("training a DFlash2 drafter is not supported")
    b = cfg.block_size
    B, S = tokens.shape
    dtype = drafter.fc.kernel.dtype
    c = drafter.hidden_norm(drafter.fc(feats.astype(dtype)))  # [B, S, D]
    ctx_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    j = jnp.arange(b, dtype=jnp.int32)
    positions = anchors[:, :, None] + j  # [B, N, b]
    first = jnp.take_along_axis(tokens, anchors, axis=1)  # the anchor (real) token
    block = jnp.where(j == 0, first[:, :, None], cfg.mask_token_id)  # [B, N, b]
    x = embed[block].astype(dtype)
    for i, layer in enumerate(drafter.layers):
        # Context K/V as add_context computes them (no input norm, o_proj or MLP on them).
        ctx_k, ctx_v = layer.attn.keys_values(c, ctx_pos)
        h = layer.attn_norm(x)
        x = x + block_attention(layer.attn, h, positions, anchors, ctx_k, ctx_v, cfg.window(i))
        x = x + layer.mlp(layer.mlp_norm(x))
    return drafter.norm(x)


def slot_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight of draft slots 1..b-1: w_k = exp(-(k - 1) / gamma) (early slots matter
    most: a wrong slot k makes every later slot useless)."""
    k = np.arange(1, block_size, dtype=np.float32)
    return np.exp(-(k - 1) / gamma)


def block_labels(tokens, loss_mask, anchors, anchor_ok, block_size: int, greedy=None):
    """Labels and validity of slots 1..b-1, NOT shifted: slot k predicts tokens[a + k], or
    with greedy [B, S] (the target's argmax after each position) greedy[a + k - 1].
    Returns (labels [B, N, b-1] int32, valid [B, N, b-1] bool)."""
    idx = anchors[:, :, None] + jnp.arange(1, block_size, dtype=jnp.int32)  # [B, N, b-1]
    B, N, _ = idx.shape
    flat = idx.reshape(B, -1)
    if greedy is None:
        labels = jnp.take_along_axis(tokens, flat, axis=1).reshape(idx.shape)
    else:
        labels = jnp.take_along_axis(greedy, flat - 1, axis=1).reshape(idx.shape)
    valid = jnp.take_along_axis(loss_mask, flat, axis=1).reshape(idx.shape)
    return labels, valid & anchor_ok[:, :, None]


def slot_states(hidden, anchors, block_size: int):
    """The target's states [B, N, b-1, D] that predict slots 1..b-1: slot k's at position
    a + k - 1 (hidden [B, S, D], anchors [B, N])."""
    idx = anchors[:, :, None] + jnp.arange(block_size - 1, dtype=jnp.int32)  # [B, N, b-1]
    B, N, _ = idx.shape
    rows = jnp.take_along_axis(hidden, idx.reshape(B, -1)[..., None], axis=1)
    return rows.reshape(*idx.shape, hidden.shape[-1])


def block_loss(
    drafter: DFlashDrafter,
    target_model,
    feats,
    tokens,
    loss_mask,
    anchors,
    anchor_ok,
    gamma: float,
    greedy=None,
    *,
    head_chunk: int,
    hidden=None,
):
    """Weighted cross-entropy of the drafter's blocks against the data's tokens, with
    greedy [B, S] against the target's argmax (block_labels), or with hidden [B, S, D] (the
    target's final states) against its whole next-token distribution; the lm_head and the
    cross-entropy run head_chunk slots at a time (kdj/train/head.py). Returns (loss, metrics)
    where metrics hold `acc` (slot-1 accuracy) and `tau` (mean accepted drafts + 1 per block
    under greedy verification against those labels, or the target's argmax: the acceptance
    length the block would get)."""
    b = drafter.cfg.block_size
    head = head_weight(target_model)
    h = drafter_blocks(drafter, target_model.embed[...], feats, tokens, anchors)
    labels, valid = block_labels(tokens, loss_mask, anchors, anchor_ok, b, greedy)
    if hidden is not None:
        labels = slot_states(hidden, anchors, b).astype(head.dtype)
    w = jnp.asarray(slot_weights(b, gamma)) * valid
    out = head_cross_entropy(h[:, :, 1:].astype(head.dtype), head, labels, w, head_chunk)
    loss = out.loss_sum / jnp.maximum(jnp.sum(w), 1e-6)
    hit = out.hit & valid
    blocks = jnp.maximum(jnp.sum(anchor_ok), 1)
    metrics = {
        "acc": jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(valid[..., 0]), 1),
        "tau": jnp.sum(jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1) + anchor_ok) / blocks,
    }
    return loss, metrics


def sample_anchors(loss_mask: np.ndarray, n: int, block_size: int, rng: np.random.Generator):
    """Random distinct anchors per sequence among loss-masked positions p <= S - b.

    loss_mask [B, S] bool (numpy). Returns (anchors [B, n] int32, ok [B, n] bool); a sequence
    with fewer than n candidates gets all of them and padding rows (anchor 0, ok False).
    """
    B, S = loss_mask.shape
    anchors = np.zeros((B, n), np.int32)
    ok = np.zeros((B, n), bool)
    for i in range(B):
        cand = np.flatnonzero(loss_mask[i, : S - block_size + 1])
        pick = rng.choice(cand, size=min(n, cand.size), replace=False) if cand.size else cand
        anchors[i, : pick.size] = np.sort(pick)
        ok[i, : pick.size] = True
    return anchors, ok
