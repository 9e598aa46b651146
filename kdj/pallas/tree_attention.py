"""Tree attention in Pallas (Triton lowering): GQA and MLA-absorbed, flash style with split-K.

Mask form (kdj/models/layers.py): the T new tokens of row b sit in cache slots start[b] ..
start[b] + T - 1; every query sees all slots < start[b]; among the new slots, query i sees
start[b] + j iff tree[b, i, j]. So only slots < start[b] + T are read, whatever the capacity.

Work split. One program owns (batch row, KV head, tile of query rows, slot range). Query
rows are the T nodes x the G = H / KVH heads sharing that KV head (row r = t * G + g), so
every K/V tile is loaded once and used by all of them; MLA is the case KVH = 1, G = H, over
one stream whose first C columns are also the values (loaded once, used as K and as V).
The slot axis is split (flash-decoding): NS programs share the committed prefix
[0, start) in whole blocks with no mask at all, and one extra program per query tile does
the tail blocks that hold the tree (masked by start and tree). Each program writes an
unnormalised f32 partial (o, running max m, running sum l); a small XLA step merges them.
Without the split, a decode step at batch 1 would run KVH = 8 programs on a 132-SM chip.

Deterministic mode (fixed_split): a node must see its keys exactly where a plain decode of
the node would, or the MMA groups the same terms differently. So every query's visible new
slots are packed (packed_paths: a node's path from the root, at start + depth), a query tile
holds one node's rows (its tile size set by G alone), and splits of F blocks count from slot
0. A T = 1 decode is the same computation with a path of one, at the cost of one program
row per node: a T-node verify reads the prefix T times (from L2, mostly). With
nodes_per_tile > 1, up to that many nodes share a tile (as many as its rows hold): the
blocks below start are read once for them, each block above once per node, every row taking
its own node's dot (the same tile shape as a decode's, so the same sums).

Backend: Pallas with the Triton lowering (``jax.experimental.pallas.triton``). It exists in
jax 0.10 (CPU CI) and 0.11 (the GPU), where it is deprecated (a warning, silenced below) in
favour of Mosaic GPU; but only the Triton-flavoured pallas_call runs interpreted on the CPU in
both versions, and the tests run this same kernel that way. Triton wants power-of-two tiles,
so the 576-wide MLA head is loaded as 512 + 64. The cache is [B, KVH, S, D] so that each
program's K/V tiles are contiguous. Which steps take the kernel, and the split sizes, are
the model's kernel policy (kdj/kernels.py).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kdj.kernels import DEFAULT


def slot_splits(B: int, KVH: int, nq: int, S: int, bk: int, *, programs: int,
                min_blocks: int) -> int:  # fmt: skip
    """How many programs share a row's committed slots (see the module docstring): enough
    for ~`programs` programs in all, each split at least `min_blocks` K blocks of bk slots of
    the S-slot cache."""
    return max(1, min(pl.cdiv(programs, B * KVH * nq), S // (min_blocks * bk)))


def _pow2_parts(d: int) -> tuple[tuple[int, int], ...] | None:
    """Split a head width into power-of-two column ranges (offset, size), each >= 16:
    576 -> ((0, 512), (512, 64)). None if that takes more than three pieces."""
    parts, off = [], 0
    for bit in reversed(range(d.bit_length())):
        size = 1 << bit
        if d & size:
            if size < 16:
                return None
            parts.append((off, size))
            off += size
    return tuple(parts) if 0 < len(parts) <= 3 else None


def supported(q_shape, k_shape, v_dim: int, latent: bool) -> bool:
    """Whether the kernel takes this shape (else callers use the XLA reference)."""
    _, T, H, Dk = q_shape
    KVH = k_shape[1]
    parts = _pow2_parts(Dk)
    if parts is None or H % KVH or T < 1:
        return False
    if latent:
        return KVH == 1 and parts[0] == (0, v_dim)
    return v_dim >= 16 and v_dim & (v_dim - 1) == 0


def _kernel(
    start_ref,  # [B] int32
    tree_ref,  # [B * T * T] flattened: tree bits (int8), or with fixed_split packed paths
    *refs,  # count [B * T] (fixed_split only), q, k, v unless latent; then o, m, l blocks
    T: int,
    G: int,
    P: int,
    Rg: int,
    shared: bool,
    KVH: int,
    parts: tuple[tuple[int, int], ...],
    dv: int,
    latent: bool,
    scale: float,
    bq: int,
    bk: int,
    n_prefix_splits: int,
    fixed_split: int,
    precision,
):
    count_ref, *refs = refs if fixed_split else (None, *refs)
    q_ref, k_ref, *refs = refs  # q [B, KVH, Rp, Dk]; k [B, KVH, S, Dk]
    v_ref, o_ref, m_ref, l_ref = (None, *refs) if latent else refs
    b, h = pl.program_id(0) // KVH, pl.program_id(0) % KVH
    qi, sp = pl.program_id(1), pl.program_id(2)
    S = k_ref.shape[2]

    rows = qi * bq + jnp.arange(bq)
    # One Q tile, kept in registers for the whole pass; scale folded in once.
    qs = [q_ref[b, h, pl.ds(qi * bq, bq), pl.ds(off, size)] for off, size in parts]

    start = start_ref[b]
    if fixed_split:  # the tile's rows are P nodes' (a group of Rg rows): each its own path
        group, local = qi * bq // Rg, (qi * bq) % Rg + jnp.arange(bq)
        row_node = jnp.minimum(local // G, P - 1)  # padding rows follow the group's last
        nodes = [jnp.minimum(group * P + j, T - 1) for j in range(P)]
        counts = [jnp.where(group * P + j < T, count_ref[b * T + n], 0)
                  for j, n in enumerate(nodes)]  # fmt: skip
        end = jnp.minimum(start + functools.reduce(jnp.maximum, counts), S)
    else:
        # Slots >= end are never read: past start + T they are stale, and past the cache's
        # last slot (a tree cut at the cache end) they do not exist; an unmasked read there
        # returns whatever memory follows, NaN included, which poisons p @ V even where p = 0.
        end = jnp.minimum(start + T, S)
    n_full = start // bk  # blocks entirely below start: visible to every query

    def step(blk, carry, tail: bool, common: bool = False):
        o, m, l = carry
        s0 = blk * bk
        slots = s0 + jnp.arange(bk)
        gather = (tail or common) and bool(fixed_split)
        reads = [(pl.ds(s0, bk), {}, None)]  # per node of the tile: (at, load mask, seen)
        if gather and common:
            # A block below start, the same for every node of the tile: read once, through
            # the gathered step's own code (a contiguous read may round a dot differently).
            seen = slots >= 0
            reads = [(slots[:, None], dict(mask=seen[:, None], other=0), seen)]
        elif gather:
            # Logical slot start + d holds a node's d-th path entry (packed_paths).
            reads = []
            for n, count in zip(nodes, counts):
                row = (b * T + n) * T
                src, seen = packed_source(
                    slots, start, count, lambda j, row=row: tree_ref[row + j].astype(jnp.int32),
                    T, S,
                )  # fmt: skip
                reads.append((src[:, None], dict(mask=seen[:, None], other=0), seen))
        elif tail:  # tail blocks run past end: read those slots as 0 (stale V times p = 0: NaN)
            reads = [(pl.ds(s0, bk), dict(mask=(slots < end)[:, None], other=0), None)]

        def cols(off, size):  # a gather indexes every axis by arrays (Pallas' interpreter)
            return off + jnp.arange(size)[None] if gather else pl.ds(off, size)

        def by_node(j, mine, out):  # node j's rows take its result, as that node alone would
            return mine if j == 0 else jnp.where((row_node == j)[:, None], mine, out)

        kss, s = [], None
        for j, (at, masked, seen) in enumerate(reads):
            ks = [plgpu.load(k_ref.at[b, h, at, cols(off, size)], **masked) for off, size in parts]
            sj = sum(plgpu.dot(qp, kp, trans_b=True, precision=precision)
                     for qp, kp in zip(qs, ks))  # fmt: skip
            sj = sj.astype(jnp.float32) * scale
            kss.append(ks)
            s = by_node(j, sj if seen is None else jnp.where(seen[None, :], sj, -jnp.inf), s)
        if tail and not gather:
            # Tree bit of (row's node, slot - start); rows past T * G are padding.
            t = jnp.minimum(rows // G, T - 1)
            j = jnp.clip(slots - start, 0, T - 1)
            bits = tree_ref[(b * T + t)[:, None] * T + j[None, :]]
            new = ((slots >= start) & (slots < end))[None, :]
            visible = (slots < start)[None, :] | (new & (bits != 0))
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet
        alpha = jnp.exp(m - m_use)
        p = jnp.exp(s - m_use[:, None])
        pv = None
        for j, ((at, masked, _), ks) in enumerate(zip(reads, kss)):
            if latent:
                vt = ks[0]  # the first C columns of the stream are the values: no second read
            else:
                vt = plgpu.load(v_ref.at[b, h, at, cols(0, v_ref.shape[3])], **masked)
            pv = by_node(j, plgpu.dot(p.astype(vt.dtype), vt, precision=precision), pv)
        pv = pv.astype(jnp.float32)
        return o * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1)

    carry = (
        jnp.zeros((bq, dv), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    if fixed_split:
        # Program sp: blocks [sp F, (sp + 1) F) of the slot axis up to the tile's last end
        # (past a node's own end a block changes none of its rows' sums). Unshared, every
        # block goes through the gathered step, as a decode of the node reads its ancestors
        # below its start and the node above; shared, the blocks below start are read once
        # for all the tile's nodes (the same keys for each), through the same code.
        n_blocks = pl.cdiv(end, bk)
        lo = jnp.minimum(sp * fixed_split, n_blocks)
        hi = jnp.minimum(lo + fixed_split, n_blocks)
        mid = lo
        if shared:
            mid = jnp.clip(start // bk, lo, hi)
            carry = lax.fori_loop(lo, mid, functools.partial(step, tail=False, common=True),
                                  carry)  # fmt: skip
        o, m, l = lax.fori_loop(mid, hi, functools.partial(step, tail=True), carry)
    else:
        # Prefix programs sp < NS share the n_full unmasked blocks; program NS does the tail.
        per = pl.cdiv(n_full, n_prefix_splits)
        lo, hi = jnp.minimum(sp * per, n_full), jnp.minimum((sp + 1) * per, n_full)
        carry = lax.fori_loop(lo, hi, functools.partial(step, tail=False), carry)
        is_tail = sp == n_prefix_splits
        lo, hi = jnp.where(is_tail, n_full, 0), jnp.where(is_tail, pl.cdiv(end, bk), 0)
        o, m, l = lax.fori_loop(lo, hi, functools.partial(step, tail=True), carry)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


class PackedPaths(NamedTuple):
    """Deterministic mode's key layout (packed_paths)."""

    index: jax.Array  # [B, T, T] int: query i's d-th visible new slot, relative to start
    count: jax.Array  # [B, T] int32: how many new slots query i sees


