"""Speculation's own overhead: near the end of the budget or the cache a step keeps every node
it can still commit; the reduced draft / verify outputs equal the full ones they replace."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.decode import tree as trees
from kdj.decode.loop import prefill
from kdj.decode.sampling import request_keys
from kdj.decode.step import accept, propose, verify
from kdj.models.transformer import build_model, full_sequence

V = 12
# jitted, as a step runs them: dispatching their many small ops one by one takes far longer
build_trees = jax.jit(trees.build_trees, static_argnums=1)
draft_trees = jax.jit(trees.draft_trees, static_argnums=1)
draft_tree = jax.jit(trees.draft_tree, static_argnums=0)
expected_tokens = jax.jit(trees.expected_tokens, static_argnums=0)
committable = jax.jit(trees.committable)


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 256,
    })  # fmt: skip
    return kdj.Target.from_model(build_model(cfg, jnp.float32, seed=1))


def greedy_path(target, seq, n):
    """The target's greedy continuation of the token list seq, n tokens."""
    seq = list(seq)
    forward = jax.jit(full_sequence, static_argnums=0)  # one compile for the padded shape
    for _ in range(n):
        padded = jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32)
        logits = forward(target.graphdef, target.state, padded)[0][0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits)))
    return seq[-n:]


def prefixes(tree, b):
    """Each node's token prefix (a tuple), in node order."""
    parent, tokens = np.asarray(tree["parent"][b]), np.asarray(tree["tokens"][b])
    out = []
    for i in range(len(tokens)):
        out.append((out[parent[i]] if parent[i] >= 0 else ()) + (int(tokens[i]),))
    return out


def longest_match(nodes, greedy):
    """Drafts a greedy walk accepts when the tree holds exactly `nodes` (prefix tuples)."""
    a = 0
    while a < len(greedy) and tuple(greedy[: a + 1]) in nodes:
        a += 1
    return a


def test_a_step_near_the_end_keeps_every_node_it_can_still_commit(target):
    """Near max_new_tokens (limit) and the cache end (room), the tree must be the best `room`
    prefixes of depth <= limit (the tree a draft cut to `limit` depths builds), and the drafts
    accepted a brute-force longest greedy match among them. The draft puts a wrong token
    first at depth 1 and the target's own path under it: the unrestricted best 4 prefixes are
    all on the wrong branch (down to depth 4), so a tree cut by depth after the build keeps
    two useless nodes at limit 2, and one cut by node index none that can be committed."""
    prompt, root, S = [3, 1, 4, 1, 5], 9, 10
    g = greedy_path(target, prompt + [root], 5)
    wrong = (g[0] + 1) % V
    probs = np.full((5, V), 0.01)
    probs[0, wrong], probs[0, g[0]] = 0.6, 0.3
    for d in range(1, 5):
        probs[d, g[d]] = 0.9
    lp = jnp.log(jnp.asarray(probs / probs.sum(-1, keepdims=True), jnp.float32))[None]
    L = jnp.asarray([len(prompt)], jnp.int32)
    key, one = request_keys([0]), jnp.float32(1.0)  # a key per sequence
    cache = prefill(target.graphdef, target.state, None, None, jnp.asarray([prompt]), L,
                    init_cache(target.cfg, 1, S, jnp.float32), None, key, one, one,
                    greedy=True).tcache  # fmt: skip
    dist = trees.Draft.of(lp)
    room = S - 1 - len(prompt)  # 4 slots after the root
    last = jnp.asarray([root], jnp.int32)
    for budget in (4, 16):
        shape = trees.DraftShape("tree", budget)
        full = prefixes(build_trees(lp, budget), 0)
        step = jax.jit(lambda c, limit, shape=shape: run_step(target, shape, dist, c, last,
                                                              limit, room))  # fmt: skip
        for limit in (1, 2, 5):
            best = prefixes(build_trees(lp[:, :limit], budget), 0)[:room]  # the cut draft's
            want = longest_match(set(best), g)
            a, tree = step(cache, jnp.asarray([limit], jnp.int32))
            assert int(a[0]) == want, (budget, limit)
            assert set(prefixes(tree, 0)[: int(tree["valid"][0].sum())]) == set(best)
            if limit == 2:  # the cases a cut after the build gets wrong
                cut = [n for n in full if len(n) <= limit][:room]
                assert want == 2 and longest_match(set(full[:room]), g) == 0
                assert longest_match(set(cut), g) == (0 if budget == 4 else 2)


