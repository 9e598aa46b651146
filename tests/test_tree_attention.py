"""Pallas tree-attention kernels (interpret mode on CPU) against the XLA reference.

The same pallas_call runs on the H200 (bench/tree_attention.py checks it there too). Shapes
are small so the file runs in well under a minute on two cores; lengths are chosen off the
block sizes, start is ragged across the batch, trees are random and prefix-closed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdj.models.layers import causal_tree, reference_attention
from kdj.pallas import tree_attention as ta
from kdj.pallas.tree_attention import supported

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _interpreted(fn, n_static):
    """Kernel entry point in interpret mode, jitted: one compile instead of an eager
    interpretation (twice as fast on CPU); the trailing float/config arguments are static."""

    def call(*args, **cfg):
        f = functools.partial(fn, interpret=True, **cfg)
        static = tuple(range(len(args) - n_static, len(args)))
        return jax.jit(f, static_argnums=static)(*args)

    return call


tree_attention = _interpreted(ta.tree_attention, 1)  # (q, k, v, start, tree, scale)
latent_tree_attention = _interpreted(ta.latent_tree_attention, 2)  # (..., scale, v_dim)


def random_trees(rng, B, T):
    """[B, T, T] ancestors-and-self masks of random trees with parent < child."""
    out = np.zeros((B, T, T), bool)
    for b in range(B):
        out[b, 0, 0] = True
        for i in range(1, T):
            out[b, i] = out[b, int(rng.integers(0, i))]
            out[b, i, i] = True
    return jnp.asarray(out)


def inputs(seed, B, T, H, KVH, dk, dv, dtype, extra=37):
    """Random q/k/v, ragged start (each row's T new slots fit in S; S off the block sizes)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, extra + 1, size=B).astype(np.int32)
    start[0] = extra  # one row with the longest prefix, one likely short
    S = extra + T + 3
    n = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    q, k, v = n(B, T, H, dk), n(B, KVH, S, dk), n(B, KVH, S, dv)  # caches [B, KVH, S, D]
    return rng, q, k, v, jnp.asarray(start)


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, r, atol=TOL[dtype], rtol=TOL[dtype])


# T = 1 (decode), 5, 17 (DFlash block), 64, 257 (DDTree budget 256): none a block multiple
# except 64, which lands on a block edge.
GQA_CASES = [
    (1, jnp.float32, {}),
    (5, jnp.bfloat16, {"block_k": 16, "num_splits": 3}),
    (17, jnp.float32, {"block_k": 16, "block_q": 32}),
    (64, jnp.bfloat16, {"block_k": 32}),
    (257, jnp.float32, {"block_k": 64, "block_q": 64}),
]


@pytest.mark.parametrize("T,dtype,cfg", GQA_CASES)
def test_gqa_random_tree(T, dtype, cfg):
    B, H, KVH, hd = (2, 8, 2, 64) if T > 64 else (3, 8, 2, 64)
    rng, q, k, v, start = inputs(T, B, T, H, KVH, hd, hd, dtype)
    tree = random_trees(rng, B, T)
    out = tree_attention(q, k, v, start, tree, hd**-0.5, **cfg)
    check(out, reference_attention(q, k, v, start, tree, hd**-0.5), dtype)


def test_gqa_causal_long_prefix(dtype=jnp.float32):
    """Causal prefill-like chain over a prefix of several blocks split across programs."""
    B, T, H, KVH, hd = 2, 9, 4, 1, 32
    _, q, k, v, start = inputs(7, B, T, H, KVH, hd, 16, dtype, extra=201)
    tree = causal_tree(B, T)
    out = tree_attention(q, k, v, start, tree, 0.3, block_k=16, num_splits=4)
    check(out, reference_attention(q, k, v, start, tree, 0.3), dtype)


@pytest.mark.parametrize(
    "T,dtype,cfg",
    [(1, jnp.float32, {}), (5, jnp.bfloat16, {"block_k": 16}), (17, jnp.float32, {"block_k": 32})],
)
def test_mla_random_tree(T, dtype, cfg):
    """Absorbed MLA: 80-wide heads (64 + 16, loaded as two pieces), values = first 64."""
    B, H, C, R = 3, 4, 64, 16
    rng, q, kv, _, start = inputs(100 + T, B, T, H, 1, C + R, 1, dtype)
    tree = random_trees(rng, B, T)
    out = latent_tree_attention(q, kv, start, tree, 0.1, C, **cfg)
    check(out, reference_attention(q, kv, kv[..., :C], start, tree, 0.1), dtype)


