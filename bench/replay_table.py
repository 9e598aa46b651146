"""The concurrency table on a target we only have with random weights (default: the
Moonlight-16B-A3B shape, a Kimi-class MoE) at chosen acceptances, with the REPLAY drafter
(kdj/replay.py: benchmarks only; it drafts the target's own recorded greedy answers,
corrupted at a rate calibrated to each --taus value, so tau is chosen, not earned).

    python bench/replay_table.py --model moonlight-16b-a3b --taus 3 5 \\
        --clients 1 4 16 64 256 --methods ar dflash ddtree16 auto --out $OUT/replay_table.json

0. the random target made steady (bench/harness.py `steady_greedy`: its greedy answer is
   the same whatever the batch, which a random bf16 MoE's is not; --no-steady keeps it raw);
1. --waves x max(--clients) random prompts, lengths uniform in [--prompt-len / 2,
   --prompt-len] (ragged: the replay's keys hold positions, so fewer prompts share one);
   their greedy continuations of --max-new tokens recorded once by plain decoding through
   the pool;
2. per --taus value, the corruption rate at which DFlash's chain reaches that tau on the first
   --calibrate-prompts recorded prompts (static batch; kdj.replay.calibrate); or the rates of
   --corrupt, taken as given (no calibration: the rows say the tau each reached);
3. per client count C and method: the first --waves x C recorded prompts through the slot pool
   of C slots in this process, timed warm: `--drivers engine` the server's Engine
   (kdj.serve.app.serving_engine, every program compiled first by Engine.warm, in threads, as
   `kdj serve` does) under a closed loop of C clients, `generate` kdj.generate(max_batch=C)
   after a pass that compiles. AR does not draft: it runs once per C, not per tau.
Each phase says on stderr when it ends, and how long it took.

Per row: new tokens/s over the wall time, tau realised (tokens per step over every request's
steps), and the share of requests whose tokens equal their recording (below 1: the target's
greedy answer moved with the batch's numerics; the replay then misses from there on, and tau
falls). auto prices its menu with this machine's tuned costs (a tuning pass at first use on
a GPU; --cost estimate skips it). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness  # bench/ is the script directory
import numpy as np

import kdj
from kdj import replay
from kdj.decode.requests import Request
from kdj.serve.app import serving_engine


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--layers", type=int, help="keep the first N layers (a slice)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-steady", dest="steady", action="store_false",
                   help="keep the random weights as drawn (a bf16 MoE's greedy answers then "
                        "change with the batch, and the replay misses them)")  # fmt: skip
    p.add_argument("--taus", type=float, nargs="+", default=[3.0, 5.0])
    p.add_argument("--corrupt", type=float, nargs="+", help="rates to run as given, "
                   "instead of calibrating --taus")  # fmt: skip
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree16", "auto"],
                   help="ar, dflash, ddtreeN (a tree of N nodes), auto")  # fmt: skip
    p.add_argument("--drivers", nargs="+", choices=["engine", "generate"], default=["engine"])
    p.add_argument("--waves", type=int, default=2, help="requests per level: waves x clients")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--calibrate-prompts", type=int, default=16)
    p.add_argument("--cost", help="auto's step cost: 'estimate', 'tune' or a JSON path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return p


def method_args(name: str, block_size: int) -> dict:
    """kdj.generate's method arguments for a table name (ar, dflash, ddtreeN, auto)."""
    if name == "ar":
        return {"method": "ar"}
    if name in ("dflash", "auto"):
        return {"method": name, "block_size": block_size}
    if name.startswith("ddtree") and name[6:].isdigit():
        return {"method": "ddtree", "block_size": block_size, "tree_budget": int(name[6:])}
    raise ValueError(f"unknown method {name!r}: ar, dflash, ddtreeN or auto")


