"""Draft trees on device: DDTree's B most probable prefixes, DFlash's chain as a degenerate
tree, the verify mask, the acceptance walk and the compaction of the accepted path.

With per-depth log-probabilities lp[d, v] (depth d = 1..L), a prefix t_1..t_d scores
sum_i lp[i, t_i]. Scores only fall along a path, so the global top-B set is prefix-closed and
can be found exactly with a per-depth beam: the top-B prefixes of depth d are among the
top-B of depth d - 1 extended by the top-K tokens of depth d (K = min(B, V)), and only the
~B ln B pairs (beam i, token j) with (i + 1)(j + 1) <= B can be (beam_pairs); the answer is
the top-B of all L beams together. Ties prefer the shallower node, which keeps closure.
Static shapes, no host round trip, no heap.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdj.cache import KVCache, gather_rows
from kdj.decode.sampling import target_probs


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """What one step verifies besides the root: "none" (plain decoding), "chain" (DFlash:
    the argmax token at depths 1..size) or "tree" (DDTree: the `size` most probable
    prefixes)."""

    kind: str
    size: int = 0

    def __post_init__(self):
        if self.kind not in ("none", "chain", "tree"):
            raise ValueError(f"unknown draft kind {self.kind!r}")
        if (self.kind == "none") != (self.size == 0) or self.size < 0:
            raise ValueError(f"draft {self.kind!r} cannot have size {self.size}")

    def __str__(self):
        return self.kind if self.kind == "none" else f"{self.kind}{self.size}"


TOP_K_CHUNK = 1024  # entries per chunk of top_k's first round
# XLA's GPU TopK kernel takes k <= 16 in one pass a row; beyond it lax.top_k sorts each row.
# Two rounds beat the sort at every batch on the H200, and the kernel only with few rows
# (a batch-1 draft's 15 depths; at 120 rows and more one round was 1.5-4x faster).
ONE_PASS_MAX_K, FEW_ROWS = 16, 16


def top_k(x, k: int):
    """lax.top_k(x, k) over the last axis, in two rounds where that is faster (see above)."""
    rows = math.prod(x.shape[:-1])
    if k <= ONE_PASS_MAX_K and rows > FEW_ROWS:
        return jax.lax.top_k(x, k)
    return top_k_two_rounds(x, k)


def top_k_two_rounds(x, k: int, chunk: int = TOP_K_CHUNK):
    """lax.top_k(x, k) over the last axis in two rounds: the top k of each whole `chunk`
    entries, then the top k of those and of the leftover entries. The same values and indices
    where top_k takes the lower index first among equals (XLA's), since the candidates keep
    index order. One round where it would not shrink the second (k > chunk, or fewer than
    two chunks)."""
    V, c = x.shape[-1], chunk
    n = V // c
    if k > c or n < 2:
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    v1, i1 = jax.lax.top_k(x[..., : n * c].reshape(*lead, n, c), k)  # [..., n, k]
    i1 = i1 + (jnp.arange(n, dtype=i1.dtype) * c)[:, None]
    rest = jnp.broadcast_to(jnp.arange(n * c, V, dtype=i1.dtype), (*lead, V - n * c))
    values = jnp.concatenate([v1.reshape(*lead, n * k), x[..., n * c :]], axis=-1)
    index = jnp.concatenate([i1.reshape(*lead, n * k), rest], axis=-1)
    v2, j = jax.lax.top_k(values, k)
    return v2, jnp.take_along_axis(index, j, axis=-1)


def total_order_key(x):
    """float32 -> int32 ranked as lax.top_k ranks floats: -NaN < -inf < ... < inf < NaN."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: flip all but the sign bit


def pruning_chunk(V: int, k: int) -> int:
    """top_k_pruned's chunk: the power of two nearest sqrt(V / k), so the chunk maxima (V / c)
    and the candidates (k x c) are about as many; at least 8."""
    return max(8, 1 << round(math.log2(math.sqrt(V / max(k, 1)))))


def top_k_pruned(x, k: int, chunk: int | None = None):
    """lax.top_k(x, k) over the last axis, the full rows read once by a plain reduction: the
    maximum of each whole `chunk` entries, the k chunks whose maxima rank highest (lower chunk
    first among equals), then the top k of those chunks' entries and the leftover ones, in
    index order. Exact, ties included, wherever lax.top_k ranks floats in total order (XLA's
    sort; its one-pass GPU kernel holds -0.0 equal to 0.0 and leaves NaNs unordered): an entry
    outside the chosen chunks has k chosen maxima ranked ahead of it, each an entry of its
    own."""
    V = x.shape[-1]
    c = chunk or pruning_chunk(V, k)
    n = V // c
    if n <= k:
        return jax.lax.top_k(x, k)
    lead = x.shape[:-1]
    full = x[..., : n * c].reshape(*lead, n, c)
    _, chosen = jax.lax.top_k(total_order_key(full).max(axis=-1), k)  # [..., k] chunks
    chosen = jnp.sort(chosen, axis=-1)  # candidates in index order: ties go to the lower
    picked = jnp.take_along_axis(full, chosen[..., None], axis=-2)  # [..., k, c]
    index = chosen[..., None] * c + jnp.arange(c, dtype=chosen.dtype)
    rest = jnp.broadcast_to(jnp.arange(n * c, V, dtype=chosen.dtype), (*lead, V - n * c))
    values = jnp.concatenate([picked.reshape(*lead, k * c), x[..., n * c :]], axis=-1)
    index = jnp.concatenate([index.reshape(*lead, k * c), rest], axis=-1)
    top, j = jax.lax.top_k(values, k)
    return top, jnp.take_along_axis(index, j, axis=-1)


class Draft(NamedTuple):
    """The drafter's per-depth distributions as a step reads them: logits [B, L, V] float32
    and their log-normaliser lse [B, L] (log-probs = logits - lse). No [B, L, V] log-softmax
    is formed: a chain reads the argmax, a tree the top-K per depth, the forecast a gather
    and one more normaliser."""

    logits: jax.Array
    lse: jax.Array
    chain: jax.Array | None = None  # [B, L] int32 a selector's path (DFlash2); None = argmax

    @classmethod
    def of(cls, logits, chain=None) -> Draft:
        x = jnp.asarray(logits, jnp.float32)
        return cls(x, jax.nn.logsumexp(x, axis=-1), chain)

    def top(self, k: int):
        """(log-probs [B, L, K] descending, tokens [B, L, K]) of the K most probable tokens."""
        values, tokens = top_k(self.logits, min(k, self.logits.shape[-1]))
        return values - self.lse[..., None], tokens

    def head(self, n: int) -> Draft:
        """Depths 1..n only."""
        chain = None if self.chain is None else self.chain[:, :n]
        return Draft(self.logits[:, :n], self.lse[:, :n], chain)

    def calibrated(self, depth, tokens, calibration):
        """log-probs [B, N] of tokens [B, N] at depths [B, N] (1-based) with the logits
        divided by temperature `calibration`."""
        x = self.logits / calibration
        lse = jax.nn.logsumexp(x, axis=-1)  # [B, L]
        rows = jnp.arange(x.shape[0])[:, None]
        return x[rows, depth - 1, tokens] - lse[rows, depth - 1]


def beam_pairs(budget: int, k: int) -> np.ndarray:
    """Flat indices i * k + j (increasing) of the (beam i, token j) pairs that can extend a
    beam of `budget`: those with (i + 1) * (j + 1) <= budget, ~budget x ln(budget) of them.
    Beam and tokens are both sorted, so every (i' <= i, j' <= j) scores >= (i, j) and has a
    lower flat index: (i + 1) * (j + 1) of them precede (i, j) in top_k's order (value, then
    lower index first), and a pair with more than `budget` of them is never chosen."""
    i, j = np.divmod(np.arange(budget * k), k)
    return np.flatnonzero((i + 1) * (j + 1) <= budget).astype(np.int32)


def _beams(top_lp, top_tok, budget: int):
    """The top-K log-probs and tokens of each depth [L, K] (descending) -> per-depth beams:
    scores [L, B], tokens [L, B], parent beam index [L, B]. Each depth extends the beam by
    top_k over the beam_pairs only: the same result, ties included, as over all B x K."""
    K = top_lp.shape[1]
    pad = budget - K  # a beam wider than the vocabulary: pad depth 1 with impossible entries
    s0 = jnp.concatenate([top_lp[0], jnp.full((pad,), -jnp.inf)])
    t0 = jnp.concatenate([top_tok[0], jnp.zeros((pad,), jnp.int32)])
    beam, rank = map(jnp.asarray, np.divmod(beam_pairs(budget, K), K))  # flat-index order

    def extend(carry, x):
        (prev,) = carry
        lp_d, tok_d = x
        score, pick = jax.lax.top_k(prev[beam] + lp_d[rank], budget)
        return (score,), (score, tok_d[rank[pick]], beam[pick])

    # unrolled: a loop of the step would launch its small body once a depth from the host
    _, (s, t, p) = jax.lax.scan(extend, (s0,), (top_lp[1:], top_tok[1:]), unroll=True)
    scores = jnp.concatenate([s0[None], s])
    tokens = jnp.concatenate([t0[None], t]).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((1, budget), -1), p]).astype(jnp.int32)
    return scores, tokens, parents


