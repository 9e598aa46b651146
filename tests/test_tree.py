"""DDTree's on-device tree build against brute-force enumeration of all prefixes; tree
verify + compaction against plain decoding of the accepted path; shrinking at the cache end."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdj.decode.sampling import request_keys
from kdj.decode.tree import build_tree, build_trees

jit_build = jax.jit(build_tree, static_argnames="budget")


def brute_force_scores(lp: np.ndarray, budget: int) -> list[float]:
    L, V = lp.shape
    scores = []
    for d in range(1, L + 1):
        for toks in itertools.product(range(V), repeat=d):
            scores.append(sum(lp[i, t] for i, t in enumerate(toks)))
    return sorted(scores, reverse=True)[:budget]


@st.composite
def cases(draw):
    L = draw(st.integers(1, 4))
    V = draw(st.integers(1, 4))
    budget = draw(st.sampled_from([1, 3, 8, 24]))  # few shapes: each one compiles once
    # small integers make ties common; a few distinct values keep it a real ranking
    raw = draw(st.lists(st.integers(-6, 0), min_size=L * V, max_size=L * V))
    return np.array(raw, np.float32).reshape(L, V) / 2, budget


@settings(max_examples=120, deadline=None)
@given(cases())
def test_tree_is_the_top_budget_prefix_closed_set(case):
    lp, budget = case
    tree = {k: np.asarray(v) for k, v in jit_build(lp, budget=budget).items()}
    valid = tree["valid"]
    want = brute_force_scores(lp, budget)
    assert valid.sum() == len(want)  # shrinks when fewer distinct prefixes exist
    np.testing.assert_allclose(sorted(tree["score"][valid], reverse=True), want, atol=1e-5)
    L = lp.shape[0]
    for i in np.flatnonzero(valid):
        p, d = tree["parent"][i], tree["depth"][i]
        assert 1 <= d <= L
        own = lp[d - 1, tree["tokens"][i]]
        if d == 1:
            assert p == -1
            np.testing.assert_allclose(tree["score"][i], own, atol=1e-5)
        else:
            assert 0 <= p < i and valid[p] and tree["depth"][p] == d - 1  # closed, parent first
            np.testing.assert_allclose(tree["score"][i], tree["score"][p] + own, atol=1e-5)
        # ancestors: exactly the chain up to the root
        chain, node = {i}, p
        while node >= 0:
            chain.add(node)
            node = tree["parent"][node]
        assert set(np.flatnonzero(tree["ancestors"][i])) == chain
    # distinct prefixes: no two valid nodes share (parent, token)
    pairs = {(tree["parent"][i], tree["tokens"][i]) for i in np.flatnonzero(valid)}
    assert len(pairs) == valid.sum()


def test_batched_build_matches_single():
    rng = np.random.default_rng(0)
    lp = np.log(rng.dirichlet(np.ones(7), size=(3, 5))).astype(np.float32)  # [B, L, V]
    batched = build_trees(lp, 16)
    for b in range(3):
        single = build_tree(lp[b], 16)
        for k in single:
            np.testing.assert_array_equal(np.asarray(batched[k][b]), np.asarray(single[k]))


# ---------------------------------------------- the pruned beam against all budget x K pairs
def all_pairs_beams(top_lp, top_tok, budget: int):
    """The beam build before pruning (top_k over all budget x K pairs each depth): the
    bench's A/B case, bench/profile_step.py, kept once."""
    from tests.test_bench import load_bench

    return load_bench("profile_step").all_pairs_beams(top_lp, top_tok, budget)


def all_pairs_build(top_lp, top_tok, budget: int):
    """build_tree_from_top before pruning (less ancestors): the all-pairs beams, then the
    global order by a full lexsort (score descending, shallower first, then beam index)."""
    scores, tokens, parents = all_pairs_beams(top_lp, top_tok, budget)
    L = scores.shape[0]
    depth = jnp.broadcast_to(jnp.arange(1, L + 1)[:, None], scores.shape).reshape(-1)
    order = jnp.lexsort((depth, -scores.reshape(-1)))[:budget]
    d_idx, b_idx = order // budget, order % budget
    where = jnp.full((L, budget), -1, jnp.int32).at[d_idx, b_idx].set(jnp.arange(budget))
    parent = jnp.where(d_idx > 0, where[jnp.maximum(d_idx - 1, 0), parents[d_idx, b_idx]], -1)
    return {"tokens": tokens[d_idx, b_idx], "depth": d_idx + 1, "parent": parent,
            "score": scores[d_idx, b_idx], "valid": jnp.isfinite(scores[d_idx, b_idx])}  # fmt: skip


def draft_tops(rng, L: int, V: int, budget: int, levels: int):
    """(top_lp [L, K] descending, top_tok [L, K]) as Draft.top gives them, K = min(budget,
    V): random log-probs (levels 0), or `levels` quantised values (ties everywhere; 1: every
    prefix of a depth ties) with some -inf."""
    if levels:
        lp = -rng.integers(0, levels, (L, V)).astype(np.float32) / 2
        lp[rng.random((L, V)) < 0.1] = -np.inf  # tokens the drafter rules out
    else:
        lp = np.log(rng.dirichlet(np.full(V, 0.3), size=L)).astype(np.float32)
    top_lp, top_tok = jax.lax.top_k(jnp.asarray(lp), min(budget, V))
    return top_lp, top_tok.astype(jnp.int32)


