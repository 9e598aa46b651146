"""method="auto" on the slot pool: which entry of the menu the next chunk at each width runs,
chosen on the host from what the chunks measured (kdj/decode/engine.py drives it).

A chunk pinned to one entry runs it as its fixed method would (Plan.pin: no forecasts, no
on-device controller), so auto costs what the entry it runs costs. A chunk's rate is tokens
committed per live row per second of the device's time: tau / seconds a step. Tau moves with
the prompts in the rows far more than entries differ (one row: one prompt), so entries are
compared in pairs: a re-check chunk of entry B against the chunks of the width's best entry A
on either side of it, which hold the same rows. Each entry keeps a score, its log rate
against the others', and the width runs the best scored. An entry not measured yet first
runs once the width has run `spacing` chunks (the cost model's price sets it: the better
priced, the sooner; an entry without a price runs at once), for two chunks, since its first
may have compiled. A measured entry that is not the best runs again for one chunk once the
width has spent `spacing` times that entry's chunk on others, the spacing growing each time
it loses (twofold, times how far it is behind), so re-checking costs at most about
1 / spacing of the time and a change of load is still seen.
"""

from __future__ import annotations

import dataclasses
import math

# Spacing of re-checks, in multiples of the entry's own chunk time: the first at most
# SPACING_MIN after the width starts (sooner the better the model prices it), growing to
# SPACING_MAX while it keeps losing (a loser then costs < 1 / SPACING_MAX of the time).
SPACING_MIN, SPACING_MAX = 4.0, 256.0
# An entry the cost model prices below this share of the width's best is not compiled there:
# the model has been off by ~1.4x, not by 2x; every entry compiled is a program per width.
COMPILE_SHARE = 0.5
# Running-mean weights: of the rate the report shows (the running entry's chunks, a
# re-checked one's, whose old rate may be long stale), and of a re-check's paired score.
EMA, RECHECK_EMA, PAIRED_EMA = 0.25, 0.5, 0.5
# A re-check's two neighbours (the best entry's chunks) further apart than this: the rows
# changed between them, so the pair is void. Chunks on the same rows agree within ~10%.
PAIR_AGREE = 1.25


def worth_compiling(priced: list[float], plain: list[bool], known: bool) -> list[bool]:
    """Which entries a width compiles: plain steps always (the pool's fallback), the others
    when priced at COMPILE_SHARE of the best or more; all of them before the drafter's
    acceptance is known (`known` False: nothing to price with), and all of a menu without
    plain steps (every width's pool must then keep the same layout of drafting entries)."""
    top = max(priced)
    if not any(plain):
        return [True] * len(priced)
    return [p or not known or r >= COMPILE_SHARE * top for r, p in zip(priced, plain)]


def spacing(priced: float, top: float) -> float:
    """An entry's first spacing: SPACING_MIN for one priced as well as the best, wider as
    its price falls below (top: the best price), within SPACING_MAX."""
    if top <= 0 or priced <= 0:  # nothing to rank it by: it runs early to find out
        return SPACING_MIN
    return min(SPACING_MAX, SPACING_MIN * top / max(priced, top / SPACING_MAX))


@dataclasses.dataclass
class Entry:
    prior: float  # the cost model's tokens per row-second, ranking it until measured (0: none)
    spacing: float  # re-check spacing, in multiples of its own chunk's time
    due_chunk: float  # before it is measured: the width's chunk count at which it first runs
    rate: float | None = None  # measured tokens per row-second (running mean: the report's)
    score: float | None = None  # log rate against the width's other entries (the pick's)
    paired: int = 0  # re-checks scored against the best entry's chunks beside them
    due_at: float = math.inf  # once measured: the width's clock (device seconds) of its re-check
    runs: int = 0  # chunks that ran it (the first is not timed: it may have compiled)
    chunks: int = 0  # chunks timed
    pending: bool = False  # a re-check dispatched, its report not read yet


@dataclasses.dataclass(frozen=True)
class Pair:
    """A timed re-check of `entry`, scored once the chunk after it reports: against the
    `anchor` entry's chunks on either side (`before`: the one just before it, if the anchor's)."""

    entry: int
    rate: float
    seconds: float
    anchor: int
    before: float | None


