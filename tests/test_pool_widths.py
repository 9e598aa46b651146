"""The slot pool at several compiled widths (kdj/decode/widths.py): the ladder, the resize
program moving every per-slot array with its slot, and an engine whose load rises and falls
(it grows and shrinks several times) giving each request what it gets alone. The tiny pair
of tests/conftest.py (vocab12_pair: drafts are accepted often)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.cost import StepCost
from kdj.decode import auto, widths
from kdj.decode.engine import Engine
from kdj.decode.requests import Request
from kdj.decode.tree import DraftShape
from tests.test_adaptive import switching  # noqa: F401 (a fixture)

LADDER = (1, 2, 4, 8)


def test_the_ladder():
    assert widths.ladder(1) == (1,)
    assert widths.ladder(8) == (1, 4, 8)
    assert widths.ladder(256) == (1, 4, 16, 64, 256)
    assert widths.ladder(8, [4, 1, 8, 2]) == LADDER
    assert [widths.fitting(LADDER, n) for n in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
    for bad in ([1, 4], [0, 8], []):
        with pytest.raises(ValueError, match="widths"):
            widths.ladder(8, bad)


# ------------------------------------------------------------------ the resize itself
def per_slot_fields(p):
    """Every per-slot array of a drafting auto pool, named, with its slot axis: the list a
    resize must move (written out here, not found as widths.batch_axes finds it)."""
    s, c = p.state, p.state.auto
    fields = {"steps": (p.steps, 0), "last": (s.last, 0), "pending": (s.pending, 0),
              "n_pend": (s.n_pend, 0), "out": (s.out, 0), "n": (s.n, 0), "done": (s.done, 0),
              "max_new": (s.max_new, 0), "stop_ids": (s.stop_ids, 0),
              "key": (jax.random.key_data(s.key), 0), "temperature": (s.temperature, 0),
              "taus": (s.stats.taus, 0), "sizes": (s.stats.sizes, 0),
              "expected": (s.stats.expected, 0), "trend": (c.trend, 1), "drafts": (c.drafts, 0),
              "hits": (c.hits, 1)}  # fmt: skip
    for name, cache in (("tcache", s.tcache), ("dcache", s.dcache)):
        fields[f"{name}.lengths"] = (cache.lengths, 0)
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            fields[f"{name}.k{i}"], fields[f"{name}.v{i}"] = (k, 0), (v, 0)
    return fields


def stamp(x, axis):
    """x with its rows made distinct along its slot axis: row b holds 10 (b + 1) plus the
    element's index mod 7 (alternating for bools), so a row left behind or taken from
    another slot shows."""
    if axis is None:
        return x
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    rows = jnp.arange(1, x.shape[axis] + 1).reshape(shape)
    if x.dtype == bool:
        return jnp.broadcast_to(rows % 2 == 0, x.shape)
    return (rows * 10 + jnp.arange(x.size).reshape(x.shape) % 7).astype(x.dtype)


def test_resize_moves_every_per_slot_field_with_its_slot(vocab12_pair):
    """Pack the live rows of a width-4 auto pool into width 2, then spread them into width
    4 again: every per-slot field (caches, lengths, tokens, budgets, stops, keys,
    temperatures, feature queue, stats, auto's forecasts, steps) follows its slot; fresh
    rows are free slots; what is the batch's carries over. Fails if one field stays put."""
    target, drafter = vocab12_pair
    menu = auto.parse_menu("auto", ["none", "chain", "tree3"], 6, None)
    engine = Engine(target, 4, 32, 8, drafter=drafter, menu=menu, widths=(2, 4))
    make, src_plan = engine._empty, engine.plans[4]
    axes = {w: engine._slot_axes(w) for w in (2, 4)}
    leaves, tree = jax.tree.flatten(make(4))
    keyed = [x if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else stamp(x, a)
             for x, a in zip(leaves, axes[4])]  # fmt: skip
    keys = jax.vmap(jax.random.key)(jnp.arange(4, dtype=jnp.uint32) + 100)
    pool4 = jax.tree.unflatten(tree, keyed)
    pool4 = pool4._replace(state=dataclasses.replace(pool4.state, key=keys, step=jnp.int32(5)))
    before = {k: np.asarray(v) for k, (v, _) in per_slot_fields(pool4).items()}
    packed = widths.resize(pool4, make(2), jnp.asarray([3, 1], jnp.int32), engine.priors[2],
                           axes=axes[2], src=src_plan, dst=engine.plans[2])  # fmt: skip
    back = widths.resize(packed, make(4), jnp.asarray([0, 1, -1, -1], jnp.int32),
                         engine.priors[4], axes=axes[4], src=engine.plans[2],
                         dst=src_plan)  # fmt: skip
    empty = {k: np.asarray(v) for k, (v, _) in per_slot_fields(make(4)).items()}
    mid = {k: np.asarray(v) for k, (v, _) in per_slot_fields(packed).items()}
    after = {k: np.asarray(v) for k, (v, _) in per_slot_fields(back).items()}
    for name, (_, axis) in per_slot_fields(pool4).items():
        moved = np.take(before[name], [3, 1], axis=axis)
        np.testing.assert_array_equal(np.take(mid[name], [0, 1], axis=axis), moved, name)
        np.testing.assert_array_equal(np.take(after[name], [0, 1], axis=axis), moved, name)
        fresh = np.take(empty[name], [2, 3], axis=axis)
        np.testing.assert_array_equal(np.take(after[name], [2, 3], axis=axis), fresh, name)
    assert int(back.state.step) == 5  # the batch's step counter carries over
    # every leaf that depends on the width was found: the rest are the batch's scalars and
    # the step-indexed choices [N] and the tally of choices
    state = make(4).state
    batch = [state.top_p, state.calibration, state.step, state.stats.choices, state.stats.tally,
             state.auto.wait, state.auto.since, state.auto.left, state.auto.drafting]  # fmt: skip
    assert sum(a is None for a in axes[4]) == len(batch)
    assert sum(a is not None for a in axes[4]) == len(per_slot_fields(pool4))


def test_a_forecast_follows_its_entry_across_menus(vocab12_pair):
    """A width with another priced menu: each slot's forecast of an entry on both menus
    moves with it; an entry new to the slots starts from its prior."""
    target, drafter = vocab12_pair
    chain, tree3, tree12 = (DraftShape("chain", 5), DraftShape("tree", 3),
                            DraftShape("tree", 12))  # fmt: skip
    none = DraftShape("none")
    menus = {2: (none, chain, tree3), 4: (none, tree3, tree12)}
    engine = Engine(target, 4, 32, 8, drafter=drafter, menu=menus, widths=(2, 4))
    p = engine._empty(4)
    trend = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + 2
    p = p._replace(state=dataclasses.replace(
        p.state, auto=dataclasses.replace(p.state.auto, trend=trend)))  # fmt: skip
    out = widths.resize(p, engine._empty(2), jnp.asarray([2, 0], jnp.int32), engine.priors[2],
                        axes=engine._slot_axes(2), src=engine.plans[4],
                        dst=engine.plans[2])  # fmt: skip
    got = np.asarray(out.state.auto.trend)
    np.testing.assert_array_equal(got[0], np.asarray(trend)[0, [2, 0]])  # none
    np.testing.assert_array_equal(got[2], np.asarray(trend)[1, [2, 0]])  # tree3
    fresh, _, _ = auto.fresh_rows(engine.plans[2], engine.priors[2], 2)
    np.testing.assert_array_equal(got[1], np.asarray(fresh)[1])  # chain: new to the slots


# ------------------------------------------------------------------ rising and falling load
def waves(n=14, seed=3):
    """Ragged prompts (2..15 tokens) with budgets 3..23, in waves of 1, 7, 1, 3, 2 requests
    with a few chunks between: the pool of 8 grows and shrinks several times."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 12, int(k)).tolist() for k in rng.integers(2, 16, n)]
    budgets = [int(m) for m in rng.choice([3, 9, 23], n)]
    sizes, gaps = [1, 7, 1, 3, 2], [2, 3, 6, 2, 0]
    return prompts, budgets, sizes, gaps


def drive(engine, prompts, budgets, sizes, gaps, seeds=None, **req):
    """Submit the waves, stepping `gaps` chunks after each, then drain: tokens per prompt."""
    seeds = seeds or [None] * len(prompts)
    got, ids, at = {}, [], 0
    for size, gap in zip(sizes, gaps):
        for p, m, s in zip(prompts[at : at + size], budgets[at : at + size], seeds[at:]):
            ids.append(engine.submit(Request(p, m, [], seed=s, **req)))
            got[ids[-1]] = []
        at += size
        for _ in range(gap):
            for u in engine.step():
                got[u.id] += u.tokens
    while engine.busy:
        for u in engine.step():
            got[u.id] += u.tokens
    return [got[i] for i in ids]


def moves(chunk_widths):
    """(grows, shrinks) between consecutive chunks."""
    w = list(chunk_widths)
    return sum(b > a for a, b in zip(w, w[1:])), sum(b < a for a, b in zip(w, w[1:]))


@pytest.fixture(scope="module")
def greedy_alone(vocab12_pair):
    target, _ = vocab12_pair
    prompts, budgets, *_ = waves()
    return kdj.generate(target, prompts, method="ar", max_new_tokens=budgets,
                        stop_tokens=[]).tokens  # fmt: skip


@pytest.mark.parametrize("method", ["ar", "auto"])  # auto drafts and skips: both paths
def test_rising_and_falling_load_token_identical(vocab12_pair, greedy_alone, method, request):
    """Greedy AR, DFlash, DDTree and auto through a pool of 8 at widths 1/2/4/8 whose load
    rises and falls: every prompt's tokens are what it gets alone, the pool grew and shrank
    several times, and ran at every width. auto has a menu of its own at each width (8: none
    but "none") and its choices scrambled (every entry, and runs that skip the drafter), so
    resizes move forecasts between menus mid-run."""
    target, drafter = vocab12_pair
    prompts, budgets, sizes, gaps = waves()
    kw = {}
    if method != "ar":
        kw = dict(drafter=drafter, menu=auto.parse_menu(method, None, 6, 6))
    if method == "auto":
        kw["menu"] = {1: auto.parse_menu("auto", ["none", "chain", "tree12"], 6, None),
                      2: auto.parse_menu("auto", ["none", "chain2", "tree3"], 6, None),
                      4: auto.parse_menu("auto", ["none", "chain"], 6, None),
                      8: (DraftShape("none"),)}  # fmt: skip
        request.getfixturevalue("switching")
    engine = Engine(target, 8, 64, 23, chunk_steps=3, widths=LADDER, **kw)
    assert drive(engine, prompts, budgets, sizes, gaps) == greedy_alone
    grows, shrinks = moves(engine.chunk_widths)
    assert grows >= 2 and shrinks >= 2 and engine.resizes >= grows + shrinks
    assert set(engine.chunk_widths) == set(LADDER)
    assert engine.method == method
    # what the pool chose, per width: its menu's entries ("plain": skipped the drafter), and
    # every token after each request's first (prefill's) committed by one of them
    chosen = engine.stats.choices
    assert (chosen == {}) == (method == "ar")
    for w, by_name in chosen.items():
        assert set(by_name) <= {*map(str, engine.plans[w].menu), "plain"}
    committed = sum(t for by_name in chosen.values() for _, t in by_name.values())
    assert method == "ar" or committed == sum(map(len, greedy_alone)) - len(prompts)
    names = {n for by_name in chosen.values() for n in by_name}
    assert method != "auto" or ("plain" in names and len(names) > 1)


def test_rising_and_falling_load_sampled_dflash_as_alone(vocab12_pair):
    """Sampled DFlash (temperature 1, a seed per prompt) through the rising and falling
    pool: each prompt's samples are what it draws in one static batch with the same seeds
    (which equals drawing alone: test_serve's test_pool_drafts_sampled_as_alone)."""
    target, drafter = vocab12_pair
    prompts, budgets, sizes, gaps = waves(10, seed=4)
    sizes, gaps = [1, 5, 1, 3], [2, 3, 5, 0]
    seeds = [100 + i for i in range(len(prompts))]
    engine = Engine(target, 8, 64, 23, chunk_steps=3, widths=LADDER, drafter=drafter,
                    menu=auto.parse_menu("dflash", None, 6, None))  # fmt: skip
    got = drive(engine, prompts, budgets, sizes, gaps, seeds, temperature=1.0)
    run = dict(drafter=drafter, method="dflash", stop_tokens=[], temperature=1.0)
    assert got == kdj.generate(target, prompts, max_new_tokens=budgets, seed=seeds, **run).tokens
    assert min(moves(engine.chunk_widths)) >= 1


def test_a_full_pool_never_resizes(vocab12_pair):
    """A pool kept full by its queue runs every chunk at its full width."""
    target, _ = vocab12_pair
    prompts, budgets, *_ = waves()
    engine = Engine(target, 4, 64, 23, chunk_steps=3, widths=(1, 2, 4))
    for p, m in zip(prompts, budgets):
        engine.submit(Request(p, m, []))
    while len(engine.waiting) > 0:
        engine.step()
    assert set(engine.chunk_widths) == {4} and engine.resizes == 0


def test_auto_compiles_at_each_width_what_may_pay(vocab12_pair):
    """Steps whose cost grows with their rows (each verified token-row 0.3 of a plain
    step's fixed cost): each width compiles plain steps and the entries the model prices at
    half the best or more there (the pool measures the rest of the way); a width left with
    plain steps alone keeps the cheapest draft shape, so its slots keep the drafter's
    context."""
    target, drafter = vocab12_pair
    drafter = dataclasses.replace(drafter, prior_acceptance=2.0)
    base = StepCost.for_config(target.cfg)
    row = base.flops_per_token + 16 * base.attn_flops_per_context  # a token-row's flops
    cost = dataclasses.replace(base, fixed_s=1.0, per_byte_s=0.0, per_flop_s=0.3 / row,
                               draft_bytes=1.0, draft_fixed_frac=0.0, draft_flops_per_seq=0.0,
                               draft_fixed_s=0.05)  # fmt: skip
    menu = ["none", "chain", "tree12"]
    opts = kdj.api.check_options(target, drafter, "auto", None, None, menu, None, 0.0, 1.0, None)
    drafting = kdj.api.pool_drafting(opts, target, drafter, 8, 64, 10.0, cost, widths=LADDER)
    menus = drafting["menu"]
    assert list(menus) == list(LADDER)
    step = auto.step_cost(cost, target, drafter)
    for w in LADDER:  # each entry priced alone, as a pinned chunk runs it
        rates = {str(s): auto.entry_rate(s, step, w, 10.0, auto.largest_tree((s,)), 2.0)
                 for s in opts.shapes}  # fmt: skip
        top = max(rates.values())
        assert [str(s) for s in menus[w]] == [n for n, r in rates.items()
                                              if n == "none" or r >= top / 2]  # fmt: skip
    assert menus[1] == opts.shapes and menus[8] == (DraftShape("none"),)
    engine = Engine(target, 8, 64, 23, widths=LADDER, **drafting)
    assert engine.plans[8].menu == (DraftShape("none"), DraftShape("chain", 5))
    assert engine.plans[1].menu == menus[1] and engine.method == "auto"
    # a menu without plain steps is compiled whole at every width: its widths' pools keep
    # one layout (a one-entry width would carry no controller, and no resize could move it)
    bare = kdj.api.check_options(target, drafter, "auto", None, None, menu[1:], None, 0.0,
                                 1.0, None)  # fmt: skip
    kept = kdj.api.pool_drafting(bare, target, drafter, 8, 64, 10.0, cost, widths=LADDER)
    assert all(m == bare.shapes for m in kept["menu"].values())


# ------------------------------------------------------------------ waking late
@pytest.mark.parametrize("method", ["ar", "dflash", "auto"])
def test_a_pool_that_wakes_late_gives_the_same_tokens_and_steps(vocab12_pair, greedy_alone, method,
                                                                 request):  # fmt: skip
    """wake=3 (bulk generation): the device runs on past finished slots until three have
    finished, so the host turns are fewer, and newcomers are prefilled three rows at a time
    (admit_rows: several prefill calls per admission); every request still gets its tokens
    alone, and its steps are the steps it ran (those of the pool that wakes at every finish:
    a finished slot riding along is not counted). Serving's wake_share (a share of the live
    slots, here half) thins the host turns the same way and changes no token."""
    target, drafter = vocab12_pair
    prompts, budgets, *_ = waves()
    kw = {}
    if method != "ar":
        kw = dict(drafter=drafter, menu=auto.parse_menu(method, None, 6, 6))
    if method == "auto":
        request.getfixturevalue("switching")  # auto's inner runs cut short by a finish

    def run(wake, share=0.0):
        engine = Engine(target, 4, 64, 23, chunk_steps=64, widths=(2, 4), wake=wake,
                        wake_share=share, admit_rows=wake, **kw)  # fmt: skip
        ids = [engine.submit(Request(p, m, [])) for p, m in zip(prompts, budgets)]
        got, steps = {i: [] for i in ids}, {}
        while engine.busy:
            for u in engine.step():
                got[u.id] += u.tokens
                steps[u.id] = u.steps
        return [got[i] for i in ids], [steps[i] for i in ids], len(engine.chunk_widths)

    tokens1, steps1, chunks1 = run(1)
    tokens3, steps3, chunks3 = run(3)
    tokens_half, _, chunks_half = run(1, share=0.5)
    assert tokens1 == tokens3 == tokens_half == greedy_alone
    assert chunks3 < chunks1 and chunks_half < chunks1
    if method == "ar":
        assert steps3 == [len(t) - 1 for t in tokens3]
    if method == "dflash":  # greedy float32: a request's steps depend on it alone
        assert steps3 == steps1 and sum(steps3) < sum(len(t) - 1 for t in tokens3)


def test_bulk_admission_prefills_whole_groups(vocab12_pair):
    """wake >= admit_rows: while more requests wait than one group, newcomers are admitted
    in whole groups (one prefill shape); the queue's tail comes in as it is."""
    target, _ = vocab12_pair
    engine = Engine(target, 8, 64, 6, chunk_steps=64, widths=(8,), wake=3, admit_rows=3)
    rows = []
    prefill = engine._prefill
    engine._prefill = lambda take, free: (rows.append(len(take)), prefill(take, free))
    for i in range(11):
        engine.submit(Request([1 + i % 5, 2], 6, []))
    while engine.busy:
        engine.step()
    assert rows[:2] == [3, 3] and set(rows[:-1]) == {3} and sum(rows) == 11


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_warm_compiles_every_program_a_stream_meets(vocab12_pair, method):
    """After `warm`, a stream over prompts of 2..40 tokens (up to five prefill chunks of 8:
    a prompt's later chunks attend to what its earlier ones wrote) with ragged budgets,
    through a pool that grows and shrinks, compiles nothing more, and every prompt's greedy
    tokens are what it gets alone. Fails if a program's shape depends on a prompt's length."""
    target, drafter = vocab12_pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 12, int(k)).tolist() for k in rng.integers(2, 41, 24)]
    budgets = [int(m) for m in rng.integers(1, 20, 24)]
    kw = {} if method == "ar" else dict(drafter=drafter, menu=auto.parse_menu(method, None, 6, 6))
    engine = Engine(target, 8, 64, 20, widths=(2, 8), admit_rows=4, prefill_chunk=8, **kw)
    # a chunk per width, prefills of rows (2) at width 2 and (2, 4) at 8 (each with its
    # first tokens' read), two resizes, an empty pool per width
    assert engine.warm(modes=(True,)) == 2 + 3 + 2 + 2
    before = len(target.executables)
    ids = [engine.submit(Request(p, m, [])) for p, m in zip(prompts, budgets)]
    got = {i: [] for i in ids}
    while engine.busy:
        for u in engine.step():
            got[u.id] += u.tokens
    assert len(target.executables) == before
    alone = kdj.generate(target, prompts, method="ar", max_new_tokens=budgets,
                         stop_tokens=[]).tokens  # fmt: skip
    assert [got[i] for i in ids] == alone
    assert engine.resizes > 0
