"""The pure pieces of a decode step, each a function of the state (kdj/decode/state.py):

    plain_step  target over `last` -> one sampled token per sequence (AR, auto's skips)
    draft       drafter context += pending features; block [last, MASK x (k - 1)] -> lp
    propose     lp -> the tree to verify: DFlash's argmax chain or DDTree's top-B prefixes
    verify      target over [last, nodes] at slots L .., positions L + depth (tree mask)
    accept      walk from the root along children equal to the target's token -> a, bonus
    commit      compact the accepted K/V, emit a drafts + bonus, L += a + 1, queue features

Rejected entries stay in both caches past L and are overwritten later (rollback by length).
kdj/decode/loop.py composes these into AR, DFlash, DDTree and auto.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdj.decode import logprobs as lps
from kdj.decode import tree as trees
from kdj.decode.logprobs import Logprobs
from kdj.decode.sampling import perturbed, position_keys, sample
from kdj.decode.state import DecodeState, is_stop

PATH_SALT = 0x5E1EC7  # folded into a draft slot's key: the chain's noise is not the target's


class Verified(NamedTuple):
    """The target's verify pass over root + nodes (T = 1 + N)."""

    tokens: jax.Array  # [B, T] int32 root, then the nodes
    valid: jax.Array  # [B, N] bool nodes that fit in the cache
    logits: jax.Array  # [B, T, V] float32
    features: jax.Array | None  # [B, T, F] drafter features of every verified token
    tcache: object  # KVCache with all T written at slots L .. L + T - 1


class Accepted(NamedTuple):
    """The accepted path of a verified tree (k = block size)."""

    path: jax.Array  # [B, k] verify indices, path[:, 0] = 0 the root; repeats past a
    a: jax.Array  # [B] int32 drafts accepted
    bonus: jax.Array  # [B] int32 the target's token after the path
    tokens: jax.Array  # [B, k - 1] int32 accepted drafts (valid up to a)
    features: jax.Array | None  # [B, k, F] features of root + accepted nodes
    size: jax.Array  # [B] int32 nodes verified
    logprobs: Logprobs | None = None  # [B, k] of emitted(), when the plan asks for them


def features(taps):
    """[B, T, K, D] tapped target states -> [B, T, K * D] drafter context features."""
    B, T, K, D = taps.shape
    return taps.reshape(B, T, K * D)


def limits(state: DecodeState):
    """Drafts each sequence may accept this step [B]: slots L .. L + a must exist in the
    cache and a + 1 tokens fit in its budget; 0 once finished."""
    L, S = state.tcache.lengths, state.tcache.capacity
    room = jnp.minimum(S - 1 - L, state.max_new - state.n - 1)
    return jnp.where(state.active, jnp.maximum(room, 0), 0)


def plain_step(target, state: DecodeState, greedy: bool, taps=(),
               logprobs: int | None = None) -> DecodeState:  # fmt: skip
    """One token per active sequence. With `taps` (a drafter's feature layers), queue the
    features of `last` for the drafter's context (taken in by `flush`); with `logprobs` (k),
    record the token's log-probability and k alternatives."""
    L, active = state.tcache.lengths, state.active
    logits, tcache, tapped = target(state.last[:, None], L, state.tcache, taps=taps)
    keys = position_keys(state.key, L + 1)  # the new token sits at position L + 1
    nxt = sample(logits[:, 0], keys, state.temperature, state.top_p, greedy)
    B, N = state.out.shape
    at = (jnp.arange(B), jnp.where(active, state.n, N))
    out = state.out.at[at].set(nxt, mode="drop")
    if logprobs is not None:
        record = state.logprobs.put(at, lps.of(logits[:, 0], nxt, logprobs))
        state = dataclasses.replace(state, logprobs=record)
    n = state.n + active
    done = state.done | (active & (is_stop(nxt, state.stop_ids) | (n >= state.max_new)))
    state = dataclasses.replace(
        state, tcache=tcache.with_lengths(L + active), last=jnp.where(active, nxt, state.last),
        out=out, n=n, done=done, step=state.step + 1,
    )  # fmt: skip
    if taps:
        feats = features(tapped)[:, 0].astype(state.pending.dtype)
        rows = jnp.arange(B)
        pending = state.pending.at[rows, state.n_pend].set(feats, mode="drop")
        n_pend = jnp.where(active, state.n_pend + 1, 0)
        state = dataclasses.replace(state, pending=pending, n_pend=n_pend)
    return state


