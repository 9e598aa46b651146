"""Self-calibration of method="auto": time this machine's steps, fit a StepCost, cache it.

A tuning pass times, at one batch bucket (the next power of two of the batch), a target pass
over T = 1 + n tokens for every n the menu verifies, and a whole drafted step (draft, tree,
verify, accept, commit: kdj/decode/loop.py's `drafted_step`) for every drafted entry, each
repeated in one on-device loop (as generate runs it); all of them compile together, in
threads, before any is timed (compiling is most of a pass). `StepCost.fit` turns
them into coefficients and `with_residuals` makes the target passes exact where they were
timed.

The result is cached as JSON under the user's cache directory ($XDG_CACHE_HOME or ~/.cache,
then kdj/costs/), one file per key: kdj version, device kind, dtype, the target's and the
drafter's shapes, batch bucket. auto reads a cached cost when there is one. Without one, on
an accelerator, auto's first use at a batch bucket runs the pass and says so on stderr
(a committed cost file, fitted on another machine, drafter or kdj, is an override, never the
default); on the CPU, where a pass over a real model takes minutes, auto prices with the
estimate from the model's shapes. A pool (kdj serve, generate with max_batch) prices a ladder
of widths: one pass times its smallest, middle and largest and fits one cost for them all.
`kdj tune` or generate(cost="tune") runs a pass anywhere; cost="estimate" never does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.metadata
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kdj.cache import init_cache
from kdj.cost import StepCost
from kdj.decode import loop
from kdj.decode import tree as trees
from kdj.decode.sampling import request_keys
from kdj.decode.state import Plan, Prefilled, init_state
from kdj.decode.step import verify

REPS = 8  # steps per timed call, run on the device in one loop
CALLS = 3  # timed calls per step after its compile (the median is kept)
CONTEXT = 256  # committed tokens per sequence while timing, unless asked otherwise


class Timing(NamedTuple):
    """One timed step of a tuning pass."""

    batch: int
    tokens: int  # verified per sequence (1 + nodes)
    context: int
    seconds: float  # median
    drafted: bool  # a whole drafted step (draft pass + tree + verify + accept + commit)
    nodes: int  # tree nodes its draft pass built (0: a chain, or no draft)
    entry: str  # what was timed: "target", or a menu entry ("chain15", "tree64")

    @property
    def name(self) -> str:
        return f"verify {self.tokens}" if self.entry == "target" else self.entry


def bucket(batch: int) -> int:
    """The batch bucket a cost is tuned and cached for: the next power of two."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return 1 << (batch - 1).bit_length()


