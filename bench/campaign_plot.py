"""Held-out tau against fresh training tokens across the drafter campaign's windows.

    python bench/campaign_plot.py --log kdj/assets/smollm2-135m-dflash-b16/campaign.jsonl \
        --lineage w10=wide --out bench/results/drafter_campaign.png

The log is the shipped drafter's campaign.jsonl: every online round (its response tokens)
and every held-out evaluation, each tagged with its window ("call"). The shipped line follows
the drafter each window continued (`main`, unless --lineage names another: in window 10 the
shipped weights were the compared "wide" drafter); the other drafters a window trained on
the same rounds are drawn as branches from that window's start. A window's first
evaluation re-measures the previous window's last weights in a new process, so the steps
there are the measurement's noise (~0.05 in bf16), not training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curves(rows: list[dict], lineage: dict[str, str]) -> dict[str, list[tuple[float, float]]]:
    """{label: [(million response tokens so far, held-out tau)]}: "shipped" and one branch per
    compared drafter ("<window> <name>")."""
    out: dict[str, list[tuple[float, float]]] = {"shipped": []}
    tokens, start = 0, {}
    for r in rows:
        call = r.get("call", "")
        start.setdefault(call, tokens)
        if "eval" not in r:
            tokens += r.get("response_tokens", 0)
            continue
        x, e = tokens / 1e6, r["eval"]
        per = e.get("drafters") or {"main": e}
        ship = lineage.get(call, "main")
        for name, d in per.items():
            label = "shipped" if name == ship else f"{call} {name}"
            line = out.setdefault(label, [])
            if label != "shipped" and not line:
                line.append((start[call] / 1e6, out["shipped"][-1][1]))  # branches off here
            if not line or line[-1] != (x, d["tau"]):  # a call's closing eval repeats
                line.append((x, d["tau"]))
    return out


def plot(lines: dict[str, list[tuple[float, float]]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in lines.items():
        style = dict(lw=2.2, color="C0", zorder=3) if label == "shipped" else dict(lw=1, ls="--")
        ax.plot(*zip(*pts), marker="o", ms=3.5, label=label, **style)
    ax.set_xlabel("fresh response tokens generated and trained on (millions)")
    ax.set_ylabel("held-out DFlash tau (T=0, 32 ShareGPT prompts)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="the campaign's campaign.jsonl")
    p.add_argument("--lineage", nargs="*", default=[],
                   help="WINDOW=NAME: a window's shipped drafter, where not main")  # fmt: skip
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--title", default="SmolLM2-135M drafter: online distillation, one H200")
    args = p.parse_args(argv)
    lineage = dict(item.split("=", 1) for item in args.lineage)
    rows = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line.strip()]
    lines = curves(rows, lineage)
    print(f"wrote {plot(lines, Path(args.out), args.title)}")
    for label, pts in lines.items():
        print(f"{label}: " + ", ".join(f"{x:.1f}M {t:.3f}" for x, t in pts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
