"""Prefill, then the whole generation as ONE on-device `lax.while_loop` over steps composed
from kdj/decode/step.py:

    AR      plain_step
    DFlash  draft -> propose(chain) -> verify -> accept -> commit
    DDTree  draft -> propose(tree)  -> verify -> accept -> commit
    auto    the same drafted step in one inner loop per menu entry, each running while the
            slots' running forecasts pick its entry; while drafting is not forecast to pay,
            runs of plain_step that queue the drafter's features, then flush
            (kdj/decode/auto.py decides); in the slot pool, a chunk pinned to one entry
            runs that entry alone (`pinned`), and the host picks the entry
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.decode import auto
from kdj.decode import logprobs as lps
from kdj.decode import tree as trees
from kdj.decode.sampling import position_keys, sample
from kdj.decode.state import DecodeState, Plan, Prefilled, init_state
from kdj.decode.step import (
    accept,
    commit,
    draft,
    features,
    flush,
    limits,
    plain_step,
    propose,
    verify,
)

scope = jax.named_scope


@functools.partial(
    jax.jit,
    static_argnames=("tgraph", "dgraph", "greedy", "logprobs"),
    donate_argnames=("tcache", "dcache"),
)
def prefill(tgraph, tstate, dgraph, dstate, tokens, prompt_lens, tcache, dcache, key, temperature,
            top_p, *, greedy, logprobs=None) -> Prefilled:  # fmt: skip
    """Target pass over the right-padded prompts tokens [B, P] (tapping the drafter's feature
    layers when there is one, dgraph not None), the first new token (with its log-probability
    and `logprobs` alternatives, when not None), and the drafter's context for every prompt
    position."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    start = jnp.zeros((tokens.shape[0],), jnp.int32)
    taps = () if drafter is None else drafter.cfg.target_layer_ids
    logits, tcache, tapped = target(
        tokens, start, tcache, taps=taps, logits_at=(prompt_lens - 1)[:, None]
    )
    first = sample(logits[:, 0], position_keys(key, prompt_lens), temperature, top_p, greedy)
    if drafter is not None:
        dcache = drafter.add_context(features(tapped), start, dcache).with_lengths(prompt_lens)
    record = None if logprobs is None else lps.of(logits[:, 0], first, logprobs)
    return Prefilled(first, tcache.with_lengths(prompt_lens), dcache, record)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "plan"), donate_argnames=("pre",))
