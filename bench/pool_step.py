"""The slot pool's step at one width, every slot busy: ms a step per method, auto beside the
fixed method it picks, so auto's own cost shows apart from its choices.

    python bench/pool_step.py --model smollm2-135m --width 16 --slots 2048 \
        --methods ar ddtree12 auto:tree12,tree16 --out $OUT/pool_step.json

Random weights (kdj.Engine, greedy, chunks of --chunk-steps, by default no host lookahead:
each turn waits for its chunk): a random drafter's drafts are seldom accepted, so the rows
measure what a step costs, not what it earns. Several --chunk-steps give a row per method
and count (METHOD@STEPS) and, per method, a least-squares fit of each pass's seconds to
chunks x chunk_ms + steps x step_ms: a chunk's own fixed cost (its dispatch, the loop's
entry, its report and, without lookahead, the host's turn) apart from its steps'. An auto
menu is given as auto:ENTRY,ENTRY (no "none": a random drafter's forecasts would send it
to plain steps); with a random drafter its forecasts are equal, so it picks its cheapest
entry, and the row says which it ran. Each method runs --repeats passes of --width requests
of --new tokens after a warm-up pass; the fastest pass is reported.
"""

from __future__ import annotations

import argparse
import time

import harness  # bench/ is the script directory
import numpy as np

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


def engine_for(menu, target, drafter, args, chunk_steps: int) -> Engine:
    kw = dict(widths=(args.width,), chunk_steps=chunk_steps, lookahead=args.lookahead)
    if menu is None:
        return Engine(target, args.width, args.slots, args.new, **kw)
    return Engine(target, args.width, args.slots, args.new, drafter=drafter, menu=menu, **kw)


def one_pass(engine: Engine, prompts, new: int) -> tuple[float, int, int]:
    """(seconds, steps, chunks) of the pool serving every prompt for `new` tokens."""
    for p in prompts:
        engine.submit(Request(p, new, []))
    steps, chunks, t0 = {}, engine.stats.chunks, time.perf_counter()
    while engine.busy:
        for u in engine.step():
            steps[u.id] = u.steps
    return time.perf_counter() - t0, max(steps.values()), engine.stats.chunks - chunks


def chunk_cost(passes: list[tuple[float, int, int]]) -> dict | None:
    """Seconds = chunks x chunk_ms + steps x step_ms, fitted over passes of two or more chunk
    lengths (None with one: the two costs cannot be told apart)."""
    if len({steps / chunks for _, steps, chunks in passes}) < 2:
        return None
    a = np.array([[chunks, steps] for _, steps, chunks in passes], float)
    y = np.array([seconds for seconds, _, _ in passes])
    (chunk_s, step_s), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {"chunk_ms": 1e3 * chunk_s, "step_ms": 1e3 * step_s}


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
    p.add_argument(
        "--chunk-steps",
        type=int,
        nargs="+",
        default=[16],
        help="steps a chunk; several: a row each and the chunk's fixed cost fitted",
    )
    p.add_argument("--lookahead", type=int, choices=(0, 1), default=0,
                   help="chunks queued beyond the one the host reads (serving: 1)")  # fmt: skip
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
    rows, costs = {}, {}
    for method in args.methods:
        passes = []
        for chunk_steps in args.chunk_steps:
            engine = engine_for(menus[method], target, drafter, args, chunk_steps)
            engine.warm(modes=(True,))
            one_pass(engine, prompts, args.new)  # first touch of every program
            runs = [one_pass(engine, prompts, args.new) for _ in range(args.repeats)]
            passes += runs
            seconds, steps, chunks = min(runs)
            # the pool's steps per entry over every pass ("plain": a step without the drafter)
            choices = {name: n for name, (n, _) in engine.stats.choices.get(args.width, {}).items()}
            name = method if len(args.chunk_steps) == 1 else f"{method}@{chunk_steps}"
            rows[name] = {"ms_per_step": 1e3 * seconds / steps, "steps": steps, "chunks": chunks,
                          "menu": [str(s) for s in engine.plans[args.width].menu],
                          "choices": choices}  # fmt: skip
            ms = rows[name]["ms_per_step"]
            print(f"{name:>24} {ms:8.2f} ms a step ({steps} steps, {chunks} chunks) {choices}",
                  flush=True)  # fmt: skip
        costs[method] = chunk_cost(passes)
        if costs[method] is not None:
            print(f"{method:>24} a chunk {costs[method]['chunk_ms']:.3f} ms + "
                  f"{costs[method]['step_ms']:.3f} ms a step", flush=True)  # fmt: skip
    return harness.write_result(args.out, {"args": vars(args), "rows": rows,
                                           "chunk_cost": costs}, argv)  # fmt: skip


if __name__ == "__main__":
    main()