def build_tree(lp, budget: int):
    """The top-`budget` prefixes of one sequence's draft distribution, lp [L, V] float32
    log-probabilities (see build_tree_from_top)."""
    top_lp, top_tok = top_k(lp.astype(jnp.float32), min(budget, lp.shape[1]))
    return build_tree_from_top(top_lp, top_tok, budget)


def build_tree_from_top(top_lp, top_tok, budget: int):
    """The top-`budget` prefixes from the K = min(budget, V) most probable tokens of each
    depth, top_lp / top_tok [L, K] (descending): ~budget x ln(budget) candidates a depth,
    whatever V is.

    Returns a dict of [budget] arrays, most probable
    first (ties: shallower first), so a parent precedes its children: tokens, depth (1..L),
    parent (index into these arrays, -1 = the root, i.e. the last committed token), score
    (log-probability of the prefix), valid (False where fewer than `budget` prefixes exist),
    and ancestors [budget, budget] bool (ancestors[i, j]: node j is node i or one of its
    ancestors).
    """
    L = top_lp.shape[0]
    scores, tokens, parents = _beams(top_lp.astype(jnp.float32), top_tok, budget)
    # global top-B: highest score first, shallower first on ties (keeps the set prefix-closed):
    # top_k takes the lower index first, and the flat index runs depth-major
    order = jax.lax.top_k(scores.reshape(-1), budget)[1]
    # Emitted in that same order, so the first b nodes are the top-b tree for every b <= budget
    # (what the adaptive controller slices) and a parent, never less probable than its child
    # and shallower on ties, always precedes it.
    d_idx, b_idx = order // budget, order % budget
    where = jnp.full((L, budget), -1, jnp.int32).at[d_idx, b_idx].set(jnp.arange(budget))
    par_beam = parents[d_idx, b_idx]
    parent = jnp.where(d_idx > 0, where[jnp.maximum(d_idx - 1, 0), par_beam], -1)
    valid = jnp.isfinite(scores[d_idx, b_idx])
    ancestors = jnp.eye(budget, dtype=bool)
    node = parent
    for _ in range(L - 1):
        ancestors = ancestors | jax.nn.one_hot(node, budget, dtype=bool)  # -1 -> no bit
        node = jnp.where(node >= 0, parent[jnp.maximum(node, 0)], -1)
    return {
        "tokens": tokens[d_idx, b_idx],
        "depth": d_idx + 1,
        "parent": parent,
        "score": scores[d_idx, b_idx],
        "valid": valid,
        "ancestors": ancestors & valid[:, None] & valid[None, :],
    }