def cache_dir() -> Path:
    """Where tuned costs live: $XDG_CACHE_HOME/kdj/costs, else ~/.cache/kdj/costs."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "kdj" / "costs"


def _version() -> str:
    try:
        return importlib.metadata.version("kdj")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def key(target, drafter, batch: int) -> str:
    """The cache key: kdj version, device kind, dtype, model shapes (a hash of both configs),
    batch bucket."""
    device = jax.devices()[0].device_kind.replace(" ", "-").replace("/", "-")
    shapes = hashlib.sha256(repr((target.cfg, drafter.cfg)).encode()).hexdigest()[:16]
    dtype = jnp.dtype(target.dtype).name
    return f"kdj{_version()}_{device}_{dtype}_{shapes}_b{bucket(batch)}"


def cached(target, drafter, batch: int) -> StepCost | None:
    """The tuned cost of this pair on this machine at this batch bucket, if a pass saved one."""
    path = cache_dir() / f"{key(target, drafter, batch)}.json"
    return StepCost.load(path) if path.exists() else None


def tune(target, drafter, shapes, batch: int, context: int = CONTEXT, progress=sys.stderr):
    """Time the steps of menu `shapes` (DraftShapes) at batch bucket(batch), fit and save the
    cost. Returns (StepCost, [Timing], path). `progress`: a stream for the progress bar (None:
    silent)."""
    tick = _bar(progress, _steps_per_bucket(shapes))
    timings = _timings(target, drafter, shapes, bucket(batch), context, tick)
    cost = _fit(target, drafter, timings)
    return cost, timings, _save(cost, target, drafter, batch)


def tune_widths(target, drafter, shapes, widths, context: int = CONTEXT, progress=sys.stderr):
    """One cost for a pool's ladder of `widths`: the steps timed at its smallest, middle and
    largest buckets only (a pass per bucket would be one per width), one fit over all of them
    (StepCost's terms scale with the batch, its residuals interpolate between the timed
    ones), saved under every width's bucket. Returns {width: StepCost}."""
    buckets = sorted({bucket(w) for w in widths})
    timed = sorted({buckets[0], buckets[len(buckets) // 2], buckets[-1]})
    tick = _bar(progress, _steps_per_bucket(shapes) * len(timed))
    timings = [t for B in timed for t in _timings(target, drafter, shapes, B, context, tick)]
    cost = _fit(target, drafter, timings)
    for B in buckets:
        _save(cost, target, drafter, B)
    return dict.fromkeys(widths, cost)


def _verify_sizes(shapes) -> list[int]:
    """The draft nodes n of every target pass a menu verifies (T = 1 + n), "none"'s 0 too."""
    return sorted({0} | {s.size for s in shapes if s.kind != "none"})


def _steps_per_bucket(shapes) -> int:
    """Progress ticks a bucket takes: each timed program's compile, then its timing."""
    return 2 * (len(_verify_sizes(shapes)) + sum(s.kind != "none" for s in shapes))


def _bar(progress, total: int):
    """A tick() that draws `kdj tune: [####    ] done/total label` on `progress` (or nothing),
    and the pass's seconds when it is done."""
    done, t0 = 0, time.perf_counter()

    def tick(label):
        nonlocal done
        done += 1
        if progress is not None:
            bar = "#" * (20 * done // total)
            progress.write(f"\rkdj tune: [{bar:<20}] {done}/{total} {label:<12}")
            if done == total:
                progress.write(f" in {time.perf_counter() - t0:.0f} s\n")
            progress.flush()

    return tick


class _Job(NamedTuple):
    """A step to time: `step(args, carry)` from the carry `make()` builds."""

    timing: Timing  # seconds 0 until timed
    step: Callable
    args: object
    make: Callable


def _timings(target, drafter, shapes, B: int, context: int, tick) -> list[Timing]:
    """A target pass of 1 + n tokens for every n the menu verifies, then a whole drafted step
    of every drafted entry, at batch B: all compiled together in threads (compiling is most
    of a pass), then timed one after another."""
    jobs = [_verify_job(target, B, n, context) for n in _verify_sizes(shapes)]
    jobs += [_drafted_job(target, drafter, s, B, context) for s in shapes if s.kind != "none"]
    timings = []
    for job, run in zip(jobs, _compile_all(jobs, target.cfg.kernels.compiler_options(), tick)):
        seconds = _seconds_per_step(run, job.args, job.make())
        timings.append(job.timing._replace(seconds=seconds))
        tick(timings[-1].name)
    return timings


def _compile_all(jobs, options=None, tick=lambda label: None) -> list:
    """Each job's REPS-step loop compiled with XLA `options` (generate's, so the timed programs
    are the ones it runs): traced here, compiled in threads (tracing holds Python's lock,
    XLA's compiler does not); tick("compiled") here as each is done."""
    lowered = [_repeat.lower(j.step, j.args, jax.eval_shape(j.make)) for j in jobs]
    workers = min(len(lowered), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        runs = [pool.submit(low.compile, options or None) for low in lowered]
        for _ in concurrent.futures.as_completed(runs):
            tick("compiled")
    return [r.result() for r in runs]


def _fit(target, drafter, timings) -> StepCost:
    n_params = sum(int(x.size) for x in jax.tree.leaves(drafter.state))
    base = StepCost.for_config(target.cfg, jnp.dtype(target.dtype).itemsize)
    base = base.with_drafter(drafter.cfg, n_params, target.cfg, jnp.dtype(target.dtype).itemsize)
    rows = [(t.batch, t.tokens, t.context, t.seconds, float(t.drafted), t.nodes) for t in timings]
    plain = [r[:4] for r, t in zip(rows, timings) if not t.drafted]
    return base.fit(rows).with_residuals(plain)


def _save(cost: StepCost, target, drafter, batch: int) -> Path:
    path = cache_dir() / f"{key(target, drafter, batch)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return cost.save(path)


def tunes_at_first_use() -> bool:
    """Whether auto tunes by itself where no pass cached a cost: on accelerators only."""
    return jax.default_backend() != "cpu"


def resolve(cost, target, drafter, shapes, batch: int, context: float):
    """generate's `cost` argument for auto: a StepCost or its JSON path as given (an override);
    "tune": a tuning pass now; "estimate": None (auto's estimate from the model's shapes);
    None: this machine's tuned cost when a pass cached one, else a pass now on an accelerator
    (tunes_at_first_use), else the estimate. A pass says so on stderr."""
    if isinstance(cost, str) and cost == "estimate":
        return None
    if cost is None:
        found = cached(target, drafter, batch)
        if found is not None or not tunes_at_first_use():
            return found
        why = f"no tuned step costs for this pair at batch {bucket(batch)} on this device yet"
    elif isinstance(cost, str) and cost == "tune":
        why = f"tuning asked for at batch {bucket(batch)}"
    else:
        return cost
    _announce(why)
    return tune(target, drafter, shapes, batch, max(int(context), 1))[0]


def resolve_widths(cost, target, drafter, shapes, widths, context: float) -> dict:
    """resolve for a pool's ladder: {width: cost argument}. Where widths lack a cached cost,
    one pass covers them all (tune_widths), on an accelerator or when asked ("tune")."""
    if isinstance(cost, str) and cost == "tune":
        _announce(f"tuning asked for at widths {list(widths)}")
    elif cost is None:
        found = {w: cached(target, drafter, w) for w in widths}
        missing = [w for w, c in found.items() if c is None]
        if not missing or not tunes_at_first_use():
            return {w: c if c is not None else "estimate" for w, c in found.items()}
        _announce(f"no tuned step costs for this pair at widths {missing} on this device yet")
        return found | tune_widths(target, drafter, shapes, missing, max(int(context), 1))
    else:
        return dict.fromkeys(widths, cost)
    return tune_widths(target, drafter, shapes, widths, max(int(context), 1))


def _announce(why: str) -> None:
    print(f"kdj: {why}: tuning auto's step costs now (once; cached in {cache_dir()}; "
          'cost="estimate" skips this)', file=sys.stderr)  # fmt: skip


def table(timings) -> str:
    """The timings as a text table (what `kdj tune` prints)."""
    lines = [f"{'step':<12} {'batch':>5} {'tokens':>6} {'context':>7} {'ms':>9}"]
    for t in timings:
        lines.append(f"{t.name:<12} {t.batch:>5} {t.tokens:>6} {t.context:>7} "
                     f"{t.seconds * 1e3:>9.3f}")  # fmt: skip
    return "\n".join(lines)


def _fresh(x):
    """A copy in its own buffer (a donated state must not hold one buffer twice)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jnp.copy(jax.random.key_data(x)))
    return jnp.copy(x)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("carry",))
def _repeat(step, args, carry):
    """REPS steps in one compiled loop, as the decode loop runs them on the device."""
    return jax.lax.fori_loop(0, REPS, lambda _, c: step(args, c), carry)


def _seconds_per_step(run, args, carry) -> float:
    """Median over CALLS calls of one step's device time, `run(args, carry)` being its REPS-step
    loop compiled (_compile_all): a step timed alone from the host would time its dispatch
    too (a few ms for a real model's parameters, more than the step itself on an H200), which
    makes every entry look alike to auto."""
    carry = jax.block_until_ready(run(args, jax.tree.map(_fresh, carry)))  # the first call
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(args, carry))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / REPS


def _verify_step(graph, nodes: int, params, carry):
    """One target pass over root + a chain of `nodes` nodes (T = 1 + nodes) at the cache's
    lengths (not advanced: every pass writes the same slots). The next root reads every
    position's argmax, as a greedy accept does, so no row of the lm_head is compiled away."""
    tcache, last = carry
    target = nnx.merge(graph, params)
    if nodes:
        logits = jnp.zeros((last.shape[0], nodes, target.cfg.vocab_size), jnp.float32)
        tree = trees.chain_trees(trees.Draft.of(logits))
    else:
        tree = trees.root_only(last.shape[0])
    verified = verify(target, tcache, last, tree)
    nxt = jnp.max(jnp.argmax(verified.logits, axis=-1), axis=1)
    return verified.tcache, nxt.astype(last.dtype)


def _verify_job(target, batch, nodes, context) -> _Job:
    def make():
        tcache = init_cache(target.cfg, batch, context + nodes + 2, target.dtype)
        tcache = tcache.with_lengths(jnp.full((batch,), context, jnp.int32))
        return tcache, jnp.zeros((batch,), jnp.int32)

    step = functools.partial(_verify_step, target.graphdef, nodes)
    return _Job(Timing(batch, 1 + nodes, context, 0.0, False, 0, "target"), step, target.state,
                make)  # fmt: skip


def _drafted_step(tgraph, dgraph, plan, args, state):
    target, drafter = nnx.merge(tgraph, args[0]), nnx.merge(dgraph, args[1])
    return loop.drafted_step(target, drafter, state, plan)


def _drafted_job(target, drafter, shape, batch, context) -> _Job:
    """A whole drafted step of one menu entry from this context (steps commit tokens, so the
    caches have room for every step of every call)."""
    k = drafter.cfg.block_size
    steps = (1 + CALLS) * REPS * k  # tokens the timed steps can commit, at most
    capacity = context + steps + shape.size + 1
    B = batch
    plan = Plan(True, steps, k, (shape,), forecast=True)  # auto's steps forecast
    width = target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)

    def make():
        lens = jnp.full((B,), context, jnp.int32)
        tcache = init_cache(target.cfg, B, capacity, target.dtype).with_lengths(lens)
        dcache = init_cache(drafter.cfg.layers, B, capacity, target.dtype).with_lengths(lens)
        pre = Prefilled(jnp.zeros((B,), jnp.int32), tcache, dcache)
        one = jnp.float32(1.0)
        return init_state(pre, jnp.full((B,), steps), jnp.full((B, 1), -1, jnp.int32),
                          request_keys([0] * B), one, one, one, [0.0], plan,
                          width)  # fmt: skip

    step = functools.partial(_drafted_step, target.graphdef, drafter.graphdef, plan)
    nodes = shape.size if shape.kind == "tree" else 0
    timing = Timing(B, 1 + shape.size, context, 0.0, True, nodes, str(shape))
    return _Job(timing, step, (target.state, drafter.state), make)