class Picks:
    """Per width, per menu entry (by index): what the chunks measured, and the pick."""

    def __init__(self, priors: dict[int, list[float]]):
        """priors: per width, each menu entry's tokens per row-second by the cost model."""
        self.entries: dict[int, list[Entry]] = {}
        self.clock: dict[int, float] = dict.fromkeys(priors, 0.0)  # device seconds run
        self.count: dict[int, int] = dict.fromkeys(priors, 0)  # chunks run
        self.last: dict[int, tuple[int, float]] = {}  # (entry, rate) of the last timed chunk
        self.open: dict[int, Pair] = {}  # a re-check waiting for the chunk after it
        for w, rates in priors.items():
            top = max(rates)
            self.entries[w] = [Entry(r, spacing(r, top), spacing(r, top)) for r in rates]

    def best(self, width: int) -> int:
        """The entry the width runs between re-checks: the best scored, else the best
        priced (measured entries count only against measured ones)."""
        es = self.entries[width]
        measured = [i for i, e in enumerate(es) if e.score is not None]
        if measured:
            return max(measured, key=lambda i: es[i].score)
        return max(range(len(es)), key=lambda i: es[i].prior)

    def next(self, width: int) -> tuple[int, bool]:
        """(entry, re-check) for the next chunk at `width`: an entry without a price (the
        drafter's acceptance is unknown) until it is measured; else one not measured yet
        once the width has run `spacing` chunks (its price ranks it: the better, the
        sooner); else the most overdue re-check; else the best."""
        es, now, n, best = (
            self.entries[width],
            self.clock[width],
            self.count[width],
            self.best(width),
        )
        unknown = [i for i, e in enumerate(es) if e.prior <= 0 and e.rate is None]
        if unknown:
            return unknown[0], True

        def due(e: Entry) -> bool:
            return n >= e.due_chunk if e.rate is None else now >= e.due_at

        waiting = [i for i, e in enumerate(es) if i != best and not e.pending and due(es[i])]
        if not waiting:
            return best, False
        pick = min(waiting, key=lambda i: (es[i].rate is not None, es[i].due_at, es[i].due_chunk))
        es[pick].pending = True  # once: its report comes a chunk later and says what next
        return pick, True

    def observe(self, width: int, entry: int, tokens: int, row_steps: int, steps: int,
                seconds: float, recheck: bool) -> None:  # fmt: skip
        """A chunk at `width` ran `entry` for `steps` steps in `seconds`, its live rows
        committing `tokens` over `row_steps` row-steps (a row's step counts while it ran).
        An entry's first chunk at a width is not timed (it may have compiled)."""
        self.clock[width] += seconds
        self.count[width] += 1
        e = self.entries[width][entry]
        e.pending, e.runs = False, e.runs + 1
        if e.runs == 1 or min(tokens, steps, row_steps) < 1 or seconds <= 0:  # nothing to time
            if e.rate is None:
                e.due_chunk = self.count[width]  # timed on its next chunk
            elif recheck:
                e.due_at = self.clock[width]
            return
        rate = tokens / row_steps * steps / seconds  # tau / seconds a step
        w = RECHECK_EMA if recheck else EMA
        e.rate = rate if e.rate is None else (1 - w) * e.rate + w * rate
        e.chunks += 1
        self._settle(width, entry, rate)
        if recheck or e.score is None:
            anchor = self.best(width)
            if anchor == entry or self.entries[width][anchor].score is None:
                self._score(width, entry, math.log(rate), seconds, first=e.score is None)
            else:
                last = self.last.get(width)
                before = last[1] if last is not None and last[0] == anchor else None
                self.open[width] = Pair(entry, rate, seconds, anchor, before)
                e.due_at = math.inf  # until it is scored, a chunk from now
        self.last[width] = (entry, rate)

    def _settle(self, width: int, entry: int, rate: float) -> None:
        """Score the open re-check, if any, now that the chunk after it (`entry`, `rate`)
        has reported: against the mean of its anchor's chunks on either side, or the one
        there is. Where those two disagree by more than PAIR_AGREE the rows changed under
        it (a prompt ended): it says nothing, and the entry is re-checked at once."""
        pair = self.open.pop(width, None)
        if pair is None:
            return
        e = self.entries[width][pair.entry]
        beside = [r for r in (pair.before, rate if entry == pair.anchor else None) if r]
        if len(beside) == 2 and max(beside) > PAIR_AGREE * min(beside):
            e.due_at = self.clock[width]
            return
        anchor = self.entries[width][pair.anchor].score
        base = math.log(sum(beside) / len(beside)) if beside else 0.0
        score = anchor + math.log(pair.rate) - base if beside else math.log(pair.rate)
        first = e.paired == 0
        e.paired += bool(beside)
        self._score(width, pair.entry, score, pair.seconds, first=first)

    def _score(self, width: int, entry: int, score: float, seconds: float, first: bool) -> None:
        """Fold a re-check's score into the entry's, and set its next re-check: soon if it
        is now the best, two to four times as far off as last time if not."""
        e = self.entries[width][entry]
        w = 1.0 if first or e.score is None else PAIRED_EMA
        e.score = score if e.score is None else (1 - w) * e.score + w * score
        best = self.best(width)
        if best == entry:
            e.spacing = SPACING_MIN
        else:  # the further behind, the longer until the next look (up to twice as long)
            behind = min(2.0, math.exp(self.entries[width][best].score - e.score))
            e.spacing = min(SPACING_MAX, 2 * behind * e.spacing)
        e.due_at = self.clock[width] + e.spacing * seconds

    def requeue(self) -> None:
        """Chunks in flight were dropped (a failed program): their re-checks are due again."""
        for w, pair in self.open.items():
            self.entries[w][pair.entry].due_at = self.clock[w]
        self.open.clear()
        self.last.clear()
        for es in self.entries.values():
            for e in es:
                e.pending = False

    def report(self, names: dict[int, tuple[str, ...]]) -> dict[int, dict]:
        """Per width that ran (names: its entries' names): the entry it runs and, per entry,
        its measured tokens per row-second (a running mean over whatever rows it ran), its
        paired rate against the running entry's (what the pick compares), the model's
        price, and the chunks it ran."""
        out = {}
        for w, es in self.entries.items():
            if not any(e.runs for e in es):
                continue
            top = es[self.best(w)].score
            out[w] = {"runs": names[w][self.best(w)],
                      "entries": {n: {"measured": e.rate, "priced": e.prior, "chunks": e.runs,
                                      "relative": None if e.score is None or top is None
                                      else math.exp(e.score - top)}
                                  for n, e in zip(names[w], es)}}  # fmt: skip
        return out