def packed_paths(tree) -> PackedPaths:
    """Each query's visible new slots (its row of tree [B, T, T]) packed in slot order; index
    is 0 past count. For a tree laid parents first (kdj/decode/tree.py) those are the node's
    path from the root, so packed at start + d they sit where a plain decode of that path
    keeps them; a chain (a DFlash draft, a prefill) packs to itself."""
    T = tree.shape[-1]
    order = jnp.argsort(~tree, axis=-1, stable=True)  # visible first, each group in order
    count = tree.sum(-1, dtype=jnp.int32)
    index = jnp.where(jnp.arange(T) < count[..., None], order, 0)
    return PackedPaths(index.astype(jnp.int16 if T < 1 << 15 else jnp.int32), count)


def packed_source(slots, start, count, entry, T: int, S: int):
    """Where a query reads logical slots `slots` of its packed layout (packed_paths), with
    `count` visible new slots and entry(j) its packed index j (0 <= j < T): (the cache slot,
    clipped into the S-slot cache; whether it is seen). Below start the cache as it is; a
    dropped node's own slot may lie past the cache, and is never seen."""
    rel = slots - start
    src = jnp.where(rel < 0, slots, start + entry(jnp.clip(rel, 0, T - 1)))
    return jnp.minimum(src, S - 1), (rel < count) & (src < S)


