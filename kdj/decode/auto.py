"""method="auto": the menu, its pricing before compiling, and the per-step controller.

A menu is a static tuple of DraftShapes ("none", "chainN", "treeN"), all compiled into one
program. Before compiling, `paying_menu` drops the entries the cost model says cannot pay at
this batch size. In the loop, a drafted step forecasts every entry's committed tokens from the
drafter's own probabilities (`expected`) into a running mean per slot; from it `pick` takes
the entry of the best tokens per second for the next drafted steps, and while drafting itself
is not forecast to pay (`drafting_pays`) steps skip the drafter, re-drafting at probes
(`probe_wait`) to refresh the forecast.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kdj.cost import StepCost
from kdj.decode import tree as trees
from kdj.decode.tree import DraftShape

# What a step may verify by default. A drafting step builds the menu's largest tree to
# forecast every entry, so each entry costs every drafted step: tree256 gave +0.3 tau over
# tree64 for a 65% slower step (SmolLM2 pair, batch 16, H200).
DEFAULT_MENU = ("none", "chain", "tree16", "tree64")

# An entry stays on the menu only when predicted to beat plain decoding by this much: the
# cost model misses auto's own switching overhead and underprices small-batch tree steps.
MENU_MARGIN = 0.15
# Where both steps were measured at this batch size the model is exact there; what is left
# unpriced is the draft pass and auto's own overhead, a few percent.
MEASURED_MARGIN = 0.03
# Probes spaced to cost about PROBE_BUDGET of decoding by the cost model, doubling after each
# probe that finds drafting does not pay, within PROBE_MIN .. PROBE_MAX plain steps.
PROBE_MIN, PROBE_MAX, PROBE_BUDGET = 8, 256, 0.02
# Queue blocks of features for plain runs: each run's end costs ~1 ms of host round trips on
# the GPU, so runs must be long; memory is B x QUEUE_BLOCKS x block x feature width.
QUEUE_BLOCKS = 4
# Pseudo-drafts (at ratio 1) that start the realised / forecast bias correction: the
# forecast, even calibrated, can be biased on the prompts at hand.
HITS_PRIOR = 4.0
# Running-mean weight of the drafted steps' forecasts: one step's forecast says little about
# the next at small batch; the calibrated prior counts as HITS_PRIOR drafted steps.
TREND_WEIGHT = 0.125
# Once drafting, stop only when drafting is this far behind plain decoding: leaving the
# drafted loop and coming back costs more than a mispredicted step.
HYSTERESIS = 0.1


# ---------------------------------------------------------------------- the menu, priced
def parse_menu(method, menu, block_size, tree_budget) -> tuple[DraftShape, ...]:
    """The static tuple of DraftShapes the step may verify, parsed and checked."""
    if method == "dflash":
        return (DraftShape("chain", block_size - 1),)
    if method == "ddtree":
        return (DraftShape("tree", tree_budget),)
    shapes = []
    for item in DEFAULT_MENU if menu is None else menu:
        item = str(item)
        kind = item.rstrip("0123456789")
        size = item[len(kind) :]
        if kind == "chain":
            size = size or block_size - 1
        try:
            shape = DraftShape(kind, int(size or 0))
        except ValueError as e:
            msg = f"bad menu entry {item!r}: {e}; use none, chain, chainN or treeN"
            raise ValueError(msg) from None
        if kind == "chain" and not 1 <= shape.size <= block_size - 1:
            raise ValueError(f"menu entry {item!r}: a chain holds 1..{block_size - 1} drafts")
        shapes.append(shape)
    if not shapes or len(set(shapes)) != len(shapes):
        raise ValueError(f"menu needs distinct entries (got {list(menu or DEFAULT_MENU)})")
    return tuple(shapes)


@functools.lru_cache(maxsize=8)  # a pure function of the config: a bounded memo
def _default_cost(cfg) -> StepCost:
    return StepCost.for_config(cfg)


def step_cost(cost, target, drafter) -> StepCost:
    """`cost` (a StepCost, its JSON path, or None: an estimate from the target's shapes)
    with the drafter's pass added when the cost knows only target steps."""
    cost = _default_cost(target.cfg) if cost is None else cost
    cost = cost if isinstance(cost, StepCost) else StepCost.load(cost)
    if not cost.draft_bytes:
        n_params = sum(int(x.size) for x in jax.tree.leaves(drafter.state))
        cost = cost.with_drafter(drafter.cfg, n_params, target.cfg)
    return cost


def entry_tau(shape, prior: float, measured=None) -> float:
    """Tokens per step a menu entry is expected to commit before any draft: 1 for "none";
    the tau its calibration run realised (`measured`, by entry name: "chain15", "tree64"); else
    that of the smallest measured entry of its kind that is at least as large (a chain or
    tree holds the smaller ones of its kind as its first nodes, so it accepts at least as much:
    an optimistic bound); else `prior`."""
    if shape.kind == "none":
        return 1.0
    measured = measured or {}
    if str(shape) in measured:
        return float(measured[str(shape)])
    sizes = {int(name[len(shape.kind) :]): tau for name, tau in measured.items()
             if name.rstrip("0123456789") == shape.kind}  # fmt: skip
    larger = [size for size in sizes if size >= shape.size]
    return float(sizes[min(larger)]) if larger else float(prior)


def priors(shapes, drafter) -> list[float]:
    """Each entry's tau before the first draft (0 = unknown: the first step drafts)."""
    if drafter.prior_acceptance <= 0:
        return [0.0] * len(shapes)
    return [entry_tau(s, drafter.prior_acceptance, drafter.entry_acceptance) for s in shapes]


def largest_tree(shapes) -> int:
    """Nodes of the menu's largest tree (0 without one): what a drafting step builds, since
    every smaller tree of the menu is its first nodes."""
    return max([s.size for s in shapes if s.kind == "tree"], default=0)


def entry_rate(shape, cost, batch: int, context: float, built: int, prior: float,
               measured=None) -> float:  # fmt: skip
    """Tokens per second one sequence commits with menu entry `shape` by the cost model (host
    floats): its expected tau (`entry_tau`) per step that drafts, building a tree of `built`
    nodes, and verifies it; for "none", one token per plain step."""
    if shape.kind == "none":
        return 1.0 / float(cost.seconds(batch, 1, context))
    step = cost.seconds(batch, 1 + shape.size, context) + cost.draft_seconds(batch, context, built)
    return entry_tau(shape, prior, measured) / float(step)


def paying_menu(shapes, cost, batch: int, context: float, prior: float, measured=None):
    """The entries of the menu that can pay at this batch size, chosen once, at trace time
    (host floats): an entry stays when a step that drafts and verifies it, committing the
    tokens per step it is expected to (`entry_tau`), is predicted to beat a plain step by
    MENU_MARGIN (MEASURED_MARGIN where both steps were measured at this batch size). A
    drafting step builds the largest tree left on the menu (the smaller ones are its first
    nodes), so every entry pays for that build: a losing largest tree goes first and the rest
    are priced again; it also goes where the entries measured by name (the calibration's)
    are predicted to do better without its build. Batch size is static in the compiled
    loop, so an entry that cannot pay on average at this batch is not compiled in (a
    per-step switch that never takes it still costs every step). Only a menu with "none" is
    trimmed, and nothing when the prior is unknown (0). A result of ("none",) alone means
    plain decoding."""
    if prior <= 0 or not any(s.kind == "none" for s in shapes):
        return shapes
    plain = entry_rate(DraftShape("none"), cost, batch, context, 0, prior)

    def rate(s, built) -> float:
        return entry_rate(s, cost, batch, context, built, prior, measured)

    def pays(s, built):
        exact = cost.measured_at(batch, 1) and cost.measured_at(batch, 1 + s.size)
        margin = MEASURED_MARGIN if exact else MENU_MARGIN
        return rate(s, built) > plain * (1 + margin)

    def best(kept) -> float:
        """The best rate of the entries measured by name (bounds do not count: they are
        optimistic), each step building the largest tree of `kept`."""
        built = largest_tree(kept)
        named = [s for s in kept if s.kind != "none" and str(s) in (measured or {})]
        return max((rate(s, built) for s in named), default=0.0)

    kept = list(shapes)
    while True:
        built = largest_tree(kept)
        smaller = [s for s in kept if not (s.kind == "tree" and s.size == built)]
        if built and best(smaller) > best(kept):  # the rest do better without its build
            kept = smaller
            continue
        losers = [s for s in kept if s.kind != "none" and not pays(s, built)]
        if not losers:
            return tuple(kept)
        largest = [s for s in losers if s.kind == "tree" and s.size == built]
        kept = [s for s in kept if s not in (largest or losers)]


# ---------------------------------------------------------------------- in the loop
def expected(shapes, draft, full, calibration):
    """Expected committed tokens [S, B] of every menu shape for every sequence, from the
    draft (a tree.Draft) recalibrated by temperature `calibration` (fitted on held-out data
    by kdj.train.calibrate; 1.0 = as the drafter says). full: the menu's largest tree (or
    None)."""
    rows = [trees.expected_tokens(s, trees.draft_tree(s, draft, full), draft, calibration)
            for s in shapes]  # fmt: skip
    return jnp.stack(rows)


def choose(shapes, gains, active, cost, context):
    """Index into `shapes` maximising expected committed tokens per predicted second for the
    whole batch (all rows run the same shape, finished ones too), the draft's cost aside (a
    drafted step pays it whatever it verifies). gains [S, B]: forecasts as `expected` gives
    them; active [B]; context: mean committed length of the active sequences."""
    B = gains.shape[1]
    total = jnp.sum(jnp.where(active[None], gains, 0.0), axis=1)
    nodes = [0 if s.kind == "none" else s.size for s in shapes]
    seconds = jnp.stack([cost.seconds(B, 1 + n, context) for n in nodes]).astype(jnp.float32)
    return jnp.argmax(total / seconds).astype(jnp.int32)


def pick(plan, ctrl, active, lengths):
    """The menu index [] of the entry auto's next drafted step verifies: of the drafting
    entries (never "none": skipping the drafter is `decide`'s), the one the slots' running
    forecasts (ctrl.trend) say commits the most tokens per second."""
    drafting = [i for i, s in enumerate(plan.menu) if s.kind != "none"]
    shapes = tuple(plan.menu[i] for i in drafting)
    trend = ctrl.trend[jnp.asarray(drafting)]
    best = choose(shapes, trend, active, plan.cost, mean_context(lengths, active))
    return jnp.asarray(drafting, jnp.int32)[best]


def mean_context(lengths, active):
    """Mean committed length [] of the active sequences (lengths [B], active [B])."""
    return jnp.sum(jnp.where(active, lengths, 0)) / jnp.maximum(jnp.sum(active), 1)


def drafting_pays(shapes, gains, active, cost, context, slack=0.0):
    """Whether a step that drafts (draft pass + the best verify of the menu) is expected to
    commit more tokens per second than a plain step that skips the drafter, judged from
    expected tokens gains [S, B] (the loop passes its running mean); with `slack`, more than
    (1 - slack) of it (HYSTERESIS). Returns a bool scalar."""
    B = gains.shape[1]
    total = jnp.sum(jnp.where(active[None], gains, 0.0), axis=1)
    draft_s = cost.draft_seconds(B, context, largest_tree(shapes))
    rates = [
        total[i] / (cost.seconds(B, 1 + s.size, context) + draft_s)
        for i, s in enumerate(shapes)
        if s.kind != "none"
    ]
    plain = jnp.sum(active) / cost.seconds(B, 1, context)
    return jnp.max(jnp.stack(rates)) > plain * (1.0 - slack)


def corrected(gains, hits):
    """gains [S, B] with the forecast drafts scaled by hits = [realised, forecast] drafts
    summed over this run's drafted steps (each started at HITS_PRIOR: `pooled`)."""
    return 1.0 + (gains - 1.0) * (hits[0] / hits[1])


def pooled(ctrl) -> jax.Array:
    """The bias correction's [realised, forecast] drafts [2]: every slot's full walks, over
    HITS_PRIOR of each (the drafter's bias is judged on all the prompts at hand)."""
    return HITS_PRIOR + jnp.sum(ctrl.hits, axis=1)


def probe_wait(shapes, cost, batch: int, context, wait):
    """Plain steps until the next probe, after one that found drafting does not pay (wait:
    the previous interval)."""
    draft_s = cost.draft_seconds(batch, context, largest_tree(shapes))
    need = jnp.ceil(draft_s / cost.seconds(batch, 1, context) / PROBE_BUDGET).astype(jnp.int32)
    return jnp.clip(jnp.maximum(2 * wait, need), PROBE_MIN, PROBE_MAX)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Controller:
    """The controller's part of the decode state: what it has seen per slot (reset when the
    pool admits a request into one), and the draft-or-skip state of the whole batch (every
    row runs the same step)."""

    trend: jax.Array  # [S, B] running mean of each slot's drafted steps' corrected forecasts
    drafts: jax.Array  # [B] float32 drafted steps behind trend (the prior counts HITS_PRIOR)
    hits: jax.Array  # [2, B] float32 realised, forecast drafts of each slot's full walks
    wait: jax.Array  # [] int32 plain steps between probes
    since: jax.Array  # [] int32 plain steps since the last draft
    left: jax.Array  # [] int32 plain steps left in the current run
    drafting: jax.Array  # [] bool the draft-or-skip state (HYSTERESIS)


def fresh_rows(plan, prior, B: int):
    """(trend [S, B], drafts [B], known []) before any draft: each entry expected to commit
    its `prior` tokens per step (1 when unknown)."""
    S = len(plan.menu)
    prior = jnp.broadcast_to(jnp.asarray(prior, jnp.float32), (S,))
    known = jnp.all(prior > 0)
    trend = jnp.broadcast_to(jnp.where(known, prior, 1.0)[:, None], (S, B))
    drafts = jnp.full((B,), jnp.where(known, HITS_PRIOR, 0.0), jnp.float32)
    return trend, drafts, known


def init_controller(plan, prior, lengths, active) -> Controller:
    """Before any draft each entry is expected to commit its `prior` tokens per step (1 when
    unknown, and then the first step drafts to find out)."""
    B = lengths.shape[0]
    gains, drafts, known = fresh_rows(plan, prior, B)
    wait, doubt = jnp.int32(0), jnp.bool_(False)
    if plan.can_skip:
        context = mean_context(lengths, active)
        doubt = known & ~drafting_pays(plan.menu, gains, active, plan.cost, context)
        wait = jnp.where(doubt, probe_wait(plan.menu, plan.cost, B, context, 0), 0)
    return Controller(
        trend=gains,
        drafts=drafts,
        hits=jnp.zeros((2, B), jnp.float32),
        wait=jnp.asarray(wait, jnp.int32),
        since=jnp.int32(0),
        left=jnp.int32(0),
        drafting=~doubt,
    )


def observe(ctrl: Controller, plan, raw, gains, choice, a, active, limit, lengths, capacity):
    """Fold a drafted step into the running mean and the bias correction. raw / gains [S, B]:
    its forecasts before / after correction; a [B]: drafts accepted; lengths: before the
    step. Rows whose walk a limit or the cache end could cut short do not count."""
    most = max(0 if s.kind == "none" else s.size for s in plan.menu)
    full_walk = active & (limit >= plan.block_size - 1) & (lengths + 1 + most <= capacity)
    seen = jnp.stack([jnp.where(full_walk, a, 0), jnp.where(full_walk, raw[choice] - 1, 0)])
    w = jnp.maximum(TREND_WEIGHT, 1.0 / (ctrl.drafts + 1))
    trend = jnp.where(active[None], (1 - w) * ctrl.trend + w * gains, ctrl.trend)
    hits = ctrl.hits + seen.astype(jnp.float32)
    return dataclasses.replace(ctrl, trend=trend, drafts=ctrl.drafts + active, hits=hits)


def decide(ctrl: Controller, plan, active, context) -> Controller:
    """After a drafted step: stay in (or enter) the drafting state, else back off to a
    probe. Drafting stays while within HYSTERESIS of paying; entering it must pay."""
    slack = jnp.where(ctrl.drafting, HYSTERESIS, 0.0)
    drafting = drafting_pays(plan.menu, ctrl.trend, active, plan.cost, context, slack)
    later = probe_wait(plan.menu, plan.cost, active.shape[0], context, ctrl.wait)
    wait = jnp.where(drafting, PROBE_MIN, later)
    return dataclasses.replace(ctrl, drafting=drafting, wait=wait, since=jnp.int32(0))


def plain_run(ctrl: Controller, room) -> Controller:
    """Plain steps to take now: none while drafting pays, else until the next probe or until
    the feature queue (`room` free slots) is full."""
    left = jnp.where(ctrl.drafting, 0, jnp.clip(ctrl.wait - ctrl.since, 0, room))
    return dataclasses.replace(ctrl, left=left.astype(jnp.int32))


def draft_due(ctrl: Controller):
    """Draft while in the drafting state, or when a probe is due."""
    return ctrl.drafting | (ctrl.since >= ctrl.wait)


def skipped(ctrl: Controller) -> Controller:
    """Count a plain step of a run."""
    return dataclasses.replace(ctrl, since=ctrl.since + 1, left=ctrl.left - 1)


def remenu(ctrl: Controller, menu, plan, prior) -> Controller:
    """Per-slot forecasts [S, B] re-indexed from the entries of `menu` to plan's menu (a pool
    moved to a width whose priced menu differs): an entry on both keeps each slot's forecast;
    one new to the slots starts from its prior (prior [len(plan.menu)]), as a newcomer's."""
    fresh, _, _ = fresh_rows(plan, prior, ctrl.trend.shape[1])
    rows = [ctrl.trend[menu.index(s)] if s in menu else fresh[i]
            for i, s in enumerate(plan.menu)]  # fmt: skip
    return dataclasses.replace(ctrl, trend=jnp.stack(rows))
