"""`kdj serve` under `kdj bench-serve`'s concurrency sweep, one server per run config, one run.

    python bench/serve_sweep.py --prompts .traincache/data/eval_prompts.json \
        --configs configs/runs/smollm2.yaml configs/runs/smollm2-dflash.yaml \
        configs/runs/smollm2-auto.yaml --concurrency 1 4 16 64 256 --out $OUT/serve.json

For each --configs YAML a real server process is started (`python -m kdj.cli serve` with
--max-batch slots, by default the largest concurrency, compiling every greedy program of its
pool before it answers /health: `--warm greedy`, timed as start_s), the sweep of
kdj/serve/bench.py runs against it over HTTP (no warm-up pass: nothing is left to compile),
and the server is stopped with SIGTERM. The prompts are the held-out ShareGPT turns whose chat
prompt fits a slot with --max-tokens to spare (a longer one would be refused with a 400
and counted as an error, not measured). Reported per config and concurrency: aggregate and
per-user tokens/s, time to first token and inter-token latency (p50 / p99), errors.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--configs", nargs="+", required=True, help="run YAMLs, one server each")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--requests", type=int, default=64, help="per level, at least C")
    p.add_argument("--waves", type=int, default=1, help="per level, at least waves x C requests")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[128], help="N, or LO HI")
    p.add_argument("--max-batch", type=int, help="slots (default: the largest concurrency)")
    p.add_argument("--context", type=int, default=2048, help="tokens per slot")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to /health")
    p.add_argument("--out", required=True)
    return p


def fitting_prompts(texts: list[str], context: int, max_tokens: int) -> list[str]:
    """The texts whose one-turn chat prompt leaves max_tokens free in a slot of context."""
    tok = load_tokenizer(smollm2_gguf_path())
    keep = []
    for t in texts:
        try:
            n = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])))
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


def sweep(config: str, prompts: list[str], args, lengths: tuple[int, int]) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    slots = args.max_batch or max(args.concurrency)
    cmd = [sys.executable, "-m", "kdj.cli", "serve", "--config", config, "--port",
           str(args.port), "--max-batch", str(slots), "--context", str(args.context),
           "--max-queue", str(4 * slots), "--warm", "greedy"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=SERVER_ENV)
    try:
        wait_healthy(url, proc, args.start_timeout)
        started = time.perf_counter() - t0
        report = bench.run(url, prompts, args.concurrency, lengths, args.requests, warmup=False,
                           waves=args.waves)  # fmt: skip
        print(bench.table(report), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"config": config, "slots": slots, "context": args.context,
            "start_s": started, "seconds": time.perf_counter() - t0, **report}  # fmt: skip


def main(argv=None):
    args = parser().parse_args(argv)
    mt = args.max_tokens
    if len(mt) > 2 or not 1 <= mt[0] <= mt[-1]:
        raise SystemExit(f"--max-tokens: one length N, or LO HI with 1 <= LO <= HI; got {mt}")
    lengths = (mt[0], mt[-1])
    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = fitting_prompts(held, args.context, lengths[1])
    print(f"{len(prompts)} of {len(held)} held-out prompts fit a {args.context}-token slot")
    runs = []
    for config in args.configs:
        runs.append(sweep(config, prompts, args, lengths))
        result = {"prompts": len(prompts), "max_tokens": list(lengths), "runs": runs}
        harness.write_result(Path(args.out), result, argv)
        bench.plot({Path(r["config"]).stem: r for r in runs}, Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
