"""`kdj serve` under `kdj bench-serve`'s concurrency sweep, one server per run config, one run;
beside it the engine's own ceiling on the same requests.

    python bench/serve_sweep.py --prompts .traincache/data/eval_prompts.json \
        --configs configs/runs/smollm2.yaml configs/runs/smollm2-dflash.yaml \
        --concurrency 1 4 16 64 256 --requests 16 --waves 4 --workloads 128 16-512 \
        --ceiling 64 256 --out $OUT/serve.json

For each --configs YAML a real server process is started (`python -m kdj.cli serve` with
--max-batch slots, by default the largest concurrency, compiling every greedy program of its
pool before it answers /health: `--warm greedy`, timed as start_s), the sweep of
kdj/serve/bench.py runs against it over HTTP once per --workloads entry (N: every request
asks N tokens; LO-HI: drawn uniformly; no warm-up pass unless --warmup: nothing is left to
compile, but auto measures its entries as it serves, so --warmup shows a long-lived server
rather than a fresh one), and the server is stopped with SIGTERM. The prompts are the
held-out ShareGPT turns whose chat prompt fits a slot with the longest workload's tokens to
spare (a longer one would be refused with a 400 and counted as an error, not measured).
Reported per config, workload and concurrency: aggregate and per-user tokens/s, TTFT, ITL and
TPOT (p50 / p99), errors, and where the server's host time went.

--ceiling W...: after the servers, in this process, each config (or each --ceiling-configs
YAML) runs exactly the requests of the W-client level (same prompts, chat template, lengths,
stop tokens and slot size) twice over, each timed warm after a pass that compiles it:
`kdj.generate(max_batch=W)`, what the engine delivers with no server in the way, and the
server's own pool (`serving_engine`: its chunk steps and wake share) under a closed loop of W
clients in this thread, no HTTP: what the server's settings cost apart from HTTP. --profile
DIR writes a cProfile of the latter. Each timed pass counts the XLA compiles it ran
(expected: none, the pass before it compiled what it meets).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

# this process only stamps the result with the device: it must not take the GPU's memory
# from the server (JAX preallocates most of it at the first device call)
SERVER_ENV = dict(os.environ)
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import harness  # noqa: E402  (bench/ is the script directory)
import httpx  # noqa: E402

from kdj.checkpoints.gguf import smollm2_gguf_path  # noqa: E402
from kdj.serve import bench  # noqa: E402
from kdj.tokenizer import load_tokenizer  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", required=True, help="eval_prompts.json (kdj train-drafter)")
    p.add_argument("--configs", nargs="+", required=True,
                   help="run YAMLs, one server each; YAML@FLAGS adds kdj serve flags to that "
                   "server (e.g. 'configs/runs/smollm2.yaml@--chunk-steps 16')")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--requests", type=int, default=64, help="per level, at least C")
    p.add_argument("--waves", type=int, default=1, help="per level, at least waves x C requests")
    p.add_argument(
        "--workloads",
        type=workload,
        nargs="+",
        default=[(128, 128)],
        help="output lengths, one sweep each: N, or LO-HI (uniform)",
    )
    p.add_argument("--procs", type=int, help="client processes (default: one per 64 clients)")
    p.add_argument("--warmup", action="store_true",
                   help="an unmeasured pass over every level first: a long-lived server's "
                   "state (auto's measured picks) rather than a fresh one's")  # fmt: skip
    p.add_argument(
        "--ceiling",
        type=int,
        nargs="*",
        default=[],
        help="also kdj.generate(max_batch=W) on the W-client level's requests",
    )
    p.add_argument("--ceiling-configs", nargs="+",
                   help="the run YAMLs whose ceiling is measured (default: --configs)")  # fmt: skip
    p.add_argument(
        "--no-ceiling-pool",
        action="store_true",
        help="the ceiling runs kdj.generate (and the prefill) only, not the server's pool "
        "in-process",
    )
    p.add_argument("--profile", help="a folder for cProfiles of the ceiling's in-process pool")
    p.add_argument("--max-batch", type=int, help="slots (default: the largest concurrency)")
    p.add_argument("--context", type=int, default=2048, help="tokens per slot")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to /health")
    p.add_argument("--out", required=True)
    return p


def workload(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a length N or a range LO-HI") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def chat_ids(tok, text: str) -> list[int]:
    """The prompt tokens kdj serve makes of a one-turn chat request."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def fitting_prompts(texts: list[str], context: int, max_tokens: int) -> list[str]:
    """The texts whose one-turn chat prompt leaves max_tokens free in a slot of context."""
    tok = load_tokenizer(smollm2_gguf_path())
    keep = []
    for t in texts:
        try:
            n = len(chat_ids(tok, t))
        except ValueError:  # a text the vocabulary cannot encode: the server would refuse it
            continue
        if n + max_tokens < context:
            keep.append(t)
    return keep


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"no healthy server at {url} after {timeout:.0f} s")