def test_slot_splits():
    """Plain decode spreads a row's slots over programs of one K block each (its only
    parallelism at batch 1 over one KV head); a tree keeps splits of 8 blocks: the policy's
    rule, which the kernel takes as given."""
    from kdj.kernels import DEFAULT
    from kdj.pallas.tree_attention import slot_splits

    def splits(B, KVH, nq, S, T, bk=64, policy=DEFAULT):
        return slot_splits(B, KVH, nq, S, bk, programs=policy.attention_programs,
                           min_blocks=policy.min_split_blocks(T))  # fmt: skip

    assert splits(B=1, KVH=1, nq=1, S=640, T=1) == 10  # Moonlight, 512 context
    assert splits(B=1, KVH=1, nq=1, S=640, T=17) == 1
    assert splits(B=1, KVH=1, nq=2, S=32768, T=1) == 132  # ~264 programs in all
    assert splits(B=1, KVH=8, nq=1, S=32768, T=17) == 33
    assert splits(B=4, KVH=1, nq=1, S=32, T=1) == 1  # less than one block
    eight = DEFAULT.replace(decode_split_blocks=8)  # a policy with 8-block decode splits
    assert splits(B=1, KVH=1, nq=1, S=640, T=1, policy=eight) == 1


def test_the_model_passes_its_policy_to_the_kernel(monkeypatch):
    """layers.attend / attend_latent hand the policy's split rule to the kernel, which then
    computes the reference's numbers (interpreted here); the reference policy keeps XLA."""
    from kdj.kernels import KernelPolicy
    from kdj.models.layers import attend, attend_latent

    seen, real = [], ta.slot_splits
    monkeypatch.setattr(ta, "slot_splits", lambda *a, **k: seen.append(k) or real(*a, **k))
    gpu = KernelPolicy.default("gpu").replace(attention_programs=99, split_blocks=3)
    B, T, H, KVH, hd = 2, 5, 4, 2, 32
    rng, q, k, v, start = inputs(21, B, T, H, KVH, hd, hd, jnp.float32)
    tree = random_trees(rng, B, T)
    want = reference_attention(q, k, v, start, tree, 0.2)
    check(attend(q, k, v, start, tree, 0.2, KernelPolicy()), want, jnp.float32)
    assert not seen  # the reference policy: XLA
    check(attend(q, k, v, start, tree, 0.2, gpu), want, jnp.float32)
    assert seen == [{"programs": 99, "min_blocks": 3}]
    _, q, kv, _, start = inputs(22, B, 1, H, 1, 80, 1, jnp.float32)  # MLA decode, C = 64
    tree = causal_tree(B, 1)
    got = attend_latent(q, kv, start, tree, 0.1, 64, gpu)
    check(got, reference_attention(q, kv, kv[..., :64], start, tree, 0.1), jnp.float32)
    assert seen[1:] == [{"programs": 99, "min_blocks": 1}]


def test_mask_error_is_caught():
    """Dropping one visible tree edge changes the answer by far more than the tolerance, so
    a kernel that misread the tree would fail the comparisons above."""
    B, T, H, KVH, hd = 2, 17, 8, 2, 64
    rng, q, k, v, start = inputs(3, B, T, H, KVH, hd, hd, jnp.float32)
    tree = np.array(random_trees(rng, B, T))
    out = tree_attention(q, k, v, start, jnp.asarray(tree), 0.125, block_k=16)
    tree[1, T - 1, 0] = False  # node T-1 no longer sees the root
    wrong = reference_attention(q, k, v, start, jnp.asarray(tree), 0.125)
    with pytest.raises(AssertionError):
        check(out, wrong, jnp.float32)


def test_fully_masked_row_is_finite():
    """A query that sees nothing (start 0, empty tree row) gives no NaN; other rows are exact."""
    B, T, H, KVH, hd = 1, 5, 4, 2, 32
    _, q, k, v, _ = inputs(5, B, T, H, KVH, hd, hd, jnp.float32)
    start = jnp.zeros((B,), jnp.int32)
    tree = np.array(causal_tree(B, T))
    tree[0, 2, :] = False
    out = np.asarray(tree_attention(q, k, v, start, jnp.asarray(tree), 0.2))
    ref = np.asarray(reference_attention(q, k, v, start, jnp.asarray(tree), 0.2))
    assert np.isfinite(out).all()
    keep = np.arange(T) != 2
    np.testing.assert_allclose(out[:, keep], ref[:, keep], atol=1e-5, rtol=1e-5)