def test_beam_pairs_are_the_dominance_bound():
    from kdj.decode.tree import beam_pairs

    for budget, k in [(1, 1), (2, 2), (7, 3), (16, 16), (64, 64), (64, 5)]:
        flat = beam_pairs(budget, k)
        want = [i * k + j for i in range(budget) for j in range(k) if (i + 1) * (j + 1) <= budget]
        assert flat.tolist() == want  # increasing flat index: top_k breaks ties as before
    assert len(beam_pairs(64, 64)) == 280  # of 4,096


@pytest.mark.parametrize("budget", [1, 2, 7, 16, 64])
@pytest.mark.parametrize("vocab", ["small", "large"])  # small: K = V < budget (or V = 1)
def test_pruned_build_equals_all_pairs(budget, vocab):
    """Beam scores, tokens and parents, and the tree built from them, bit-identical to top_k
    over every pair and a full sort of every beam entry, ties included."""
    from kdj.decode.tree import _beams, build_tree_from_top

    V = max(1, budget // 3) if vocab == "small" else budget + 9
    beams = jax.jit(_beams, static_argnames="budget")
    build = jax.jit(build_tree_from_top, static_argnames="budget")
    ref_beams = jax.jit(all_pairs_beams, static_argnames="budget")
    ref_build = jax.jit(all_pairs_build, static_argnames="budget")
    rng = np.random.default_rng(budget)
    for levels in [0, 0, 0, 1, 2, 3, 3, 4, 4]:
        top_lp, top_tok = draft_tops(rng, 6, V, budget, levels)
        got, want = beams(top_lp, top_tok, budget=budget), ref_beams(top_lp, top_tok, budget=budget)
        for name, g, w in zip(("scores", "tokens", "parents"), got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
        tree, ref = build(top_lp, top_tok, budget=budget), ref_build(top_lp, top_tok, budget=budget)
        for name, w in ref.items():
            np.testing.assert_array_equal(np.asarray(tree[name]), np.asarray(w), err_msg=name)


# ------------------------------------------------------- verify and compaction on a target
@pytest.fixture(scope="module", params=["qwen3", "deepseek_v3"])
def target(request, tmp_path_factory):
    import kdj
    from tests.hf_models import build

    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path, vocab_size=12, num_hidden_layers=2)
    return kdj.load_target(path, dtype="float32")


def test_tree_verify_and_compaction_equal_plain_decoding_of_the_path(target):
    """Verify a DDTree over a prompt, take a path that leaves the chain order, compact: the
    cache rows of prompt + root + path, and the logits along the path, must equal those of
    plainly running those tokens causally."""
    from kdj.cache import init_cache
    from kdj.decode import tree as trees
    from kdj.decode.loop import prefill

    model, V, S = target.model, target.cfg.vocab_size, 32
    prompt = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    L = jnp.asarray([5], jnp.int32)
    last = jnp.asarray([9], jnp.int32)
    key, one = request_keys([0]), jnp.float32(1.0)  # a key per sequence
    cache = prefill(target.graphdef, target.state, None, None, prompt, L,
                    init_cache(target.cfg, 1, S, jnp.float32), None, key, one, one,
                    greedy=True).tcache  # fmt: skip
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (1, 3, V)) * 2, axis=-1)
    tree = trees.build_trees(lp, 10)
    tokens, positions, mask, valid = trees.verify_inputs(tree, last, L, S)
    logits, cache, _ = model(tokens, L, cache, positions=positions, tree=mask)
    # the deepest path that is not the chain 0, 1, 2, .. (so compaction must move rows)
    parent, depth = np.asarray(tree["parent"][0]), np.asarray(tree["depth"][0])

    def path_to(node):
        up = [node]
        while parent[up[-1]] >= 0:
            up.append(int(parent[up[-1]]))
        return [0] + [i + 1 for i in reversed(up)]  # verify indices, root first

    paths = [path_to(i) for i in np.argsort(-depth, kind="stable")]
    path = next(p for p in paths if p != list(range(len(p))))
    assert len(path) >= 3
    a = len(path) - 1
    cache = trees.compact(cache, jnp.asarray([path]), jnp.asarray([a]))

    seq = jnp.concatenate([prompt, tokens[:, jnp.asarray(path)]], axis=1)  # prompt, root, path
    n = seq.shape[1]
    empty = init_cache(target.cfg, 1, S, jnp.float32)
    plain_logits, plain, _ = model(seq, jnp.zeros((1,), jnp.int32), empty)
    for got, want in zip(cache.k + cache.v, plain.k + plain.v):
        np.testing.assert_allclose(got[:, :, :n], want[:, :, :n], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        logits[0, jnp.asarray(path)], plain_logits[0, 5:], atol=1e-4, rtol=1e-4
    )


def test_tree_shrinks_at_the_cache_end():
    """Nodes whose slot would fall outside the cache leave the tree, deepest-last first, and
    what remains is still prefix-closed."""
    from kdj.decode import tree as trees

    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (2, 4, 7)), axis=-1)
    tree = trees.build_trees(lp, 12)
    start = np.array([10, 3], np.int32)
    _, positions, mask, valid = trees.verify_inputs(tree, np.array([0, 0], np.int32), start, 16)
    valid = np.asarray(valid)
    assert valid[0].sum() == 16 - 10 - 1 and valid[1].all()
    parent = np.asarray(tree["parent"])
    for i in np.flatnonzero(valid[0]):
        assert parent[0, i] < 0 or valid[0, parent[0, i]]
    assert not np.asarray(mask)[0, 1:, 1:][~valid[0]].any()
