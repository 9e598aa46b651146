"""The slot pool's step at one width, every slot busy: ms a step per method, auto beside the
fixed method it picks, so auto's own cost shows apart from its choices.

    python bench/pool_step.py --model smollm2-135m --width 16 --slots 2048 \
        --methods ar ddtree12 auto:tree12,tree16 --out $OUT/pool_step.json

Random weights (kdj.Engine, greedy, chunks of --chunk-steps, no host lookahead: each turn
waits for its chunk): a random drafter's drafts are seldom accepted, so the rows measure what
a step costs, not what it earns. An auto menu is given as auto:ENTRY,ENTRY (no "none": a
random drafter's forecasts would send it to plain steps); with a random drafter its
forecasts are equal, so it picks its cheapest entry, and the row says which it ran. Each
method runs --repeats passes of --width requests of --new tokens after a warm-up pass; the
fastest pass is reported.
"""

from __future__ import annotations

import argparse
import time

import harness  # bench/ is the script directory

from kdj.decode import auto
from kdj.decode.engine import Engine
from kdj.decode.requests import Request


def menu_of(method: str, block: int):
    """The draft shapes a method verifies (None: AR); SystemExit naming a method it is not."""
    if method == "ar":
        return None
    if method.startswith("auto:"):
        return auto.parse_menu("auto", method[5:].split(","), block, None)
    if method == "dflash":
        return auto.parse_menu("dflash", None, block, None)
    if method.startswith("ddtree") and method[6:].isdigit():
        return auto.parse_menu("ddtree", None, block, int(method[6:]))
    raise SystemExit(f"--methods: {method!r} is not ar, dflash, ddtreeN or auto:ENTRY,...")


def engine_for(menu, target, drafter, args) -> Engine:
    kw = dict(widths=(args.width,), chunk_steps=args.chunk_steps, lookahead=0)
    if menu is None:
        return Engine(target, args.width, args.slots, args.new, **kw)
    return Engine(target, args.width, args.slots, args.new, drafter=drafter, menu=menu, **kw)


def one_pass(engine: Engine, prompts, new: int) -> tuple[float, int]:
    """(seconds, steps) of the pool serving every prompt for `new` tokens."""
    for p in prompts:
        engine.submit(Request(p, new, []))
    steps, t0 = {}, time.perf_counter()
    while engine.busy:
        for u in engine.step():
            steps[u.id] = u.steps
    return time.perf_counter() - t0, max(steps.values())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="configs/models name or YAML")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--width", type=int, default=16, help="pool rows (all busy)")
    p.add_argument("--slots", type=int, default=2048, help="cache slots a row")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens a request")
    p.add_argument("--new", type=int, default=64, help="new tokens a request")
    p.add_argument("--block", type=int, default=16, help="drafter block size")
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["ar", "ddtree12", "auto:tree12,tree16"])
    p.add_argument("--out", default=None)
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    menus = {method: menu_of(method, args.block) for method in args.methods}  # before loading
    target = harness.random_target(args.model, args.layers, args.dtype)
    dcfg = harness.drafter_config(target.cfg, args.model, block_size=args.block)
    drafter = harness.random_drafter(dcfg, args.dtype)
    prompts = harness.random_prompts(target.cfg.vocab_size - 1, args.width, args.prompt)
    rows = {}
    for method in args.methods:
        engine = engine_for(menus[method], target, drafter, args)
        engine.warm(modes=(True,))
        one_pass(engine, prompts, args.new)  # first touch of every program
        runs = [one_pass(engine, prompts, args.new) for _ in range(args.repeats)]
        seconds, steps = min(runs)
        # the pool's steps per entry over every pass ("plain": a step without the drafter)
        choices = {name: n for name, (n, _) in engine.stats.choices.get(args.width, {}).items()}
        rows[method] = {"ms_per_step": 1e3 * seconds / steps, "steps": steps,
                        "menu": [str(s) for s in engine.plans[args.width].menu],
                        "choices": choices}  # fmt: skip
        ms = rows[method]["ms_per_step"]
        print(f"{method:>24} {ms:8.2f} ms a step ({steps} steps) {choices}", flush=True)
    return harness.write_result(args.out, {"args": vars(args), "rows": rows}, argv)


if __name__ == "__main__":
    main()