def packed_view(x, start, paths: PackedPaths):
    """x [B, KVH, S, D] -> each query's logical view [B, KVH, T, S, D] and seen [B, T, S]:
    what the kernel reads in deterministic mode, laid out for the XLA reference."""
    B, T, _ = paths.index.shape
    S = x.shape[2]
    index = paths.index.astype(jnp.int32)
    src, seen = packed_source(
        jnp.arange(S), start[:, None, None], paths.count[..., None],
        lambda j: jnp.take_along_axis(index, j, axis=-1), T, S,
    )  # fmt: skip
    return jax.vmap(lambda xb, sb: xb[:, sb])(x, src), seen


def _merge(o, m, l, in_order: bool):
    """The split partials o [P, NS, R, dv], m and l [P, NS, R] -> o [P, R, dv] normalised:
    weights exp(m_i - max m); empty splits (m = -inf) weigh 0, and a row that saw nothing at
    all (l = 0) comes out as 0 rather than NaN. in_order: add the splits one by one, first
    to last (XLA's reduction may group them by the array's shape: by T, in a verify)."""
    big = m.max(axis=1, keepdims=True)
    w = jnp.exp(m - jnp.where(big == -jnp.inf, 0.0, big))
    if in_order:
        den, acc = w[:, 0] * l[:, 0], w[:, 0, :, None] * o[:, 0]
        for i in range(1, m.shape[1]):
            den, acc = den + w[:, i] * l[:, i], acc + w[:, i, :, None] * o[:, i]
    else:
        den, acc = (w * l).sum(axis=1), (w[..., None] * o).sum(axis=1)
    return acc / jnp.where(den == 0, 1.0, den)[..., None]