def run_step(target, shape, lp, cache, last, limit, room):
    tree = propose(shape, lp, None, limit, cache.capacity - 1 - cache.lengths)
    verified = verify(target.model, cache, last, tree)
    one = jnp.float32(1.0)
    acc = accept(tree, verified, limit, request_keys([0]), one, one, block_size=6, greedy=True)
    return acc.a, tree


def test_committable_is_the_identity_when_everything_fits():
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (2, 4, 7)), axis=-1)
    tree = build_trees(lp, 12)
    same = committable(tree, jnp.asarray([4, 4]), jnp.asarray([20, 12]))
    for k in tree:
        np.testing.assert_array_equal(np.asarray(same[k]), np.asarray(tree[k]))
    chain = trees.chain_trees(trees.Draft.of(lp))
    cut = committable(chain, jnp.asarray([2, 4]), jnp.asarray([20, 3]))
    assert np.asarray(cut["valid"]).tolist() == [[True, True, False, False], [True] * 3 + [False]]
    np.testing.assert_array_equal(np.asarray(cut["tokens"]), np.asarray(chain["tokens"]))


@pytest.mark.parametrize("fn", [trees.top_k_two_rounds, trees.top_k_pruned])
def test_chunked_top_k_equals_lax_top_k_ties_included(fn):
    """The draft's top-K per depth in two rounds (per chunk, then over the chunks' winners and
    the leftover entries) or pruned by chunk maxima gives lax.top_k's values and indices
    exactly: with many ties (small integers), -inf entries, NaNs of either sign, rows of -inf
    or NaN only, rows all below zero (log-probs), ties across chunks of different maxima, a
    vocabulary that is not a whole number of chunks, and k at, below and above the chunk and
    the chunk count (one round)."""
    rng = np.random.default_rng(0)
    top_k = jax.jit(fn, static_argnums=(1, 2))
    for V, chunk in [(61, 7), (64, 8), (3 * trees.TOP_K_CHUNK + 5, trees.TOP_K_CHUNK),
                     (3 * trees.TOP_K_CHUNK + 5, None)]:  # None: its default  # fmt: skip
        ties = rng.integers(0, 5, (3, 4, V)).astype(np.float32)
        holes = rng.normal(size=(3, 4, V)).astype(np.float32)
        holes[..., ::3] = -np.inf
        holes[0, 0], holes[0, 1], holes[1, 0, 5:] = -np.inf, -np.nan, -np.nan
        holes[2, 1, 7], holes[2, 2, 40] = np.nan, np.inf
        logprobs = rng.normal(size=(3, 4, V)).astype(np.float32) - 12  # all below zero
        spikes = rng.integers(0, 3, (3, 4, V)).astype(np.float32)  # the k-th value ties across
        spikes[..., rng.integers(0, V, 3)] = 9  # chunks whose maxima differ
        for x in (ties, holes, logprobs, spikes):
            for k in sorted({1, 6, chunk or 64, (chunk or 64) + 1, 16, min(64, V)}):
                want = jax.lax.top_k(jnp.asarray(x), k)
                got = top_k(jnp.asarray(x), k, *([] if chunk is None else [chunk]))
                np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), f"{k}")
                np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), f"{k}")


def test_top_k_equals_lax_top_k_in_both_regimes():
    """top_k (one round or two by k and the row count) gives lax.top_k's result on either
    side of its rule: few rows or many, k up to the one-pass kernel's and above it."""
    x = jnp.round(jax.random.normal(jax.random.key(1), (20, 3 * trees.TOP_K_CHUNK + 9)) * 4)
    top_k = jax.jit(trees.top_k, static_argnums=1)
    for rows in (1, trees.FEW_ROWS, trees.FEW_ROWS + 1, 20):
        for k in (4, trees.ONE_PASS_MAX_K, trees.ONE_PASS_MAX_K + 1, 64):
            want, got = jax.lax.top_k(x[:rows], k), top_k(x[:rows], k)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), f"{rows} rows, k {k}")


