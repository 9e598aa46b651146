"""Where the slot pool's host turns went (kdj/decode/engine.py counts them; `kdj serve`
reports them at GET /stats; `kdj bench-serve` differences two reads over a level), and how
many steps each width's next chunk runs (ChunkSteps)."""

from __future__ import annotations

import dataclasses

import numpy as np

# follow_host: a device wait longer than this, and than this share of the chunk before it,
# counts as the host's; this many chunks without one take a step off a width's chunks
STARVED_S, STARVED_SHARE, CALM_CHUNKS = 2e-4, 0.1, 8


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
    # and how many were long enough to count (ChunkSteps.observe)
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


class ChunkSteps:
    """Steps the next chunk at each width may run (`run`, width -> steps): its bound, or with
    `follow_host` as few as keep the device busy through the host's turns, so tokens reach
    their streams a step or so apart instead of a chunk apart."""

    def __init__(self, bounds: dict[int, int], follow_host: bool):
        self.bounds, self.follow_host = bounds, follow_host
        self.run = {w: 1 if follow_host else b for w, b in bounds.items()}
        self._calm = dict.fromkeys(bounds, 0)  # chunks since the device last waited

    def observe(self, width: int, starved_s: float, ran_s: float, stats: TurnStats) -> None:
        """The device waited `starved_s` for the host since the chunk before this one (this
        one ran `ran_s`) started, though the host had queued this one behind it. A wait
        worth counting doubles this width's steps (up to its bound): the host's turn needs
        a longer chunk to hide behind. CALM_CHUNKS chunks in a row without one take a step
        off (down to 1). Without follow_host the waits are only counted."""
        stats.starved_s += starved_s
        waited = starved_s > max(STARVED_S, STARVED_SHARE * ran_s)
        stats.starved += waited
        if not self.follow_host:
            return
        s = self.run[width]
        if waited:
            self.run[width], self._calm[width] = min(self.bounds[width], 2 * s), 0
            return
        self._calm[width] += 1
        if self._calm[width] >= CALM_CHUNKS and s > 1:
            self.run[width], self._calm[width] = s - 1, 0
