"""Where the slot pool's host turns went (kdj/decode/engine.py counts them; `kdj serve`
reports them at GET /stats; `kdj bench-serve` differences two reads over a level), and how
many steps each width's next chunk runs (ChunkSteps)."""

from __future__ import annotations

import dataclasses

import numpy as np

# follow_host: a device wait longer than this, and than this share of the chunk before it,
# counts as the host's; this many chunks without one end a width's spell at its steps
STARVED_S, STARVED_SHARE, CALM_CHUNKS = 2e-4, 0.1, 8
# ... and a chunk's own fixed cost (its dispatch, loop entry and report) may make a step cost
# this much more than in the cheapest chunks seen: fewer steps stream sooner but cost that
FIXED_SHARE = 0.2
EMA = 0.25  # weight of a chunk's cost per step in its step count's running mean


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
    """Steps the next chunk at each width may run (`run`, width -> steps): its bound, or
    with `follow_host` as few as keep the device busy stepping, so tokens reach their streams
    a few steps apart instead of a chunk apart. Two costs bound it from below: the host's
    turn, which a chunk must outlast (else the device waits: the steps double), and each
    chunk's own fixed cost, which a chunk must amortise. The latter is measured, not assumed:
    each width starts at its bound and walks down a step at a time, recording each step
    count's seconds per step, while that stays within FIXED_SHARE of the cheapest seen."""

    def __init__(self, bounds: dict[int, int], follow_host: bool):
        self.bounds, self.follow_host = bounds, follow_host
        self.run = dict(bounds)
        self._calm = dict.fromkeys(bounds, 0)  # chunks since the device last waited
        self.per_step = {w: {} for w in bounds}  # width -> {steps: mean seconds per step}

    def step_ms(self) -> dict[int, dict[int, float]]:
        """Per width, each step count's running mean of ms a step so far (what a chunk's
        own cost adds to its steps shows as the counts' difference)."""
        return {w: {s: 1e3 * c for s, c in sorted(costs.items())}
                for w, costs in self.per_step.items() if costs}  # fmt: skip

    def forget(self, width: int) -> None:
        """Search `width`'s step count afresh from its bound (what a step costs changed)."""
        self.run[width], self._calm[width], self.per_step[width] = self.bounds[width], 0, {}

    def observe(self, width: int, starved_s: float, ran_s: float, steps: int,
                stats: TurnStats) -> None:  # fmt: skip
        """A chunk of `steps` steps ran `ran_s` seconds; before it started, the device waited
        `starved_s` for the host since the chunk before, though the host had queued it behind
        that one (without follow_host the waits are only counted). A wait worth counting
        doubles this width's steps (up to its bound): the host's turn needs a longer chunk to
        hide behind. After CALM_CHUNKS chunks without one, a step comes off if the step count
        below costs little more per step than the cheapest (or is not measured yet); a step
        goes back on if this one costs more than that."""
        stats.starved_s += starved_s
        waited = starved_s > max(STARVED_S, STARVED_SHARE * ran_s)
        stats.starved += waited
        costs = self.per_step[width]
        if steps >= 1:
            old = costs.get(steps)
            new = ran_s / steps
            costs[steps] = new if old is None else (1 - EMA) * old + EMA * new
        if not self.follow_host:
            return
        s = self.run[width]
        if waited:
            self.run[width], self._calm[width] = min(self.bounds[width], 2 * s), 0
            return
        self._calm[width] += 1
        if self._calm[width] < CALM_CHUNKS:
            return
        self._calm[width] = 0
        dearest = (1 + FIXED_SHARE) * min(costs.values(), default=0.0)
        if costs.get(s, 0.0) > dearest:
            self.run[width] = min(self.bounds[width], s + 1)
        elif s > 1 and costs.get(s - 1, 0.0) <= dearest:
            self.run[width] = s - 1
