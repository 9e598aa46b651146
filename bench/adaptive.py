"""Adaptive speculation against every fixed draft size: tokens/s vs batch size, one run.

For each batch size the same held-out prompts are generated with plain decoding (AR), fixed
DFlash (the drafter's chain), fixed DDTree budgets and method="auto" (the controller with the
step-cost model `--cost`, as `kdj bench --fit-cost` fits it on this GPU). Every sequence
generates exactly --new tokens (stop tokens off), so every method does the same work and
tokens/s compare directly. Greedy (T=0), bf16.

    python bench/adaptive.py --target <SmolLM2-135M-Instruct.Q4_1.gguf> \
        --drafter smollm2-135m-dflash-b16 --prompts .traincache/data/eval_prompts.json \
        --batches 1 4 16 64 256 --budgets 16 64 256 --cost $OUT/cost.json \
        --out $OUT/adaptive.json

Prompts: the "sharegpt" held-out conversations of eval_prompts.json (what `kdj train-drafter`
caches: ShareGPT conversations after the first 16,000), cycled when a batch needs more.
Writes JSON, a markdown table (.md) and a plot (.png) of tokens/s and speedup vs batch size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

import kdj


def run_method(target, drafter, prompts, method, new, repeats, **kw) -> dict:
    """Compile run, then the median of `repeats` timed runs of one method."""
    kdj.api._EXECUTABLES.clear()
    args = dict(max_new_tokens=new, stop_tokens=[], method=method, **kw)
    if method != "ar":
        args["drafter"] = drafter
    outs = [kdj.generate(target, prompts, **args) for _ in range(repeats + 1)]
    timed = sorted(outs[1:], key=lambda o: o.stats["decode_s"])
    o = timed[len(timed) // 2]
    s = o.stats
    row = {
        "tokens_per_s": s["tokens_per_s"],
        "step_ms": 1e3 * s["decode_s"] / max(s["steps"], 1),
        "tau": s["mean_acceptance"],
        "steps": s["steps"],
        "new_tokens": s["new_tokens"],
        "compile_s": outs[0].stats["compile_s"],
    }
    for key in ("mean_expected_acceptance", "calibration_error", "draft_choice_counts"):
        if key in s:
            row[key] = s[key]
    return row, o.tokens


def sweep(target, drafter, prompts, batches, budgets, new, repeats, cost, log=print,
          save=lambda rows: None) -> list:  # fmt: skip
    rows = []
    for B in batches:
        batch = [prompts[i % len(prompts)] for i in range(B)]
        methods = {"ar": {}, "dflash": {}}
        methods.update({f"ddtree{b}": {"tree_budget": b} for b in budgets})
        methods["auto"] = {"cost": cost}
        res, ref = {}, None
        for name, kw in methods.items():
            method = "ddtree" if name.startswith("ddtree") else name
            r, toks = run_method(target, drafter, batch, method, new, repeats, **kw)
            ref = toks if ref is None else ref
            # bf16: a verify pass over many tokens rounds differently from a one-token step,
            # so near-tied argmaxes may flip; the fraction shows how often (tests run f32)
            r["identical_to_ar"] = sum(a == b for a, b in zip(toks, ref)) / B
            res[name] = r
            log(f"B={B:4d} {name:10s} {r['tokens_per_s']:10.0f} tok/s  tau {r['tau']:.2f}  "
                f"step {r['step_ms']:.3f} ms")  # fmt: skip
        fixed = {k: v["tokens_per_s"] for k, v in res.items() if k != "auto"}
        best = max(fixed, key=fixed.get)
        auto = res["auto"]["tokens_per_s"]
        rows.append({
            "batch": B, "methods": res, "best_fixed": best,
            "auto_vs_best_fixed": auto / fixed[best], "auto_vs_ar": auto / fixed["ar"],
        })  # fmt: skip
        rows.sort(key=lambda r: r["batch"])
        save(rows)  # after every batch size: a cut run keeps what it measured
    return rows


def markdown(rows) -> str:
    names = list(rows[0]["methods"])
    head = "| batch | " + " | ".join(names) + " | best fixed | auto / best | auto / AR |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for r in rows:
        cells = [f"{r['methods'][n]['tokens_per_s']:,.0f} ({r['methods'][n]['tau']:.2f})"
                 for n in names]  # fmt: skip
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + f" | {r['best_fixed']} | "
                     f"{r['auto_vs_best_fixed']:.3f} | {r['auto_vs_ar']:.3f} |")  # fmt: skip
    return "tokens/s (tau)\n\n" + "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    p.add_argument("--prompts", required=True, help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cost", help="StepCost JSON for auto (default: kdj's conservative one)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from kdj.train.loop import chat_prompts

    target = kdj.load_target(args.target, dtype=args.dtype)
    drafter = kdj.load_drafter(args.drafter, target=target)
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(target.tokenizer, held, args.max_prompt_tokens)
    t0 = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows):
        meta = {
            "date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "args": vars(args), "seconds": time.time() - t0,
            "calibration": drafter.calibration,
        }  # fmt: skip
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(markdown(rows))
        plot(rows, out.with_suffix(".png"))

    rows = sweep(target, drafter, prompts, args.batches, args.budgets, args.new, args.repeats,
                 args.cost, save=save)  # fmt: skip
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
