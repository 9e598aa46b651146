"""Adaptive speculation against every fixed draft size: tokens/s vs batch size, one run.

For each batch size the same held-out prompts are generated with plain decoding (AR), fixed
DFlash (the drafter's chain), fixed DDTree budgets and method="auto" (the controller with the
step-cost model `--cost`, or with `--fit-cost` one fitted to this run's fixed-method decode
steps before auto runs). Every sequence
generates exactly --new tokens (stop tokens off), so every method does the same work and
tokens/s compare directly. Greedy (T=0), bf16.

    python bench/adaptive.py --prompts .traincache/data/eval_prompts.json \
        --batches 1 8 64 256 --methods ar dflash ddtree16 ddtree64 auto --out $OUT/pair.json

With --fit-from RUN.json ... --fit-cost cost.json it generates nothing: the step cost is
fitted to the fixed-method rows of earlier runs (their step times as measured there).

Prompts: the "sharegpt" held-out conversations of eval_prompts.json (what `kdj train-drafter`
caches: ShareGPT conversations after the first 16,000), cycled when a batch needs more.
Writes JSON, a markdown table (.md) and a plot (.png) of tokens/s and speedup vs batch size.
Greedy agreement: each method's `identical_to_ar` (share of sequences token-identical to AR
at the same batch), and AR against itself at the next smaller batch (`ar_identical_to_batch`),
the rate at which bf16 kernels alone make greedy outputs differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness  # bench/ is the script directory

import kdj


def run_method(target, drafter, prompts, method, new, repeats, **kw) -> tuple[dict, list]:
    """Compile run, then the median of `repeats` timed runs of one method."""
    if method != "ar":
        kw["drafter"] = drafter
    s, tokens = harness.timed_generate(target, prompts, repeats, max_new_tokens=new,
                                       method=method, **kw)  # fmt: skip
    row = {"tokens_per_s": s["tokens_per_s"], "step_ms": s["step_ms"],
           "tau": s["mean_acceptance"], "steps": s["steps"], "new_tokens": s["new_tokens"],
           "compile_s": s["compile_s"]}  # fmt: skip
    for key in ("mean_expected_acceptance", "calibration_error", "draft_choice_counts"):
        if key in s:
            row[key] = s[key]
    return row, tokens


def fit_cost(target, drafter, rows, path):
    """kdj.cost.StepCost fitted to this run's decode-loop step times: AR steps (target
    alone) and fixed DFlash/DDTree steps (draft + verify of 1 + nodes tokens). Saved to
    path; generate(method="auto", cost=path) loads it."""
    from kdj.cost import StepCost

    n_params = harness.param_count(drafter.state)
    base = StepCost.for_config(target.cfg).with_drafter(drafter.cfg, n_params, target.cfg)
    k = drafter.cfg.block_size
    data = []
    for r in rows:
        for name, m in r["methods"].items():
            if name == "auto":
                continue
            T = 1 if name == "ar" else k if name == "dflash" else 1 + int(name[len("ddtree") :])
            data.append((r["batch"], T, r["context"], m["step_ms"] / 1e3, name != "ar",
                         T - 1 if name.startswith("ddtree") else 0))  # fmt: skip
    cost = base.fit(data)
    cost.save(path)
    worst = max(abs(cost.seconds(b, t, c) + d * cost.draft_seconds(b, c, n) - s) / s
                for b, t, c, s, d, n in data)  # fmt: skip
    print(f"step cost fitted to {len(data)} loop steps (worst relative error {worst:.0%}) -> "
          f"{path}")  # fmt: skip
    return cost


def summarise(row) -> dict:
    res = row["methods"]
    fixed = {k: v["tokens_per_s"] for k, v in res.items() if k != "auto"}
    best = max(fixed, key=fixed.get)
    row["best_fixed"] = best
    if "auto" in res:
        auto = res["auto"]["tokens_per_s"]
        row["auto_vs_best_fixed"] = auto / fixed[best]
        row["auto_vs_ar"] = auto / fixed["ar"] if "ar" in fixed else float("nan")
    return row


def sweep(target, drafter, prompts, batches, methods, new, repeats, cost, fit_path=None,
          log=print, save=lambda rows: None) -> list:  # fmt: skip
    """methods: names among ar, dflash, ddtree<B>, auto. Fixed methods run first at every
    batch; with fit_path the step-cost model is fitted to them before auto runs."""
    rows = []
    for B in batches:
        batch = [prompts[i % len(prompts)] for i in range(B)]
        context = sum(len(p) for p in batch) / B + new / 2  # mean tokens in the cache
        rows.append({"batch": B, "context": context, "prompts": batch, "methods": {}})

    def measure(row, name, **kw):
        method = "ddtree" if name.startswith("ddtree") else name
        if method == "ddtree":
            kw["tree_budget"] = int(name[len("ddtree") :])
        r, toks = run_method(target, drafter, row["prompts"], method, new, repeats, **kw)
        ref = row.setdefault("_ar_tokens", toks if name == "ar" else None)
        # bf16: a verify pass over many tokens rounds differently from a one-token step,
        # so near-tied argmaxes may flip; the fraction shows how often (tests run f32)
        if ref is not None:
            r["identical_to_ar"] = sum(a == b for a, b in zip(toks, ref)) / len(toks)
        row["methods"][name] = r
        log(
            f"B={row['batch']:4d} {name:10s} {r['tokens_per_s']:10.0f} tok/s  tau "
            f"{r['tau']:.2f}  step {r['step_ms']:.3f} ms  {r.get('draft_choice_counts', '')}"
        )
        save(rows)  # after every measurement: a cut run keeps what it measured

    for row in rows:
        for name in methods:
            if name != "auto":
                measure(row, name)
    if fit_path:
        cost = fit_cost(target, drafter, rows, fit_path)
    if "auto" in methods:
        for row in rows:
            measure(row, "auto", cost=cost)
    ar_across_batches(rows)
    for row in rows:
        row.pop("prompts")
        row.pop("_ar_tokens", None)
        summarise(row)
    save(rows)
    return rows


def ar_across_batches(rows) -> None:
    """AR against itself at the next smaller batch, on the prompts both share (the first b
    sequences: prompts cycle the same way at every batch), as row["ar_identical_to_batch"] =
    {"batch": b, "identical": share of token-identical sequences}. bf16 kernels round
    differently with the batch size as with the tokens per pass, so this is the rate
    `identical_to_ar` of the speculative methods is to be read against."""
    done = sorted((r for r in rows if r.get("_ar_tokens") is not None), key=lambda r: r["batch"])
    for small, big in zip(done, done[1:]):
        a, b = small["_ar_tokens"], big["_ar_tokens"][: len(small["_ar_tokens"])]
        same = sum(x == y for x, y in zip(a, b)) / len(a)
        big["ar_identical_to_batch"] = {"batch": small["batch"], "identical": same}


def markdown(rows) -> str:
    names = list(rows[0]["methods"])
    head = "| batch | " + " | ".join(names) + " | best fixed | auto / best | auto / AR |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for r in rows:
        cells = [f"{r['methods'][n]['tokens_per_s']:,.0f} ({r['methods'][n]['tau']:.2f})"
                 for n in names]  # fmt: skip
        auto = [r.get("auto_vs_best_fixed", float("nan")), r.get("auto_vs_ar", float("nan"))]
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + f" | {r['best_fixed']} | "
                     f"{auto[0]:.3f} | {auto[1]:.3f} |")  # fmt: skip
    return "tokens/s (tau)\n\n" + "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = sorted(rows, key=lambda r: r["batch"])  # measured in any order, drawn by batch
    batches = [r["batch"] for r in rows]
    for n in rows[0]["methods"]:
        tps = [r["methods"][n]["tokens_per_s"] for r in rows]
        ar = [r["methods"]["ar"]["tokens_per_s"] for r in rows]
        style = dict(lw=2.5, color="black") if n == "auto" else {}
        axes[0].plot(batches, tps, "o-", label=n, **style)
        axes[1].plot(batches, [t / a for t, a in zip(tps, ar)], "o-", label=n, **style)
    for ax, title in zip(axes, ("tokens/s", "tokens/s vs AR")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    p.add_argument("--prompts", help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree16", "ddtree64",
                   "ddtree256", "auto"], help="ar, dflash, ddtree<B>, auto")  # fmt: skip
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cost", help="StepCost JSON for auto, or tune / estimate (default: this "
                   "machine's tuned cost, tuned at first use on a GPU)")  # fmt: skip
    p.add_argument("--fit-cost", help="fit a StepCost to this run's fixed methods, save it here "
                   "and run auto with it")  # fmt: skip
    p.add_argument("--fit-from", nargs="+", help="earlier runs' JSON: only fit --fit-cost")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--kernels",
        default="default",
        choices=sorted(harness.KERNEL_CASES),
        help="kernel case of bench/harness.py the target (and drafter) run",
    )
    p.add_argument("--out")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if args.fit_from and not args.fit_cost:
        p.error("--fit-from needs --fit-cost (where the fitted step cost goes)")
    if not args.fit_from and not (args.prompts and args.out):
        p.error("a sweep needs --prompts and --out")

    from kdj.train.loop import chat_prompts

    target = harness.with_kernels(kdj.load_target(args.target, dtype=args.dtype), args.kernels)
    drafter = kdj.load_drafter(args.drafter, target=target)
    if args.fit_from:
        rows = []
        for f in args.fit_from:
            for r in json.loads(Path(f).read_text())["rows"]:
                if "context" not in r:  # runs a and b did not record it
                    p.error(f"{f}: the batch-{r['batch']} row has no 'context' to fit with")
                rows.append(r)
        return fit_cost(target, drafter, rows, args.fit_cost)
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(target.tokenizer, held, args.max_prompt_tokens)
    out = Path(args.out)

    def save(rows):
        clean = [{k: v for k, v in r.items() if k not in ("prompts", "_ar_tokens")} for r in rows]
        meta = {"calibration": drafter.calibration}
        harness.write_result(out, {"meta": meta, "rows": clean}, argv)

    rows = sweep(target, drafter, prompts, args.batches, args.methods, args.new, args.repeats,
                 args.cost, args.fit_cost, save=save)  # fmt: skip
    out.with_suffix(".md").write_text(markdown(rows))
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
