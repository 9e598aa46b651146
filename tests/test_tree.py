"""DDTree's on-device tree build against brute-force enumeration of all prefixes."""

from __future__ import annotations

import itertools

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

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