def test_supported_shapes():
    assert supported((1, 17, 32, 128), (1, 8, 99, 128), 128, latent=False)
    assert supported((1, 17, 128, 576), (1, 1, 99, 576), 512, latent=True)
    assert not supported((1, 17, 12, 20), (1, 4, 99, 20), 20, latent=False)  # 20 = 16 + 4
    assert not supported((1, 17, 12, 64), (1, 5, 99, 64), 64, latent=False)  # H % KVH
    assert not supported((1, 17, 16, 96), (1, 1, 99, 96), 48, latent=True)  # V not 1st piece


def test_tree_cut_at_the_cache_end():
    """Near the cache end verify_inputs drops the nodes whose slots fall past the last one
    (S < start + T). The kernel must not read past slot S - 1: on the H200 that memory held
    NaNs that leaked into p @ V (DDTree budget 256 at batch 1 accepted nothing). This fails
    in interpret mode too when the kernel's last block runs past S."""
    B, T, H, KVH, hd = 2, 40, 4, 2, 32
    rng, q, k, v, _ = inputs(11, B, T, H, KVH, hd, hd, jnp.float32, extra=50)
    S = k.shape[2] - T + 25  # the cache ends 25 slots into the tree
    k, v = k[:, :, :S], v[:, :, :S]
    start = jnp.asarray([50, 40], jnp.int32)
    valid = np.arange(T)[None, :] < (S - np.asarray(start))[:, None]  # slots start + i < S
    tree = np.array(random_trees(rng, B, T)) & valid[:, :, None] & valid[:, None, :]
    tree[:, np.arange(T), np.arange(T)] |= ~valid  # a dropped node sees itself only...
    tree = jnp.asarray(tree)
    out = np.asarray(tree_attention(q, k, v, start, tree, 0.2, block_k=16))
    ref = np.asarray(reference_attention(q, k, v, start, tree, 0.2))
    keep = jnp.asarray(valid)  # ...and its output is never used: compare the kept nodes
    assert np.isfinite(out[keep]).all()
    np.testing.assert_allclose(out[keep], ref[keep], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- deterministic layout
def random_parents(rng, B, T):
    """[B, T] parents of random trees (node 0 the root, parent < child) and their [B, T, T]
    ancestors-and-self masks."""
    parent = np.full((B, T), -1)
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        mask[b, 0, 0] = True
        for i in range(1, T):
            parent[b, i] = rng.integers(0, i)
            mask[b, i] = mask[b, parent[b, i]]
            mask[b, i, i] = True
    return parent, jnp.asarray(mask)


def path_of(parent, i):
    """Node i's path from the root, root first, by walking its parents."""
    path = [i]
    while parent[path[-1]] >= 0:
        path.append(int(parent[path[-1]]))
    return path[::-1]


def decoded_cache(x, b, start, path, fill):
    """Row b of cache x [B, KVH, S, D] as a plain decode of `path` holds it: the committed
    slots < start, then the path's nodes (written at start + tree index) at start + 0, 1, ..;
    `fill` past them (slots a decode has not written)."""
    x = np.asarray(x[b])
    out = np.full_like(x, fill)
    out[:, :start] = x[:, :start]
    out[:, start : start + len(path)] = x[:, start + np.asarray(path)]
    return out


def test_packed_layout_is_each_nodes_decode_cache():
    """Deterministic mode's key layout: each node's committed slots as they are, then its
    packed new slots, equal the cache a plain decode of the node's path holds (exactly)."""
    B, T, KVH, D = 3, 23, 2, 8
    rng = np.random.default_rng(4)
    parent, mask = random_parents(rng, B, T)
    start = np.asarray([5, 0, 13], np.int32)
    k = jnp.asarray(rng.standard_normal((B, KVH, 13 + T + 2, D)), jnp.float32)
    paths = ta.packed_paths(mask)
    view, seen = (np.asarray(x) for x in ta.packed_view(k, jnp.asarray(start), paths))
    for b in range(B):
        for t in range(T):
            path = path_of(parent[b], t)
            assert int(paths.count[b, t]) == len(path)
            n = start[b] + len(path)
            assert seen[b, t, :n].all() and not seen[b, t, n:].any()
            want = decoded_cache(k, b, start[b], path, np.nan)[:, :n]
            np.testing.assert_array_equal(view[b, :, t, :n], want)
    assert (np.asarray(ta.packed_paths(causal_tree(2, 6)).index) == np.tril(np.arange(6))).all()


DETERMINISTIC = dict(fixed_split=2, block_q=64, block_k=16)


def node_by_node(call, q, caches, start, parent, fill=1e4):
    """call(q, caches, start, tree) as T = 1 decodes, one per node of every row, each over the
    cache a plain decode of the node's path holds (as one batch of B x T decodes; the slots
    past the path hold `fill`, which must not be read). Returns [B, T, H, Dv]."""
    B, T = q.shape[:2]
    paths = [(b, path_of(parent[b], t)) for b in range(B) for t in range(T)]
    cs = [jnp.stack([decoded_cache(c, b, start[b], p, fill) for b, p in paths]) for c in caches]
    at = jnp.asarray([start[b] + len(p) - 1 for b, p in paths], jnp.int32)
    out = call(q.reshape(B * T, 1, *q.shape[2:]), *cs, at, jnp.ones((B * T, 1, 1), bool))
    return out.reshape(B, T, *out.shape[2:])


@pytest.mark.parametrize(
    "dtype,H,KVH,cfg",
    [(jnp.bfloat16, 8, 2, DETERMINISTIC),  # G = 4: one 16-row tile per node
     (jnp.float32, 64, 2, dict(DETERMINISTIC, block_q=16)),  # G = 32: two tiles per node
     (jnp.bfloat16, 8, 2, dict(DETERMINISTIC, nodes_per_tile=3)),  # 3 nodes a tile, shared
     (jnp.float32, 64, 2, dict(DETERMINISTIC, block_q=16, nodes_per_tile=3))],  # 1, shared
)  # fmt: skip
def test_deterministic_gqa_node_equals_its_decode(dtype, H, KVH, cfg):
    """fixed_split: every node of a random tree computes, bitwise, what the same kernel
    computes for a T = 1 decode of the node's path (slots past it filled with junk it must
    not read), and the reference's numbers; with nodes_per_tile, nodes sharing a query tile
    and the blocks below start read once for them all (19 nodes: the last tile part empty)."""
    B, T, hd = 2, 19, 32
    rng, q, k, v, start = inputs(8, B, T, H, KVH, hd, hd, dtype)
    parent, tree = random_parents(rng, B, T)
    out = tree_attention(q, k, v, start, tree, 0.2, **cfg)
    check(out, reference_attention(q, k, v, start, tree, 0.2), dtype)
    one = node_by_node(lambda *a: tree_attention(*a, 0.2, **cfg), q, (k, v), start, parent)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(one, np.float32))