def build_trees(lp, budget: int):
    """Batched build_tree: lp [B, L, V] -> the same dict with a leading batch dimension."""
    return jax.vmap(lambda x: build_tree(x, budget))(lp)


def draft_trees(draft: Draft, budget: int, limit=None):
    """build_trees of a Draft, from its top-K per depth (never a full log-softmax). limit
    [B] (optional): the deepest draft each row can still commit; deeper prefixes are left
    out of the build, so near max_new_tokens the whole budget goes to nodes that can be
    committed, as a draft cut to the tokens left would build them."""
    top_lp, top_tok = draft.top(budget)
    if limit is not None:
        deep = jnp.arange(1, top_lp.shape[1] + 1)[None, :] > limit[:, None]  # [B, L]
        top_lp = jnp.where(deep[:, :, None], -jnp.inf, top_lp)
    return jax.vmap(lambda v, t: build_tree_from_top(v, t, budget))(top_lp, top_tok)


def chain_trees(draft: Draft):
    """DFlash's draft as a tree: the argmax token at every depth (or the draft's own chain,
    DFlash2's selector path), each node the child of the previous one. -> the build_trees
    dict with budget L (the draft's depths)."""
    B, L, _ = draft.logits.shape
    idx = jnp.arange(L)
    if draft.chain is None:
        tokens = jnp.argmax(draft.logits, axis=-1).astype(jnp.int32)
        lp = jnp.max(draft.logits, axis=-1) - draft.lse
    else:
        tokens = draft.chain
        lp = jnp.take_along_axis(draft.logits, tokens[..., None], axis=-1)[..., 0] - draft.lse
    return {
        "tokens": tokens,
        "depth": jnp.broadcast_to(idx + 1, (B, L)),
        "parent": jnp.broadcast_to(idx - 1, (B, L)),
        "score": jnp.cumsum(lp, axis=1),
        "valid": jnp.ones((B, L), bool),
        "ancestors": jnp.broadcast_to(idx[:, None] >= idx[None, :], (B, L, L)),
    }


