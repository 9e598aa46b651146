"""Speculative decoding with a DFlash drafter, as a chain (DFlash) or a tree (DDTree): draft ->
verify -> accept -> compact -> commit, one jitted step, the whole generation one on-device
`lax.while_loop`.

Per sequence b, `L[b]` (= both caches' `lengths`) counts committed tokens whose K/V are in the
target cache; `last[b]` is the newest committed token (not yet in the cache), so a step's root
sits at slot L:

    draft   drafter context += pending target features (positions L - n_pend .. L - 1);
            block [last, MASK x (k - 1)] at L .. L + k - 1 -> per-depth log-probs lp[1..k-1]
    tree    DFlash: the argmax chain (k - 1 nodes); DDTree: the top-B prefixes of lp
            (kdj/decode/tree.py), B = tree_budget; method "auto": `choose` picks one shape
            of a static menu (plain, chains, trees) per step from the drafter's expected
            acceptance and a step-cost model, and `lax.switch` runs it; while drafting
            itself is not forecast to pay, steps skip the drafter (plain decoding that
            queues the target features for the drafter's context)
    verify  target over [last, nodes] at slots L .., positions L + depth, each node seeing the
            past and its ancestors; taps features
    accept  walk from the root along children equal to the target's token (greedy or
            sampled, lossless), capped by cache and token budget: a drafts + bonus
    compact move the accepted nodes' K/V to slots L + 1 .. L + a (no-op for a chain)
    commit  L += a + 1; last = bonus; pending = features of the accepted nodes

Rejected entries stay in both caches past L and are overwritten later ("rollback by length").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.cache import KVCache
from kdj.decode import tree as trees
from kdj.decode.autoregressive import is_stop
from kdj.decode.sampling import sample


def _features(taps):
    """[B, T, K, D] tapped target states -> [B, T, K * D] drafter context features."""
    B, T, K, D = taps.shape
    return taps.reshape(B, T, K * D)


@functools.partial(
    jax.jit, static_argnames=("tgraph", "dgraph", "greedy"), donate_argnames=("tcache", "dcache")
)
def prefill(tgraph, tstate, dgraph, dstate, tokens, prompt_lens, tcache, dcache, key, temperature,
            top_p, *, greedy):  # fmt: skip
    """Target prefill (tapping the drafter's feature layers), first token, and the drafter's
    context cache for every prompt position. Returns (first [B], tcache, dcache)."""
    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    B, P = tokens.shape
    start = jnp.zeros((B,), jnp.int32)
    logits, tcache, taps = target(
        tokens, start, tcache, taps=drafter.cfg.target_layer_ids,
        logits_at=(prompt_lens - 1)[:, None],
    )  # fmt: skip
    first = sample(logits[:, 0], jax.random.fold_in(key, 0), temperature, top_p, greedy)
    dcache = drafter.add_context(_features(taps), start, dcache)
    return first, tcache.with_lengths(prompt_lens), dcache.with_lengths(prompt_lens)


def draft(target, drafter, dcache: KVCache, last, pending, n_pend, k: int):
    """Add pending context, then run the block. Returns (lp [B, k - 1, V] float32 draft
    log-probabilities for depths 1 .. k - 1, dcache). pending [B, P, K*D] holds features of
    positions L - n_pend ..; slots >= n_pend are padding (written past L, masked, overwritten
    later)."""
    B = pending.shape[0]
    L = dcache.lengths
    dcache = drafter.add_context(pending, L - n_pend, dcache)
    block = jnp.full((B, k), drafter.cfg.mask_token_id, jnp.int32).at[:, 0].set(last)
    positions = L[:, None] + jnp.arange(k, dtype=jnp.int32)
    h = drafter(target.embed[...][block], positions, dcache)
    return jax.nn.log_softmax(target.logits(h[:, 1:]), axis=-1), dcache


def expected(shapes, lp, full, calibration):
    """Expected committed tokens [S, B] of every menu shape for every sequence, from the draft
    log-probs lp [B, L, V] recalibrated by temperature `calibration` (fitted on held-out data
    by kdj.train.evaluate.calibrate; 1.0 = as the drafter says). full: the menu's largest tree
    (or None)."""
    lp_cal = jax.nn.log_softmax(lp * (1.0 / calibration), axis=-1)
    rows = [trees.expected_tokens(s, trees.draft_tree(s, lp, full), lp_cal) for s in shapes]
    return jnp.stack(rows)


def choose(shapes, gains, active, cost, context):
    """The adaptive controller: index into `shapes` maximising expected committed tokens per
    predicted second for the whole batch (all rows run the same shape, finished ones too),
    once this step's draft is done (its cost is sunk).

    gains [S, B] from `expected`; active [B]; cost: a kdj.cost.StepCost; context: mean
    committed length of the active sequences."""
    B = gains.shape[1]
    total = jnp.sum(jnp.where(active[None], gains, 0.0), axis=1)
    nodes = [0 if s.kind == "none" else s.size for s in shapes]
    seconds = jnp.stack([cost.seconds(B, 1 + n, context) for n in nodes]).astype(jnp.float32)
    return jnp.argmax(total / seconds)


def largest_tree(shapes) -> int:
    """Nodes of the menu's largest tree (0 without one): what a drafting step builds, since
    every smaller tree of the menu is its first nodes."""
    return max([s.size for s in shapes if s.kind == "tree"], default=0)


def mean_context(lengths, active):
    """Mean committed length [] of the active sequences (lengths [B], active [B])."""
    return jnp.sum(jnp.where(active, lengths, 0)) / jnp.maximum(jnp.sum(active), 1)


def drafting_pays(shapes, gains, active, cost, context, slack=0.0):
    """Whether a step that drafts (draft pass + the best verify of the menu) is expected to
    commit more tokens per second than a plain step that skips the drafter, judged from
    expected tokens gains [S, B] (the loop passes its running mean, TREND_WEIGHT); with
    `slack`, more than (1 - slack) of it (HYSTERESIS). Returns a bool scalar."""
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


# An entry stays on the menu only if it is predicted to beat plain decoding by more than
# MENU_MARGIN. The margin covers what the cost model misses, as measured on the H200: auto's own
# machinery (switching between plain runs and drafted steps, steps drafted on a noisy
# forecast), and the tree steps it underprices at small batch. At batch 4 it priced DDTree 16
# 8% ahead of plain decoding in run h and 12% ahead in run j; the fixed DDTree 16 was 6% and
# 0.4% behind (auto drafting at 0.995 of AR in run j). At batch 1 it priced 18% and got 14%.
MENU_MARGIN = 0.15
# Where `kdj bench` measured the plain and the verify step at this batch size (the cost file's
# residuals make the model exact there), what is left unmeasured is the draft pass (priced by
# the model: with a cost fitted to target steps alone, from bytes and FLOPs only) and auto's
# own machinery: on the H200 at batch 1 auto drafting ran at 1.01x (run j) and 0.98x (run k)
# of the fixed DDTree 16.
MEASURED_MARGIN = 0.03


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


def paying_menu(shapes, cost, batch: int, context: float, prior: float, measured=None):
    """The entries of the menu that can pay at this batch size, chosen once, at trace time
    (host floats): an entry stays when a step that drafts and verifies it, committing the
    tokens per step it is expected to (`entry_tau`), is predicted to beat a plain step by
    MENU_MARGIN (MEASURED_MARGIN where both steps were measured at this batch size). A
    drafting step builds the largest tree
    left on the menu (the smaller ones are its first nodes), so every entry pays for that
    build: a losing largest tree goes first and the rest are priced again. Batch size is
    static in the compiled loop, so an entry that cannot pay on average at this batch is not
    compiled in (a per-step switch that never takes it still costs every step). Only a menu
    with "none" is trimmed, and nothing when the prior is unknown (0). A result of ("none",)
    alone means plain decoding."""
    if prior <= 0 or not any(s.kind == "none" for s in shapes):
        return shapes
    plain = 1.0 / float(cost.seconds(batch, 1, context))

    def pays(s, built):
        step = cost.seconds(batch, 1 + s.size, context) + cost.draft_seconds(batch, context, built)
        exact = cost.measured_at(batch, 1) and cost.measured_at(batch, 1 + s.size)
        margin = MEASURED_MARGIN if exact else MENU_MARGIN
        return entry_tau(s, prior, measured) / float(step) > plain * (1 + margin)

    kept = list(shapes)
    while True:
        built = largest_tree(kept)
        losers = [s for s in kept if s.kind != "none" and not pays(s, built)]
        if not losers:
            return tuple(kept)
        largest = [s for s in losers if s.kind == "tree" and s.size == built]
        kept = [s for s in kept if s not in (largest or losers)]


# A plain step skips the drafter. While drafting does not pay, the loop still drafts now and
# then to refresh its forecast (a probe). Probes are spaced so that they cost about
# PROBE_BUDGET of the decoding time by the cost model (a draft pass is cheap next to a step
# at batch 1 and dear at batch 256), backing off by doubling after each probe that finds
# drafting does not pay, within PROBE_MIN .. PROBE_MAX steps.
PROBE_MIN, PROBE_MAX, PROBE_BUDGET = 8, 256, 0.02

# Plain steps queue the target features the drafter's context will need; a run of plain
# steps ends when the queue is full (or a probe is due), and the run's end costs host round
# trips on the GPU (leaving one while loop, the flush, the outer loop's and the draft loop's
# predicates, entering the next): ~1 ms each on the H200 at batch 4 (BENCHMARKS.md, run e).
# A queue of QUEUE_BLOCKS blocks makes runs that long. Memory: B x QUEUE_BLOCKS x k x the
# drafter's feature width (SmolLM2 at batch 256: 4 x 16 x 2304 bf16 = 75 MB).
QUEUE_BLOCKS = 4

# The drafter's forecast, even recalibrated on held-out data, can be biased on the prompts at
# hand (on the H200, run d: DDTree 16 at batch 1 forecast 0.71 accepted drafts per step and
# got 0.84, so the controller judged a 1.08x win a loss). The loop therefore scales the
# forecast's drafts (gain - 1; the bonus token is certain) by realised / forecast drafts of
# its own drafted steps so far, starting from HITS_PRIOR pseudo-drafts at ratio 1.
HITS_PRIOR = 4.0

# Whether to draft the next steps is judged from a running mean of the drafted steps' (bias-
# corrected) forecasts, not the latest one alone: at small batch one step's forecast says
# little about the next steps' (on the H200, run f: at batch 1 single low forecasts kept
# DDTree 16, a 1.07x win on average, skipped for 113 of 121 steps). The mean weighs the
# drafted steps equally for the first 1 / TREND_WEIGHT, then decays by TREND_WEIGHT per step.
# The calibrated prior counts as HITS_PRIOR drafted steps: in run h's batch-1 prompt (traced
# on the CPU) the first draft after the prompt forecast 1.2 tokens against 1.8 later on, and
# with the prior weighed as one step the H200 run took plain runs for 108 of 119 steps.
TREND_WEIGHT = 0.125

# Draft-or-skip is a two-state switch. Skipping, the loop starts drafting when the running mean
# says drafting pays (from the prior before the first step, or at a probe); drafting, it stops
# only when the running mean says drafting is HYSTERESIS behind plain decoding, not merely
# behind: leaving the drafted loop for a run of plain steps and coming back costs ~2 ms at
# batch 1 on the H200 (run h), more than a mispredicted step.
# (Traced on the CPU with run h's batch-1 prompt and the H200 cost file: without the slack
# the loop drafted 16 of 116 steps, with it all 67, committing 1.90 tokens per step.)
HYSTERESIS = 0.1


def corrected(gains, hits):
    """gains [S, B] with the forecast drafts scaled by hits = [realised, forecast] drafts
    summed over this run's drafted steps (each started at HITS_PRIOR)."""
    return 1.0 + (gains - 1.0) * (hits[0] / hits[1])


def probe_wait(shapes, cost, batch: int, context, wait):
    """Plain steps until the next probe, after one that found drafting does not pay (wait:
    the previous interval)."""
    ratio = cost.draft_seconds(batch, context, largest_tree(shapes)) / cost.seconds(
        batch, 1, context
    )
    need = jnp.ceil(ratio / PROBE_BUDGET).astype(jnp.int32)
    return jnp.clip(jnp.maximum(2 * wait, need), PROBE_MIN, PROBE_MAX)


@functools.partial(
    jax.jit,
    static_argnames=("tgraph", "dgraph", "greedy", "max_steps", "block_size", "shapes", "cost"),
    donate_argnames=("tcache", "dcache"),
)
def decode_loop(tgraph, tstate, dgraph, dstate, tcache, dcache, first, max_new, stop_ids, key,
                temperature, top_p, calibration, prior, *, greedy, max_steps, block_size,
                shapes, cost):  # fmt: skip
    """Speculative generation until every sequence hit a stop token or its own max_new.

    shapes: the static menu of trees.DraftShape a step may verify; with one entry every step
    verifies it (DFlash: chain k - 1; DDTree: tree B), with several the controller (`choose`,
    needs `cost`) picks one per step and `lax.switch` runs it. With "none" on a menu of
    several, a step whose draft is not expected to pay (`drafting_pays`, from the running
    mean of the drafted steps' forecasts) skips the drafter and decodes plainly; drafting
    resumes at the next probe (`probe_wait`) that finds it pays. prior [len(shapes)] (or one
    for all): tokens per step each entry is expected to commit before the first draft (its
    calibration run's realised tau; 1 for "none"; 0 = unknown): when it says drafting does
    not pay, the first step is plain and the first probe comes later, else the first step
    drafts; it also starts the running mean. max_steps = max(max_new).
    Returns (out [B, max_steps] int32, n_out [B], taus [B, max_steps] (tokens committed per
    step, 0 once finished), sizes [B, max_steps] (draft nodes verified per step), choices
    [max_steps] (index into shapes per step; len(shapes): the drafter was skipped), expected
    [B, max_steps] (tokens the drafter expected each step to commit), steps, tcache, dcache).
    """
    target, drafter = nnx.merge(tgraph, tstate), nnx.merge(dgraph, dstate)
    k = block_size
    B = first.shape[0]
    S = tcache.capacity
    N = max_steps  # = max(max_new): each step commits >= 1 token and never passes max_new
    D = target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)
    out = jnp.zeros((B, N), jnp.int32).at[:, 0].set(first)
    n = jnp.ones((B,), jnp.int32)
    done = is_stop(first, stop_ids) | (n >= max_new)
    taus = jnp.zeros((B, max_steps), jnp.int32)
    adaptive = len(shapes) > 1
    # "none" on a menu of several: steps may skip the drafter altogether
    can_skip = adaptive and any(s.kind == "none" for s in shapes)
    # the feature queue: k slots for a drafted step's accepted nodes, more for plain runs
    pending = jnp.zeros((B, k * (QUEUE_BLOCKS if can_skip else 1), D), tcache.k[0].dtype)
    n_pend = jnp.zeros((B,), jnp.int32)
    built = largest_tree(shapes)
    most_nodes = max(0 if s.kind == "none" else s.size for s in shapes)

    def verify(shape, lp, full, tcache, last, limit, step_key):
        """One target pass over root + the shape's tree, acceptance walk and compaction."""
        L = tcache.lengths
        tree = trees.draft_tree(shape, lp, full)
        tokens, positions, mask, valid = trees.verify_inputs(tree, last, L, S)
        logits, tcache, taps = target(
            tokens, L, tcache, positions=positions, tree=mask, taps=drafter.cfg.target_layer_ids
        )
        path, a, bonus = trees.accept_tree(
            tree, valid, logits, step_key, temperature, top_p, limit, max_depth=k - 1,
            greedy=greedy,
        )  # fmt: skip
        accepted = jnp.take_along_axis(tokens, path[:, 1:], axis=1)  # [B, k - 1]
        feats = jnp.take_along_axis(_features(taps), path[:, :, None], axis=1)  # [B, k, K*D]
        # compaction runs after the switch, outside any branch: inside one, XLA copies the
        # whole cache every step to keep the branch's in-place updates safe
        return tcache, a, bonus, accepted, feats.astype(pending.dtype), valid.sum(1), path

    def cond(c):
        return (c["step"] < max_steps) & ~jnp.all(c["done"])

    def drafted(c, active, limit, step_key, context):
        """A step that drafts: draft, pick the menu entry (adaptive), verify it."""
        # n_pend <= k here: a plain run ends with a flush, a drafted step queues its a + 1
        queued = c["pending"][:, :k]
        lp, dcache = draft(target, drafter, c["dcache"], c["last"], queued, c["n_pend"], k)
        # one build of the menu's largest tree; smaller trees are its first nodes
        full = trees.build_trees(lp, built) if built else None
        args = (lp, full, c["tcache"], c["last"], limit, step_key)
        raw = expected(shapes, lp, full, calibration)  # [S, B]
        gains = corrected(raw, c["hits"])
        if adaptive:
            choice = choose(shapes, gains, active, cost, context)
            branches = [functools.partial(verify, shape) for shape in shapes]
            res = jax.lax.switch(choice, branches, *args)
        else:
            choice = jnp.int32(0)
            res = verify(shapes[0], *args)
        return (*res, dcache, choice.astype(jnp.int32), gains, raw)

    def active_context(c):
        """(active [B], mean committed length of the active sequences)."""
        active = ~c["done"]
        return active, mean_context(c["tcache"].lengths, active)

    def step_inputs(c):
        L = c["tcache"].lengths
        active, context = active_context(c)
        # Commit at most up to the cache end (slots L .. L + a must exist) and the budget.
        limit = jnp.where(active, jnp.maximum(jnp.minimum(S - 1 - L, max_new - c["n"] - 1), 0), 0)
        step_key = jax.random.fold_in(key, c["step"] + 1)
        return c, active, limit, step_key, context

    def commit(c, res, active, limit):
        """Compact, emit the accepted tokens + bonus (cut after a stop), advance the carry.
        limit [B]: the drafts this step could accept (step_inputs)."""
        tcache, a, bonus, accepted, feats, size, path, dcache, choice, gains, raw = res
        tcache = trees.compact(tcache, path, a)
        L = c["tcache"].lengths
        j = jnp.arange(k)
        emitted = jnp.where(
            j[None] < a[:, None], jnp.pad(accepted, ((0, 0), (0, 1))), bonus[:, None]
        )
        valid_out = j[None] <= a[:, None]
        stop_at = valid_out & jnp.any(emitted[..., None] == stop_ids[:, None, :], axis=-1)
        first_stop = jnp.argmax(stop_at, axis=1)
        count = jnp.where(stop_at.any(1), first_stop + 1, a + 1)
        count = jnp.where(active, count, 0)
        cols = jnp.where(j[None] < count[:, None], c["n"][:, None] + j[None], N)
        out = c["out"].at[jnp.arange(B)[:, None], cols].set(emitted, mode="drop")
        n = c["n"] + count
        done = c["done"] | (active & (stop_at.any(1) | (n >= max_new)))
        L_new = jnp.where(active, L + a + 1, L)
        # what the drafter expected this step to commit (before stop/limit cuts)
        expect = jnp.where(active, raw[choice], 0)
        # the forecast's bias: rows whose limit could cut the walk short, or whose tree could
        # lose nodes at the cache end (verify_inputs), do not count
        full_walk = active & (limit >= k - 1) & (L + 1 + most_nodes <= S)
        hits = c["hits"] + jnp.stack(
            [jnp.sum(jnp.where(full_walk, a, 0)), jnp.sum(jnp.where(full_walk, raw[choice] - 1, 0))]
        ).astype(jnp.float32)
        w = jnp.maximum(TREND_WEIGHT, 1.0 / (c["drafts"] + 1))
        trend = jnp.where(active[None], (1 - w) * c["trend"] + w * gains, c["trend"])
        running = jnp.any(active)  # a step with nothing left to run records nothing
        i = jnp.where(running, c["step"], max_steps)  # out of range: dropped
        return {
            **c,
            "tcache": tcache.with_lengths(L_new),
            "dcache": dcache.with_lengths(L_new),
            "last": jnp.where(active, bonus, c["last"]),
            "pending": c["pending"].at[:, :k].set(feats),
            "n_pend": jnp.where(active, a + 1, 0),
            "out": out,
            "n": n,
            "done": done,
            "taus": c["taus"].at[:, i].set(count, mode="drop"),
            "sizes": c["sizes"].at[:, i].set(jnp.where(active, size, 0), mode="drop"),
            "choices": c["choices"].at[i].set(choice, mode="drop"),
            "expected": c["expected"].at[:, i].set(expect, mode="drop"),
            "trend": trend,
            "drafts": c["drafts"] + 1,
            "hits": hits,
            "step": c["step"] + running.astype(jnp.int32),
        }

    def draft_due(c):
        """Draft while in the drafting state (see HYSTERESIS), or when a probe is due."""
        return c["drafting"] | (c["since"] >= c["wait"])

    def plain_body(c):
        """A step that skips the drafter, built like plain decoding's (autoregressive.py): a
        one-token target pass that also taps the features the drafter's context will take
        in; they are queued in `pending` (slots L - n_pend ..) until `flush`."""
        L, active = c["tcache"].lengths, ~c["done"]
        logits, tcache, taps = target(
            c["last"][:, None], L, c["tcache"], taps=drafter.cfg.target_layer_ids
        )
        step_key = jax.random.fold_in(key, c["step"] + 1)
        nxt = sample(logits[:, 0], step_key, temperature, top_p, greedy)
        rows = jnp.arange(B)
        out = c["out"].at[rows, jnp.where(active, c["n"], N)].set(nxt, mode="drop")
        n = c["n"] + active
        done = c["done"] | (active & (is_stop(nxt, stop_ids) | (n >= max_new)))
        feats = _features(taps)[:, 0].astype(pending.dtype)
        i = jnp.where(jnp.any(active), c["step"], max_steps)  # nothing left: record nothing
        return {
            **c,
            "tcache": tcache.with_lengths(L + active),
            "last": jnp.where(active, nxt, c["last"]),
            "pending": c["pending"].at[rows, c["n_pend"]].set(feats, mode="drop"),
            "n_pend": jnp.where(active, c["n_pend"] + 1, 0),
            "out": out,
            "n": n,
            "done": done,
            "taus": c["taus"].at[:, i].set(active.astype(jnp.int32), mode="drop"),
            "choices": c["choices"].at[i].set(len(shapes), mode="drop"),
            "expected": c["expected"].at[:, i].set(active.astype(jnp.float32), mode="drop"),
            "step": c["step"] + jnp.any(active).astype(jnp.int32),
            "since": c["since"] + 1,
            "left": c["left"] - 1,
        }

    def flush(c):
        """The drafter's context takes in the queued features (a plain run's, and before them
        the last drafted step's)."""
        L = c["tcache"].lengths
        dcache = drafter.add_context(c["pending"], L - c["n_pend"], c["dcache"])
        return {**c, "dcache": dcache.with_lengths(L), "n_pend": jnp.zeros_like(c["n_pend"])}

    def drafted_body(c):
        ops = step_inputs(c)
        active, context = ops[1], ops[4]
        c = commit(c, drafted(*ops), active, ops[2])
        if can_skip:  # after a draft: stay in (or enter) the drafting state, else back off
            slack = jnp.where(c["drafting"], HYSTERESIS, 0.0)  # stay within it; enter: pay
            drafting = drafting_pays(shapes, c["trend"], active, cost, context, slack)
            later = probe_wait(shapes, cost, B, context, c["wait"])
            c = {**c, "drafting": drafting, "wait": jnp.where(drafting, PROBE_MIN, later),
                 "since": jnp.int32(0)}  # fmt: skip
        return c

    def body(c):
        if not can_skip:
            return drafted_body(c)
        # The controller decides once per run of plain steps how many to take: none while
        # drafting pays, else until the next probe or until the feature queue is full. Plain
        # and drafting steps run as inner loops, not branches: loop-carried caches are
        # updated in place, while a lax.cond around the target pass makes XLA copy them.
        room = c["pending"].shape[1] - jnp.max(c["n_pend"])
        left = jnp.where(c["drafting"], 0, jnp.clip(c["wait"] - c["since"], 0, room))
        c = jax.lax.while_loop(lambda c: cond(c) & (c["left"] > 0), plain_body, {**c, "left": left})
        c = flush(c)
        return jax.lax.while_loop(lambda c: cond(c) & draft_due(c), drafted_body, c)

    # Before any draft: each entry is expected to commit its `prior` tokens per step (1 when
    # it is unknown, and then the first step drafts to find out).
    prior = jnp.broadcast_to(jnp.asarray(prior, jnp.float32), (len(shapes),))
    known = jnp.all(prior > 0)
    gains = jnp.broadcast_to(jnp.where(known, prior, 1.0)[:, None], (len(shapes), B))
    wait, doubt = jnp.int32(0), jnp.bool_(False)
    if can_skip:
        active = ~done
        context = mean_context(tcache.lengths, active)
        doubt = known & ~drafting_pays(shapes, gains, active, cost, context)
        wait = jnp.where(doubt, probe_wait(shapes, cost, B, context, 0), 0)
    carry = {
        "tcache": tcache, "dcache": dcache, "last": first, "pending": pending, "n_pend": n_pend,
        "out": out, "n": n, "done": done, "taus": taus, "sizes": jnp.zeros_like(taus),
        "choices": jnp.full((max_steps,), -1, jnp.int32),
        "expected": jnp.zeros((B, max_steps), jnp.float32), "step": jnp.int32(0),
        # running mean of the drafted steps' expected tokens per menu entry and sequence
        "trend": gains, "drafts": jnp.where(known, HITS_PRIOR, 0.0).astype(jnp.float32),
        "hits": jnp.full((2,), HITS_PRIOR, jnp.float32),  # realised, forecast drafts (corrected)
        "wait": wait, "since": jnp.int32(0), "left": jnp.int32(0),
        "drafting": ~doubt,  # the draft-or-skip state (HYSTERESIS)
    }  # fmt: skip
    c = jax.lax.while_loop(cond, body, carry)
    return (c["out"], c["n"], c["taus"], c["sizes"], c["choices"], c["expected"], c["step"],
            c["tcache"], c["dcache"])  # fmt: skip
