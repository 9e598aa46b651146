"""The engine's device loop in one worker thread, bridged to asyncio.

The HTTP handlers (event loop) put requests and cancellations into a thread-safe inbox; the
worker takes them in between engine steps and hands each request's updates back to its
asyncio queue with `call_soon_threadsafe`. A step that raises fails the requests in the
pool (their clients get the error), resets the pool and keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading

from kdj.decode.engine import Engine, Request, Update


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


class Worker:
    def __init__(self, engine: Engine, max_queue: int):
        self.engine, self.max_queue = engine, max_queue
        self.inbox: queue.Queue = queue.Queue()
        self.tickets: dict[int, Ticket] = {}
        self.in_flight = 0  # submitted and not yet finished (read by the event loop)
        self.cancelled = 0  # requests ended by a cancel (a disconnect, a stop string)
        self._cancelling: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kdj-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is in flight (clients get a "cancelled" end) and join the thread."""
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

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
            self._take(block=not self.engine.busy)
            if self._stop.is_set():
                break
            if self.engine.busy:
                try:
                    updates = self.engine.step()
                except Exception as e:  # one failed step must not end the server
                    self._fail(self.engine.reset(), RuntimeError(f"engine step failed: {e}"))
                    continue
                for u in updates:
                    self._deliver(u)
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

    def _deliver(self, u: Update) -> None:
        ticket = self.tickets.get(u.id)
        if ticket is None:
            return
        ticket.send(u)
        if u.finished:
            if u.id in self._cancelling:
                self._cancelling.discard(u.id)
                self.cancelled += 1
            self._finish(u.id)

    def _finish(self, rid: int) -> None:
        del self.tickets[rid]
        with self._lock:
            self.in_flight -= 1

    def _fail(self, ids, error: Exception) -> None:
        for rid in ids:
            if rid in self.tickets:
                self.tickets[rid].send(error)
                self._finish(rid)
