"""What generate reports about a run (its stats dict): tokens, steps, acceptance and times,
and for speculative methods the drafter's forecast beside the realised tau and auto's
choices. `res` is kdj.api.Run: the loop's output on the host and its times."""

from __future__ import annotations

import numpy as np


def decode_stats(method, res, B: int) -> dict:
    """Tokens, steps, acceptance and times of any method."""
    new = int(res.n_out[:B].sum())
    if res.stats is None:  # plain decoding: one token per decode step
        taus = [[1] * (int(n) - 1) for n in res.n_out[:B]]
    else:  # taus[b]: tokens committed per decode step while sequence b was running
        taus = [[int(t) for t in row if t > 0] for row in res.stats.taus[:B]]
    flat = [t for row in taus for t in row]
    decode_s = res.times["decode_s"]
    return {
        "method": method,
        "batch": B,
        "steps": res.steps,
        "new_tokens": new,
        "acceptance_lengths": taus,
        "mean_acceptance": float(np.mean(flat)) if flat else float("nan"),
        "acceptance_histogram": np.bincount(flat, minlength=2)[1:].tolist() if flat else [],
        **res.times,
        # the first token of each sequence comes from prefill; decode produced the rest
        "tokens_per_s": (new - B) / decode_s if decode_s > 0 else float("nan"),
    }


def speculative_stats(method, res, B, shapes, block_size, forecast: bool) -> dict:
    """The drafter's forecast beside the realised tau (where the run forecast), and auto's
    choices."""
    if res.stats is None:  # auto ran plain decoding: every step skipped the drafter
        taus = [[1] * (int(n) - 1) for n in res.n_out[:B]]
        expected, choices = [[1.0] * len(row) for row in taus], [len(shapes)] * res.steps
    else:
        taus = [[int(t) for t in row if t > 0] for row in res.stats.taus[:B]]
        # the drafter's own forecast of each step's tau (DDTree Proposition 1): its gap to
        # the realised tau is the calibration error (steps cut by a stop or max_new_tokens
        # realise less than forecast)
        expected = [[float(e) for e, t in zip(er, tr) if t > 0]
                    for er, tr in zip(res.stats.expected[:B], res.stats.taus[:B])]  # fmt: skip
        choices = res.stats.choices
    pairs = [(e, t) for er, tr in zip(expected, taus) for e, t in zip(er, tr)]
    stats = {"block_size": block_size}
    if forecast:
        stats["expected_acceptance"] = expected
        stats["mean_expected_acceptance"] = float(np.mean([e for e, _ in pairs] or np.nan))
        stats["calibration_error"] = float(np.mean([abs(e - t) for e, t in pairs] or np.nan))
    if method == "auto":
        # per step, for the whole batch; "skip": a plain step that did not run the drafter
        names = [str(s) for s in shapes] + ["skip"]
        picked = [names[i] for i in choices[: res.steps]]
        stats["menu"] = names[:-1]
        stats["draft_choices"] = picked
        stats["draft_choice_counts"] = {n: picked.count(n) for n in names}
    return stats
