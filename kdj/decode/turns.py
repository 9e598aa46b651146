"""Where the slot pool's host turns went (kdj/decode/engine.py counts them; `kdj serve`
reports them at GET /stats; `kdj bench-serve` differences two reads over a level)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class TurnStats:
    """Where the host's turns went, cumulative (a server reports them; a benchmark takes the
    difference over a run): `wait_s` of `turn_s` was spent blocked on a chunk's report, the
    rest was the host's own work (admission, resizes, dispatch, reading reports)."""

    turns: int = 0
    turn_s: float = 0.0
    wait_s: float = 0.0
    chunks: int = 0
    prefills: int = 0  # prefill calls (one per admission group and prompt chunk)
    admitted: int = 0
    tokens: int = 0  # tokens handed out
    # the device's waits for the host between chunks queued back to back: their seconds,
    # and how many were long enough to count (Engine._follow)
    starved_s: float = 0.0
    starved: int = 0
    widths: dict[int, int] = dataclasses.field(default_factory=dict)  # chunks run per width
    # per width, per choice of the drafting methods (a menu entry's name, "plain": a step
    # that skipped the drafter): [pool steps, tokens they committed over all rows]
    choices: dict[int, dict[str, list[int]]] = dataclasses.field(default_factory=dict)

    def tally(self, width: int, names: tuple[str, ...], tally: np.ndarray) -> None:
        at = self.choices.setdefault(width, {})
        for name, (steps, tokens) in zip(names, tally.tolist()):
            if steps:
                mine = at.setdefault(name, [0, 0])
                mine[0], mine[1] = mine[0] + steps, mine[1] + tokens