def pool_slots(args) -> int:
    return args.max_batch or max(args.concurrency)


def server_command(config: str, args) -> list[str]:
    """`kdj serve` for a --configs entry: YAML, or YAML@FLAGS with extra serve flags."""
    slots = pool_slots(args)
    yaml_path, _, flags = config.partition("@")
    return [sys.executable, "-m", "kdj.cli", "serve", "--config", yaml_path, "--port",
            str(args.port), "--max-batch", str(slots), "--context", str(args.context),
            "--max-queue", str(4 * slots), "--warm", "greedy", *shlex.split(flags)]  # fmt: skip


def sweep(config: str, prompts: list[str], args) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = server_command(config, args)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=SERVER_ENV)
    workloads = []
    try:
        wait_healthy(url, proc, args.start_timeout)
        started = time.perf_counter() - t0
        for lengths in args.workloads:
            report = bench.run(url, prompts, args.concurrency, lengths, args.requests,
                               warmup=args.warmup, waves=args.waves, procs=args.procs)  # fmt: skip
            print(f"{config}, max_tokens {lengths}:\n{bench.table(report)}", flush=True)
            workloads.append(report)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"config": config, "slots": pool_slots(args), "context": args.context,
            "start_s": started, "seconds": time.perf_counter() - t0,
            "workloads": workloads}  # fmt: skip


def closed_loop(engine, requests: list, clients: int) -> int:
    """`clients` clients on `engine`, each sending its next request when its last one ends;
    the tokens handed out."""
    todo, live, tokens = collections.deque(requests), 0, 0
    while todo and live < clients:
        engine.submit(todo.popleft())
        live += 1
    while engine.busy:
        for u in engine.step():
            tokens += len(u.tokens)
            if u.finished:
                live -= 1
                if todo:
                    engine.submit(todo.popleft())
                    live += 1
    return tokens