def test_reduced_draft_paths_equal_the_full_log_softmax_ones():
    """A tree built from the top-K of the logits equals one built from the full log-softmax;
    the chain from the argmax equals the argmax / max of the log-softmax; the forecast from
    the logits equals the one from the recalibrated log-softmax."""
    logits = jax.random.normal(jax.random.key(4), (3, 5, 40)) * 3
    lp = jax.nn.log_softmax(logits, axis=-1)
    dist = trees.Draft.of(logits)
    for budget in (1, 7, 16, 64):  # 64 > V: the top-K is the whole vocabulary
        old, new = build_trees(lp, budget), draft_trees(dist, budget)
        for k in ("tokens", "depth", "parent", "valid", "ancestors"):
            np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(old[k]), k)
        np.testing.assert_allclose(new["score"], old["score"], atol=1e-5)
    chain = trees.chain_trees(dist)
    assert chain["tokens"].tolist() == jnp.argmax(lp, -1).tolist()
    np.testing.assert_allclose(chain["score"], jnp.cumsum(lp.max(-1), axis=1), atol=1e-5)
    for cal in (1.0, 1.7):
        lp_cal = np.asarray(jax.nn.log_softmax(lp / cal, axis=-1))
        for shape in (trees.DraftShape("chain", 4), trees.DraftShape("tree", 16)):
            tree = draft_tree(shape, dist)
            b, d, t = np.indices(tree["tokens"].shape)[0], tree["depth"] - 1, tree["tokens"]
            node = lp_cal[b, np.asarray(d), np.asarray(t)]
            score = np.einsum("bij,bj->bi", np.asarray(tree["ancestors"], float), node)
            want = 1 + np.where(tree["valid"], np.exp(score), 0).sum(1)
            got = expected_tokens(shape, tree, dist, cal)
            np.testing.assert_allclose(got, want, rtol=1e-5)


# ------------------------------------------------------------- self-calibrating auto
@pytest.fixture(scope="module")
def drafter(target):
    from kdj.models.drafter import DrafterConfig, build_drafter

    layers = target.cfg.replace(model_type="qwen3", num_layers=1, qk_norm=True)
    dcfg = DrafterConfig(layers=layers, block_size=4, mask_token_id=V - 1, target_layer_ids=(0, 1),
                         num_target_layers=2)  # fmt: skip
    return kdj.Drafter.from_model(build_drafter(dcfg, jnp.float32, seed=2))


def test_a_tuned_step_is_timed_inside_one_compiled_loop(monkeypatch):
    """Timed one call at a time from the host, a step's time includes its dispatch (a few ms
    for a real model's parameters, more than the step itself on an H200), so every menu entry
    looks alike to auto: the pass runs REPS steps per call in one compiled loop instead."""
    from kdj.decode import tune

    traced, carries = [], []

    def step(args, c):
        traced.append(c)  # once per trace, not once per step
        return c + args

    job = tune._Job(None, step, jnp.int32(1), lambda: jnp.int32(0))
    ticks = []
    (run,) = tune._compile_all([job], tick=ticks.append)
    assert ticks == ["compiled"] and len(traced) == 1  # traced once, for the whole loop

    def spy(args, carry):
        carry = run(args, carry)
        carries.append(int(carry))  # read now: the next call donates it
        return carry

    assert tune._seconds_per_step(spy, jnp.int32(1), jnp.int32(0)) > 0
    assert carries == [tune.REPS * i for i in range(1, 2 + tune.CALLS)]


def test_the_tuning_pass_compiles_with_generates_xla_options(target, drafter, monkeypatch):
    """The timed programs are compiled as generate compiles its own (deterministic mode turns
    XLA's excess precision off, which changes the programs), all together, a tick each."""
    from kdj.decode import auto, tune

    seen = []

    def spy(jobs, options=None, tick=lambda label: None):
        seen.append(options)
        return real(jobs, options, tick)

    real = tune._compile_all
    monkeypatch.setattr(tune, "_compile_all", spy)
    shapes = auto.parse_menu("auto", ["none", "tree5"], 4, None)
    det = target.with_kernels(target.cfg.kernels.as_deterministic())
    ticks = []
    for t in (target, det):
        tune._timings(t, drafter, shapes, 2, 16, ticks.append)
    assert seen == [target.cfg.kernels.compiler_options(), {"xla_allow_excess_precision": False}]
    assert ticks == (["compiled"] * 3 + ["verify 1", "verify 6", "tree5"]) * 2


