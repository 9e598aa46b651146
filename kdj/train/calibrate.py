"""Calibrating the drafter's confidence for the adaptive controller.

method="auto" forecasts each step's tau from the drafter's own probabilities: 1 + the
probability of every drafted node (DDTree, Proposition 1). A drafter trained with
cross-entropy is rarely calibrated for that use (the factorised per-position marginals also
ignore that depths are correlated), so the forecast is scaled by one temperature t:
log-probs / t, renormalised. `calibrate` runs greedy generation on held-out prompts once per
candidate t (the drafts and accepted tokens do not depend on t; only the forecast does),
compares forecast and realised tau step by step, and keeps the t whose mean forecast matches
the mean realised tau best. The result is saved beside the drafter (calibration.json) and
load_drafter picks it up (kdj.checkpoints.dflash.load_calibration).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kdj.checkpoints.dflash import CALIBRATION

FILE = CALIBRATION  # read back by kdj.checkpoints.dflash.load_calibration (load_drafter)
TEMPERATURES = (0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0)


def calibrate(target, drafter, prompts, *, method="ddtree", tree_budget=16,
              temperatures=TEMPERATURES, max_new_tokens=64, entry_budgets=(16, 64),
              log=print) -> dict:  # fmt: skip
    """Fit the forecast temperature on prompts (token-id lists) at T=0. Returns a report:
    per candidate t the mean forecast, mean realised tau and mean absolute step error; the
    chosen temperature; the error before (t = 1) and after; and the tau that method="auto"'s
    drafting menu entries realise on the same prompts (the chain of DFlash and trees of
    `entry_budgets` nodes, by entry name), which prices them before any draft."""
    import kdj

    kw = {"tree_budget": tree_budget} if method == "ddtree" else {}
    rows = []

    def steps(method, t=1.0, **kw):
        """(forecast, realised) tau of every step of a greedy run, each sequence's last step
        left out: max_new_tokens cuts it short of its forecast."""
        s = kdj.generate(target, prompts, drafter=drafter, method=method, calibration=t,
                         max_new_tokens=max_new_tokens, stop_tokens=[], **kw).stats  # fmt: skip
        pairs = [(e, r) for er, rr in zip(s["expected_acceptance"], s["acceptance_lengths"])
                 for e, r in list(zip(er, rr))[:-1]]  # fmt: skip
        return np.array(pairs).T

    def measure(t):
        forecast, realised = steps(method, t, **kw)
        row = {"temperature": t, "mean_forecast": float(forecast.mean()),
               "mean_realised": float(realised.mean()),
               "mean_abs_error": float(np.abs(forecast - realised).mean()),
               "steps": len(realised)}  # fmt: skip
        rows.append(row)
        log(f"t={t:<5.3g} forecast {row['mean_forecast']:.3f}  realised {row['mean_realised']:.3f}"
            f"  |error| {row['mean_abs_error']:.3f} over {row['steps']} steps")  # fmt: skip

    for t in sorted(temperatures):
        measure(t)
    # The mean forecast falls as t rises: where two neighbours bracket the realised tau,
    # interpolate t between them and measure it too.
    for lo, hi in zip(rows, rows[1:]):
        gap_lo = lo["mean_forecast"] - lo["mean_realised"]
        gap_hi = hi["mean_forecast"] - hi["mean_realised"]
        if gap_lo > 0 > gap_hi:
            frac = gap_lo / (gap_lo - gap_hi)
            measure(lo["temperature"] + frac * (hi["temperature"] - lo["temperature"]))
            break
    best = min(rows, key=lambda r: abs(r["mean_forecast"] - r["mean_realised"]))
    by_entry = {}
    for m, budget in [("dflash", None)] + [("ddtree", b) for b in entry_budgets]:
        if m == method and budget == (tree_budget if method == "ddtree" else None):
            tau = best["mean_realised"]  # measured above
        else:
            tau = float(steps(m, **({"tree_budget": budget} if budget else {}))[1].mean())
        name = f"tree{budget}" if budget else f"chain{drafter.cfg.block_size - 1}"
        by_entry[name] = tau
        log(f"{name}: realised tau {tau:.3f}")
    before = next((r for r in rows if r["temperature"] == 1.0), None)
    return {
        "temperature": best["temperature"],
        "method": method,
        "tree_budget": tree_budget if method == "ddtree" else None,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "error_before": before and before["mean_abs_error"],
        "bias_before": before and before["mean_forecast"] - before["mean_realised"],
        "error_after": best["mean_abs_error"],
        "bias_after": best["mean_forecast"] - best["mean_realised"],
        "realised_acceptance": best["mean_realised"],  # method="auto"'s prior (load)
        "realised_by_entry": by_entry,  # prices method="auto"'s menu entries (load)
        "candidates": rows,
    }


def save(report: dict, drafter_dir) -> Path:
    path = Path(drafter_dir) / FILE
    path.write_text(json.dumps(report, indent=2))
    return path
