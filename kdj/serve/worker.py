"""The engine's device loop in one worker thread, bridged to asyncio.

The HTTP handlers (event loop) put requests and cancellations into a thread-safe inbox; the
worker takes them in between engine steps and hands a turn's updates back to their asyncio
queues in one `call_soon_threadsafe` per event loop (one wake-up of the loop per turn, not
one per stream). A step that raises fails the requests in the pool (their clients get the
error), resets the pool and keeps serving.

The worker and the event loop share the GIL: the worker needs it only briefly per turn, but
each time it waits for it up to the interpreter's switch interval (5 ms by default) while
the loop runs handlers. `switch_interval_s` shortens that wait while the worker runs.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import queue
import sys
import threading
import time

from kdj.decode.engine import Engine
from kdj.decode.requests import Request, Update


class Overloaded(Exception):
    """The queue is full: the client should retry later (HTTP 503)."""


@dataclasses.dataclass
class Ticket:
    """One request in flight: its engine request and where its updates go."""

    request: Request
    updates: asyncio.Queue
    loop: asyncio.AbstractEventLoop

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.updates.put_nowait, item)


def _hand_out(batch: list) -> None:
    """On the event loop: a turn's (ticket, item) pairs into their tickets' queues."""
    for ticket, item in batch:
        ticket.updates.put_nowait(item)


@dataclasses.dataclass
class WorkerStats:
    """The worker thread's time, cumulative: idle (no request anywhere), delivering updates."""

    idle_s: float = 0.0
    deliver_s: float = 0.0
    updates: int = 0


class Worker:
    def __init__(self, engine: Engine, max_queue: int, switch_interval_s: float = 0.001):
        self.engine, self.max_queue = engine, max_queue
        self.switch_interval_s = switch_interval_s
        self._switch_before = sys.getswitchinterval()
        self.stats = WorkerStats()
        self.inbox: queue.Queue = queue.Queue()
        self.tickets: dict[int, Ticket] = {}
        self.in_flight = 0  # submitted and not yet finished (read by the event loop)
        self.cancelled = 0  # requests ended by a cancel (a disconnect, a stop string)
        self._cancelling: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdj-engine", daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(self.switch_interval_s)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is in flight (clients get a "cancelled" end) and join the thread."""
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)
        sys.setswitchinterval(self._switch_before)

    def submit(self, request: Request) -> Ticket:
        """Queue a request (ValueError: it does not fit the engine; Overloaded: queue full)."""
        self.engine.check(request)
        with self._lock:
            if self._stop.is_set():
                raise Overloaded("the server is shutting down")
            if self.in_flight >= self.engine.B + self.max_queue:
                slots, queued = self.engine.B, self.max_queue
                raise Overloaded(f"server busy: {self.in_flight} requests in flight ({slots} "
                                 f"slots + {queued} queued); retry later")  # fmt: skip
            self.in_flight += 1
        ticket = Ticket(request, asyncio.Queue(), asyncio.get_running_loop())
        self.inbox.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        self.inbox.put(("cancel", ticket))

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.busy
            t0 = time.perf_counter()
            self._take(block=idle)
            if idle:
                self.stats.idle_s += time.perf_counter() - t0
            if self._stop.is_set():
                break
            if self.engine.busy:
                try:
                    updates = self.engine.step()
                except Exception as e:  # one failed step must not end the server
                    self._fail(self.engine.reset(), RuntimeError(f"engine step failed: {e}"))
                    continue
                t0 = time.perf_counter()
                self._deliver(updates)
                self.stats.deliver_s += time.perf_counter() - t0
                self.stats.updates += len(updates)
        ended = RuntimeError("cancelled: the server is shutting down")
        self._fail(list(self.tickets), ended)
        while not self.inbox.empty():  # submitted after the last turn: never started
            item = self.inbox.get_nowait()
            if item is not None and item[0] == "submit":
                item[1].send(ended)
                with self._lock:
                    self.in_flight -= 1

    def _take(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, ticket = item
            if kind == "submit":
                self.tickets[self.engine.submit(ticket.request)] = ticket
            elif ticket.request.id in self.tickets:
                self.engine.cancel(ticket.request.id)
                self._cancelling.add(ticket.request.id)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, updates: list[Update]) -> None:
        batches = collections.defaultdict(list)  # per event loop (one, for a server)
        for u in updates:
            ticket = self.tickets.get(u.id)
            if ticket is None:
                continue
            batches[ticket.loop].append((ticket, u))
            if u.finished:
                if u.id in self._cancelling:
                    self._cancelling.discard(u.id)
                    self.cancelled += 1
                self._finish(u.id)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_hand_out, batch)

    def _finish(self, rid: int) -> None:
        del self.tickets[rid]
        with self._lock:
            self.in_flight -= 1

    def _fail(self, ids, error: Exception) -> None:
        for rid in ids:
            if rid in self.tickets:
                self.tickets[rid].send(error)
                self._finish(rid)
