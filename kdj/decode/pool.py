"""The slot pool's device programs, driven from the host by kdj/decode/engine.py.

    empty   a pool of B free slots: the DecodeState of kdj/decode/loop.py (with the
            drafter's cache and feature queue when the pool drafts), every row done
    prefill newcomers' prompts, one chunk of C tokens of A rows per call, written straight
            into their pool rows (target and drafter K/V); a row whose prompt is complete
            joins the running slots (lengths, first token, budgets, stops, keys,
            temperatures; its feature queue emptied). Compiled per (width, A, C): a
            fixed set, whatever the prompts' lengths
    chunk   the loop's own body (loop.body: plain_step, drafted_step, or auto's runs of
            plain and drafted steps) over the whole pool, until `wake` running slots have
            finished (serving: 1; data generation: a share of the pool), all are done, or a
            bound of steps; beside the pool (donated to the next program) it returns a
            `Report`: what the host reads of it, in buffers of their own

`Pool` carries, beside the DecodeState, each slot's steps since admission: a request's tokens
per step, (tokens - 1) / steps (the first token comes from prefill). method="auto" runs
each chunk pinned to one entry of its menu (Plan.pin; the host picks it,
kdj/decode/picks.py), so the state keeps the whole menu's layout (the feature queue of
plain runs, a tally row per entry) and a chunk of any entry can follow any other. Free and
finished slots ride along: a step costs what a step of B rows costs. The state's step-indexed
`Stats` are not read here: the pool's step count grows without bound, and their writes past
`plan.max_steps` are dropped, so they stay one fixed buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.cache import KVCache, init_cache
from kdj.decode import logprobs as lps
from kdj.decode import loop
from kdj.decode.sampling import position_keys, request_keys, sample
from kdj.decode.state import DecodeState, Plan, Prefilled, init_state, is_stop
from kdj.decode.step import features

STOP_WIDTH = 8  # stop ids per request (-1 padded): one compile for every request


class Pool(NamedTuple):
    state: DecodeState
    steps: jax.Array  # [B] int32 steps each slot's request took while running


def empty(target, drafter, plan: Plan, B: int, S: int, calibration=1.0, prior=None) -> Pool:
    """B free slots of S tokens; `plan.max_steps` is the most tokens a request emits.
    calibration, prior: auto's forecast temperature and per-entry priors (loop.decode's)."""

    def zeros():  # a buffer each: the pool is donated
        return jnp.zeros((B,), jnp.int32)

    dcache = None if drafter is None else init_cache(drafter.cfg.layers, B, S, target.dtype)
    record = None if plan.logprobs is None else lps.empty((B,), plan.logprobs)
    pre = Prefilled(zeros(), init_cache(target.cfg, B, S, target.dtype), dcache, record)
    width = 0 if drafter is None else target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)
    state = init_state(pre, zeros(), jnp.full((B, STOP_WIDTH), -1, jnp.int32),
                       request_keys(np.zeros(B, np.uint32)),
                       jnp.ones((B,), jnp.float32), 1.0, calibration, prior, plan,
                       width)  # fmt: skip
    return Pool(state, zeros())


class Report(NamedTuple):
    """What the host reads after a chunk: buffers of their own, so the pool can be donated to
    the next program before the host has read them (the host runs a chunk behind)."""

    start: jax.Array  # [B] int32 the position of tokens[:, 0] in each row's output
    tokens: jax.Array  # [B, window] int32 the row's output from `start` on
    n: jax.Array  # [B] int32 tokens each row has emitted
    done: jax.Array  # [B] bool
    steps: jax.Array  # [B] int32 steps each row's request took while running
    ran: jax.Array  # [] int32 steps this chunk ran
    # [len(menu) + 1, 2] int32 this chunk's steps and committed tokens per choice (index
    # len(menu): a plain step); None for plain decoding
    tally: jax.Array | None
    logprobs: lps.Logprobs | None = None  # [B, window] beside tokens, when the plan asks


def window(plan: Plan, bound: int) -> int:
    """Tokens a row can emit in one chunk of `bound` steps, and the first (from prefill)."""
    return 1 + bound * max(plan.block_size, 1)


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "plan", "width"),
                   donate_argnames=("pool",))  # fmt: skip
def chunk(tgraph, tstate, dgraph, dstate, pool: Pool, bound, wake, *, plan: Plan,
          width: int) -> tuple[Pool, Report]:  # fmt: skip
    """The loop's body over the pool until `wake` running slots have finished, all are done,
    or `bound` steps ran. Each slot counts the steps it was running for: the body's own
    inner loops (auto's runs) also stop when any slot finishes, so a body call's steps are
    either all before or all after a slot's last. The report's window of `width` tokens
    starts where the row stood at entry (at 0 for a row admitted since its last chunk, whose
    first token came from prefill): it holds every token the chunk emitted if `bound` steps
    fit it (`window`)."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    entry = pool.state
    stop_at = entry.step + bound

    def going(s):
        finished = jnp.sum(s.done & ~entry.done)
        return (s.step < stop_at) & (finished < wake) & ~jnp.all(s.done)

    def counted(carry):
        s, ran = carry

        def inner(t):
            return going(t) & ~jnp.any(t.done & ~s.done)

        t = loop.body(target, drafter, plan, inner)(s)
        return t, ran + jnp.where(s.active, t.step - s.step, 0)

    state, steps = jax.lax.while_loop(lambda c: going(c[0]), counted, (entry, pool.steps))
    start = jnp.where(pool.steps == 0, 0, entry.n)
    at = jnp.minimum(start[:, None] + jnp.arange(width), state.out.shape[1] - 1)
    tokens = jnp.take_along_axis(state.out, at, axis=1)
    tally = None if state.stats is None else state.stats.tally - entry.stats.tally
    record = None if state.logprobs is None else state.logprobs.take(at)
    return Pool(state, steps), Report(start, tokens, state.n, state.done, steps,
                                   state.step - entry.step, tally, record)  # fmt: skip


class Admission(NamedTuple):
    """One prefill chunk of A newcomers: prompt positions start .. start + C - 1 of each, and
    what a row needs once its last prompt token is in (engine.py builds these)."""

    slots: jax.Array  # [A] int32 pool rows; >= B: padding, or a row whose prompt ended earlier
    tokens: jax.Array  # [A, C] int32 the chunk's prompt tokens (right-padded)
    start: jax.Array  # [] int32 the chunk's first position
    lens: jax.Array  # [A] int32 prompt lengths
    max_new: jax.Array  # [A] int32
    stop: jax.Array  # [A, STOP_WIDTH] int32 (-1 padded)
    temps: jax.Array  # [A] float32
    seeds: jax.Array  # [A] uint32 the requests' seeds (a sample at position p: (seed, p))
    top_p: jax.Array  # [] float32 the pool's


def blank(rows: int, width: int, free: int, top_p: float = 1.0) -> Admission:
    """An admission of `rows` padding rows (slot `free`: dropped) of `width` prompt tokens,
    numpy arrays for the host to fill in."""
    return Admission(np.full(rows, free, np.int32), np.zeros((rows, width), np.int32),
                     np.int32(0), np.zeros(rows, np.int32), np.ones(rows, np.int32),
                     np.full((rows, STOP_WIDTH), -1, np.int32), np.ones(rows, np.float32),
                     np.zeros(rows, np.uint32), np.float32(top_p))  # fmt: skip


def admission(take, free: list[int], rows: int, width: int, pool_width: int, top_p: float,
              seed: int) -> Admission:  # fmt: skip
    """Requests `take` (kdj/decode/requests.py) bound for pool rows `free`, as one admission of
    `rows` rows (padding: slot pool_width, dropped) holding their whole prompts in `width`
    tokens; `prompt_chunk` cuts it per prefill call. A request without a seed draws from
    (seed, its id)."""
    new = blank(rows, width, pool_width, top_p)
    for i, (r, b) in enumerate(zip(take, free)):
        new.tokens[i, : len(r.tokens)] = r.tokens
        new.lens[i], new.slots[i], new.max_new[i] = len(r.tokens), b, r.max_new
        new.temps[i] = max(r.temperature, 1e-6)
        new.seeds[i] = r.seed if r.seed is not None else (seed * 1_000_003 + r.id) % 2**32
        new.stop[i, : len(r.stop)] = r.stop
    return new


def prompt_chunk(new: Admission, c: int, C: int, pool_width: int) -> Admission:
    """Prompt positions c*C .. c*C + C - 1 of an admission; rows whose prompt ended in an
    earlier chunk sit this one out (slot pool_width: dropped)."""
    s = c * C
    return new._replace(slots=np.where(new.lens > s, new.slots, pool_width).astype(np.int32),
                        tokens=new.tokens[:, s : s + C], start=np.int32(s))  # fmt: skip


def _rows(cache: KVCache, slots) -> KVCache:
    """Rows `slots` of a pool's cache (out-of-range slots read a clipped row: their writes
    are dropped)."""
    at = jnp.clip(slots, 0, cache.batch - 1)
    return KVCache([k[at] for k in cache.k], [v[at] for v in cache.v], cache.lengths[at])


def _put(cache: KVCache, rows: KVCache, slots) -> KVCache:
    def put(p, n):
        return p.at[slots].set(n, mode="drop")

    return dataclasses.replace(cache, k=[put(p, n) for p, n in zip(cache.k, rows.k)],
                               v=[put(p, n) for p, n in zip(cache.v, rows.v)])  # fmt: skip


@jax.jit
def first_tokens(pool: Pool, rows) -> tuple:
    """An admission's first tokens, ends and log-probability records (or None) at pool `rows`
    ([A]: its rows bucket, the padding repeating a row): one program per (width, A), where
    eager indexing would compile one per newcomer count while serving."""
    s = pool.state
    return s.out[rows, 0], s.done[rows], jax.tree.map(lambda x: x[rows, :1], s.logprobs)


@jax.jit
def mark_done(done, rows):
    """done[rows] = True; `rows` padded to the pool's width with the width (dropped): one
    program per width for every count of rows freed."""
    return done.at[rows].set(True, mode="drop")


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "plan"), donate_argnames=("pool",))
def prefill(tgraph, tstate, dgraph, dstate, pool: Pool, new: Admission, *,
            plan: Plan) -> Pool:  # fmt: skip
    """One chunk of the newcomers' prompts written straight into their pool rows: the target
    pass over C tokens on top of what earlier chunks wrote (tapping the drafter's feature
    layers, whose context it adds), so the program depends on (pool width, A, C) and never on
    a prompt's length. Rows whose last prompt token is in this chunk join the running
    slots: their first token, lengths, budgets, stops, keys, temperatures; feature queues
    emptied."""
    target = nnx.merge(tgraph, tstate)
    drafter = None if dgraph is None else nnx.merge(dgraph, dstate)
    state = pool.state
    B = state.done.shape[0]
    A, C = new.tokens.shape
    start = jnp.full((A,), new.start, jnp.int32)
    taps = () if drafter is None else drafter.cfg.target_layer_ids
    at = jnp.clip(new.lens - 1 - new.start, 0, C - 1)  # the prompt's last token, if here
    rows = _rows(state.tcache, new.slots)
    logits, rows, tapped = target(new.tokens, start, rows, taps=taps, logits_at=at[:, None])
    state = dataclasses.replace(state, tcache=_put(state.tcache, rows, new.slots))
    if drafter is not None:
        ctx = drafter.add_context(features(tapped), start, _rows(state.dcache, new.slots))
        state = dataclasses.replace(state, dcache=_put(state.dcache, ctx, new.slots))
    keys = request_keys(new.seeds)
    first = sample(logits[:, 0], position_keys(keys, new.lens), new.temps, new.top_p, plan.greedy)
    joins = new.lens <= new.start + C
    slots = jnp.where(joins, new.slots, B)
    N = state.out.shape[1]
    row = jnp.zeros((A, N), jnp.int32).at[:, 0].set(first)
    done = is_stop(first, new.stop) | (new.max_new <= 1)

    def set_(x, v):
        return x.at[slots].set(v, mode="drop")

    state = dataclasses.replace(
        state, tcache=state.tcache.with_lengths(set_(state.tcache.lengths, new.lens)),
        last=set_(state.last, first), out=set_(state.out, row),
        n=set_(state.n, jnp.ones((A,), jnp.int32)), done=set_(state.done, done),
        max_new=set_(state.max_new, new.max_new), stop_ids=set_(state.stop_ids, new.stop),
        temperature=set_(state.temperature, new.temps), key=set_(state.key, keys),
        top_p=new.top_p,
    )  # fmt: skip
    if plan.logprobs is not None:  # the rows' records start with the first token's
        record = lps.empty((A, N), plan.logprobs)
        record = record.put((slice(None), 0), lps.of(logits[:, 0], first, plan.logprobs))
        state = dataclasses.replace(state, logprobs=state.logprobs.put(slots, record))
    if drafter is not None:  # the rows' queues start empty, as after a prefill alone
        state = dataclasses.replace(
            state, dcache=state.dcache.with_lengths(set_(state.dcache.lengths, new.lens)),
            pending=set_(state.pending, 0), n_pend=set_(state.n_pend, 0),
        )  # fmt: skip
    return Pool(state, set_(pool.steps, 0))