def flush(drafter, state: DecodeState) -> DecodeState:
    """The drafter's context takes in every queued feature."""
    L = state.tcache.lengths
    dcache = drafter.add_context(state.pending, L - state.n_pend, state.dcache)
    return dataclasses.replace(
        state, dcache=dcache.with_lengths(L), n_pend=jnp.zeros_like(state.n_pend)
    )


def draft(target, drafter, state: DecodeState, k: int):
    """Take in the pending context (at most k features: a drafted step queues a + 1), then
    run the block at slots L .. L + k - 1. Returns (tree.Draft of depths 1 .. k - 1: logits
    [B, k - 1, V] float32, their log-normaliser and, for DFlash2, the selector's chain;
    state with the drafter's cache written). A replay drafter (benchmarks only) drafts from
    the row's emitted tokens and position instead, and leaves the state as it is."""
    if hasattr(drafter, "replay"):  # kdj/models/replay.py: no layers, no context to take in
        logits = drafter.replay(state.out, state.n, state.tcache.lengths, k)
        return trees.Draft.of(logits), state
    B, L = state.last.shape[0], state.dcache.lengths
    dcache = drafter.add_context(state.pending[:, :k], L - state.n_pend, state.dcache)
    block = jnp.full((B, k), drafter.cfg.mask_token_id, jnp.int32).at[:, 0].set(state.last)
    positions = L[:, None] + jnp.arange(k, dtype=jnp.int32)
    h = drafter(target.embed[...][block], positions, dcache)
    logits = drafter.logits(target.logits(h[:, 1:]))
    chain = None  # DFlash: the argmax of each depth
    if drafter.selector is not None:  # DFlash2: the selector's walk from the last token
        keys = path_keys(state.key, positions[:, 1:])
        chain = drafter.selector.walk(h[:, 1:], logits, state.last, keys, state.temperature)
    return trees.Draft.of(logits, chain), dataclasses.replace(state, dcache=dcache)


def path_keys(keys, positions):
    """Keys [B, L] for a drafter that samples its chain (DFlash2's selector) at draft slots
    `positions` [B, L]: each position's sampling key, salted apart from the target's draws."""
    at = position_keys(keys, positions)
    salted = jax.vmap(lambda k: jax.random.fold_in(k, PATH_SALT))(at.reshape(-1))
    return salted.reshape(at.shape)


def propose(shape: trees.DraftShape, dist: trees.Draft, full=None, limit=None, room=None):
    """The tree a step verifies for `shape` (a build_trees dict, [B, N] arrays); `full`: a
    tree of at least shape.size nodes to slice instead of building again. With limit [B]
    (drafts each row may accept) and room [B] (cache slots after the root), only the nodes
    that can still be committed, laid first (trees.committable); a tree is built from depths
    <= limit only (`full` too: drafted_step builds it with the same limit)."""
    tree = trees.draft_tree(shape, dist, full, limit)
    return tree if limit is None else trees.committable(tree, limit, room)


def verify(target, tcache, last, tree, taps=()) -> Verified:
    """One target pass over root + the tree's nodes; nodes past the cache end are dropped."""
    tokens, positions, mask, valid = trees.verify_inputs(tree, last, tcache.lengths,
                                                         tcache.capacity)  # fmt: skip
    logits, tcache, tapped = target(
        tokens, tcache.lengths, tcache, positions=positions, tree=mask, taps=taps
    )
    feats = None if tapped is None else features(tapped)
    return Verified(tokens, valid, logits, feats, tcache)


