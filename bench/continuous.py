"""Continuous batching against static batches on a mixed-length workload, one run.

    python bench/continuous.py --prompts .traincache/data/eval_prompts.json \
        --requests 256 --slots 64 --lengths 16 512 --out $OUT/continuous.json

The same --requests held-out prompts, each with its own output length drawn uniformly from
--lengths (seeded; stop tokens off, so every request emits exactly its length), generated
two ways with the same --slots rows in flight:
- static: consecutive batches of --slots prompts, each batch running until its longest
  request is done (what kdj.generate does without max_batch);
- continuous: kdj.generate(max_batch=--slots), the slot pool of kdj/decode/engine.py
  refilling a slot as soon as its request finishes.
Reported: aggregate new tokens/s over the whole workload (wall time, compiles excluded by a
warm-up pass of the same workload), per method.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness  # bench/ is the script directory
import numpy as np

import kdj


def timed(call) -> float:
    call()  # compile every shape the workload needs
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True, help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--lengths", nargs=2, type=int, default=[16, 512])
    p.add_argument("--methods", nargs="+", default=["ar"])
    p.add_argument("--chunk-steps", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    from kdj.train.loop import chat_prompts

    target = kdj.load_target("smollm2-135m-instruct", dtype="bfloat16")
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(target.tokenizer, held, 512)
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    rng = np.random.default_rng(args.seed)
    lo, hi = args.lengths
    lengths = rng.integers(lo, hi + 1, args.requests).tolist()
    cache = 512 + hi + 16
    new_tokens = sum(lengths)
    rows = []
    for method in args.methods:
        kw = dict(method=method, stop_tokens=[], cache_size=cache)
        if method != "ar":
            kw["drafter"] = kdj.load_drafter(args.drafter, target=target)
        t_static = timed(lambda kw=kw: static(target, prompts, lengths, args.slots, kw))
        t_cont = timed(lambda kw=kw: kdj.generate(target, prompts, max_new_tokens=lengths,
                                                  max_batch=args.slots, **kw))  # fmt: skip
        row = {"method": method, "slots": args.slots, "requests": args.requests,
               "new_tokens": new_tokens, "static_tokens_per_s": new_tokens / t_static,
               "continuous_tokens_per_s": new_tokens / t_cont,
               "gain": t_static / t_cont}  # fmt: skip
        print(json.dumps(row))
        rows.append(row)
        harness.write_result(Path(args.out), {"lengths": [lo, hi], "rows": rows}, argv)


def static(target, prompts, lengths, slots, kw):
    """Consecutive batches of `slots` prompts, each run until its longest request is done."""
    for i in range(0, len(prompts), slots):
        kdj.generate(target, prompts[i : i + slots], max_new_tokens=lengths[i : i + slots], **kw)


if __name__ == "__main__":
    main()
