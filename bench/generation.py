"""Bulk generation of the drafter's training data: static batches against the slot pool.

    python bench/generation.py --prompts .traincache/data/eval_prompts.json \
        --requests 4096 --pool 1024 --new 256 --out $OUT/generation.json

The same --requests chat prompts (the held-out ShareGPT turns, repeated; only timed, never
trained on), answered by the target alone at --temperature with its stop tokens on, two ways:
- static: consecutive kdj.generate calls of --pool prompts, each batch running until its
  longest response is done (how the drafter's data was made before the pool);
- pool: kdj.train.data.respond, what regen and the online rounds call: --pool slots refilled
  as responses finish (kdj/decode/engine.py, the serving engine).
Each way runs twice: the first pass includes its compiles, the second is warm. Reported per
way: response tokens (the two ways sample differently, so their counts differ), seconds and
response tokens/s of both passes. Issue 23 asks for >= 100K warm response tokens/s on the H200.
`--smoke` runs 64 prompts through 16 slots for 16 tokens (CPU: the script runs end to end).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness  # bench/ is the script directory

import kdj
from kdj.train.data import respond
from kdj.train.loop import chat_prompts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True, help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=4096, help="prompts answered per pass")
    p.add_argument("--pool", type=int, default=1024, help="rows in flight (static batch size)")
    p.add_argument("--new", type=int, default=256, help="max new tokens per response")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens kept at most")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--ways", nargs="+", choices=["static", "pool"], default=["static", "pool"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="64 prompts, 16 slots, 16 tokens")
    p.add_argument("--out", required=True)
    return p


def static(target, prompts, pool, new, temperature, seed, capacity) -> int:
    """Consecutive batches of `pool` prompts; returns the response tokens generated."""
    tokens = 0
    for i in range(0, len(prompts), pool):
        out = kdj.generate(target, prompts[i : i + pool], method="ar", max_new_tokens=new,
                           temperature=temperature, seed=seed + i, cache_size=capacity)  # fmt: skip
        tokens += sum(map(len, out.tokens))
    return tokens


def pooled(target, prompts, pool, new, temperature, seed, capacity) -> int:
    out = respond(target, prompts, pool, new, temperature, seed, capacity)
    return sum(map(len, out.tokens))


def main(argv=None):
    args = parser().parse_args(argv)
    if args.smoke:
        args.requests, args.pool, args.new, args.prompt_len = 64, 16, 16, 64
    if args.pool < 1 or args.requests < 1 or args.new < 1:
        raise SystemExit("--requests, --pool and --new must be positive")
    target = kdj.load_target(args.target, dtype=args.dtype)
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(target.tokenizer, held, args.prompt_len)
    if not prompts:
        raise SystemExit(f"{args.prompts}: no ShareGPT prompt fits {args.prompt_len} tokens")
    prompts = [prompts[i % len(prompts)] for i in range(args.requests)]
    capacity = -(-(max(map(len, prompts)) + args.new) // 128) * 128
    ways = {"static": static, "pool": pooled}
    rows = []
    for way in args.ways:
        row = {"way": way, "requests": args.requests, "pool": args.pool, "new": args.new}
        for phase in ("cold", "warm"):
            t = time.perf_counter()
            tokens = ways[way](target, prompts, args.pool, args.new, args.temperature,
                               args.seed, capacity)  # fmt: skip
            seconds = time.perf_counter() - t
            row |= {f"{phase}_tokens": tokens, f"{phase}_s": round(seconds, 3),
                    f"{phase}_tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
        harness.write_result(Path(args.out), {"temperature": args.temperature, "rows": rows},
                             argv)  # fmt: skip


if __name__ == "__main__":
    main()