def prompts_for(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, length // 2), length + 1, n)
    return [rng.integers(0, vocab, k).tolist() for k in lens]


def on_engine(target, drafter, kw: dict, clients: int, prompts, max_new: int, context: int,
              cost, warm: bool = False) -> tuple[list[list[int]], int]:  # fmt: skip
    """The server's pool under a closed loop of `clients` clients, each sending its next
    request when its last one ends: (tokens per request, steps over all requests). `warm`:
    compile every program of the pool and return (nothing run)."""
    engine = serving_engine(target, drafter, kw["method"], kw.get("block_size"),
                            kw.get("tree_budget"), clients, context,
                            cost=cost if kw["method"] == "auto" else None)  # fmt: skip
    if warm:
        engine.warm((True,))
        return [], 0
    todo = list(range(len(prompts)))[::-1]
    got: dict[int, list[int]] = {}
    index: dict[int, int] = {}
    steps: dict[int, int] = {}

    def submit():
        i = todo.pop()
        index[engine.submit(Request(list(prompts[i]), max_new, []))] = i
        got[i] = []

    for _ in range(min(clients, len(todo))):
        submit()
    while engine.busy:
        for u in engine.step():
            got[index[u.id]] += u.tokens
            steps[u.id] = u.steps
            if u.finished and todo:
                submit()
    return [got[i] for i in range(len(prompts))], sum(steps.values())


def on_generate(target, drafter, kw: dict, clients: int, prompts, max_new: int, context: int,
                cost, warm: bool = False) -> tuple[list[list[int]], int]:  # fmt: skip
    """kdj.generate(max_batch=clients): (tokens per request, steps over all requests); `warm`
    changes nothing (generate compiles as it goes: the pass itself warms)."""
    extra = {"cost": cost} if kw["method"] == "auto" and cost else {}
    out = kdj.generate(target, prompts, drafter=drafter if kw["method"] != "ar" else None,
                       max_new_tokens=max_new, stop_tokens=[], max_batch=clients,
                       cache_size=context, **kw, **extra)  # fmt: skip
    return out.tokens, sum(out.stats["request_steps"])


DRIVERS = {"engine": on_engine, "generate": on_generate}


def measure(driver, target, drafter, kw, clients, rec: replay.Recording, args, context) -> dict:
    """One cell: its programs compiled (the engine driver: Engine.warm; generate: a whole
    pass), then the timed pass."""
    n = args.waves * clients
    prompts, recorded = rec.prompts[:n], rec.continuations[:n]
    run = DRIVERS[driver]
    run(target, drafter, kw, clients, prompts, args.max_new, context, args.cost, warm=True)
    t0 = time.perf_counter()
    tokens, steps = run(target, drafter, kw, clients, prompts, args.max_new, context, args.cost)
    wall = time.perf_counter() - t0
    new = sum(map(len, tokens))
    same = np.mean([t == r for t, r in zip(tokens, recorded)])
    return {"driver": driver, "clients": clients, "requests": n, "tokens": new, "wall_s": wall,
            "tok_s": new / wall, "tau": (new - n) / steps if steps else 1.0,
            "same_as_recording": float(same)}  # fmt: skip


def main(argv=None):
    args = parser().parse_args(argv)
    if "generate" in args.drivers and args.waves < 2:
        raise SystemExit("--drivers generate needs --waves >= 2 (else no request waits for a slot)")
    methods = {m: method_args(m, args.block_size) for m in args.methods}
    tables = drafts(args)  # checked before the target is made
    target = harness.random_target(args.model, args.layers, args.dtype, seed=args.seed,
                                   steady=args.steady)  # fmt: skip
    vocab = target.cfg.vocab_size
    prompts = prompts_for(vocab, args.waves * max(args.clients), args.prompt_len, args.seed)
    context = -(-(args.prompt_len + args.max_new + args.block_size) // 64) * 64
    t0 = time.perf_counter()
    rec = replay.record(target, prompts, args.max_new, max_batch=max(args.clients))
    say(f"recorded {len(prompts)} greedy continuations", t0)
    weights = "random, steady greedy (harness.steady_greedy)" if args.steady else "random"
    meta = {"model": args.model, "layers": target.cfg.num_layers, "weights": weights,
            "drafter": "replay (benchmarks only)", "record_s": time.perf_counter() - t0,
            "context": context}  # fmt: skip
    rows, result = [], {"meta": meta, "calibration": [], "rows": []}

    def emit(row):
        print(json.dumps(row), flush=True)
        rows.append(row)
        result["rows"] = rows
        harness.write_result(Path(args.out), dict(result, meta=dict(meta)), argv)

    drafters = []  # (tau asked for, rate, replay drafter), every rate ready before the cells
    for tau, rate in tables:
        t0 = time.perf_counter()
        if rate is None:
            cal = replay.calibrate(target, rec, tau, block_size=args.block_size,
                                   prompts=args.calibrate_prompts, seed=args.seed)  # fmt: skip
            result["calibration"].append({"tau_requested": tau, "corrupt": cal.corrupt,
                                          "tau_dflash": cal.tau})  # fmt: skip
            drafters.append((tau, cal.corrupt, cal.drafter))
            say(f"calibrated tau {tau}: corruption rate {cal.corrupt:.3f} "
                f"(DFlash tau {cal.tau:.2f})", t0)  # fmt: skip
        else:
            drafters.append((tau, rate, replay.replay_drafter(target, rec, rate, args.block_size,
                                                              args.seed)))  # fmt: skip
    # a client level at a time, every method and rate in it: a run cut short still holds
    # whole rows of the table
    for clients in args.clients:
        cells = [("ar", None, None, None)] if "ar" in methods else []
        cells += [(name, tau, rate, drafter) for tau, rate, drafter in drafters
                  for name in methods if name != "ar"]  # fmt: skip
        for name, tau, rate, drafter in cells:
            for driver in args.drivers:
                t0 = time.perf_counter()
                cell = measure(driver, target, drafter, methods[name], clients, rec, args,
                               context)  # fmt: skip
                emit({"method": name, "tau_requested": tau, "corrupt": rate, **cell})
                say(f"{name} at {clients} clients ({driver}, corrupt {rate})", t0)
    return harness.write_result(Path(args.out), dict(result, meta=dict(meta)), argv)


def drafts(args) -> list[tuple[float | None, float | None]]:
    """(tau asked for, corruption rate) per drafted table: --taus to calibrate, or the
    --corrupt rates as given."""
    if args.corrupt is None:
        return [(tau, None) for tau in args.taus]
    for rate in args.corrupt:
        if not 0.0 <= rate <= 1.0:
            raise SystemExit(f"--corrupt {rate}: a rate must be in [0, 1]")
    return [(None, rate) for rate in args.corrupt]


def say(what: str, since: float) -> None:
    """A phase's end on stderr, with its seconds: what a timed-out run got through."""
    print(f"replay_table: {what} in {time.perf_counter() - since:.0f} s", file=sys.stderr,
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