def ceiling(config: str, prompts: list[str], args) -> list[dict]:
    """On each --ceiling W-client level's requests, per workload: kdj.generate(max_batch=W),
    one prefill of W of those prompts (the yardstick of TTFT at W clients), and the server's
    own pool (kdj.serve.app.serving_engine) driven in this process by a closed loop of W
    clients, with no HTTP; each timed warm, after a pass that compiles it.
    --profile DIR: a cProfile of the pool's timed pass, per level."""
    import kdj
    from kdj.cli.runs import dtype_name, load_run
    from kdj.decode.requests import Request
    from kdj.serve.app import Compiles, serving_engine

    run = load_run(config.partition("@")[0])  # the in-process pool takes no serve flags
    dec = run["decode"]
    target = kdj.load_target(run["target"], dtype=dtype_name(run["dtype"]))
    drafter = kdj.load_drafter(run["drafter"], target=target) if run["drafter"] else None
    stop = sorted(target.tokenizer.stop_ids or target.cfg.eos_token_ids)
    rows = []
    for lengths in args.workloads:
        per_level, lens = bench.workload(args.ceiling, lengths, args.requests, args.waves)
        for w in args.ceiling:
            n = per_level[w]
            batch = [chat_ids(target.tokenizer, prompts[i % len(prompts)]) for i in range(n)]

            def generate(w=w, batch=batch, new=lens[:n]):
                out = kdj.generate(target, batch, drafter=drafter, method=dec["method"],
                                   block_size=dec["block_size"], tree_budget=dec["tree_budget"],
                                   max_new_tokens=new, max_batch=w, cache_size=args.context,
                                   temperature=0.0)  # fmt: skip
                return sum(len(t) for t in out.tokens)

            def pool(w=w, batch=batch, new=lens[:n]):
                engine = serving_engine(target, drafter, dec["method"], dec["block_size"],
                                        dec["tree_budget"], w, args.context)  # fmt: skip
                requests = [Request(list(p), m, list(stop), 0.0, 1.0, None)
                            for p, m in zip(batch, new)]  # fmt: skip
                return closed_loop(engine, requests, w)

            def prefill(w=w, batch=batch):
                # one prefill of W prompts (and its first token): the yardstick for TTFT at W
                out = kdj.generate(target, batch[:w], drafter=drafter, method=dec["method"],
                                   block_size=dec["block_size"], tree_budget=dec["tree_budget"],
                                   max_new_tokens=1, max_batch=w, cache_size=args.context,
                                   temperature=0.0)  # fmt: skip
                return sum(len(t) for t in out.tokens)

            row = {"config": config, "max_tokens": list(lengths), "max_batch": w, "requests": n}
            calls = (("generate", generate), ("prefill", prefill))
            calls += () if args.no_ceiling_pool else (("pool", pool),)
            for name, call in calls:
                t0 = time.perf_counter()
                call()  # compiles every shape this workload meets
                first = time.perf_counter() - t0
                profile = cProfile.Profile() if args.profile and name == "pool" else None
                t0 = time.perf_counter()
                with profile or contextlib.nullcontext(), Compiles() as compiles:
                    tokens = call()
                wall = time.perf_counter() - t0
                row[name] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
                             "first_call_s": first, "compiles": compiles.count}  # fmt: skip
                if profile is not None:
                    stem = f"{Path(config).stem}_{lengths[0]}-{lengths[1]}_{w}"
                    write_profile(profile, Path(args.profile) / f"profile_{stem}.txt")
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def label(config: str) -> str:
    """A server's name in the plot: its YAML's stem and any serve flags."""
    yaml_path, _, flags = config.partition("@")
    return f"{Path(yaml_path).stem} {flags}".strip()


def write_profile(profile: cProfile.Profile, path: Path) -> None:
    """The profile's 30 costliest functions by own time, then by cumulative time."""
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def main(argv=None):
    args = parser().parse_args(argv)
    longest = max(hi for _, hi in args.workloads)
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = fitting_prompts(held, args.context, longest)
    print(f"{len(prompts)} of {len(held)} held-out prompts fit a {args.context}-token slot")
    result = {"prompts": len(prompts), "workloads": [list(w) for w in args.workloads],
              "runs": [], "ceiling": []}  # fmt: skip
    for config in args.configs:
        result["runs"].append(sweep(config, prompts, args))
        harness.write_result(Path(args.out), result, argv)
        for k, lengths in enumerate(args.workloads):
            name = "" if len(args.workloads) == 1 else f"_{lengths[0]}-{lengths[1]}"
            png = Path(args.out).with_name(Path(args.out).stem + name + ".png")
            bench.plot({label(r["config"]): r["workloads"][k] for r in result["runs"]}, png)
    for config in (args.ceiling_configs or args.configs) if args.ceiling else ():
        result["ceiling"] += ceiling(config, prompts, args)
        harness.write_result(Path(args.out), result, argv)


if __name__ == "__main__":
    main()
