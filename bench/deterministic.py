"""Deterministic mode (generate(deterministic=True)) on the device: every method's tokens
against deterministic AR's, at every batch, and what the mode costs against the default.

    python bench/deterministic.py --prompts .traincache/data/eval_prompts.json \
        --batches 1 8 64 256 --out $OUT/deterministic.json

For the real SmolLM2 pair (bf16, held-out ShareGPT prompts cycled to the batch, every
sequence exactly --new tokens), per batch:
- `identical`: the share of sequences whose deterministic tokens equal deterministic AR's,
  per method (greedy), and the same at temperature 1 with one seed per prompt (`sampled`);
- tokens/s of each method deterministic and default (`cost` = 1 - det / default);
- `alone`: the first --alone prompts generated one at a time against their rows of the
  batch-64 run; `rerun`: DFlash at batch 64 twice.
Then a random-weight target of --moe-model's shape (its first --moe-layers layers) with a
random drafter, the same identity checks at --moe-batches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import harness  # bench/ is the script directory

import kdj

# auto prices its menu with the shape estimate: identity must hold whatever it chooses, and
# a first-use tuning pass per batch bucket would only add compiles to this run
METHODS = {"ar": {}, "dflash": {}, "ddtree16": {"tree_budget": 16},
           "ddtree64": {"tree_budget": 64}, "auto": {"cost": "estimate"}}  # fmt: skip


def identical(a, b) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def run(target, drafter, prompts, name, new, **kw):
    method = "ddtree" if name.startswith("ddtree") else name
    d = drafter if name != "ar" else None
    out = kdj.generate(target, prompts, drafter=d, method=method, max_new_tokens=new,
                       stop_tokens=[], **METHODS[name], **kw)  # fmt: skip
    s = out.stats
    return out.tokens, {"tokens_per_s": s["tokens_per_s"], "tau": s.get("mean_acceptance", 1.0),
                        "compile_s": s["compile_s"]}  # fmt: skip


def batch_row(target, drafter, prompts, B, methods, new, cache, timed, log, rows, save):
    """Greedy identity and cost at batch B; sampled identity for the speculative methods.
    The row joins `rows` at once and `save` runs after every method: a cut run keeps them."""
    batch = [prompts[i % len(prompts)] for i in range(B)]
    kw = dict(cache_size=cache)
    ref, ar = run(target, drafter, batch, "ar", new, deterministic=True, **kw)
    row = {"batch": B, "methods": {"ar": {"det": ar}}}
    rows.append(row)
    seeds = list(range(1000, 1000 + B))
    sref, _ = run(target, drafter, batch, "ar", new, deterministic=True, temperature=1.0,
                  seed=seeds, **kw)  # fmt: skip
    for name in methods:
        r = row["methods"].setdefault(name, {})
        if name != "ar":
            toks, r["det"] = run(target, drafter, batch, name, new, deterministic=True, **kw)
            r["identical"] = identical(toks, ref)
            stoks, _ = run(target, drafter, batch, name, new, deterministic=True,
                           temperature=1.0, seed=seeds, **kw)  # fmt: skip
            r["sampled_identical"] = identical(stoks, sref)
        if name in timed:
            _, r["default"] = run(target, drafter, batch, name, new, **kw)
            r["cost"] = 1 - r["det"]["tokens_per_s"] / r["default"]["tokens_per_s"]
        log(f"B={B:4d} {name:9s} " + json.dumps({k: v for k, v in r.items()}, default=str))
        save()
    return row, ref


def moe_rows(args, log):
    target = harness.random_target(args.moe_model, args.moe_layers, "bfloat16")
    dcfg = harness.drafter_config(target.cfg, args.moe_model, num_layers=1)
    drafter = harness.random_drafter(dcfg, "bfloat16")
    prompts = harness.random_prompts(target.cfg.vocab_size, max(args.moe_batches), 48)
    rows = []
    for B in args.moe_batches:
        batch = [p[: 16 + 5 * (i % 7)] for i, p in enumerate(prompts[:B])]  # ragged
        ref, _ = run(target, drafter, batch, "ar", args.new, deterministic=True)
        seeds = list(range(B))
        sref, _ = run(target, drafter, batch, "ar", args.new, deterministic=True,
                      temperature=1.0, seed=seeds)  # fmt: skip
        row = {"batch": B, "methods": {}}
        for name in ("dflash", "ddtree16", "auto"):
            toks, _ = run(target, drafter, batch, name, args.new, deterministic=True)
            stoks, _ = run(target, drafter, batch, name, args.new, deterministic=True,
                           temperature=1.0, seed=seeds)  # fmt: skip
            row["methods"][name] = {"identical": identical(toks, ref),
                                    "sampled_identical": identical(stoks, sref)}  # fmt: skip
        log(f"{args.moe_model} B={B} " + json.dumps(row["methods"]))
        rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True, help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--timed",
        nargs="+",
        default=["ar", "dflash", "ddtree16"],
        help="methods also run in the default mode (the cost)",
    )
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--alone", type=int, default=8)
    p.add_argument("--moe-model", default="moonlight-16b-a3b")
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--moe-batches", nargs="*", type=int, default=[1, 8, 64])
    p.add_argument(
        "--kernels",
        default="default",
        choices=sorted(harness.KERNEL_CASES),
        help="kernel case of bench/harness.py the real target runs (both modes)",
    )
    p.add_argument("--out", required=True)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from kdj.train.loop import chat_prompts

    target = kdj.load_target("smollm2-135m-instruct", dtype="bfloat16")
    if harness.KERNEL_CASES[args.kernels].get("deterministic"):
        raise SystemExit(
            f"--kernels {args.kernels} turns deterministic mode on for the default "
            "runs too: pick a case that leaves it off (e.g. packed-tiles)"
        )
    target = harness.with_kernels(target, args.kernels)
    drafter = kdj.load_drafter(args.drafter, target=target)
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(target.tokenizer, held, 512)
    cache = 512 + args.new + 128  # one capacity for every run: the same shapes alone or not
    result = {"rows": [], "moe": []}

    def save():
        harness.write_result(Path(args.out), result, argv)

    for B in args.batches:
        row, ref = batch_row(target, drafter, prompts, B, args.methods, args.new, cache,
                             args.timed, print, result["rows"], save)  # fmt: skip
        if B == 64:
            batch = [prompts[i % len(prompts)] for i in range(B)]
            again, _ = run(target, drafter, batch, "dflash", args.new, deterministic=True,
                           cache_size=cache)  # fmt: skip
            first, _ = run(target, drafter, batch, "dflash", args.new, deterministic=True,
                           cache_size=cache)  # fmt: skip
            row["rerun_identical"] = identical(again, first)
            alone = [run(target, drafter, [batch[i]], "dflash", args.new, deterministic=True,
                         cache_size=cache)[0][0] for i in range(args.alone)]  # fmt: skip
            row["alone_identical"] = identical(alone, ref[: args.alone])
            print(f"B=64 rerun {row['rerun_identical']} alone {row['alone_identical']}")
            save()
    if args.moe_batches:
        result["moe"] = moe_rows(args, print)
        save()


if __name__ == "__main__":
    main()