def accept(tree, verified: Verified, limit, keys, temperature, top_p, *, block_size: int,
           greedy: bool, logprobs: int | None = None) -> Accepted:  # fmt: skip
    """The longest path along which every node equals the target's own token (argmax or a
    sample: lossless either way), at most `limit` [B] drafts, plus the bonus token. keys [B]:
    each sequence's sampling key; the token after a node at depth d is drawn at position
    L + d + 1 with its own key, as plain decoding draws it (sampling.py). With `logprobs`
    (k): each token it emits scored by the raw logits of the node before it."""
    scores = verified.logits
    if not greedy:  # the target's sample at each node is the argmax of its perturbed logits
        depth = jnp.pad(tree["depth"], ((0, 0), (1, 0)))  # the root at depth 0
        at = position_keys(keys, verified.tcache.lengths[:, None] + depth + 1)
        scores = perturbed(scores, at, temperature, top_p)
    path, a, bonus = trees.accept_tree(
        tree, verified.valid, scores, keys, temperature, top_p, limit,
        max_depth=block_size - 1, greedy=True,
    )  # fmt: skip
    tokens = jnp.take_along_axis(verified.tokens, path[:, 1:], axis=1)
    feats = verified.features
    if feats is not None:
        feats = jnp.take_along_axis(feats, path[:, :, None], axis=1)
    record = None
    if logprobs is not None:  # the token after path node j came from that node's logits
        rows = jnp.take_along_axis(verified.logits, path[:, :, None], axis=1)  # [B, k, V]
        record = lps.of(rows, emitted(tokens, a, bonus, jnp.arange(path.shape[1])), logprobs)
    return Accepted(path, a, bonus, tokens, feats, verified.valid.sum(1), record)


def emitted(tokens, a, bonus, j):
    """The tokens a step emits [B, k] (valid up to a): the a accepted drafts, then the bonus;
    tokens [B, k - 1] accepted drafts, j = arange(k)."""
    return jnp.where(j[None] < a[:, None], jnp.pad(tokens, ((0, 0), (0, 1))), bonus[:, None])


def commit(state: DecodeState, tcache, acc: Accepted):
    """Compact the accepted nodes' K/V to slots L + 1 .., emit a drafts + bonus (cut after a
    stop token), advance both caches by a + 1 and queue the accepted features for the next
    draft. tcache: the verified cache (lengths still L). Returns (state, count [B] tokens
    emitted)."""
    tcache = trees.compact(tcache, acc.path, acc.a)
    active, L = state.active, state.tcache.lengths
    B, N = state.out.shape
    k = acc.path.shape[1]
    j = jnp.arange(k)
    tokens = emitted(acc.tokens, acc.a, acc.bonus, j)
    valid = j[None] <= acc.a[:, None]
    stop_at = valid & jnp.any(tokens[..., None] == state.stop_ids[:, None, :], axis=-1)
    count = jnp.where(stop_at.any(1), jnp.argmax(stop_at, axis=1) + 1, acc.a + 1)
    count = jnp.where(active, count, 0)
    cols = jnp.where(j[None] < count[:, None], state.n[:, None] + j[None], N)
    at = (jnp.arange(B)[:, None], cols)
    out = state.out.at[at].set(tokens, mode="drop")
    if acc.logprobs is not None:
        state = dataclasses.replace(state, logprobs=state.logprobs.put(at, acc.logprobs))
    n = state.n + count
    done = state.done | (active & (stop_at.any(1) | (n >= state.max_new)))
    L_new = jnp.where(active, L + acc.a + 1, L)
    pending = state.pending.at[:, :k].set(acc.features.astype(state.pending.dtype))
    state = dataclasses.replace(
        state, tcache=tcache.with_lengths(L_new), dcache=state.dcache.with_lengths(L_new),
        last=jnp.where(active, acc.bonus, state.last), pending=pending,
        n_pend=jnp.where(active, acc.a + 1, 0), out=out, n=n, done=done, step=state.step + 1,
    )  # fmt: skip
    return state, count
