"""Acceptance evaluation: tau (tokens per target step, bonus included) and speed of DFlash and
DDTree (tree budgets B) against plain AR decoding, on held-out ShareGPT and HumanEval.

Every configuration runs the same prompts as one batch in the same process, so the tokens/s
of AR, DFlash and DDTree are comparable (compile time is excluded by kdj.generate). Drafters
compared in one process share the AR runs (`ar_runs`). In bf16 the default kernels round a
step by the shapes and algorithms the process picks, so tau moves between processes;
deterministic=True (kdj.generate's deterministic mode) makes tau a function of the weights
and prompts alone, comparable across processes and machines.
Results: a JSON report and a PNG plot of tau and speedup against the tree budget.
"""

from __future__ import annotations

import json
from pathlib import Path

BUDGETS = (16, 32, 64, 128, 256)
TEMPERATURES = (0.0, 1.0)


def _run(target, prompts, drafter, method, temperature, max_new_tokens, seed, **kw) -> dict:
    import kdj

    s = kdj.generate(
        target,
        prompts,
        drafter=drafter,
        method=method,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        **kw,
    ).stats
    out = {
        "tau": s["mean_acceptance"],
        "tokens_per_s": s["tokens_per_s"],
        "new_tokens": s["new_tokens"],
        "decode_s": s["decode_s"],
    }
    if method != "ar":
        out["depth_acceptance"] = depth_rates(s["acceptance_lengths"], drafter.cfg.block_size - 1)
    return out


def depth_rates(lengths, depth: int) -> list[float]:
    """How far into the block the drafter stays right: for k = 1..depth, the share of steps
    that accepted draft k among those that accepted drafts 1..k-1. lengths: tokens each step
    committed (the bonus included), per sequence; the list stops where no step got that far."""
    accepted = [n - 1 for row in lengths for n in row]
    rates, reached = [], len(accepted)
    for k in range(1, depth + 1):
        if not reached:
            break
        got = sum(a >= k for a in accepted)
        rates.append(got / reached)
        reached = got
    return rates


def eval_acceptance(
    target,
    drafter,
    datasets: dict[str, list[list[int]]],
    *,
    budgets=BUDGETS,
    temperatures=TEMPERATURES,
    max_new_tokens: int = 256,
    seed: int = 0,
    log=print,
    out_dir=None,
    meta: dict | None = None,
    deterministic: bool = False,
    ar_runs: dict | None = None,
) -> dict:
    """datasets: name -> prompts (token ids). Returns
    {name: {"T=<t>": {"ar": {...}, "dflash": {...}, "ddtree": {"<B>": {...}}}}}, each leaf
    with tau, tokens_per_s and speedup (against AR at the same temperature), or an error.
    With out_dir, the JSON and PNG are rewritten after every (dataset, temperature).
    ar_runs: AR's results by (dataset, temperature), filled on first use, so several drafters
    evaluated in one process run AR once and are priced against the same run."""
    report: dict = {}
    ar_runs = {} if ar_runs is None else ar_runs
    for name, prompts in datasets.items():
        for t in temperatures:
            run = dict(
                target=target,
                prompts=prompts,
                temperature=t,
                max_new_tokens=max_new_tokens,
                seed=seed,
                deterministic=deterministic,
            )
            key = (name, float(t))
            if key not in ar_runs:
                ar_runs[key] = _run(drafter=None, method="ar", **run)
            ar = ar_runs[key]
            res = {"ar": ar, "dflash": _run(drafter=drafter, method="dflash", **run)}
            res["ddtree"] = {
                str(b): _run(drafter=drafter, method="ddtree", tree_budget=b, **run)
                for b in budgets
            }
            for r in [res["dflash"], *res["ddtree"].values()]:
                if "tokens_per_s" in r:
                    r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"]
            report.setdefault(name, {})[f"T={t:g}"] = res
            if out_dir is not None:  # after every configuration: a cut run keeps its results
                write_report(report, out_dir, meta)
            d = res["dflash"]
            log(
                f"{name} T={t:g}: AR {ar['tokens_per_s']:.0f} tok/s; DFlash tau "
                f"{d.get('tau', float('nan')):.2f}, {d.get('speedup', float('nan')):.2f}x"
            )
    return report


def compare_table(reports: dict[str, dict]) -> str:
    """Drafters side by side (reports: label -> eval_acceptance's report, one or several): a
    Markdown table of tau (and speedup over AR) per set and temperature, DFlash then each
    DDTree budget."""
    first = next(iter(reports.values()))
    budgets = sorted({b for per_t in first.values() for r in per_t.values() for b in r["ddtree"]},
                     key=int)  # fmt: skip
    head = ["set", "T", "drafter", "DFlash tau", *(f"DDTree {b}" for b in budgets)]
    rows = [head, ["---"] * len(head)]

    def tau(r):
        if "tau" not in r:
            return "-"
        return f"{r['tau']:.3f} ({r['speedup']:.2f}x)" if "speedup" in r else f"{r['tau']:.3f}"

    for name, per_t in first.items():
        for t in per_t:
            for label, report in reports.items():
                res = report[name][t]
                rows.append([name, t[2:], label, tau(res["dflash"]),
                             *(tau(res["ddtree"].get(b, {})) for b in budgets)])  # fmt: skip
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def plot_report(report: dict, path) -> Path:
    """Tau and speedup against the tree budget: DDTree lines, DFlash as dashed levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    i = 0
    for name, per_t in report.items():
        for t, res in per_t.items():
            c = colors[i % len(colors)]
            i += 1
            label = f"{name} {t}"
            for ax, key in zip(axes, ("tau", "speedup")):
                pts = [(int(b), r[key]) for b, r in res["ddtree"].items() if key in r]
                if pts:
                    ax.plot(*zip(*pts), "o-", color=c, label=f"DDTree {label}")
                if key in res["dflash"]:
                    ax.axhline(res["dflash"][key], color=c, ls="--", label=f"DFlash {label}")
    for ax, title in zip(axes, ("tau (tokens per target step)", "speedup vs AR")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget B")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def write_report(report: dict, out_dir, meta: dict | None = None) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "acceptance.json"
    js.write_text(json.dumps({"meta": meta or {}, "results": report}, indent=2))
    return js, plot_report(report, out / "acceptance.png")
