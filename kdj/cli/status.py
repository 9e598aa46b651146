"""A status line on stderr while a long call runs (compiling can take tens of seconds)."""

from __future__ import annotations

import sys
import threading
import time


class Status:
    """`with Status("compiling"):` shows "<text> ... N s" on stderr, updated every second in
    place on a terminal; elsewhere (a log, a pipe) one line when it starts."""

    def __init__(self, text: str, stream=None):
        self.text, self.stream = text, stream or sys.stderr
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> Status:
        self.start = time.perf_counter()
        if self.stream.isatty():
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        else:
            print(f"{self.text} ...", file=self.stream, flush=True)
        return self

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            elapsed = time.perf_counter() - self.start
            print(f"\r{self.text} ... {elapsed:.0f} s", end="", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            print("\r\033[K", end="", file=self.stream, flush=True)  # clear the line
