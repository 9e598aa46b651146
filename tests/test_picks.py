"""auto on the slot pool (kdj/decode/picks.py): the host runs each chunk pinned to one menu
entry and picks the entry from what the chunks measured. Synthetic chunks with known rates
check the pick, its cost, and that it follows a change; an engine run checks the wiring."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kdj.decode import auto
from kdj.decode.picks import SPACING_MAX, SPACING_MIN, Picks, spacing, worth_compiling


def run(picks: Picks, rates, chunks: int, width: int = 4, seconds=None, prompts=None):
    """`chunks` chunks at `width`, entry i committing rates[i] tokens per row-second (16 steps
    of 16 live rows, one second a chunk unless `seconds` says per entry), times prompts[k]
    in chunk k (the rows' prompts: easier or harder for every entry); returns the seconds
    each entry ran."""
    ran = [0.0] * len(rates)
    for k in range(chunks):
        i, recheck = picks.next(width)
        s = 1.0 if seconds is None else seconds[i]
        ease = 1.0 if prompts is None else prompts[k]
        tokens = round(rates[i] * ease * s * 16)  # rate = tokens / row_steps * steps / s
        picks.observe(width, i, tokens, 16 * 16, 16, s, recheck)
        ran[i] += s
    return ran


def test_the_pick_finds_the_best_entry_against_its_prices_and_rechecks_rarely():
    """Priced plain > tree > chain, measured chain best: the pick moves to chain, and over a
    long run the other entries cost little; each entry was measured."""
    picks = Picks({4: [1.0, 0.8, 0.9]})
    ran = run(picks, [10.0, 16.0, 7.0], 3000)
    assert picks.best(4) == 1
    assert all(e.chunks >= 2 for e in picks.entries[4])
    lost = (ran[0] * (1 - 10 / 16) + ran[2] * (1 - 7 / 16)) / sum(ran)
    assert lost < 0.02  # the re-checks' cost against always running the best
    # a re-check that keeps losing is spaced out to SPACING_MAX chunks of its own
    assert picks.entries[4][2].spacing == SPACING_MAX


def test_a_slow_entrys_rechecks_are_spaced_in_time_not_chunks():
    """An entry whose chunks take 8x as long is re-checked as rarely in time: its share of
    the time stays about 1 / spacing, not 8 / spacing."""
    picks = Picks({4: [1.0, 1.0]})
    ran = run(picks, [10.0, 4.0], 3000, seconds=[1.0, 8.0])
    assert picks.best(4) == 0 and ran[1] / sum(ran) < 0.03


def test_the_pick_follows_a_change():
    """The best entry gets worse against the other (longer contexts cost trees more): the
    next re-check, at most SPACING_MAX of its chunks away, finds it and the width moves."""
    picks = Picks({4: [1.0, 1.0]})
    run(picks, [10.0, 16.0], 400)
    assert picks.best(4) == 1
    run(picks, [10.0, 6.0], int(SPACING_MAX) + 8)
    assert picks.best(4) == 0


def test_the_pick_is_not_fooled_by_the_prompts_under_it():
    """The rows' prompts change every few chunks and move every entry's rate 3x, far more
    than the entries differ (1.2x): each re-check is scored against the best entry's chunks
    beside it, on the same rows (a pair whose two sides disagree, the prompts changed
    within it, is void), so the width settles on the better entry and stays."""
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.choice([0.4, 1.2], 400), rng.integers(2, 6, 400))[:1500]
    picks = Picks({4: [1.0, 1.0]})
    ran = run(picks, [10.0, 12.0], len(prompts), prompts=prompts)
    assert picks.best(4) == 1 and ran[0] / sum(ran) < 0.03
    report = picks.report({4: ("chain3", "tree4")})[4]["entries"]
    assert report["chain3"]["relative"] == pytest.approx(10 / 12, rel=0.03)


def test_widths_are_measured_apart():
    picks = Picks({1: [1.0, 1.0], 4: [1.0, 1.0]})
    run(picks, [10.0, 16.0], 200, width=1)
    run(picks, [16.0, 10.0], 200, width=4)
    assert (picks.best(1), picks.best(4)) == (1, 0)
    report = picks.report({1: ("none", "chain3"), 4: ("none", "chain3")})
    assert report[1]["runs"] == "chain3" and report[4]["runs"] == "none"
    assert report[4]["entries"]["none"]["measured"] == pytest.approx(16.0, rel=0.05)


def test_entries_without_a_price_are_measured_first():
    """The drafter's acceptance unknown (drafting entries priced 0): they run first, each
    for two chunks (an entry's first chunk is not timed: it may have compiled), then the
    priced one; priced entries start sooner the better they are priced."""
    picks = Picks({4: [1.0, 0.0, 0.0]})
    ran = []
    for _ in range(6):
        i, recheck = picks.next(4)
        ran.append((i, recheck))
        picks.observe(4, i, 16, 16, 1, 1.0, recheck)
    assert ran[:4] == [(1, True), (1, True), (2, True), (2, True)]
    assert all(e.rate is not None for e in picks.entries[4][1:])
    assert picks.entries[4][0].runs >= 1  # then the plain entry, which had a price
    assert spacing(1.0, 1.0) == SPACING_MIN and spacing(0.5, 1.0) == 2 * SPACING_MIN
    assert spacing(1e-9, 1.0) == SPACING_MAX


def test_what_a_width_compiles():
    """Plain steps always; the rest when priced at half the best or more; all when the
    drafter's acceptance is unknown, or the menu has no plain steps."""
    assert worth_compiling([1.0, 1.4, 0.6], [True, False, False], True) == [True, True, False]
    assert worth_compiling([3.0, 1.0], [True, False], True) == [True, False]
    assert worth_compiling([3.0, 0.0], [True, False], False) == [True, True]
    assert worth_compiling([3.0, 1.0], [False, False], True) == [True, True]  # no plain steps


def test_the_pools_auto_runs_pinned_chunks_and_says_what_it_measured(vocab12_pair):
    """An Engine running auto: each chunk ran one entry (its tally has one drafting entry or
    plain steps), every entry was measured at the width that ran, and the entry it runs is
    the best paired; the tokens are plain greedy's. Sampled chunks are measured apart."""
    import kdj
    from kdj.decode.engine import Engine
    from kdj.decode.requests import Request

    target, drafter = vocab12_pair
    known = dataclasses.replace(drafter, prior_acceptance=2.0)
    menu = auto.parse_menu("auto", ["none", "chain", "tree12"], 6, None)
    engine = Engine(target, 2, 96, 40, drafter=known, menu=menu, widths=(2,), chunk_steps=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8], [9, 7, 9], [3, 2, 3, 8, 4, 6]]
    ids = [engine.submit(Request(p, 40, [])) for p in prompts]
    got = {i: [] for i in ids}
    while engine.busy:
        for u in engine.step():
            got[u.id] += u.tokens
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=40, stop_tokens=[])
    assert [got[i] for i in ids] == ar.tokens
    report = engine.measured()[2]
    entries = report["entries"]
    assert set(entries) == {"none", "chain5", "tree12"}
    assert all(e["chunks"] >= 1 and e["measured"] > 0 for e in entries.values())
    assert entries[report["runs"]]["relative"] == 1.0
    assert all(e["relative"] is None or e["relative"] <= 1.0 for e in entries.values())
    pricing = engine.pricing()[2]  # a full pool's tok/s; the report's, a row's
    assert all(entries[n]["priced"] == pytest.approx(pricing[n] / 2) for n in entries)
    choices = engine.stats.choices[2]
    assert choices["plain"][0] > 0 and choices["chain5"][0] > 0 and choices["tree12"][0] > 0
    for p in prompts:  # sampled: measured apart, the greedy picks untouched
        engine.submit(Request(p, 40, [], temperature=1.0, seed=0))
    while engine.busy:
        engine.step()
    after = engine.measured()
    assert after[2] == report and after["2 sampled"]["entries"]["none"]["chunks"] >= 1


def test_a_dropped_chunk_leaves_no_recheck_waiting():
    """A re-check waits for the chunk after it to be scored; chunks dropped in flight (a
    failed program) void it, and the entry is re-checked next."""
    picks = Picks({4: [1.0, 1.0]})
    for entry, recheck in [(0, False), (0, False), (1, True), (1, True)]:
        picks.observe(4, entry, 32, 16, 16, 1.0, recheck)
    assert picks.entries[4][1].score is None  # its pair waits for entry 0's next chunk
    picks.requeue()
    assert picks.next(4) == (1, True)
