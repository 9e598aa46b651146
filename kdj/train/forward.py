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
with the N blocks of a sequence sharing one context K/V computation: both run the drafter's
one layer stack (DFlashDrafter.blocks), each with its own attention.

DFlash2 (kdj/models/dflash2.py): the block convolutions are part of that layer stack, the
logits are the drafter's (scaled and capped), and the candidate selector learns the target's
greedy choices after the sequence's tokens with a loss of its own (selector_loss), added
with weight optim.selector_weight; its gradient stops at the drafter's states and logits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.models.dflash2 import follow
from kdj.models.drafter import DFlashDrafter, DrafterAttention
from kdj.models.layers import NEG_INF, apply_rope, rope_frequencies, softmax_scale
from kdj.models.transformer import full_hidden
from kdj.train.head import head_argmax, head_cross_entropy, head_top_k


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
    target_graphdef, target_state, tokens, layer_ids, labels: str, head_chunk: int,
    greedy: bool = False,
) -> TargetPass:  # fmt: skip
    """Frozen target pass over tokens [B, S] for a loss on `labels` (OptimConfig.labels):
    with "tokens" the layers after the last tap are dead code under jit; with "target" (or
    greedy: a DFlash2 selector's labels) the argmax runs head_chunk rows at a time;
    "distribution" keeps the final states."""
    h, feats = _frozen_target(target_graphdef, target_state, tokens, layer_ids)
    nxt = None
    if labels == "target" or greedy:
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
    norm) of N blocks per sequence, through the inference layer stack (DFlashDrafter.blocks:
    DFlash2's convolutions included) with block_attention as each layer's attention.

    embed [V, D]: the target's embedding table (frozen); feats [B, S, K*D]: target features of
    every position; tokens [B, S]; anchors [B, N] int32 with anchors <= S - b.
    """
    cfg = drafter.cfg
    b = cfg.block_size
    B, S = tokens.shape
    c = drafter.hidden_norm(drafter.fc(feats.astype(drafter.fc.kernel.dtype)))  # [B, S, D]
    ctx_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    j = jnp.arange(b, dtype=jnp.int32)
    positions = anchors[:, :, None] + j  # [B, N, b]
    block = jnp.where(j == 0, block_anchors(tokens, anchors)[:, :, None], cfg.mask_token_id)

    def attend(i, attn, u):
        # Context K/V as add_context computes them (no input norm, o_proj or MLP on them).
        ctx_k, ctx_v = attn.keys_values(c, ctx_pos)
        return block_attention(attn, u, positions, anchors, ctx_k, ctx_v, cfg.window(i))

    return drafter.blocks(embed[block], attend)


def block_anchors(tokens, anchors):
    """The anchor (real, committed) token of each block [B, N]: its slot 0."""
    return jnp.take_along_axis(tokens, anchors, axis=1)


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
    choices=None,
    selector_weight: float = 1.0,
):
    """Weighted cross-entropy of the drafter's blocks against the data's tokens, with
    greedy [B, S] against the target's argmax (block_labels), or with hidden [B, S, D] (the
    target's final states) against its whole next-token distribution; the lm_head and the
    cross-entropy run head_chunk slots at a time (kdj/train/head.py). Returns (loss, metrics)
    where metrics hold `acc` (slot-1 accuracy) and `tau` (mean accepted drafts + 1 per block
    under greedy verification against those labels, or the target's argmax: the acceptance
    length the block would get).

    A DFlash2 drafter's selector learns the target's choices [B, S] (its argmax after each
    position, required then): loss = the drafter's + selector_weight * selector_loss's, and
    the metrics add draft_loss and selector_loss's."""
    b = drafter.cfg.block_size
    head = head_weight(target_model)
    h = drafter_blocks(drafter, target_model.embed[...], feats, tokens, anchors)
    labels, valid = block_labels(tokens, loss_mask, anchors, anchor_ok, b, greedy)
    if hidden is not None:
        labels = slot_states(hidden, anchors, b).astype(head.dtype)
    w = jnp.asarray(slot_weights(b, gamma)) * valid
    logit_map = drafter_logit_map(drafter)
    out = head_cross_entropy(h[:, :, 1:].astype(head.dtype), head, labels, w, head_chunk,
                             logit_map)  # fmt: skip
    loss = out.loss_sum / jnp.maximum(jnp.sum(w), 1e-6)
    hit = out.hit & valid
    metrics = {
        "acc": jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(valid[..., 0]), 1),
        "tau": mean_tau(hit, anchor_ok),
    }
    if drafter.selector is None:
        return loss, metrics
    if choices is None:
        raise ValueError("a DFlash2 drafter's selector learns the target's choices: block_loss "
                         "needs choices [B, S] (target_pass with greedy=True)")  # fmt: skip
    targets, _ = block_labels(tokens, loss_mask, anchors, anchor_ok, b, choices)
    # The selector's gradient stops at the drafter's states: the drafter's layers learn from
    # their own logits' loss alone, so it cannot trade their accuracy for its pair scores.
    h_sel = jax.lax.stop_gradient(h[:, :, 1:]).astype(head.dtype)
    unary, cand = head_top_k(h_sel, head, drafter.selector.top_k, head_chunk, logit_map)
    before = slot_inputs(tokens, anchors, b)
    sel_loss, sel_metrics = selector_loss(drafter.selector, h_sel, unary, cand, before,
                                          targets, w, anchor_ok)  # fmt: skip
    metrics = dict(metrics, draft_loss=loss, **sel_metrics)
    return loss + selector_weight * sel_loss, metrics


