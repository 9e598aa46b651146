"""Adaptive speculation (method="auto"): the expected-acceptance formula, the step-cost model,
the controller's choices, and losslessness while the controller switches draft shapes."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.config import ModelConfig, load_yaml
from kdj.cost import StepCost
from kdj.decode import auto
from kdj.decode import tree as trees
from kdj.decode.tree import DraftShape
from tests.hf_models import build
from tests.test_speculative import VOCAB, exact_joint, make_drafter, prompts_for

MENU = ["none", "chain2", "chain", "tree3", "tree12"]


# ------------------------------------------------------------------ expected acceptance
def test_expected_tokens_is_one_plus_the_tree_probability_mass():
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (1, 3, 4)) * 2, axis=-1)
    p = np.exp(np.asarray(lp[0], np.float64))
    for shape in (DraftShape("tree", 7), DraftShape("chain", 3), DraftShape("none")):
        dist = trees.Draft.of(lp)
        tree = trees.draft_tree(shape, dist, trees.build_trees(lp, 20))
        got = float(trees.expected_tokens(shape, tree, dist)[0])
        # brute force: every node's prefix probability under the factorised drafter
        want = 1.0
        toks, depth, parent = (np.asarray(tree[k][0]) for k in ("tokens", "depth", "parent"))
        for i in range(toks.shape[0]):
            prob, j = 1.0, i
            while j >= 0:
                prob *= p[depth[j] - 1, toks[j]]
                j = parent[j]
            want += prob
        assert got == pytest.approx(want, rel=1e-5), shape


def test_top_of_the_largest_tree_is_the_smaller_tree():
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(2), (2, 4, 6)), axis=-1)
    full = trees.build_trees(lp, 30)
    for b in (1, 5, 17):
        small = trees.build_trees(lp, b)
        np.testing.assert_allclose(trees.top(full, b)["score"], small["score"], atol=1e-6)


# ------------------------------------------------------------------ the step-cost model
def moonlight() -> ModelConfig:
    from pathlib import Path

    path = Path(__file__).parent.parent / "configs" / "models" / "moonlight-16b-a3b.yaml"
    return ModelConfig.from_hf(load_yaml(path))


def test_cost_terms_count_touched_experts():
    cost = StepCost.for_config(moonlight())
    assert cost.moe_layers == 26 and cost.num_experts == 64 and cost.top_k == 6
    b1, _ = cost.terms(1, 1, 0)
    b16, _ = cost.terms(1, 16, 0)
    b_all, _ = cost.terms(256, 16, 0)
    # one token touches k experts per layer; 4096 tokens touch all 64
    kv = cost.kv_bytes_per_token  # the new tokens' K/V are written
    assert b1 - cost.dense_bytes - kv == pytest.approx(26 * 6 * cost.expert_bytes, rel=1e-3)
    b_all -= cost.dense_bytes + 4096 * kv
    assert b_all == pytest.approx(26 * 64 * cost.expert_bytes, rel=1e-3)
    assert b1 < b16 < b_all


def test_fit_recovers_known_coefficients(tmp_path):
    truth = dataclasses.replace(
        StepCost.for_config(moonlight()), fixed_s=2e-4, per_byte_s=1 / 3e12, per_flop_s=1 / 4e14
    )
    grid = itertools.product((1, 4, 16, 64, 256), (1, 8, 16), (256, 4096))
    rows = [(b, t, c, float(truth.seconds(b, t, c))) for b, t, c in grid]
    fitted = StepCost.for_config(moonlight()).fit(rows)
    for name in ("fixed_s", "per_byte_s", "per_flop_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert StepCost.load(fitted.save(tmp_path / "cost.json")) == fitted
    (tmp_path / "bad.json").write_text('{"fixed": 1}')
    with pytest.raises(ValueError, match="unknown step-cost fields"):
        StepCost.load(tmp_path / "bad.json")


def test_residuals_make_the_model_exact_at_measured_steps(tmp_path):
    """with_residuals: measured / predicted per measured (batch, T); seconds() is exact there,
    interpolated in log2(batch) between measured batches, clamped outside them, and for a T
    never measured the nearest measured T's. The residuals survive save / load and keep the
    cost hashable (it is a static argument of the jitted loop)."""
    base = StepCost.for_config(moonlight())
    c = 512
    rows = [(1, 1, c, 1.2 * float(base.seconds(1, 1, c))),
            (16, 1, c, 0.8 * float(base.seconds(16, 1, c))),
            (16, 17, c, 1.1 * float(base.seconds(16, 17, c)))]  # fmt: skip
    cost = base.with_residuals(rows)
    for b, t, ctx, s in rows:
        assert float(cost.seconds(b, t, ctx)) == pytest.approx(s)
        assert cost.measured_at(b, t)
    assert not cost.measured_at(4, 1) and not cost.measured_at(16, 16)
    assert cost.residual(4, 1) == pytest.approx(1.0)  # halfway from 1.2 to 0.8 in log2(batch)
    assert cost.residual(256, 1) == pytest.approx(0.8)
    assert cost.residual(1, 17) == pytest.approx(1.1)
    # T = 65 never measured: the nearest measured T's (17), so a bigger tree is priced on
    # the same footing as a measured one
    assert cost.residual(4, 65) == pytest.approx(1.1)
    assert float(cost.seconds(4, 65, c)) == pytest.approx(1.1 * float(base.seconds(4, 65, c)))
    assert StepCost.load(cost.save(tmp_path / "cost.json")) == cost
    hash(cost)
    assert cost.fit(rows * 2).residuals == ()  # refitted coefficients: old ratios dropped
    with pytest.raises(ValueError, match="one measurement per"):
        base.with_residuals(rows + rows[:1])
    with pytest.raises(ValueError, match="has no time"):
        cost.residual(0, 1)


def test_the_menu_margin_shrinks_where_both_steps_were_measured():
    """A tree predicted to beat plain decoding by 7% is no reason to draft when the model
    priced it (MENU_MARGIN covers its error), and is when both steps at this batch were
    measured (the residuals: MEASURED_MARGIN)."""
    shapes = (DraftShape("none"), DraftShape("tree", 16))
    base = dataclasses.replace(StepCost.for_config(moonlight()), fixed_s=1.0, per_byte_s=0.0,
                               per_flop_s=0.0)  # fmt: skip
    tau = 1.07 * 2.0  # a tree step costs two plain steps (no draft pass priced here)
    rows = [(16, 1, 100.0, 1.0), (16, 17, 100.0, 2.0)]
    priced = dataclasses.replace(base, residuals=((16, 1, 1.0), (16, 17, 2.0)))
    assert auto.MEASURED_MARGIN < 0.07 < auto.MENU_MARGIN
    assert auto.paying_menu(shapes, base.with_residuals(rows), 16, 100.0, tau) == shapes
    # the same prices from the model alone at a batch without measurements: dropped
    assert auto.paying_menu(shapes, priced, 8, 100.0, tau) == shapes[:1]


def test_fit_with_drafted_steps_recovers_the_draft_terms():
    """Decode-loop rows: AR steps alone and whole speculative steps (draft pass + a tree of
    n nodes + verify) pin down the drafting overhead and per-node tree cost too."""
    from kdj.models.drafter import DrafterConfig

    cfg = moonlight()
    layers = cfg.replace(family="llama", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)
    dcfg = DrafterConfig(layers=layers, block_size=8, mask_token_id=0, target_layer_ids=(1,),
                         num_target_layers=cfg.num_layers)  # fmt: skip
    base = StepCost.for_config(cfg).with_drafter(dcfg, 10**8, cfg)
    truth = dataclasses.replace(base, fixed_s=3e-4, per_byte_s=1 / 2e12, per_flop_s=1 / 3e14,
                                draft_fixed_s=2e-4, per_node_s=1e-7,
                                per_tree_node_s=1e-5)  # fmt: skip
    rows = []
    for b, c in itertools.product((1, 4, 16, 64, 256), (256, 2048)):
        rows.append((b, 1, c, float(truth.seconds(b, 1, c)), 0, 0))
        for t, n in ((8, 0), (17, 16), (65, 64)):  # a chain, trees of 16 and 64 nodes
            s = truth.seconds(b, t, c) + truth.draft_seconds(b, c, n)
            rows.append((b, t, c, float(s), 1, n))
    fitted = base.fit(rows)
    names = ("fixed_s", "per_byte_s", "per_flop_s", "draft_fixed_s", "per_node_s",
             "per_tree_node_s")  # fmt: skip
    for name in names:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-5), name


def test_controller_prefers_plain_decoding_when_verify_tokens_are_dear():
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(3), (2, 4, 6)) * 3, axis=-1)
    shapes = tuple(DraftShape(*s) for s in (("none",), ("chain", 4), ("tree", 12)))
    full = trees.build_trees(lp, 12)
    active = jnp.ones((2,), bool)
    base = StepCost.for_config(moonlight())
    dear = dataclasses.replace(base, fixed_s=0.0, per_byte_s=0.0, per_flop_s=1.0)
    free = dataclasses.replace(base, fixed_s=1.0, per_byte_s=0.0, per_flop_s=0.0)
    gains = auto.expected(shapes, trees.Draft.of(lp), full, 1.0)  # [S, B]
    assert shapes[int(auto.choose(shapes, gains, active, dear, 100.0))].kind == "none"
    i = auto.choose(shapes, gains, active, free, 100.0)
    assert shapes[int(i)] == DraftShape("tree", 12)  # same cost: the most expected tokens
    total = gains.sum(axis=1)
    assert float(total[2]) >= float(total[1]) >= float(total[0]) == 2.0
    # a hotter calibration spreads the drafter's mass: it forecasts fewer accepted tokens
    hot = auto.expected(shapes, trees.Draft.of(lp), full, 2.0)
    assert float(hot[2].sum()) < float(total[2])


def test_draft_cost_and_the_decision_to_skip_the_drafter():
    from kdj.models.drafter import DrafterConfig

    cfg = moonlight()
    layers = cfg.replace(family="llama", num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)
    dcfg = DrafterConfig(layers=layers, block_size=8, mask_token_id=0, target_layer_ids=(1,),
                         num_target_layers=cfg.num_layers)  # fmt: skip
    base = StepCost.for_config(cfg)
    assert base.draft_seconds(4, 100) == 0.0  # no drafter yet
    cost = base.with_drafter(dcfg, 10**7, cfg)
    head = cfg.vocab_size * cfg.hidden_size
    assert cost.draft_bytes == 2 * (10**7 + head)
    assert cost.draft_flops_per_seq == 2 * (10**7 * 8 + head * 7)
    assert cost.draft_seconds(64, 100) > cost.draft_seconds(1, 100) > 0

    shapes = tuple(DraftShape(*s) for s in (("none",), ("chain", 4), ("tree", 12)))
    active = jnp.ones((2,), bool)
    sure = jnp.array([[1.0, 1.0], [5.0, 5.0], [9.0, 9.0]])  # every draft accepted
    hopeless = jnp.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert bool(auto.drafting_pays(shapes, sure, active, cost, 100.0))
    assert not bool(auto.drafting_pays(shapes, hopeless, active, cost, 100.0))
    # compute-bound: 13 verified tokens cost 13x one; 9 expected tokens do not pay for it
    dear = dataclasses.replace(cost, fixed_s=0.0, per_byte_s=0.0, per_flop_s=1.0)
    assert not bool(auto.drafting_pays(shapes, sure, active, dear, 100.0))


def test_forecast_bias_correction_turns_a_judged_loss_into_drafting():
    """The loop scales the forecast drafts (gain - 1) by realised / forecast drafts so far: a
    drafter that under-forecasts (run d on the H200: 0.71 forecast, 0.84 realised drafts per
    step) is judged on what it delivers. The plain entry (gain 1) is never scaled."""
    shapes = tuple(DraftShape(*s) for s in (("none",), ("tree", 16)))
    gains = jnp.array([[1.0], [1.71]])
    prior = jnp.full((2,), auto.HITS_PRIOR)
    np.testing.assert_allclose(auto.corrected(gains, prior), gains)  # ratio 1 at start
    hits = prior + jnp.array([0.84 * 40, 0.71 * 40])  # 40 drafted steps
    fixed = auto.corrected(gains, hits)
    assert float(fixed[0, 0]) == 1.0
    np.testing.assert_allclose(float(fixed[1, 0]), 1 + 0.71 * float(hits[0] / hits[1]), rtol=1e-6)
    # a cost where a drafted step is 1.77 plain steps (batch 1 on the H200): raw says skip,
    # corrected says draft
    cost = dataclasses.replace(StepCost.for_config(moonlight()), fixed_s=1.0, per_byte_s=0.0,
                               per_flop_s=0.0, draft_fixed_s=0.77)  # fmt: skip
    active = jnp.ones((1,), bool)
    assert float(cost.draft_seconds(1, 100.0, 16)) == pytest.approx(0.77)
    assert not bool(auto.drafting_pays(shapes, gains, active, cost, 100.0))
    assert bool(auto.drafting_pays(shapes, fixed, active, cost, 100.0))


def test_hysteresis_keeps_drafting_just_below_break_even():
    """With slack, drafting 'pays' down to (1 - slack) of plain decoding's rate, and no
    lower: the loop stays in its drafted steps through small dips of the running mean."""
    shapes = tuple(DraftShape(*s) for s in (("none",), ("tree", 16)))
    # a drafted step costs 1.77 plain steps: break-even at 1.77 tokens per step
    cost = dataclasses.replace(StepCost.for_config(moonlight()), fixed_s=1.0, per_byte_s=0.0,
                               per_flop_s=0.0, draft_fixed_s=0.77)  # fmt: skip
    active = jnp.ones((1,), bool)
    h = auto.HYSTERESIS
    for tau, strict, slack in ((1.80, True, True), (1.70, False, True), (1.50, False, False)):
        gains = jnp.array([[1.0], [tau]])
        assert bool(auto.drafting_pays(shapes, gains, active, cost, 100.0)) == strict
        assert bool(auto.drafting_pays(shapes, gains, active, cost, 100.0, h)) == slack


def test_the_menu_keeps_only_entries_that_can_pay_at_the_batch_size():
    """paying_menu prices each entry's drafted step (draft pass with its own tree + verify)
    against a plain step at the calibrated tokens per step: bandwidth-bound steps keep every
    entry, compute-bound ones keep those whose extra tokens the prior pays for."""
    shapes = tuple(DraftShape(*s) for s in (("none",), ("chain", 3), ("tree", 16), ("tree", 64)))
    base = StepCost.for_config(moonlight())
    flat = dataclasses.replace(base, fixed_s=1.0, per_byte_s=0.0, per_flop_s=0.0,
                               draft_fixed_s=0.5, per_node_s=1e-3)  # fmt: skip
    # a drafted step costs 1.5 + nodes/1000 plain steps (the draft pass builds the largest
    # tree left) and its tau must beat that by the factor m
    m = 1 + auto.MENU_MARGIN
    assert auto.paying_menu(shapes, flat, 1, 100.0, m * 1.54) == shapes[:3]
    assert auto.paying_menu(shapes, flat, 1, 100.0, m * 1.58) == shapes
    assert auto.paying_menu(shapes, flat, 1, 100.0, m * 1.49) == shapes[:1]  # too thin
    # each entry priced at its own measured tau where the calibration has one
    measured = {"tree16": m * 1.54, "chain3": m * 1.505}
    assert auto.paying_menu(shapes, flat, 1, 100.0, 1.4, measured) == shapes[::2]
    # entries without a measurement of their own: the smallest larger one of their kind
    # bounds them (a chain or tree holds the smaller ones as its first nodes), else the prior
    known = {"chain15": 1.46, "tree16": 1.96, "tree64": 2.23}
    taus = [auto.entry_tau(DraftShape(*s), 1.9, known)
            for s in (("none",), ("chain", 7), ("chain", 15), ("tree", 8), ("tree", 32),
                      ("tree", 128))]  # fmt: skip
    assert taus == [1.0, 1.46, 1.46, 1.96, 2.23, 1.9]
    # every drafted step builds the largest tree left: a chain that loses beside tree64
    # (cost 1.564) and tree16 (1.516) stays once the trees are gone (1.5), and one that loses
    # while tree64 wins goes (tree16, bounded by tree64's tau, stays)
    chain = {"chain3": m * 1.505}
    assert auto.paying_menu(shapes, flat, 1, 100.0, 1.4, chain) == shapes[:2]
    both = {"chain3": m * 1.505, "tree64": m * 1.57}
    assert auto.paying_menu(shapes, flat, 1, 100.0, 1.4, both) == shapes[:1] + shapes[2:]
    # every entry pays, but the calibration's taus say tree16 and the chain do better
    # without tree64's build (drafted steps 1.5 + nodes/100 plain steps): tree64 goes first,
    # so the chain, a loser beside it, is priced with tree16's build and stays
    tree_dear = dataclasses.replace(flat, per_node_s=1e-2)
    taus = {"chain3": 2.0, "tree16": 2.6, "tree64": 3.0}
    assert auto.paying_menu(shapes, tree_dear, 1, 100.0, 2.0, taus) == shapes[:3]
    taus["tree64"] = 3.4  # worth its build: all stay but the chain (0.93 of a plain rate)
    assert auto.paying_menu(shapes, tree_dear, 1, 100.0, 2.0, taus) == shapes[:1] + shapes[2:]
    # compute-bound: 4 verified tokens cost 4x one; even the chain needs 4+ tokens per step
    dear = dataclasses.replace(base, fixed_s=0.0, per_byte_s=0.0, per_flop_s=1.0)
    assert auto.paying_menu(shapes, dear, 256, 100.0, 3.0) == shapes[:1]
    assert auto.paying_menu(shapes, dear, 256, 100.0, 5.0) == shapes[:2]
    # nothing known, or a menu without "none" (the user asked to draft): nothing dropped
    assert auto.paying_menu(shapes, dear, 256, 100.0, 0.0) == shapes
    assert auto.paying_menu(shapes[1:], dear, 256, 100.0, 3.0) == shapes[1:]


# ------------------------------------------------------------------ lossless while switching
def _scramble(x, salt: int):
    """A well-mixed pseudo-random integer from a float32 scalar that changes every step."""
    x = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) + jnp.uint32(salt)
    x = (x ^ (x >> 16)) * jnp.uint32(2246822519)
    return (x ^ (x >> 13)) * jnp.uint32(3266489917) >> 16


def scrambled_choice(shapes, gains, active, cost, context):
    """Test double for the controller: a pseudo-random drafting entry at every step (from the
    mean context length and the slots' forecasts), so one run enters and leaves every
    entry's loop many times."""
    return (_scramble(context + jnp.mean(gains), 1) % len(shapes)).astype(jnp.int32)


def scrambled_pays(shapes, gains, active, cost, context, slack=0.0):
    """Test double for the draft-or-skip decision: pseudo-random too, so runs mix plain steps
    that skip the drafter with drafted ones."""
    return _scramble(context, 7) % 4 != 0


@pytest.fixture
def switching(monkeypatch):
    monkeypatch.setattr(auto, "choose", scrambled_choice)
    monkeypatch.setattr(auto, "drafting_pays", scrambled_pays)
    monkeypatch.setattr(auto, "PROBE_MAX", 4)  # short plain runs: many drafted steps
    jax.clear_caches()  # each test loads a fresh target, whose executables start empty
    yield
    jax.clear_caches()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_greedy_auto_equals_ar_while_switching_every_entry(family, switching, tmp_path):
    build(family, tmp_path, vocab_size=VOCAB, num_hidden_layers=3)
    target = kdj.load_target(tmp_path, dtype="float32")
    drafter = make_drafter(target, block=5)
    prompts = prompts_for(target)
    kw = dict(max_new_tokens=40, stop_tokens=[])
    ar = kdj.generate(target, prompts, method="ar", **kw)
    au = kdj.generate(target, prompts, drafter=drafter, method="auto", menu=MENU, **kw)
    assert au.tokens == ar.tokens
    # every drafting entry and skipped steps; "none" is never a drafted step's entry
    assert set(au.stats["draft_choices"]) == {"chain2", "chain4", "tree3", "tree12", "skip"}
    assert max(max(t) for t in au.stats["acceptance_lengths"]) > 1


def test_sampled_auto_is_lossless_while_switching(switching, tmp_path):
    from tests.test_speculative import chi_square_p_ok

    build("qwen3", tmp_path, vocab_size=6, num_hidden_layers=2)
    target = kdj.load_target(tmp_path, dtype="float32")
    drafter = make_drafter(target, layers=1, block=4, seed=3)
    prompt = [1, 2, 3, 4]
    # five tokens so that the run has steps enough to both draft and skip; the test is on
    # the joint law of the first three (later steps cannot change it)
    out = kdj.generate(target, [prompt] * 6000, drafter=drafter, method="auto", menu=MENU[:4],
                       max_new_tokens=5, temperature=0.9, stop_tokens=[])  # fmt: skip
    t = np.array(out.tokens)
    V = target.cfg.vocab_size
    assert chi_square_p_ok(
        (t[:, 0] * V + t[:, 1]) * V + t[:, 2], exact_joint(target, prompt, 3, 0.9)
    )
    assert len(set(out.stats["draft_choices"])) > 1 and "skip" in out.stats["draft_choices"]


def test_auto_default_menu_and_bad_menus(tmp_path):
    build("llama", tmp_path, vocab_size=VOCAB, num_hidden_layers=2)
    target = kdj.load_target(tmp_path, dtype="float32")
    drafter = make_drafter(target, layers=1, block=4, ids=(1,))
    prompts = prompts_for(target, (4, 9))
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=12, stop_tokens=[])
    au = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=12, stop_tokens=[])
    assert au.stats["method"] == "auto" and au.tokens == ar.tokens
    assert au.stats["menu"] == ["none", "chain3", "tree16", "tree64"]
    # compute-bound prices: drafting never pays, so after the first (forced) draft the loop
    # skips the drafter and re-drafts only at probes spaced by the draft's price (>= 8 steps)
    dear = dataclasses.replace(StepCost.for_config(target.cfg), fixed_s=0.0, per_byte_s=0.0,
                               per_flop_s=1.0)  # fmt: skip
    sk = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=40, stop_tokens=[],
                      cost=dear)  # fmt: skip
    ar40 = kdj.generate(target, prompts, method="ar", max_new_tokens=40, stop_tokens=[])
    picks = sk.stats["draft_choices"]
    assert sk.tokens == ar40.tokens and len(picks) == 39
    drafted = [i for i, p in enumerate(picks) if p != "skip"]
    assert drafted[0] == 0 and all(b - a > auto.PROBE_MIN for a, b in zip(drafted, drafted[1:]))
    # a prior that says drafting cannot pay: not even the first step drafts
    doubtful = dataclasses.replace(drafter, prior_acceptance=1.2)
    pr = kdj.generate(target, prompts, drafter=doubtful, max_new_tokens=40, stop_tokens=[],
                      cost=dear)  # fmt: skip
    # (at no size: the menu is trimmed to "none" before compiling and auto runs plain decoding)
    assert pr.tokens == ar40.tokens and pr.stats["draft_choices"] == ["skip"] * 39
    assert pr.stats["menu"] == ["none"] and pr.stats["mean_expected_acceptance"] == 1.0
    for menu, msg in ((["tree0"], "bad menu entry"), (["chain9"], "a chain holds 1..3"),
                      (["none", "none"], "distinct"), (["fork2"], "bad menu entry")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            kdj.generate(target, prompts, drafter=drafter, menu=menu)
    with pytest.raises(ValueError, match="calibration must be a positive"):
        kdj.generate(target, prompts, drafter=drafter, calibration=0.0)
    with pytest.raises(ValueError, match="menu applies to method 'auto'"):
        kdj.generate(target, prompts, drafter=drafter, method="dflash", menu=["none"])
    with pytest.raises(ValueError, match="cost applies to method 'auto' with a drafter, not "
                       "'ddtree'"):  # fmt: skip
        kdj.generate(target, prompts, drafter=drafter, method="ddtree", cost="estimate")
    for given in (-5, "x"):  # plain decoding has no forecast to calibrate
        with pytest.raises(ValueError, match="calibration applies to method 'dflash' or "
                           "'ddtree' or 'auto' with a drafter, not 'ar'"):  # fmt: skip
            kdj.generate(target, prompts, drafter=drafter, method="ar", calibration=given)


def test_calibration_changes_only_the_forecast_and_is_saved_with_the_drafter(tmp_path):
    from kdj.train import calibrate

    build("qwen3", tmp_path / "t", vocab_size=VOCAB, num_hidden_layers=3)
    target = kdj.load_target(tmp_path / "t", dtype="float32")
    make_drafter(target, block=5).save(tmp_path / "d")
    drafter = kdj.load_drafter(tmp_path / "d", target=target)
    assert drafter.calibration == 1.0  # no calibration.json yet
    prompts = prompts_for(target)
    kw = dict(tree_budget=6, temperatures=(0.5, 1.0, 3.0), max_new_tokens=24, log=lambda s: 0)
    report = calibrate.calibrate(target, drafter, prompts, entry_budgets=(2, 6), **kw)
    rows = report["candidates"]
    assert len({r["mean_realised"] for r in rows}) == 1  # same drafts, same acceptance
    # the menu entries' own tau: tree6 is the fitted run's; chain4 (DFlash at block 5) and
    # tree2 ran on the same prompts (a tree of 2 nodes commits at most 3 tokens a step)
    by_entry = report["realised_by_entry"]
    assert set(by_entry) == {"chain4", "tree2", "tree6"}
    assert by_entry["tree6"] == rows[0]["mean_realised"]
    assert all(1.0 <= t <= 5.0 for t in by_entry.values())
    assert by_entry["tree2"] <= 3.0
    forecasts = [r["mean_forecast"] for r in rows]
    assert forecasts[0] > forecasts[1] > forecasts[2]  # hotter: less confident
    assert abs(report["bias_after"]) <= abs(report["bias_before"])
    calibrate.save(report, tmp_path / "d")
    again = kdj.load_drafter(tmp_path / "d", target=target)
    assert again.calibration == report["temperature"]
    assert again.entry_acceptance == by_entry and again.prior_acceptance == by_entry["tree6"]
    out = kdj.generate(target, prompts, drafter=again, method="ddtree", tree_budget=6,
                       max_new_tokens=8, stop_tokens=[], calibration=again.calibration)  # fmt: skip
    assert out.stats["calibration_error"] >= 0


def test_bench_adaptive_refits_the_step_cost_from_saved_runs(tmp_path):
    """bench/adaptive.py --fit-from: the step cost fitted to earlier runs' fixed-method rows
    (AR, DFlash = a chain of k - 1 drafts, DDTree<n>) recovers the cost that made them."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import adaptive

    build("llama", tmp_path / "t", vocab_size=VOCAB, num_hidden_layers=2)
    target = kdj.load_target(tmp_path / "t", dtype="float32")
    make_drafter(target, layers=1, block=4, ids=(1,)).save(tmp_path / "d")
    drafter = kdj.load_drafter(tmp_path / "d", target=target)
    n_params = sum(int(x.size) for x in jax.tree.leaves(drafter.state))
    base = StepCost.for_config(target.cfg).with_drafter(drafter.cfg, n_params, target.cfg)
    truth = dataclasses.replace(base, fixed_s=5e-4, per_byte_s=1e-12, per_flop_s=1e-14,
                                draft_fixed_s=2e-4, per_node_s=1e-6,
                                per_tree_node_s=1e-5)  # fmt: skip

    def ms(batch, context, tokens, nodes, drafted):
        s = truth.seconds(batch, tokens, context) + drafted * truth.draft_seconds(
            batch, context, nodes
        )
        return {"step_ms": float(s) * 1e3}

    rows = [{"batch": b, "context": c, "methods": {
                "ar": ms(b, c, 1, 0, 0), "dflash": ms(b, c, 4, 0, 1),
                "ddtree16": ms(b, c, 17, 16, 1), "ddtree64": ms(b, c, 65, 64, 1),
                "auto": {"step_ms": 1.0}}}  # auto rows are not fitted
            for b, c in itertools.product((1, 16, 256), (100.0, 900.0))]  # fmt: skip
    runs = [tmp_path / "a.json", tmp_path / "b.json"]
    for run, part in zip(runs, (rows[:3], rows[3:])):
        run.write_text(json.dumps({"meta": {}, "rows": part}))
    out = tmp_path / "cost.json"
    pair = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d"), "--dtype",
            "float32"]  # fmt: skip
    adaptive.main([*pair, "--fit-from", *map(str, runs), "--fit-cost", str(out)])
    fitted = StepCost.load(out)
    for name in ("fixed_s", "per_byte_s", "per_flop_s", "draft_fixed_s", "per_node_s",
                 "per_tree_node_s"):  # fmt: skip
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-4), name
    del rows[0]["context"]  # runs before 2026-11-29c did not record it
    runs[0].write_text(json.dumps({"meta": {}, "rows": rows[:1]}))
    with pytest.raises(SystemExit):
        adaptive.main([*pair, "--fit-from", str(runs[0]), "--fit-cost", str(out)])


def test_bench_adaptive_compares_ar_across_batch_sizes():
    """bench/adaptive.py: each batch's AR tokens against the next smaller batch's, on the
    sequences both share; a batch without AR tokens is skipped."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import adaptive

    rows = [{"batch": 4, "_ar_tokens": [[1, 2], [3, 4], [5, 6], [7, 8]]},
            {"batch": 1, "_ar_tokens": [[1, 2]]},
            {"batch": 16, "_ar_tokens": None},
            {"batch": 8, "_ar_tokens": [[1, 2], [3, 5], [5, 6], [7, 9]] * 2}]  # fmt: skip
    adaptive.ar_across_batches(rows)
    by = {r["batch"]: r.get("ar_identical_to_batch") for r in rows}
    assert by == {1: None, 4: {"batch": 1, "identical": 1.0},
                  8: {"batch": 4, "identical": 0.5}, 16: None}  # fmt: skip


def test_autos_step_copies_no_layer_of_the_caches(vocab12_pair):
    """auto verifies each menu entry in a loop of its own (and in the pool, a chunk pinned to
    each entry): no compiled pool chunk copies a layer of the target's or the drafter's cache
    (a conditional whose branches write the cache would copy every layer, every step)."""
    import re

    from kdj.decode import pool
    from kdj.decode.engine import Engine

    target, drafter = vocab12_pair
    menu = auto.parse_menu("auto", ["none", "chain", "tree12"], 6, None)
    engine = Engine(target, max_batch=4, cache_size=96, max_new_cap=8, drafter=drafter,
                    menu=menu, widths=(4,))  # fmt: skip
    engine.warm(modes=(True,))
    state = engine.pool.state
    layers = {tuple(x.shape) for x in state.tcache.k + state.tcache.v + state.dcache.k}
    programs = target.executables.compiled(pool.chunk)
    assert len(programs) == len(menu)  # one per entry
    for program in programs:
        copies = re.finditer(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", program.as_text())
        copied = {tuple(int(d) for d in m.group(1).split(",")) for m in copies}
        assert layers and not layers & copied, f"layer caches copied: {layers & copied}"