def top(tree, n: int):
    """The first n nodes of a build_trees dict: the top-n tree (nodes are in score order)."""
    return {k: v[:, :n, :n] if k == "ancestors" else v[:, :n] for k, v in tree.items()}


def root_only(batch: int):
    """The tree of plain decoding: no nodes, the root alone (build_trees dict, budget 0)."""
    i32 = jnp.zeros((batch, 0), jnp.int32)
    return {
        "tokens": i32,
        "depth": i32,
        "parent": i32,
        "score": jnp.zeros((batch, 0), jnp.float32),
        "valid": jnp.zeros((batch, 0), bool),
        "ancestors": jnp.zeros((batch, 0, 0), bool),
    }


def committable(tree, limit, room):
    """The nodes of `tree` a step can still commit, laid first and contiguous: those of depth
    <= limit [B] (the walk never goes deeper) and, in score order, the first room [B] of them
    (the cache slots left after the root). Near max_new_tokens or the cache end, nodes too
    deep to commit would otherwise take slots from shallower ones. Kept nodes keep their
    order, so the tree stays prefix-closed with parents first."""
    B, N = tree["tokens"].shape
    if N == 0:
        return tree
    keep = tree["valid"] & (tree["depth"] <= limit[:, None])
    rank = jnp.cumsum(keep, axis=1) - 1  # a kept node's new index
    keep = keep & (rank < room[:, None])
    order = jnp.argsort(jnp.where(keep, 0, 1), axis=1, stable=True)  # kept first, in order

    def take(x):
        return jnp.take_along_axis(x, order, axis=1)

    parent = take(tree["parent"])
    parent = jnp.where(parent >= 0, jnp.take_along_axis(rank, jnp.maximum(parent, 0), 1), -1)
    valid = take(keep)
    anc = jnp.take_along_axis(tree["ancestors"], order[:, :, None], axis=1)
    anc = jnp.take_along_axis(anc, order[:, None, :], axis=2)
    return {
        "tokens": take(tree["tokens"]),
        "depth": take(tree["depth"]),
        "parent": jnp.where(valid, parent, -1),
        "score": take(tree["score"]),
        "valid": valid,
        "ancestors": anc & valid[:, :, None] & valid[:, None, :],
    }


def draft_tree(shape: DraftShape, draft: Draft, full=None, limit=None):
    """The tree a step verifies for `shape`. `full` (optional) is a build_trees dict of at
    least shape.size nodes to slice instead of building again (built with the same `limit`);
    limit: as draft_trees takes it (a chain is cut by `committable` instead)."""
    if shape.kind == "chain":
        return chain_trees(draft.head(shape.size))
    if shape.kind == "tree":
        if full is not None:
            return top(full, shape.size)
        return draft_trees(draft, shape.size, limit)
    return root_only(draft.logits.shape[0])


def expected_tokens(shape: DraftShape, tree, draft: Draft, calibration=1.0):
    """Tokens a step is expected to commit: 1 + the drafter's probability of every node of
    the tree (DDTree, Proposition 1), the drafts treated as independent per depth, with the
    draft's logits at temperature `calibration`; tree gives the node set. Returns [B]."""
    if shape.kind == "none":
        return jnp.ones(draft.logits.shape[:1], jnp.float32)
    node_lp = draft.calibrated(tree["depth"], tree["tokens"], calibration)  # [B, N]
    score = jnp.einsum("bij,bj->bi", tree["ancestors"].astype(jnp.float32), node_lp)
    return 1.0 + jnp.sum(jnp.where(tree["valid"], jnp.exp(score), 0.0), axis=1)