def test_tuning_pass_times_the_menu_caches_by_key_and_auto_reads_it(
    target, drafter, tmp_path, monkeypatch, capsys
):
    import io

    from kdj.decode import auto, tune

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shapes = auto.parse_menu("auto", ["none", "chain", "tree5"], 4, None)
    assert tune.cached(target, drafter, 3) is None
    bar = io.StringIO()
    cost, timings, path = tune.tune(target, drafter, shapes, 3, context=16, progress=bar)
    assert path.parent == tmp_path / "kdj" / "costs" and path.name.endswith("_b4.json")
    assert "float32" in path.name and re.search(r"10/10 tree5 +in \d+ s\n$", bar.getvalue())
    assert [(t.entry, t.tokens) for t in timings] == [
        ("target", 1), ("target", 4), ("target", 6), ("chain3", 4), ("tree5", 6)
    ]  # fmt: skip
    assert all(t.batch == 4 and t.seconds > 0 for t in timings)
    for t in timings[:3]:  # exact where the target pass was timed
        assert cost.seconds(4, t.tokens, 16) == pytest.approx(t.seconds, rel=1e-6)
    assert tune.cached(target, drafter, 4) == cost  # same bucket: 3 and 4
    assert tune.resolve(None, target, drafter, shapes, 3, 16.0) == cost  # what auto prices with
    assert tune.resolve(path, target, drafter, shapes, 3, 16.0) == path  # an override wins
    assert tune.cached(target, drafter, 5) is None  # bucket 8 was never tuned
    assert "tree5" in tune.table(timings)
    # generate's auto reads the cached cost (bucket 4): the same tokens as plain decoding
    gen = functools.partial(kdj.generate, target, max_new_tokens=12, stop_tokens=[])
    kw = dict(drafter=drafter, method="auto", menu=["none", "tree5"])
    prompts = [[3, 1, 4], [5, 9, 2], [2, 7, 1]]
    assert gen(prompts, **kw).tokens == gen(prompts, method="ar").tokens
    # on the CPU auto's default prices an untuned bucket with the shape estimate, silently;
    # on an accelerator its first use there runs the pass, says so, and later uses read it
    five = [[3, 1, 4]] * 5  # bucket 8, never tuned
    ar = gen(five, method="ar")
    assert tune.resolve(None, target, drafter, shapes, 5, 16.0) is None
    assert not tune.tunes_at_first_use()
    assert gen(five, **kw).tokens == ar.tokens
    assert tune.cached(target, drafter, 5) is None and not capsys.readouterr().err
    monkeypatch.setattr(tune, "tunes_at_first_use", lambda: True)
    first = gen(five, **kw)
    assert "no tuned step costs for this pair at batch 8" in capsys.readouterr().err
    assert tune.cached(target, drafter, 5) is not None and first.tokens == ar.tokens
    assert gen(five, **kw).tokens == ar.tokens
    assert "tuning" not in capsys.readouterr().err  # cached: no second pass
    # an explicit tuning pass inside generate runs even where one is cached, and says so
    assert gen(five, cost="tune", **kw).tokens == ar.tokens
    assert "tuning asked for at batch 8: tuning auto's step costs now" in capsys.readouterr().err


def test_a_pools_ladder_is_tuned_in_one_pass_over_three_widths(
    target, drafter, tmp_path, monkeypatch, capsys
):
    """A pool prices auto at every width of its ladder: at first use one pass times the
    smallest, middle and largest buckets, fits one cost and caches it for every width; a
    fixed method on a pool tunes nothing."""
    import io

    from kdj.decode import auto, tune

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tune, "tunes_at_first_use", lambda: True)
    shapes = auto.parse_menu("auto", ["none", "tree5"], 4, None)
    timed, real = [], tune._verify_job

    def spy(t, B, n, c):
        timed.append(B)
        return real(t, B, n, c)

    monkeypatch.setattr(tune, "_verify_job", spy)
    bar = io.StringIO()
    costs = tune.tune_widths(target, drafter, shapes, [1, 2, 4, 8, 16], context=16, progress=bar)
    assert sorted(set(timed)) == [1, 4, 16] and "18/18" in bar.getvalue()
    assert len({id(c) for c in costs.values()}) == 1 and set(costs) == {1, 2, 4, 8, 16}
    assert all(tune.cached(target, drafter, w) == costs[1] for w in (1, 2, 4, 8, 16))
    # cached now: resolve_widths reads it, no pass; a width never tuned would run one
    timed.clear()
    got = tune.resolve_widths(None, target, drafter, shapes, [1, 2, 4], 16.0)
    assert got == dict.fromkeys([1, 2, 4], costs[1]) and not timed
    assert tune.resolve_widths("estimate", target, drafter, shapes, [32], 16.0) == {32: "estimate"}
    capsys.readouterr()
    prompts = [[3, 1, 4]] * 5
    kw = dict(drafter=drafter, max_new_tokens=6, stop_tokens=[], max_batch=4)
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=6, stop_tokens=[])
    assert kdj.generate(target, prompts, method="dflash", **kw).tokens == ar.tokens
    assert not timed and "tuning" not in capsys.readouterr().err  # a fixed method: no pass
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "fresh"))
    out = kdj.generate(target, prompts, method="auto", menu=["none", "tree5"], **kw)
    assert out.tokens == ar.tokens
    assert "no tuned step costs for this pair at widths" in capsys.readouterr().err
    assert timed  # one pass for the pool's ladder