def drafter_logit_map(drafter: DFlashDrafter):
    """The map from the head's logits to the drafter's (DFlash2's scale and cap); None for
    DFlash, whose logits are the head's."""
    return None if drafter.cfg.dflash2 is None else drafter.cfg.dflash2.logits


def mean_tau(hit, anchor_ok):
    """Mean tokens per verify step of the blocks (accepted drafts + the bonus token) where
    hit [B, N, b-1] says which draft slots the target accepts; padding blocks not counted."""
    blocks = jnp.maximum(jnp.sum(anchor_ok), 1)
    return jnp.sum(jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1) + anchor_ok) / blocks


def slot_inputs(tokens, anchors, block_size: int):
    """The sequence's token before each draft slot [B, N, b-1]: slot k's at a + k - 1 (the
    anchor token for slot 1), the token the target's choice for slot k follows."""
    idx = anchors[:, :, None] + jnp.arange(block_size - 1, dtype=jnp.int32)
    B, N, _ = idx.shape
    return jnp.take_along_axis(tokens, idx.reshape(B, -1), axis=1).reshape(idx.shape)


def selector_loss(selector, h, unary, cand, before, targets, weights, anchor_ok):
    """The candidate selector's loss on N blocks per sequence: at each draft slot p, given
    the sequence's token x_p before it, rank the target's choice y_p after x_p (its argmax
    there) first among the slot's candidates. Teacher-forced on the sequence: the walk's
    pick at a slot counts only while every earlier pick was accepted.

    h [B, N, L, D] the drafter's final states (gradient stopped), unary and cand [B, N, L, k]
    each slot's top-k logits and tokens, before [B, N, L] the tokens x (slot_inputs; x_0 the
    anchor), targets [B, N, L] the target's choices y, weights [B, N, L] (0: no loss),
    anchor_ok [B, N]. Returns (loss, metrics: selector_loss; selector_tau and top1_tau, the
    tau of the selector's greedy walk from the anchor and of the argmax chain, against the
    target's choices)."""
    # L_sel = sum_p w_p [logsumexp_j s_p(x_p, c_pj) - s_p(x_p, y_p)] / sum_p w_p over the
    # slots whose target choice y_p is a candidate c_pj (s: CandidateSelector.score)
    s = selector.score(h, unary, cand, before[..., None].astype(cand.dtype))[..., 0, :]
    is_target = cand == targets[..., None]  # [B, N, L, k]: at most one candidate each
    w = weights * jnp.any(is_target, axis=-1)
    gold = jnp.sum(jnp.where(is_target, s, 0.0), axis=-1)
    ce = jax.nn.logsumexp(s, axis=-1) - gold
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    valid = weights > 0
    B, N, L, k = cand.shape
    pairs = selector.pair_scores(h, unary, cand, before[..., 0]).reshape(B * N, L, k, k)
    picks = follow(pairs, jnp.zeros((B * N,)), jnp.zeros((B * N, L, k))).reshape(B, N, L)
    walked = jnp.take_along_axis(cand, picks[..., None], axis=-1)[..., 0]
    metrics = {
        "selector_loss": loss,
        "selector_tau": mean_tau((walked == targets) & valid, anchor_ok),
        "top1_tau": mean_tau((cand[..., 0] == targets) & valid, anchor_ok),
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
