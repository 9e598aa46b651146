"""The slot pool's device programs, driven from the host by kdj/decode/engine.py.

    empty   a pool of B free slots: the DecodeState of kdj/decode/loop.py (with the
            drafter's cache and feature queue when the pool drafts), every row done
    admit   write newcomers, prefilled by `prefill_rows` (compiled per rows x prompt
            length, whatever the pool's width), into rows of the pool (target and drafter
            K/V, lengths, the rows' budgets, stops, keys, temperatures; their feature
            queues emptied)
    chunk   the loop's own body (loop.body: plain_step, drafted_step, or auto's runs of
            plain and drafted steps) over the whole pool, until `wake` running slots have
            finished (serving: 1; data generation: a share of the pool), all are done, or a
            bound of steps

`Pool` carries, beside the DecodeState, each slot's steps since admission: a request's tokens
per step, (tokens - 1) / steps (the first token comes from prefill). method="auto" keeps its
controller's forecasts per slot (kdj/decode/auto.py `Controller`): admission resets a slot's
to the calibrated priors. Its steps are priced at the pool's B rows (its compiled width:
the engine keeps B near the live slots, kdj/decode/widths.py), whatever the number of live
slots (free and finished slots ride along, so a step costs what a step of B rows costs),
and they earn what the live slots' forecasts add up to (`auto.choose` and
`auto.drafting_pays` count active rows only). The state's step-indexed
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
from kdj.decode import auto, loop
from kdj.decode.sampling import request_keys
from kdj.decode.state import DecodeState, Plan, Prefilled, init_state, is_stop

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
    pre = Prefilled(zeros(), init_cache(target.cfg, B, S, target.dtype), dcache)
    width = 0 if drafter is None else target.cfg.hidden_size * len(drafter.cfg.target_layer_ids)
    state = init_state(pre, zeros(), jnp.full((B, STOP_WIDTH), -1, jnp.int32),
                       request_keys(np.zeros(B, np.uint32), shared=True),
                       jnp.ones((B,), jnp.float32), 1.0, calibration, prior, plan,
                       width)  # fmt: skip
    return Pool(state, zeros())


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "plan"), donate_argnames=("pool",))
def chunk(tgraph, tstate, dgraph, dstate, pool: Pool, bound, wake, *, plan: Plan) -> Pool:
    """The loop's body over the pool until `wake` running slots have finished, all are done,
    or `bound` steps ran. Each slot counts the steps it was running for: the body's own
    inner loops (auto's runs) also stop when any slot finishes, so a body call's steps are
    either all before or all after a slot's last."""
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
    return Pool(state, steps)


def _put(pool: KVCache, new: KVCache, slots, lens) -> KVCache:
    """Rows `slots` of the pool's cache take the P slots of a newcomers' cache."""
    P = new.capacity

    def put(p, n):
        return p.at[slots, :, :P].set(n, mode="drop")

    return dataclasses.replace(
        pool, k=[put(p, n) for p, n in zip(pool.k, new.k)],
        v=[put(p, n) for p, n in zip(pool.v, new.v)],
        lengths=pool.lengths.at[slots].set(lens, mode="drop"),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("tgraph", "dgraph", "greedy", "dtype"))
def _prefill_new(tgraph, tstate, dgraph, dstate, tokens, lens, seeds, temps, top_p, *, greedy,
                 dtype):  # fmt: skip
    A, P = tokens.shape
    cache = init_cache(nnx.merge(tgraph, tstate).cfg, A, P, dtype)
    dcache = None
    if dgraph is not None:
        dcache = init_cache(nnx.merge(dgraph, dstate).cfg.layers, A, P, dtype)
    keys = request_keys(seeds, shared=True)  # a request's samples: (its seed, position)
    pre = loop.prefill(tgraph, tstate, dgraph, dstate, tokens, lens, cache, dcache, keys, temps,
                       top_p, greedy=greedy)  # fmt: skip
    return pre, keys


def prefill_rows(target, drafter, tokens, lens, seeds, temps, top_p, *, greedy: bool):
    """The newcomers' prefill, tokens [A, P], as one program (their empty caches and keys
    made inside it: no eager work on the host's turn): their caches hold P slots only (the
    pool keeps the rest), so the program depends on (A, P) and not on the pool's width.
    Returns (Prefilled, the rows' keys)."""
    tg, ts = target.graphdef, target.state
    dg, ds = (None, None) if drafter is None else (drafter.graphdef, drafter.state)
    rows = (tokens, lens, seeds, temps, top_p)
    fn = target.executables.get(_prefill_new, tg, ts, dg, ds, *rows,
                                options=target.cfg.kernels.compiler_options(),
                                greedy=greedy, dtype=target.dtype)  # fmt: skip
    return fn(ts, ds, *rows)


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("pool",))
def admit(pool: Pool, pre: Prefilled, lens, slots, max_new, stop, temps, keys, prior, *,
          plan: Plan) -> Pool:  # fmt: skip
    """Write prefilled newcomers (`prefill_rows`) into pool rows `slots` [A] (B: padding,
    dropped). prior [len(plan.menu)]: auto's priors, which the rows' forecasts restart from."""
    state = pool.state
    A = lens.shape[0]
    N = state.out.shape[1]
    row = jnp.zeros((A, N), jnp.int32).at[:, 0].set(pre.first)
    done = is_stop(pre.first, stop) | (max_new <= 1)

    def set_(x, v):
        return x.at[slots].set(v, mode="drop")

    state = dataclasses.replace(
        state, tcache=_put(state.tcache, pre.tcache, slots, lens), last=set_(state.last, pre.first),
        out=set_(state.out, row), n=set_(state.n, jnp.ones((A,), jnp.int32)),
        done=set_(state.done, done), max_new=set_(state.max_new, max_new),
        stop_ids=set_(state.stop_ids, stop), temperature=set_(state.temperature, temps),
        key=set_(state.key, keys),
    )  # fmt: skip
    if pre.dcache is not None:  # the rows' queues start empty, as after a prefill alone
        state = dataclasses.replace(
            state, dcache=_put(state.dcache, pre.dcache, slots, lens),
            pending=set_(state.pending, 0), n_pend=set_(state.n_pend, 0),
        )  # fmt: skip
    if plan.adaptive:
        rows = set_(jnp.zeros(state.done.shape, bool), True)
        ctrl = auto.admit(state.auto, plan, prior, rows, state.tcache.lengths, state.active)
        state = dataclasses.replace(state, auto=ctrl)
    return Pool(state, set_(pool.steps, 0))