def test_fixed_methods_do_no_forecast_work_unless_asked(target):
    """A fixed method's drafted step skips the drafter's forecast (a pass over the [B, L, V]
    draft): fewer full-vocabulary reductions than the same step asked to forecast, which
    auto's steps always do; the stats say so."""
    from kdj.decode.loop import drafted_step
    from kdj.decode.state import Plan, Prefilled, init_state
    from kdj.models.drafter import build_drafter
    from kdj.train.config import DrafterShape
    from kdj.train.trainer import drafter_config_for

    shape = DrafterShape(num_layers=1, block_size=4, mask_token_id=V - 1, intermediate_size=32)
    dmodel = build_drafter(drafter_config_for(target.cfg, shape), jnp.float32, seed=2)
    B, S, k = 2, 32, shape.block_size
    lens = jnp.full((B,), 8, jnp.int32)
    tcache = init_cache(target.cfg, B, S, jnp.float32).with_lengths(lens)
    dcache = init_cache(dmodel.cfg.layers, B, S, jnp.float32).with_lengths(lens)
    pre = Prefilled(jnp.zeros((B,), jnp.int32), tcache, dcache)
    width = target.cfg.hidden_size * len(dmodel.cfg.target_layer_ids)

    def vocab_reductions(plan):
        one = jnp.float32(1.0)
        state = init_state(pre, jnp.full((B,), 8), jnp.full((B, 1), -1, jnp.int32),
                           request_keys([0] * B), one, one, one, [0.0], plan,
                           width)  # fmt: skip
        jaxpr = jax.make_jaxpr(lambda s: drafted_step(target.model, dmodel, s, plan))(state)

        def count(jx):
            n = 0
            for eq in jx.eqns:
                shapes = [getattr(v.aval, "shape", ()) for v in eq.invars]
                if eq.primitive.name == "reduce_max" and any(s and s[-1] == V for s in shapes):
                    n += 1
                for value in eq.params.values():  # the bodies of jit, cond, scan, while
                    for sub in value if isinstance(value, (tuple, list)) else [value]:
                        sub = getattr(sub, "jaxpr", sub)
                        if hasattr(sub, "eqns"):
                            n += count(sub)
            return n

        return count(jaxpr.jaxpr)

    menu = (trees.DraftShape("chain", k - 1),)
    fixed = vocab_reductions(Plan(True, 8, k, menu))
    asked = vocab_reductions(Plan(True, 8, k, menu, forecast=True))
    assert 0 < fixed < asked
    drafter = kdj.Drafter.from_model(dmodel, "tiny", None)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    plain = kdj.generate(target, prompts, drafter=drafter, method="dflash", max_new_tokens=6)
    told = kdj.generate(target, prompts, drafter=drafter, method="dflash", max_new_tokens=6,
                        calibration=1.0)  # fmt: skip
    assert "expected_acceptance" not in plain.stats and told.stats["calibration_error"] >= 0
    assert plain.tokens == told.tokens


def test_a_ddtree_step_runs_no_loop_of_its_own(target):
    """The decode loop is the only loop of a DDTree run: a loop inside the step (the beam's
    extension, one depth at a time) would be launched from the host once a depth."""
    from kdj.decode import loop
    from kdj.decode.state import Plan, Prefilled
    from kdj.models.drafter import DrafterConfig, build_drafter

    layers = target.cfg.replace(model_type="qwen3", num_layers=1, qk_norm=True)
    dcfg = DrafterConfig(layers=layers, block_size=8, mask_token_id=V - 1, target_layer_ids=(0, 1),
                         num_target_layers=2)  # fmt: skip
    drafter = kdj.Drafter.from_model(build_drafter(dcfg, jnp.float32, seed=2))
    B, S = 2, 64
    tcache = init_cache(target.cfg, B, S, jnp.float32).with_lengths(jnp.full((B,), 5, jnp.int32))
    dcache = init_cache(dcfg.layers, B, S, jnp.float32).with_lengths(tcache.lengths)
    one = jnp.float32(1.0)
    for budget in (16, 64):
        plan = Plan(True, 16, 8, (trees.DraftShape("tree", budget),))
        compiled = loop.decode.lower(
            target.graphdef, target.state, drafter.graphdef, drafter.state,
            Prefilled(jnp.zeros((B,), jnp.int32), tcache, dcache), jnp.full((B,), 16, jnp.int32),
            jnp.full((B, 1), -1, jnp.int32), request_keys([0] * B), one, one, one,
            jnp.zeros((1,)), plan=plan,
        ).compile()  # fmt: skip
        assert len(re.findall(r" while\(", compiled.as_text())) == 1, budget