@pytest.mark.parametrize("cfg", [DETERMINISTIC, dict(DETERMINISTIC, nodes_per_tile=4)])
def test_deterministic_mla_node_equals_its_decode(cfg):
    B, T, H, C, R = 2, 11, 4, 64, 16
    rng, q, kv, _, start = inputs(9, B, T, H, 1, C + R, 1, jnp.bfloat16)
    parent, tree = random_parents(rng, B, T)
    out = latent_tree_attention(q, kv, start, tree, 0.1, C, **cfg)
    check(out, reference_attention(q, kv, kv[..., :C], start, tree, 0.1), jnp.bfloat16)
    one = node_by_node(lambda q, kv, s, t: latent_tree_attention(q, kv, s, t, 0.1, C, **cfg),
                       q, (kv,), start, parent)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(one, np.float32))


def test_packed_reference_node_equals_its_decode():
    """Deterministic mode's XLA path (the CPU's) takes the kernel's layout: the reference's
    numbers, and each node bitwise its decode's."""
    from kdj.models.layers import packed_reference_attention

    B, T, H, KVH, hd = 2, 13, 8, 2, 32
    rng, q, k, v, start = inputs(10, B, T, H, KVH, hd, hd, jnp.bfloat16)
    parent, tree = random_parents(rng, B, T)
    run = jax.jit(packed_reference_attention, static_argnums=5)
    out = run(q, k, v, start, tree, 0.2)
    check(out, reference_attention(q, k, v, start, tree, 0.2), jnp.bfloat16)
    one = node_by_node(lambda *a: run(*a, 0.2), q, (k, v), start, parent, fill=0.0)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(one, np.float32))
