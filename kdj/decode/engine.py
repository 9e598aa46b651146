"""Continuous batching: a fixed pool of B slots on the device, requests streamed through it.

    host                                  device
    admit waiting requests into free  ->  prefill only those rows (bucketed: A newcomers
    slots                                 rounded up to a power of two, prompts to 16 tokens),
                                          their K/V and state written into the pool
    re-enter                          ->  ONE while_loop of plain_step over the whole pool,
                                          until a slot finishes or `chunk_steps` steps ran
    retire finished slots, hand out   <-  out / n / done (never the caches)
    the new tokens

Finished and free slots ride along without advancing (`done`), as in kdj/decode/loop.py.
A newcomer's prefill stalls the running slots for one prefill call of at most B rows of
the longest waiting prompt; a slot finishing wakes the host, so a free slot waits at most one
chunk. Plain decoding (AR) only so far.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.cache import init_cache
from kdj.decode.loop import prefill
from kdj.decode.sampling import request_keys
from kdj.decode.state import DecodeState, is_stop
from kdj.decode.step import plain_step
from kdj.handles import Target

STOP_WIDTH = 8  # stop ids per request (-1 padded): one compile for every request


@dataclasses.dataclass
class Request:
    tokens: list[int]
    max_new: int
    stop: list[int]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # its samples' seed (None: one derived from the pool's and its id)
    id: int = -1  # set by Engine.submit


class Mode(NamedTuple):
    """What the whole pool shares: greedy (static in the compiled step) and top_p."""

    greedy: bool
    top_p: float


def mode_of(req: Request) -> Mode:
    greedy = req.temperature == 0.0
    return Mode(greedy, 1.0 if greedy else req.top_p)


class Update(NamedTuple):
    """New tokens of one request since the last update; `finished` once it is done."""

    id: int
    tokens: list[int]
    finished: bool


@functools.partial(jax.jit, static_argnames=("tgraph", "greedy"), donate_argnames=("state",))
def run_chunk(tgraph, tstate, state: DecodeState, bound, *, greedy) -> DecodeState:
    """plain_step over the pool until a running slot finishes, all are done, or `bound` steps."""
    target = nnx.merge(tgraph, tstate)
    entry_done, stop_at = state.done, state.step + bound

    def cond(s):
        return (s.step < stop_at) & ~jnp.any(s.done & ~entry_done) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, lambda s: plain_step(target, s, greedy), state)


@functools.partial(jax.jit, static_argnames=("tgraph", "greedy"), donate_argnames=("state",))
def admit(tgraph, tstate, state: DecodeState, tokens, lens, slots, max_new, stop, temps, seeds,
          *, greedy) -> DecodeState:  # fmt: skip
    """Prefill newcomers tokens [A, P] and write them into pool rows `slots` [A] (B: padding,
    dropped). The prefill cache holds P slots only: the pool keeps the rest."""
    target = nnx.merge(tgraph, tstate)
    A, P = tokens.shape
    cache = init_cache(target.cfg, A, P, state.tcache.k[0].dtype)
    keys = request_keys(seeds, shared=True)  # a request's samples: (its seed, position)
    pre = prefill(tgraph, tstate, None, None, tokens, lens, cache, None, keys, temps[:, None],
                  state.top_p, greedy=greedy)  # fmt: skip

    def put(pool, new):
        return pool.at[slots, :, :P].set(new, mode="drop")

    pool = state.tcache
    tcache = dataclasses.replace(
        pool,
        k=[put(p, n) for p, n in zip(pool.k, pre.tcache.k)],
        v=[put(p, n) for p, n in zip(pool.v, pre.tcache.v)],
        lengths=pool.lengths.at[slots].set(lens, mode="drop"),
    )
    N = state.out.shape[1]
    row = jnp.zeros((A, N), jnp.int32).at[:, 0].set(pre.first)
    done = is_stop(pre.first, stop) | (max_new <= 1)

    def set_(x, v):
        return x.at[slots].set(v, mode="drop")

    return dataclasses.replace(
        state, tcache=tcache, last=set_(state.last, pre.first), out=set_(state.out, row),
        n=set_(state.n, jnp.ones((A,), jnp.int32)), done=set_(state.done, done),
        max_new=set_(state.max_new, max_new), stop_ids=set_(state.stop_ids, stop),
        temperature=set_(state.temperature, temps[:, None]), key=set_(state.key, keys),
    )  # fmt: skip


class Engine:
    """A pool of `max_batch` slots of `cache_size` tokens each; each request emits at most
    `max_new_cap` tokens. The running slots share a `Mode`: greedy (exact argmax) or sampled
    at one top_p, each slot at its own temperature; the pool switches mode when it drains.
    A request's token at position p is sampled with a key from (its seed, p), so its samples
    do not depend on its neighbours; without a seed of its own it gets one from `seed` and its
    id. Not thread-safe: one thread drives `step`."""

    def __init__(self, target: Target, max_batch: int, cache_size: int, max_new_cap: int,
                 *, chunk_steps: int = 32, seed: int = 0):  # fmt: skip
        if max_batch < 1 or cache_size < 2 or max_new_cap < 1 or chunk_steps < 1:
            raise ValueError("max_batch, max_new_cap, chunk_steps >= 1 and cache_size >= 2")
        if target.sharding is not None:
            raise ValueError("the serving engine runs on one device (target has a mesh)")
        self.target, self.B, self.S, self.N = target, max_batch, cache_size, max_new_cap
        self.greedy, self.chunk_steps = True, chunk_steps  # greedy: the running mode's
        self.seed = seed
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_batch
        self.sent = [0] * max_batch  # tokens of each slot's request handed out so far
        self.cancelled: set[int] = set()
        self._ids = itertools.count()
        self.state = self._empty_state()

    def _empty_state(self) -> DecodeState:
        B, N, t = self.B, self.N, self.target

        def zeros():  # a buffer each: the state is donated
            return jnp.zeros((B,), jnp.int32)

        return DecodeState(
            tcache=init_cache(t.cfg, B, self.S, t.dtype), dcache=None, last=zeros(),
            pending=None, n_pend=None, out=jnp.zeros((B, N), jnp.int32), n=zeros(),
            done=jnp.ones((B,), bool), max_new=zeros(), stop_ids=jnp.full((B, STOP_WIDTH), -1),
            key=request_keys(np.zeros(B, np.uint32), shared=True),
            temperature=jnp.ones((B, 1), jnp.float32),
            top_p=jnp.float32(1.0), calibration=jnp.float32(1.0), step=jnp.int32(0),
            stats=None, auto=None,
        )  # fmt: skip

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
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")

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
        self.slots = [None] * self.B
        self.cancelled.clear()
        self.state = self._empty_state()
        return ids

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    # ------------------------------------------------------------------ the host's turn
    def step(self) -> list[Update]:
        """Retire cancelled slots, admit, run one chunk on the device, hand out new tokens."""
        updates = self._drop_cancelled()
        self._admit()
        if any(r is not None for r in self.slots):
            t = self.target
            exe = t.executables
            fn = exe.get(run_chunk, t.graphdef, t.state, self.state, jnp.int32(0),
                         greedy=self.greedy)  # fmt: skip
            self.state = fn(t.state, self.state, jnp.int32(self.chunk_steps))
            updates += self._collect()
        return updates

    def _drop_cancelled(self) -> list[Update]:
        if not self.cancelled:
            return []
        dropped = [Update(r.id, [], True) for r in self.waiting if r.id in self.cancelled]
        self.waiting = collections.deque(r for r in self.waiting if r.id not in self.cancelled)
        freed = [b for b, r in enumerate(self.slots) if r is not None and r.id in self.cancelled]
        if freed:
            idx = jnp.asarray(freed)
            self.state = dataclasses.replace(self.state, done=self.state.done.at[idx].set(True))
        updates = dropped + [Update(self.slots[b].id, [], True) for b in freed]
        for b in freed:
            self.slots[b] = None
        self.cancelled.clear()
        return updates

    def _admit(self) -> None:
        """Fill free slots from the head of the queue with requests of the pool's mode (FIFO:
        a request of another mode waits for the pool to drain, so none starves)."""
        free = [b for b, r in enumerate(self.slots) if r is None]
        if not free or not self.waiting:
            return
        running = [r for r in self.slots if r is not None]
        mode = mode_of(running[0] if running else self.waiting[0])
        take = []
        while self.waiting and len(take) < len(free) and mode_of(self.waiting[0]) == mode:
            take.append(self.waiting.popleft())
        if not take:
            return
        self.greedy = mode.greedy
        A = min(1 << (len(take) - 1).bit_length(), self.B)  # bucket: powers of two
        P = min(-(-max(len(r.tokens) for r in take) // 16) * 16, self.S)
        tokens = np.zeros((A, P), np.int32)
        lens, slots = np.ones(A, np.int32), np.full(A, self.B, np.int32)
        max_new, temps = np.ones(A, np.int32), np.ones(A, np.float32)
        seeds = np.zeros(A, np.uint32)
        stop = np.full((A, STOP_WIDTH), -1, np.int32)
        for i, (r, b) in enumerate(zip(take, free)):
            tokens[i, : len(r.tokens)] = r.tokens
            lens[i], slots[i], max_new[i] = len(r.tokens), b, r.max_new
            temps[i] = max(r.temperature, 1e-6)
            seeds[i] = r.seed if r.seed is not None else (self.seed * 1_000_003 + r.id) % 2**32
            stop[i, : len(r.stop)] = r.stop
            self.slots[b], self.sent[b] = r, 0
        t = self.target
        self.state = dataclasses.replace(self.state, top_p=jnp.float32(mode.top_p))
        args = (self.state, *map(jnp.asarray, (tokens, lens, slots, max_new, stop, temps, seeds)))
        fn = t.executables.get(admit, t.graphdef, t.state, *args, greedy=self.greedy)
        self.state = fn(t.state, *args)

    def _collect(self) -> list[Update]:
        n, done = np.asarray(self.state.n), np.asarray(self.state.done)
        owned = [b for b, r in enumerate(self.slots) if r is not None]
        hi = max(int(n[b]) for b in owned)
        out = np.asarray(self.state.out[:, :hi])
        updates = []
        for b in owned:
            new = out[b, self.sent[b] : n[b]].tolist()
            self.sent[b] = int(n[b])
            if new or done[b]:
                updates.append(Update(self.slots[b].id, new, bool(done[b])))
            if done[b]:
                self.slots[b] = None
        return updates


def generate_stream(target: Target, prompts: list[list[int]], max_batch: int, max_new: list[int],
                    stop: list[list[int]], *, cache_size: int, temperature: float = 0.0,
                    top_p: float = 1.0, seed: int = 0, seeds: list[int] | None = None,
                    chunk_steps: int = 32):  # fmt: skip
    """Generated tokens of every prompt (token ids), streamed through a pool of `max_batch`
    slots; each list ends at its first stop token or its budget. seeds: one per prompt (its
    samples then do not depend on the other prompts); else each is derived from `seed`."""
    engine = Engine(target, max_batch, cache_size, max(max_new), chunk_steps=chunk_steps,
                    seed=seed)  # fmt: skip
    seeds = seeds if seeds is not None else [None] * len(prompts)
    ids = [engine.submit(Request(list(p), m, list(s), temperature, top_p, seed))
           for p, m, s, seed in zip(prompts, max_new, stop, seeds)]  # fmt: skip
    got: dict[int, list[int]] = {i: [] for i in ids}
    while engine.busy:
        for u in engine.step():
            got[u.id] += u.tokens
    return [got[i] for i in ids]
