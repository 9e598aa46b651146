"""The slot pool's device side of the host/device split: the pool kept on one thread of its
own, and the programs queued there (kdj/decode/engine.py is the host side).

On a GPU a chunk's call returns only when its while_loop has finished (XLA reads each
iteration's predicate back to the host), so whoever calls it is held for the whole chunk.
`DeviceQueue` owns the pool on a thread that does nothing else: every program that reads or
writes it (a chunk, a prefill, a resize, freeing slots) is queued there in order, and the
host only waits for the futures of what it needs to read (a report, first tokens).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from kdj.decode import pool
from kdj.decode.logprobs import Logprobs


class DeviceQueue:
    """A pool on its own thread. `queue(fn, *args)` runs fn(pool, *args) after everything
    queued before it; fn returns the new pool, or a NamedTuple with a `pool` field (and what
    the host reads). Once one program raised, each later one raises too until `restart`:
    none runs on the state of a program that failed halfway."""

    def __init__(self, pool_: pool.Pool):
        self._pool, self._broken = pool_, None  # the device thread's own
        # seconds the thread sat with nothing queued, up to the program now running (read
        # by that program: a chunk's report says how long the host kept the device waiting)
        self.idle_s, self._end = 0.0, time.perf_counter()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdj-device")

    def queue(self, fn, *args) -> concurrent.futures.Future:
        return self._thread.submit(self._apply, fn, *args)

    def restart(self, pool_: pool.Pool) -> None:
        """Replace the pool after everything queued; a broken queue serves again from here."""
        self._thread.submit(self._restart, pool_)

    def read(self) -> pool.Pool:
        """The pool once everything queued has run (tests, inspection)."""
        return self._thread.submit(lambda: self._pool).result()

    def hold(self, event) -> None:
        """Queue a wait for `event` (tests: the device busy until it is set)."""
        self._thread.submit(event.wait)

    def _apply(self, fn, *args):
        if self._broken is not None:
            raise RuntimeError(f"an earlier pool program failed: {self._broken}")
        self.idle_s += time.perf_counter() - self._end
        try:
            out = fn(self._pool, *args)
        except BaseException as e:
            self._broken = e
            raise
        finally:
            self._end = time.perf_counter()
        self._pool = out if isinstance(out, pool.Pool) else out.pool
        return out

    def _restart(self, pool_: pool.Pool) -> None:
        self._pool, self._broken = pool_, None


# ------------------------------------------------------------------ programs queued there
class Ran(NamedTuple):
    """What a chunk's program gave back: the pool after it, and its report."""

    pool: pool.Pool
    report: pool.Report
    idle_s: float  # the device thread's idle seconds (DeviceQueue.idle_s) when it started
    seconds: float  # how long it ran


def run_chunk(pool_: pool.Pool, fn, ts, ds, bound, wake, queue: DeviceQueue) -> Ran:
    """One chunk, its report's copies to the host started at once. Timed from the end of
    the work queued before it (a prefill, a resize), which it would otherwise wait for on
    the device inside its own time."""
    jax.block_until_ready(pool_)
    t0 = time.perf_counter()
    pool_, report = fn(ts, ds, pool_, bound, wake)
    for x in jax.tree.leaves(report):  # the host reads them a chunk later
        x.copy_to_host_async()
    # held until the chunk has run, as a GPU's while_loop holds it anyway: where dispatch is
    # asynchronous (CPU) the thread's idle time would otherwise not be the device's
    report.n.block_until_ready()
    return Ran(pool_, report, queue.idle_s, time.perf_counter() - t0)


def free(pool_: pool.Pool, mark_done, rows: np.ndarray) -> pool.Pool:
    """`rows` ride along as done from the next chunk on (cancelled); mark_done:
    pool.mark_done compiled for the pool's width."""
    state = pool_.state
    return pool_._replace(state=dataclasses.replace(state, done=mark_done(state.done, rows)))


class Joined(NamedTuple):
    """What an admission's last prefill call gives back: the pool, and the newcomers' first
    tokens (their copy to the host under way)."""

    pool: pool.Pool
    first: jax.Array  # [newcomers] int32
    done: jax.Array  # [newcomers] bool: ended at it (a stop token, a one-token budget)
    logprobs: Logprobs | None  # [newcomers, 1] the first tokens', when the pool records


def prefill_chunk(pool_: pool.Pool, fn, ts, ds, new, last=None):
    """One prefill call; after an admission's last (last: pool.first_tokens compiled for the
    pool, and the admission's rows), a Joined with the newcomers' first tokens."""
    pool_ = fn(ts, ds, pool_, new)
    if last is None:
        return pool_
    first_tokens, rows = last
    joined = Joined(pool_, *first_tokens(pool_, rows))
    for x in jax.tree.leaves(joined[1:]):
        x.copy_to_host_async()
    return joined