def _flash(q, k, v, start, tree, scale, *, G, latent, dv, cfg, interpret):
    """q [B, KVH, R, Dk] (rows t * G + g) -> [B, KVH, R, dv] f32, normalised."""
    B, KVH, R, Dk = q.shape
    S = k.shape[2]
    T = tree.shape[1]
    fixed = cfg.get("fixed_split") or 0
    bk = cfg.get("block_k") or 64  # on the H200, 1.4-2.3x faster than 16 or 32 for MLA
    P, Rg, Tp, shared = 1, G, T, False  # nodes a query tile holds; rows per group of P
    if fixed:
        # Query tiles of a size set by G alone: a T = 1 decode and every node of a verify
        # run the same tile over the same key layout. A group of P nodes' G rows each (padded
        # to Rg) fills whole tiles; nodes_per_tile > 1 lets P nodes share a tile, and the
        # blocks below start be read once for them all (shared).
        bq = min(cfg.get("block_q") or 64, max(16, pl.next_power_of_2(G)))
        packing = cfg.get("nodes_per_tile") or 1
        P, shared = max(1, min(packing, T, bq // G)), packing > 1
        Rg, Tp = pl.cdiv(P * G, bq) * bq, pl.cdiv(T, P) * P
        q = jnp.pad(q.reshape(B, KVH, T, G, Dk), ((0, 0), (0, 0), (0, Tp - T), (0, 0), (0, 0)))
        q = q.reshape(B, KVH, Tp // P, P * G, Dk)
        q = jnp.pad(q, ((0, 0),) * 3 + ((0, Rg - P * G), (0, 0)))
        q = q.reshape(B, KVH, Tp // P * Rg, Dk)
        paths = packed_paths(tree)
        ins = [start.astype(jnp.int32), paths.index.reshape(-1), paths.count.reshape(-1)]
        ns = pl.cdiv(pl.cdiv(S, bk), fixed) - 1  # splits of `fixed` blocks from slot 0
    else:
        bq = cfg.get("block_q") or max(16, min(64, pl.next_power_of_2(R)))
        ins = [start.astype(jnp.int32), tree.astype(jnp.int8).reshape(-1)]
    Rp = pl.cdiv(q.shape[2], bq) * bq
    nq = Rp // bq
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Rp - q.shape[2]), (0, 0)))
    if not fixed:
        ns = cfg.get("num_splits") or slot_splits(
            B, KVH, nq, S, bk, programs=cfg.get("programs") or DEFAULT.attention_programs,
            min_blocks=cfg.get("min_split_blocks") or DEFAULT.min_split_blocks(T),
        )  # fmt: skip
    parts = _pow2_parts(Dk)
    kernel = functools.partial(
        _kernel,
        T=T,
        G=G,
        P=P,
        Rg=Rg,
        shared=shared,
        KVH=KVH,
        parts=parts,
        dv=dv,
        latent=latent,
        scale=float(scale),
        bq=bq,
        bk=bk,
        n_prefix_splits=ns,
        fixed_split=fixed,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    ins += [q, k] if latent else [q, k, v]
    out_shape = [
        jax.ShapeDtypeStruct((B * KVH, ns + 1, Rp, dv), jnp.float32),
        jax.ShapeDtypeStruct((B * KVH, ns + 1, Rp), jnp.float32),
        jax.ShapeDtypeStruct((B * KVH, ns + 1, Rp), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, bq, dv), lambda i, j, s: (i, s, j, 0)),
        pl.BlockSpec((None, None, bq), lambda i, j, s: (i, s, j)),
        pl.BlockSpec((None, None, bq), lambda i, j, s: (i, s, j)),
    ]
    full = [pl.BlockSpec(x.shape, lambda i, j, s, n=x.ndim: (0,) * n) for x in ins]
    with warnings.catch_warnings():
        # jax 0.11 deprecates the Triton lowering (see the module docstring): say it once here.
        warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")
        o, m, l = pl.pallas_call(
            kernel,
            grid=(B * KVH, nq, ns + 1),
            in_specs=full,
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(
                num_warps=cfg.get("num_warps") or (8 if latent else 4),
                num_stages=cfg.get("num_stages") or 2,
            ),
            interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
            name="tree_attention_mla" if latent else "tree_attention_gqa",
        )(*ins)
    o = _merge(o, m, l, in_order=bool(fixed))
    o = o[:, : Tp // P * Rg].reshape(B, KVH, Tp // P, Rg, dv)[:, :, :, : P * G]
    return o.reshape(B, KVH, Tp, G, dv)[:, :, :T].reshape(B, KVH, R, dv)


def tree_attention(q, k, v, start, tree, scale: float, *, interpret: bool | None = None, **cfg):
    """GQA tree attention. q [B, T, H, Dk]; k [B, KVH, S, Dk]; v [B, KVH, S, Dv]; start [B]
    int32; tree [B, T, T] bool. Returns [B, T, H, Dv] in q's dtype. ``cfg``: block_q,
    block_k, num_warps, num_stages (defaults tuned on the H200); num_splits, or the rule's
    programs and min_split_blocks (default: kdj.kernels.DEFAULT's); or fixed_split=F
    (deterministic mode): each program owns F blocks counted from slot 0 and one node's query
    rows (nodes_per_tile: up to that many nodes'), and reads each node's new slots packed
    (packed_paths), so a node computes exactly what a plain decode of its path computes,
    whatever the tree, batch, T or prefix.
    interpret: run in Pallas' interpreter (default: everywhere but on a GPU)."""
    B, T, H, Dk = q.shape
    KVH, Dv = k.shape[1], v.shape[-1]
    G = H // KVH
    # [B, T, KVH, G, Dk] -> [B, KVH, T * G, Dk]: a KV head's queries become one row block.
    qr = q.reshape(B, T, KVH, G, Dk).transpose(0, 2, 1, 3, 4).reshape(B, KVH, T * G, Dk)
    o = _flash(qr, k, v, start, tree, scale, G=G, latent=False, dv=Dv, cfg=cfg, interpret=interpret)
    o = o.reshape(B, KVH, T, G, Dv).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Dv)
    return o.astype(q.dtype)


def latent_tree_attention(
    q, kv, start, tree, scale: float, v_dim: int, *, interpret: bool | None = None, **cfg
):
    """MLA absorbed tree attention. q [B, T, H, C + R]; kv [B, 1, S, C + R], whose first
    v_dim = C columns are the values; start [B]; tree [B, T, T]. Returns [B, T, H, C]."""
    B, T, H, Dk = q.shape
    qr = q.reshape(B, 1, T * H, Dk)  # KVH = 1: rows t * H + h, no transpose needed
    o = _flash(qr, kv, None, start, tree, scale, G=H, latent=True, dv=v_dim, cfg=cfg,
               interpret=interpret)  # fmt: skip
    return o.reshape(B, T, H, v_dim).astype(q.dtype)


__all__ = [
    "PackedPaths",
    "latent_tree_attention",
    "packed_paths",
    "packed_source",
    "packed_view",
    "supported",
    "tree_attention",
]