def verify_inputs(tree, last, start, capacity: int):
    """The target's verify pass over root + nodes (T = 1 + N).

    tree: build_trees / chain_trees dict ([B, N] arrays); last [B]: the root (the last
    committed token, at slot start); nodes go to slots start + 1 .. start + N. Nodes whose
    slot falls outside the cache are never valid (a tree cut by `committable` has none).
    Returns (tokens [B, T], positions [B, T] = start + depth, mask [B, T, T], valid [B, N]).
    """
    B, N = tree["tokens"].shape
    valid = tree["valid"] & (start[:, None] + 1 + jnp.arange(N) < capacity)
    tokens = jnp.concatenate([last[:, None], tree["tokens"]], axis=1)
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), tree["depth"]], axis=1)
    anc = tree["ancestors"] & valid[:, :, None] & valid[:, None, :]
    mask = jnp.zeros((B, N + 1, N + 1), bool).at[:, :, 0].set(True).at[:, 1:, 1:].set(anc)
    return tokens, start[:, None] + depth, mask, valid


def target_tokens(logits, key, temperature, top_p, greedy: bool):
    """The target's own token at every node: argmax, or one independent draw per node from
    the target's distribution. logits [B, T, V] -> [B, T] int32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    p = target_probs(logits, temperature, top_p)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32)


def accept_tree(tree, valid, logits, key, temperature, top_p, limit, *, max_depth: int,
                greedy: bool):  # fmt: skip
    """Walk the verified tree from the root, always moving to the child whose token equals
    the target's token at the current node; stop where none does or after `limit` [B] steps.

    Lossless for greedy and sampling alike: the target's token at each node is a genuine
    target draw given that node's ancestors, and the walk emits exactly those draws (a
    matched child's token, then the token at the last node as the bonus). For a chain this is
    speculative sampling with a point-mass proposal (accept with probability p(x), else a
    draw from p without x). Siblings carry distinct tokens, so at most one child matches.

    Returns (path [B, D + 1] verify indices of the accepted nodes, path[:, 0] = 0 the root and
    entries past `a` repeat the last accepted node; a [B] accepted drafts; bonus [B]).
    max_depth (static) = D, the deepest depth a tree can have (block size - 1).
    """
    y = target_tokens(logits, key, temperature, top_p, greedy)  # [B, T]
    B = valid.shape[0]
    parent = tree["parent"] + 1  # verify index of each node's parent (0 = root)
    nodes = tree["tokens"]
    cur = jnp.zeros((B,), jnp.int32)
    alive = jnp.ones((B,), bool)
    a = jnp.zeros((B,), jnp.int32)
    path = [cur]
    for _ in range(max_depth if nodes.shape[1] else 0):
        want = jnp.take_along_axis(y, cur[:, None], axis=1)
        match = valid & (parent == cur[:, None]) & (nodes == want) & (alive & (a < limit))[:, None]
        found = match.any(axis=1)
        cur = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32) + 1, cur)
        a, alive = a + found, alive & found
        path.append(cur)
    path += [cur] * (max_depth + 1 - len(path))  # no nodes: the root alone
    bonus = jnp.take_along_axis(y, cur[:, None], axis=1)[:, 0]
    return jnp.stack(path, axis=1), a, bonus


def compact(cache: KVCache, path, a) -> KVCache:
    """Move the accepted path's cache rows to contiguous slots: the node at verify index
    path[b, j] (slot start + path[b, j]) goes to slot start + j, for j = 1 .. a[b]; start =
    cache.lengths (the root's slot). A path that is already the chain 0, 1, 2, .. (every
    DFlash step, and DDTree steps whose path runs through nodes 1, 2, 3, ..) moves nothing,
    so the copy is skipped when no sequence of the batch needs it.
    """
    start = cache.lengths
    j = jnp.arange(1, path.shape[1])
    moved = (path[:, 1:] != j[None]) & (j[None] <= a[:, None])
    src = start[:, None] + path[:, 1:]
    dst = jnp.where(j[None] <= a[:, None], start[:, None] + j[None], cache.capacity)  # drop

    def move(c: KVCache) -> KVCache:
        return KVCache(
            k=[gather_rows(x, src, dst) for x in c.k],
            v=[gather_rows(x, src, dst) for x in c.v],
            lengths=c.lengths,
        )

    return jax.lax.cond(moved.any(), move, lambda c: c, cache)
