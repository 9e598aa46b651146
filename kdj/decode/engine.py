"""Continuous batching: a fixed pool of B slots on the device, requests streamed through it.

    host                                  device (kdj/decode/pool.py)
    admit waiting requests into free  ->  prefill only those rows, `admit_rows` at a time,
    slots                                 `prefill_chunk` prompt tokens per call, written
                                          straight into their rows of the pool (compiled
                                          per width and rows bucket: a fixed set, whatever
                                          the prompts' lengths; `warm` compiles it ahead)
    re-enter                          ->  ONE while_loop of the decode loop's own body over
                                          the whole pool (plain_step; with a drafter, DFlash's
                                          or DDTree's drafted_step, or for auto the entry of
                                          its menu the host picked for this chunk), until
                                          `wake` slots finish or `chunk_steps` steps ran
    retire finished slots, hand out   <-  a Report: each row's new tokens, n / done / steps
    the new tokens                        (never the caches)

The host runs one chunk behind the device (`lookahead`): it queues chunk k+1 (and any
admission's prefill before it) and only then reads chunk k's report, so the device works
through the host's turn instead of waiting for it. The pool lives on the engine's own device
thread (kdj/decode/device.py): every program that reads or writes it (a chunk, a prefill,
a resize, freeing slots) is queued there in order, and the host only waits for reports (a
host that touched the pool itself would wait for the whole chunk before it could admit). A
slot that finished in chunk k is seen (and refilled) one chunk late; that costs the slot a
chunk, not the pool a host turn.

Finished and free slots ride along without advancing (`done`), as in kdj/decode/loop.py.
Since a step computes every row of its compiled width, the pool runs at the smallest width
of a ladder (`widths`, default 1, 4, 16, 64, ... up to max_batch; kdj/decode/widths.py)
that holds its live slots and the requests that may join them: between chunks the host
packs the live rows into a narrower pool, or spreads them into a wider one before admitting
(one gather program per pair of widths). A pool that stays full never moves.
A newcomer's prefill stalls the running slots for ceil(longest prompt / prefill_chunk) calls
of at most `admit_rows` rows, per group of newcomers; slots finishing wake the host (`wake`:
1 when serving, or a share of the live slots, `wake_share`, with many in flight), so a free
slot waits at most one chunk. AR, DFlash, DDTree and auto run on the pool. auto's chunks
each run one entry of its menu (plain steps, a chain, a tree) as that fixed method would,
picked on the host per width from the tokens per second the chunks measured
(kdj/decode/picks.py); the cost model only ranks the entries before they are measured and
leaves out of a width's compiled menu those it prices far below the best there.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import time
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kdj import arguments
from kdj.decode import auto, device, pool
from kdj.decode import logprobs as lps
from kdj.decode.device import DeviceQueue
from kdj.decode.picks import Picks
from kdj.decode.pool import STOP_WIDTH
from kdj.decode.requests import Request, Update, mode_of
from kdj.decode.state import Plan
from kdj.decode.tree import DraftShape
from kdj.decode.turns import ChunkSteps, TurnStats
from kdj.decode.widths import batch_axes, chunk_bounds, fitting, ladder, resize
from kdj.handles import Drafter, Target, check_pair

HISTORY = 4096  # chunks whose width the engine remembers (chunk_widths)
LOOKAHEAD = 1  # chunks queued on the device beyond the one whose report the host waits for
# prompt tokens per prefill call: one compiled shape for every prompt; long enough that a
# prompt takes few calls, short enough that padding a short one costs about a verify step
PREFILL_CHUNK = 256


# a serving pool's host turn once this share of its live slots has finished (at least one):
# with hundreds of streams a turn per finish would come nearly every step, each a turn's cost
# and an update to every stream; a finished request waits for ~1/16 of the others instead
SERVE_WAKE_SHARE = 1 / 16


class Engine:
    """A pool of `max_batch` slots of `cache_size` tokens each; each request emits at most
    `max_new_cap` tokens. With a `drafter`, steps draft `block_size` tokens (default: the
    drafter's) and verify a draft shape of `menu`: one for DFlash's chain or DDTree's tree,
    several for method="auto", whose controller picks per step with `cost` (a StepCost, its
    JSON path, or None: the estimate from the target's shapes) and the drafter's forecasts
    at temperature `calibration` (kdj.api's `pool_drafting` builds these from a method and
    prices auto's menu for the pool); without a drafter, plain decoding.
    The running slots share a `Mode`: greedy (exact argmax) or sampled at one top_p, each slot
    at its own temperature, with or without log-probabilities; the pool switches mode when
    it drains. Requests that ask for log-probabilities are a mode of their own, since the
    mode's machinery exists already and a pool without them runs the very programs it
    would anyway; such a pool records the MAX_TOP alternatives of every token (one program
    whatever a request's k), and each request gets its own k of them. A request's token at
    position p is sampled with a key from (its seed, p), so its samples do not depend on its
    neighbours; without a seed of its own it gets one from `seed` and its id. The device
    runs `chunk_steps` steps at most (an int, or one per width: a mapping width -> steps;
    fewer steps stream tokens sooner, more give the host longer turns; with `follow_host`,
    as few of them as keep the device busy stepping: kdj/decode/turns.py), and returns early
    once `wake` slots, or the share
    `wake_share` of the live ones if more, have finished: 1 serves each finished request at
    once; more keeps finished slots idle a little longer for fewer host turns (serving many
    streams: SERVE_WAKE_SHARE; bulk generation: with wake >= admit_rows, newcomers are
    admitted in whole groups of admit_rows while more wait, so every prefill has one shape). Prompts
    are prefilled `prefill_chunk` tokens per call. `lookahead` chunks are queued on the
    device beyond the one the host reads (0: `step` returns the tokens of the chunk it ran).
    Not thread-safe: one thread drives `step`.
    widths: the ladder of compiled widths (ascending, ending at max_batch; default powers of
    4 below it); `menu` and `cost` may then be one per width (a mapping width -> value).
    What ran: `width` (now), `chunk_widths` (each recent chunk's width), `resizes`."""

    def __init__(self, target: Target, max_batch: int, cache_size: int, max_new_cap: int,
                 *, drafter: Drafter | None = None, block_size: int | None = None,
                 menu: tuple[DraftShape, ...] | Mapping[int, tuple[DraftShape, ...]] = (),
                 cost=None, calibration: float = 1.0,
                 chunk_steps: int | Mapping[int, int] = 32, seed: int = 0,
                 widths: tuple[int, ...] | None = None, wake: int = 1,
                 wake_share: float = 0.0, admit_rows: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, lookahead: int = LOOKAHEAD,
                 follow_host: bool = False):  # fmt: skip
        if min(max_batch, max_new_cap, wake, admit_rows, prefill_chunk) < 1 or cache_size < 2:
            raise ValueError("max_batch, max_new_cap, wake, admit_rows, prefill_chunk >= 1 "
                             "and cache_size >= 2")  # fmt: skip
        if not 0 <= wake_share <= 1:
            raise ValueError(f"wake_share must be in [0, 1]: {wake_share}")
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, got {lookahead}")
        if target.sharding is not None:
            raise ValueError("the serving engine runs on one device (target has a mesh)")
        self.widths = ladder(max_batch, widths)
        self.bounds = chunk_bounds(chunk_steps, self.widths)
        self.chunk_steps = ChunkSteps(self.bounds, follow_host)
        self._idle_at: float | None = None  # the device's idle seconds at the last chunk read
        self.calibration = 1.0
        if drafter is not None:
            if drafter.sharding is not None:
                raise ValueError("the serving engine runs on one device (drafter has a mesh)")
            block_size = check_pair(target, drafter, block_size)
            drafter = drafter.with_kernels(target.cfg.kernels)  # it follows its target's policy
            self.calibration = float(calibration)
        elif block_size is not None or menu or cost is not None:
            raise ValueError("block_size, menu and cost need a drafter")
        self.target, self.drafter = target, drafter
        self.B, self.S, self.N = max_batch, cache_size, max_new_cap
        self.plans = {w: Plan(True, max_new_cap) for w in self.widths}  # greedy: set per chunk
        self.priors = {w: jnp.zeros((1,), jnp.float32) for w in self.widths}  # auto's, per entry
        if drafter is not None:
            self._drafting_plans(drafter, block_size, menu, cost)
        # auto's entry per chunk, per mode (greedy or sampled: the entries rank differently)
        # and width, from what the chunks measured (kdj/decode/picks.py)
        priced = self.pricing()  # a full pool's tok/s: a row's is the width's share
        self.picks = {greedy: Picks({w: [r / w for r in p.values()] for w, p in priced.items()})
                      for greedy in (True, False)}  # fmt: skip
        self.greedy, self.wake, self.lookahead = True, wake, lookahead
        self.logprobs = False  # whether the pool records log-probabilities (its mode's)
        self.wake_share = wake_share
        self.admit_rows = admit_rows
        self.C = min(prefill_chunk, cache_size)  # prompt tokens per prefill call
        self.seed = seed
        self.waiting: collections.deque[Request] = collections.deque()
        self.width = self.widths[0]  # the width the pool runs at now
        self.slots: list[Request | None] = [None] * self.width
        self.sent: dict[int, int] = {}  # each running request's tokens handed out so far
        self.steps: dict[int, int] = {}  # and its steps, as of the last report read
        self.inflight: collections.deque[InFlight] = collections.deque()
        self.newcomers: collections.deque[Newcomers] = collections.deque()  # first tokens due
        self.cancelled: set[int] = set()
        self._ids = itertools.count()
        self._axes: dict[int, tuple] = {}  # each width's slot axes (widths.batch_axes)
        self.chunk_widths: collections.deque[int] = collections.deque(maxlen=HISTORY)
        self.resizes = 0
        self.stats = TurnStats()
        self._shapes: dict[int, pool.Pool] = {}  # each width's pool as shapes (programs' keys)
        self._programs: dict[tuple, object] = {}  # (kind, width, ...) -> its compiled program
        self.device = DeviceQueue(self._empty(self.width))  # the pool, on its own thread

    def _drafting_plans(self, drafter, block_size, menu, cost) -> None:
        """Each width's Plan and priors: `menu` and `cost` one for every width, or one per
        width (kdj.api's `pool_drafting` prices auto's menu at each). A width whose menu has
        no draft shape left keeps the cheapest draft shape of the others: the pool's state
        keeps the drafter's context at every width, so its slots can draft once the pool
        shrinks to a width where drafting pays (auto there probes rarely, PROBE_BUDGET)."""
        menus = menu if isinstance(menu, Mapping) else dict.fromkeys(self.widths, menu)
        costs = cost if isinstance(cost, Mapping) else dict.fromkeys(self.widths, cost)
        if set(menus) != set(self.widths) or set(costs) != set(self.widths):
            raise ValueError(f"menu and cost need one entry per width {list(self.widths)}")
        # no step verifies more nodes than a cache holds after a one-token prompt
        cap = arguments.tree_cap(self.S, [1])
        menus = {w: arguments.cap_trees(tuple(m), cap) for w, m in menus.items()}
        shapes = [s for m in menus.values() for s in m if s.kind != "none"]
        if not shapes:
            names = sorted({str(s) for m in menus.values() for s in m})
            raise ValueError(f"a drafting pool needs a draft shape on its menu, got {names} "
                             "(plain decoding: no drafter)")  # fmt: skip
        cheapest = min(shapes, key=lambda s: s.size)
        for w, m in menus.items():
            if all(s.kind == "none" for s in m):
                m = (*m, cheapest)
            step_cost = auto.step_cost(costs[w], self.target, drafter) if len(m) > 1 else None
            self.plans[w] = Plan(True, self.N, block_size, m, step_cost)
            if self.plans[w].adaptive:
                self.priors[w] = jnp.asarray(auto.priors(m, drafter), jnp.float32)

    @property
    def pool(self) -> pool.Pool:
        """The pool's device state once everything queued has run (tests, inspection)."""
        return self.device.read()

    @pool.setter
    def pool(self, value: pool.Pool) -> None:
        """Replace the pool after everything queued (a failed program's queue serves again)."""
        self.device.restart(value)

    def _shape(self, width: int) -> pool.Pool:
        """The pool of `width` slots as shapes on the device: what a program is looked up by."""
        key = (width, self.logprobs)
        if key not in self._shapes:
            on_device = jnp.zeros(()).sharding  # where the pool's arrays live: part of the key

            def shaped(x):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_device,
                                            weak_type=x.weak_type)  # fmt: skip

            empty = jax.eval_shape(lambda: self._empty(width))
            self._shapes[key] = jax.tree.map(shaped, empty)
        return self._shapes[key]

    def _program(self, key: tuple, fn, *args, **static):
        """The compiled `fn` for the pool's program `key` ((kind, width, ...)), found in the
        target's Executables once: its lookup keys on every parameter, each chunk's would
        cost milliseconds of the host's turn."""
        if key not in self._programs:
            self._programs[key] = self.target.executables.get(fn, *args, **static)
        return self._programs[key]

    def pricing(self) -> dict[int, dict[str, float]]:
        """What the cost model says of auto's entries: per width, each entry of the menu and
        the tokens per second it predicts for a full pool running that entry alone (as a chunk
        pinned to it does; "none": plain steps), at the entry's prior tau (0 without one) and
        half a slot's context. It ranks the entries until the chunks have measured them
        (`picks`). Empty for AR and the fixed methods."""
        d = self.drafter
        out = {}
        for w, plan in self.plans.items():
            if plan.adaptive:
                out[w] = {str(s): w * auto.entry_rate(s, plan.cost, w, self.S / 2,
                                                      auto.largest_tree((s,)),
                                                      d.prior_acceptance, d.entry_acceptance)
                          for s in plan.menu}  # fmt: skip
        return out

    def measured(self) -> dict:
        """Why auto runs what it runs: per width it has run greedy chunks at (keyed by the
        width) and sampled ones ("W sampled"), the entry it runs now and each entry's measured
        tokens per live row per second beside the cost model's (`Picks`)."""
        names = {w: tuple(map(str, plan.menu)) for w, plan in self.plans.items()}
        sampled = self.picks[False].report(names)
        return {**self.picks[True].report(names), **{f"{w} sampled": r for w, r in sampled.items()}}

    @property
    def plan(self) -> Plan:
        """The plan of the width the pool runs at now."""
        return self._layout(self.width)

    def _layout(self, width: int) -> Plan:
        """The plan that shapes the pool at `width`: the width's, recording log-probabilities
        when the running mode does (greedy is set per program)."""
        k = min(lps.MAX_TOP, self.target.cfg.vocab_size) if self.logprobs else None
        return dataclasses.replace(self.plans[width], logprobs=k)

    @property
    def method(self) -> str:
        """What the pool runs: "ar", "dflash" (a chain), "ddtree" (a tree) or "auto"."""
        plan = self.plans[self.B]
        if not plan.speculative:
            return "ar"
        if plan.adaptive:
            return "auto"
        return "dflash" if plan.menu[0].kind == "chain" else "ddtree"

    def _empty(self, width: int) -> pool.Pool:
        return self._maker(width)()

    def _maker(self, width: int):
        """A call making an empty pool of `width` slots in the running mode: bound now, for
        the device thread to run later (the mode may change before it does)."""
        return functools.partial(pool.empty, self.target, self.drafter, self._layout(width),
                                 width, self.S, self.calibration, self.priors[width])  # fmt: skip

    @property
    def _xla(self) -> dict:
        """The compiler options of the target's kernel policy (deterministic: no excess
        precision)."""
        return self.target.cfg.kernels.compiler_options()

    def _graphs(self) -> tuple:
        """(tgraph, tstate, dgraph, dstate): the programs' model arguments."""
        t, d = self.target, self.drafter
        return (t.graphdef, t.state) + ((None, None) if d is None else (d.graphdef, d.state))

    # ------------------------------------------------------------------ requests
    def check(self, req: Request) -> None:
        """ValueError naming what does not fit the pool."""
        if not req.tokens:
            raise ValueError("empty prompt")
        if not 1 <= req.max_new <= self.N:
            raise ValueError(f"max_tokens must be in [1, {self.N}], got {req.max_new}")
        if len(req.tokens) + req.max_new > self.S:
            raise ValueError(f"prompt ({len(req.tokens)} tokens) + max_tokens ({req.max_new})"
                             f" exceed the context of {self.S} tokens")  # fmt: skip
        if len(req.stop) > STOP_WIDTH:
            raise ValueError(f"at most {STOP_WIDTH} stop tokens, got {len(req.stop)}")
        if not (req.temperature >= 0 and 0 < req.top_p <= 1):  # a NaN fails it too
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got "
                             f"{req.temperature} and {req.top_p}")  # fmt: skip
        if req.logprobs is not None and not 0 <= req.logprobs <= lps.MAX_TOP:
            raise ValueError(f"logprobs must be in [0, {lps.MAX_TOP}], got {req.logprobs}")

    def submit(self, req: Request) -> int:
        self.check(req)
        req.id = next(self._ids)
        self.waiting.append(req)
        return req.id

    def cancel(self, rid: int) -> None:
        """Drop a waiting request, or free the slot of a running one at the next step."""
        self.cancelled.add(rid)

    def reset(self) -> list[int]:
        """Drop every request (after a failed step); returns the ids dropped."""
        ids = [r.id for r in self.waiting] + [r.id for r in self.slots if r is not None]
        self.waiting.clear()
        self.slots = [None] * self.width
        self.sent.clear()
        self.steps.clear()
        self.inflight.clear()
        for picks in self.picks.values():
            picks.requeue()
        self.newcomers.clear()
        self.cancelled.clear()
        self.pool = self._empty(self.width)
        return ids

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.inflight) or any(r is not None for r in self.slots)

    # ------------------------------------------------------------------ the host's turn
    def step(self) -> list[Update]:
        """Retire cancelled slots, admit, queue one chunk on the device (unless more than
        `lookahead` are queued), and hand out the new tokens of the oldest chunk in flight
        once more than `lookahead` are (or nothing was left to queue). Newcomers' first
        tokens come before that chunk's: once their prefill, which runs before it, is done
        (a turn of their own), so a request's first token waits for its prefill, not for
        the chunk after it."""
        t0 = time.perf_counter()
        updates = self._drop_cancelled()
        self._fit()
        self._admit()
        live = sum(r is not None for r in self.slots)
        if live and len(self.inflight) <= self.lookahead:
            self.chunk_widths.append(self.width)
            plan = dataclasses.replace(self.plan, greedy=self.greedy)
            pin, recheck = None, False
            if plan.adaptive:  # auto: one entry a chunk, picked from what chunks measured
                pin, recheck = self.picks[plan.greedy].next(self.width)
                plan = dataclasses.replace(plan, pin=pin)
            fn = self._chunk_program(self._shape(self.width), self.width, plan)
            wake = max(self.wake, math.ceil(self.wake_share * live))
            _, ts, _, ds = self._graphs()
            bound = np.int32(self.chunk_steps.run[self.width])
            ran = self.device.queue(device.run_chunk, fn, ts, ds, bound, np.int32(wake),
                                    self.device)  # fmt: skip
            choices = (*map(str, self.plans[self.width].menu), "plain")
            chunk, follows = self.stats.chunks, bool(self.inflight)
            self.inflight.append(InFlight(ran, list(self.slots), self.width, choices, chunk,
                                          follows, pin, recheck, plan.greedy))  # fmt: skip
            self.stats.chunks += 1
            self.stats.widths[self.width] = self.stats.widths.get(self.width, 0) + 1
        if self.inflight and (len(self.inflight) > self.lookahead or not live):
            first = self._first_tokens(self.inflight[0].chunk)
            updates += first or self._collect(self.inflight.popleft())
        self.stats.turns += 1
        self.stats.turn_s += time.perf_counter() - t0
        return updates

    def _chunk_program(self, pool_: pool.Pool, width: int, plan: Plan):
        """The compiled chunk of a pool of `width` slots (`pool_`: such a pool)."""
        tg, ts, dg, ds = self._graphs()
        window = min(self.N, pool.window(plan, self.bounds[width]))
        key = ("chunk", width, plan.greedy, plan.logprobs, plan.pin)
        return self._program(key, pool.chunk, tg, ts, dg, ds, pool_, np.int32(0), np.int32(0),
                             options=self._xla, plan=plan, width=window)  # fmt: skip

    def _drop_cancelled(self) -> list[Update]:
        if not self.cancelled:
            return []
        dropped = [Update(r.id, [], True, 0) for r in self.waiting if r.id in self.cancelled]
        self.waiting = collections.deque(r for r in self.waiting if r.id not in self.cancelled)
        freed = [b for b, r in enumerate(self.slots) if r is not None and r.id in self.cancelled]
        if freed:
            rows = np.full(self.width, self.width, np.int32)  # padding: dropped
            rows[: len(freed)] = freed
            done = self._shape(self.width).state.done
            fn = self._program(("free", self.width), pool.mark_done, done, rows)
            self.device.queue(device.free, fn, rows)
        updates = dropped
        for b in freed:  # their steps as of the last report: the device is not waited for
            rid = self.slots[b].id
            updates.append(Update(rid, [], True, self.steps.pop(rid, 0)))
            self.sent.pop(rid, None)
            self.slots[b] = None
        self.cancelled.clear()
        return updates

    def _admissible(self) -> list[Request]:
        """The head of the queue that may join the running slots: requests of the pool's mode
        (FIFO: a request of another mode waits for the pool to drain, so none starves)."""
        running = [r for r in self.slots if r is not None]
        if not self.waiting:
            return []
        mode = mode_of(running[0] if running else self.waiting[0])
        head = itertools.takewhile(lambda r: mode_of(r) == mode, self.waiting)
        return list(itertools.islice(head, self.B - len(running)))

    def _fit(self) -> None:
        """Move the pool to the smallest width that holds its live slots and the requests that
        may join them: their rows packed first, in order (widths.resize). A pool that stays
        full, or idle, stays put."""
        live = [b for b, r in enumerate(self.slots) if r is not None]
        width = fitting(self.widths, len(live) + len(self._admissible()))
        if width == self.width or not (live or self.waiting):
            return
        empty = self._maker(width)
        if live:
            rows = jax.device_put(np.asarray(live + [-1] * (width - len(live)), np.int32))
            args = (self._shape(self.width), self._shape(width), rows, self.priors[width])
            fn = self._program(("resize", self.width, width, self.logprobs), resize, *args,
                               axes=self._slot_axes(width), src=self.plan,
                               dst=self._layout(width))  # fmt: skip
            self.device.queue(lambda p: fn(p, empty(), rows, self.priors[width]))
            self.resizes += 1
        else:
            self.device.queue(lambda p: empty())
        self.slots = [self.slots[b] for b in live] + [None] * (width - len(live))
        self.width = width

    def _slot_axes(self, width: int) -> tuple:
        key = (width, self.logprobs)
        if key not in self._axes:
            self._axes[key] = batch_axes(lambda n: pool.empty(
                self.target, self.drafter, self._layout(width), n, self.S, self.calibration,
                self.priors[width]))  # fmt: skip
        return self._axes[key]

    def warm(self, modes: tuple[bool, ...] = (True, False), progress=None,
             threads: int | None = None) -> int:  # fmt: skip
        """Compile every program the pool can meet, ahead of the first request (a server
        calls it before it answers /health): for each greedy mode of `modes`, each width's
        chunk, prefill and first tokens' read (per rows bucket) and freeing of slots, and
        the resize between every pair of widths, all without log-probabilities (a pool
        recording them compiles at its first use). Nothing else compiles while serving: a
        compile there stalls every stream. `threads` compile at once (default: up to 8, one
        per two cores; XLA's compiles are mostly one thread each), over the pools' shapes,
        except that an empty pool of each width is made once (its eager ops compile).
        progress(done, total), if given, is called after each. Returns the programs
        compiled or found."""
        tg, ts, dg, ds = self._graphs()
        jobs = []
        for greedy in modes:
            for w in self.widths:
                plan = dataclasses.replace(self._layout(w), greedy=greedy)
                pins = range(len(plan.menu)) if plan.adaptive else [None]
                jobs += [("chunk", w, dataclasses.replace(plan, pin=p)) for p in pins]
                jobs += [("prefill", w, plan, a) for a in self._row_buckets(w)]
        jobs += [("resize", a, b) for a in self.widths for b in self.widths if a != b]
        jobs += [("width", w) for w in self.widths]
        pools = {w: self._shape(w) for w in self.widths}
        for w in self.widths:  # each width's slot axes, before the threads
            self._slot_axes(w)
        get = self.target.executables.get

        def compile_(job):
            empty = pools.__getitem__
            if job[0] == "chunk":
                _, w, plan = job
                self._chunk_program(empty(w), w, plan)
            elif job[0] == "prefill":
                _, w, plan, a = job
                new = jax.device_put(pool.blank(a, self.C, w))
                get(pool.prefill, tg, ts, dg, ds, empty(w), new, options=self._xla,
                    plan=plan)  # fmt: skip
                get(pool.first_tokens, empty(w), np.zeros(a, np.int32))
            elif job[0] == "width":  # freeing slots; an idle pool's new width (eager ops)
                w = job[1]
                get(pool.mark_done, empty(w).state.done, np.zeros(w, np.int32))
                jax.block_until_ready(self._empty(w))
            else:
                _, a, b = job
                src = empty(a)
                args = (src, empty(b), jnp.zeros((b,), jnp.int32), self.priors[b])
                get(resize, *args, axes=self._slot_axes(b), src=self._layout(a),
                    dst=self._layout(b))  # fmt: skip

        threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            for i, done in enumerate(concurrent.futures.as_completed(
                    [ex.submit(compile_, job) for job in jobs])):  # fmt: skip
                done.result()
                if progress is not None:
                    progress(i + 1, len(jobs))
        return len(jobs)

    def _admit(self) -> None:
        """Fill free slots with the admissible head of the queue, `admit_rows` at a time."""
        free = [b for b, r in enumerate(self.slots) if r is None]
        take = self._admissible()[: len(free)]
        G = min(self.admit_rows, self.width)
        if self.wake >= G and len(self.waiting) > len(take):  # bulk, more to come: whole
            whole = take[: len(take) // G * G]  # groups, so every prefill has one shape
            if whole or any(r is not None for r in self.slots):  # (an idle pool takes all)
                take = whole
        for _ in take:
            self.waiting.popleft()
        self.stats.admitted += len(take)
        for i in range(0, len(take), G):
            self._prefill(take[i : i + G], free[i : i + G])

    def _row_buckets(self, width: int) -> tuple[int, ...]:
        """The row counts an admission into a pool of `width` is padded to: the ladder's
        widths below its group size, and the group size (a few shapes per width)."""
        G = min(self.admit_rows, width)
        return (*[w for w in self.widths if w < G], G)

    def _prefill(self, take: list[Request], free: list[int]) -> None:
        """Requests `take` into pool rows `free`: their prompts prefilled `prefill_chunk`
        tokens at a time (one program per (width, rows), whatever the prompts' lengths)."""
        mode = mode_of(take[0])
        self.greedy = mode.greedy
        if mode.logprobs != self.logprobs:  # no slot is live: a pool with(out) the record
            self.logprobs = mode.logprobs
            empty = self._maker(self.width)
            self.device.queue(lambda p: empty())
        W, C = self.width, self.C
        A = fitting(self._row_buckets(W), len(take))
        chunks = -(-max(len(r.tokens) for r in take) // C)
        rows = pool.admission(take, free, A, chunks * C, W, mode.top_p, self.seed)
        for r, b in zip(take, free):
            self.slots[b] = r
            self.sent[r.id], self.steps[r.id] = 0, 0
        plan = dataclasses.replace(self.plan, greedy=self.greedy)
        tg, ts, dg, ds = self._graphs()
        for c in range(chunks):
            new = jax.device_put(pool.prompt_chunk(rows, c, C, W))  # one transfer per chunk
            key = ("prefill", W, A, plan.greedy, plan.logprobs)
            fn = self._program(key, pool.prefill, tg, ts, dg, ds, self._shape(W), new,
                               options=self._xla, plan=plan)  # fmt: skip
            last = self._first_tokens_at(free[: len(take)], A) if c == chunks - 1 else None
            joined = self.device.queue(device.prefill_chunk, fn, ts, ds, new, last)
            self.stats.prefills += 1
        # the chunk queued next is the first they run in: their first tokens come before it
        self.newcomers.append(Newcomers(joined, take, self.stats.chunks))

    def _first_tokens_at(self, rows: list[int], A: int) -> tuple:
        """pool.first_tokens compiled for this pool and an admission of A rows, and `rows`
        padded to A (repeating the first)."""
        at = np.asarray(rows + rows[:1] * (A - len(rows)), np.int32)
        fn = self._program(("first", self.width, A, self.logprobs), pool.first_tokens,
                           self._shape(self.width), at)  # fmt: skip
        return fn, at

    def _first_tokens(self, chunk: int) -> list[Update]:
        """The first tokens of the newcomers admitted before chunk `chunk` that are not
        handed out yet: waits for their prefill (queued before that chunk), not the chunk."""
        updates = []
        while self.newcomers and self.newcomers[0].before <= chunk:
            came = self.newcomers.popleft()
            t0 = time.perf_counter()
            joined = came.joined.result()
            first, done = np.asarray(joined.first), np.asarray(joined.done)
            record = jax.tree.map(np.asarray, joined.logprobs)  # [newcomers, 1] or None
            self.stats.wait_s += time.perf_counter() - t0
            ended = set()
            for i, (r, token) in enumerate(zip(came.requests, first.tolist())):
                if self.sent.get(r.id) == 0:  # still running, nothing of it handed out
                    self.sent[r.id] = 1
                    mine = None if r.logprobs is None else lps.rows(record, i, 0, 1, r.logprobs)
                    updates.append(Update(r.id, [token], bool(done[i]), 0, mine))
                    if done[i]:  # its row rides along done in the chunks already queued
                        ended.add(r.id)
                        del self.sent[r.id], self.steps[r.id]
            self.slots = [None if r is not None and r.id in ended else r for r in self.slots]
        return updates

    def _collect(self, flight: InFlight) -> list[Update]:
        """The updates of a chunk's report; its finished requests leave their slots."""
        t0 = time.perf_counter()
        ran = flight.ran.result()
        report = ran.report
        start, tokens, n, done, steps = (np.asarray(x) for x in report[:5])
        logprobs = jax.tree.map(np.asarray, report.logprobs)  # None: the pool records none
        self.stats.wait_s += time.perf_counter() - t0
        tally = None if report.tally is None else np.asarray(report.tally)
        if tally is not None:
            self.stats.tally(flight.width, flight.choices, tally)
        # a re-check of another auto entry is not the width's steady cost per step
        if flight.follows and self._idle_at is not None and not flight.recheck:
            self.chunk_steps.observe(flight.width, ran.idle_s - self._idle_at, ran.seconds,
                                     int(report.ran), self.stats)  # fmt: skip
        self._idle_at = ran.idle_s
        updates, finished = [], set()
        committed = row_steps = 0  # by the rows read here (auto's picks measure these)
        for b, r in enumerate(flight.rows):
            if r is None or r.id not in self.sent:  # free, or cancelled since
                continue
            sent, end = self.sent[r.id] - start[b], n[b] - start[b]
            if sent < 0 or end > tokens.shape[1]:
                raise RuntimeError(f"chunk report of row {b} holds tokens {start[b]}.."
                                   f"{start[b] + tokens.shape[1]}, not {sent}..{end}")  # fmt: skip
            new = tokens[b, sent:end].tolist()
            record = None
            if r.logprobs is not None:
                record = lps.rows(logprobs, b, sent, end, r.logprobs)
            self.stats.tokens += len(new)
            committed += len(new)
            row_steps += int(steps[b]) - self.steps[r.id]
            self.sent[r.id], self.steps[r.id] = int(n[b]), int(steps[b])
            if new or done[b]:
                updates.append(Update(r.id, new, bool(done[b]), int(steps[b]), record))
            if done[b]:
                finished.add(r.id)
                del self.sent[r.id], self.steps[r.id]
        if finished:  # their rows, wherever a resize has moved them since
            self.slots = [None if r is not None and r.id in finished else r for r in self.slots]
        if flight.pin is not None:
            self._measure(flight, committed, row_steps, int(report.ran), ran.seconds)
        return updates

    def _measure(self, flight: InFlight, committed: int, row_steps: int, steps: int,
                 seconds: float) -> None:  # fmt: skip
        """Feed auto's picks a chunk pinned to one entry: the tokens its steps committed and
        the row-steps they took, over the rows still held (a cancelled row counts in
        neither), its steps and seconds. A width whose best entry changed searches its chunk
        length afresh: the steps cost what the new one costs."""
        picks = self.picks[flight.greedy]
        before = picks.best(flight.width)
        picks.observe(flight.width, flight.pin, committed, row_steps, steps, seconds,
                      flight.recheck)  # fmt: skip
        if picks.best(flight.width) != before:
            self.chunk_steps.forget(flight.width)


class InFlight(NamedTuple):
    """A dispatched chunk: what it gives back (once run) and the request each row held."""

    ran: concurrent.futures.Future  # of a device.Ran
    rows: list[Request | None]
    width: int
    choices: tuple[str, ...]  # the names of the report's tally rows
    chunk: int  # its place among the engine's chunks (0, 1, ...)
    follows: bool  # queued while the chunk before it was in flight (the device had work)
    pin: int | None = None  # auto: the menu entry it ran (Plan.pin)
    recheck: bool = False  # auto: a re-check of an entry other than the width's best
    greedy: bool = True  # the pool's mode it ran in (auto measures each mode's picks apart)


class Newcomers(NamedTuple):
    """Requests admitted together, whose first tokens the host hands out before chunk
    `before` (the first they run in)."""

    joined: concurrent.futures.Future  # of a device.Joined
    requests: list[Request]
    before: int