def decode(tgraph, tstate, dgraph, dstate, pre: Prefilled, max_new, stop_ids, key, temperature,
           top_p, calibration, prior, *, plan: Plan) -> DecodeState:  # fmt: skip
    """Generate until every sequence hit a stop token or its own max_new [B]. prior
    [len(plan.menu)]: auto's tokens per step of each entry before any draft (0 = unknown).
    Returns the final state (`.output()` is what the host reads)."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    width = 0 if drafter is None else target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)
    state = init_state(pre, max_new, stop_ids, key, temperature, top_p, calibration, prior, plan,
                       width)  # fmt: skip
    return run(target, drafter, state, plan)


def running(state: DecodeState, plan: Plan):
    return (state.step < plan.max_steps) & ~jnp.all(state.done)


def body(target, drafter, plan: Plan, going=None):
    """The loop's body for the plan's method: one step (AR, DFlash, DDTree, auto over a menu
    without "none"), or auto's runs of plain and drafted steps (a menu with "none"), whose
    inner loops stop where the loop itself would: `going(state)`, the loop's condition
    (default `running`; the slot pool's stops when a slot finishes, kdj/decode/pool.py)."""
    going = going or (lambda s: running(s, plan))
    if not plan.speculative:

        def step(s):
            with scope("plain_step"):
                return plain_step(target, s, plan.greedy, logprobs=plan.logprobs)

        return step
    if plan.pin is not None:
        return pinned(target, drafter, plan, going)
    if not plan.adaptive:
        return lambda s: drafted_step(target, drafter, s, plan)
    if not plan.can_skip:
        return lambda s: drafted_runs(target, drafter, s, plan, going)
    return lambda s: auto_runs(target, drafter, s, plan, going)


def run(target, drafter, state: DecodeState, plan: Plan) -> DecodeState:
    """The one loop: which body it runs is the plan's method."""
    return jax.lax.while_loop(lambda s: running(s, plan), body(target, drafter, plan), state)


def check(shape, target, taps, plan, dist, full, tcache, last, limit, key, temperature, top_p):
    """propose -> verify -> accept for one menu entry."""
    with scope("propose"):
        tree = propose(shape, dist, full, limit, tcache.capacity - 1 - tcache.lengths)
    with scope("verify"):
        verified = verify(target, tcache, last, tree, taps)
    with scope("accept"):
        acc = accept(tree, verified, limit, key, temperature, top_p, block_size=plan.block_size,
                     greedy=plan.greedy, logprobs=plan.logprobs)  # fmt: skip
    return verified.tcache, acc


def drafted_step(target, drafter, state: DecodeState, plan: Plan, entry: int = 0) -> DecodeState:
    """draft -> propose -> verify -> accept -> commit of the menu's `entry`, plus the step's
    records (auto's: its forecasts of every entry, which pick the entries of later steps)."""
    i, key, active, limit = state.step, state.key, state.active, limits(state)
    L = state.tcache.lengths  # before the step
    context = auto.mean_context(L, active)
    with scope("draft"):
        dist, state = draft(target, drafter, state, plan.block_size)
    with scope("propose"):  # one build of the menu's largest tree: smaller ones are its nodes
        built = auto.largest_tree(plan.shapes)
        full = trees.draft_trees(dist, built, limit) if built else None
    raw = None
    if plan.forecasts:
        with scope("forecast"):
            raw = auto.expected(plan.shapes, dist, full, state.calibration)  # [S, B]
    taps = drafter.cfg.target_layer_ids
    args = (dist, full, state.tcache, state.last, limit, key, state.temperature, state.top_p)
    choice = jnp.int32(entry)
    tcache, acc = check(plan.menu[entry], target, taps, plan, *args)
    with scope("commit"):
        state, count = commit(state, tcache, acc)
        expect = jnp.where(active, raw[choice] if raw is not None else jnp.nan, 0)
        size = jnp.where(active, acc.size, 0)
        state = dataclasses.replace(state, stats=state.stats.record(i, count, size, choice, expect))
    if plan.controlled:
        with scope("control"):
            gains = auto.corrected(raw, auto.pooled(state.auto))
            ctrl = auto.observe(state.auto, plan, raw, gains, choice, acc.a, active, limit, L,
                                state.tcache.capacity)  # fmt: skip
            if plan.can_skip:
                ctrl = auto.decide(ctrl, plan, active, context)
            state = dataclasses.replace(state, auto=ctrl)
    return state


def skip_step(target, drafter, state: DecodeState, plan: Plan) -> DecodeState:
    """auto's plain step: the drafter is skipped; its features are queued."""
    i, active = state.step, state.active
    with scope("plain_step"):
        state = plain_step(target, state, plan.greedy, drafter.cfg.target_layer_ids,
                           plan.logprobs)  # fmt: skip
    ones = active.astype(jnp.int32)
    stats = state.stats.record(i, ones, 0, len(plan.menu), active.astype(jnp.float32))
    return dataclasses.replace(state, stats=stats, auto=auto.skipped(state.auto))


def pinned(target, drafter, plan: Plan, going):
    """The body of a program pinned to one entry of auto's menu (the slot pool's host picks
    it per chunk): its drafted step alone; for "none", plain steps that queue the drafter's
    features until the queue is full, then its flush, so a later drafted chunk finds the
    drafter's context complete."""
    if plan.menu[plan.pin].kind != "none":
        return lambda s: drafted_step(target, drafter, s, plan, plan.pin)
    return lambda s: plain_run(target, drafter, s, plan, going, lambda ctrl, room: room)


def plain_run(target, drafter, state: DecodeState, plan: Plan, going, steps) -> DecodeState:
    """Plain steps that queue the drafter's features, as many as steps(controller, room in
    the queue) says and while `going`, then the queue flushed into the drafter's context."""
    room = state.pending.shape[1] - jnp.max(state.n_pend)
    ctrl = dataclasses.replace(state.auto, left=jnp.asarray(steps(state.auto, room), jnp.int32))
    state = jax.lax.while_loop(
        lambda s: going(s) & (s.auto.left > 0),
        lambda s: skip_step(target, drafter, s, plan),
        dataclasses.replace(state, auto=ctrl),
    )
    with scope("flush"):
        return flush(drafter, state)


def auto_runs(target, drafter, state: DecodeState, plan: Plan, going) -> DecodeState:
    """A run of plain steps (none while drafting pays), the queue flushed into the drafter's
    context, then drafted steps while they are due; each step only while `going`. Inner
    loops, not branches: loop-carried caches update in place, while a lax.cond around the
    target pass makes XLA copy them. A run cut short by `going` resumes at the next body:
    `since` counts its plain steps."""
    state = plain_run(target, drafter, state, plan, going,
                      lambda ctrl, room: auto.plain_run(ctrl, room).left)  # fmt: skip
    return drafted_runs(target, drafter, state, plan, going)


def drafted_runs(target, drafter, state: DecodeState, plan: Plan, going) -> DecodeState:
    """auto's drafted steps while they are due: one inner loop per drafting entry of the menu,
    each running while the slots' running forecasts pick its entry (`auto.pick`). Loops, not
    a lax.switch per step: XLA copies every layer's cache into and out of a conditional whose
    branches write it, and reads its branch index back to the host; a loop's cache is
    updated in place. A change of entry ends the body, and the next one takes it up."""
    for k, shape in enumerate(plan.menu):
        if shape.kind == "none":
            continue

        def due(s, k=k):
            picked = auto.pick(plan, s.auto, s.active, s.tcache.lengths)
            return going(s) & auto.draft_due(s.auto) & (picked == k)

        state = jax.lax.while_loop(
            due, lambda s, k=k: drafted_step(target, drafter, s, plan, k), state
        )
    return state
