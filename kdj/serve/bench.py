"""`kdj bench-serve`: a load generator for an OpenAI-compatible server (kdj serve or any other).

At each concurrency C, C clients stream chat completions back to back until
max(requests, waves x C) have completed (one wave: every client's first request, which all
arrive at once; later waves see the server in its steady state). The clients are spread over
`procs` processes (default: one per 64 clients), each an asyncio loop with a connection per
client, so the load generator is not what limits the server: each process reports the share
of its wall time it spent on the CPU (`client_cpu` is the largest; near 1 means the clients
may be the bottleneck).

Per request: time to first token (TTFT) and time per output token after it (TPOT:
(end - first token) / (tokens - 1)); per token as received: inter-token latency (ITL): a
token's gap to the one before it, 0 for the later tokens of an event that carries several.
Tokens per event come from the server's running usage (kdj: `stream_options`
`continuous_usage_stats`); a server without it counts one token per event. Per level:
aggregate tokens per second (all completion tokens / wall time), tokens per second per user,
p50 / p99 of the rest, over the requests that completed; refused or failed ones are counted
(`errors`, with the first one's message), and a level where every request failed stops the
sweep. Against a kdj server the level also reports where the server's host time went
(GET /stats, differenced over the level: `server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import random
import time
from typing import NamedTuple

import httpx
import numpy as np

CLIENTS_PER_PROC = 64


class ServerError(RuntimeError):
    """The server is absent or failed every request: the sweep cannot go on (`kdj bench-serve`
    says so in one line)."""


class Sample(NamedTuple):
    ttft_s: float
    tpot_s: float  # nan for a one-token reply
    seconds: float
    tokens: int
    itl_s: list[float]  # each token's gap to the one before it, after the first token


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
              usage_stream: bool) -> Sample:  # fmt: skip
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}  # fmt: skip
    if usage_stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    t0 = time.perf_counter()
    first = last = None
    tokens, itl = 0, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage")
            if usage is not None:
                k = usage["completion_tokens"] - tokens
            else:
                k = int(any(_content(c) for c in chunk.get("choices", ())))
            if k <= 0:
                continue
            if first is None:
                first = now
                itl += [0.0] * (k - 1)
            else:
                itl += [now - last] + [0.0] * (k - 1)
            last, tokens = now, tokens + k
    end = time.perf_counter()
    first = end if first is None else first
    tpot = (end - first) / (tokens - 1) if tokens > 1 else float("nan")
    return Sample(first - t0, tpot, end - t0, tokens, itl)


def _content(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _clients(url, model, prompts, lengths, jobs, concurrency, timeout, usage_stream):
    """`concurrency` clients taking the request indices `jobs` until none is left."""
    samples: list[Sample] = []
    errors: list[str] = []  # refused or failed requests: counted, the level goes on
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def user():
            while jobs:
                i = jobs.pop()
                try:
                    samples.append(await one(client, model, prompts[i % len(prompts)],
                                             lengths[i % len(lengths)], usage_stream))  # fmt: skip
                except (RuntimeError, httpx.HTTPError) as e:
                    errors.append(str(e) or type(e).__name__)

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return samples, errors


def _proc(args) -> tuple[list[Sample], list[str], float]:
    """One client process: its share of the clients and requests; (samples, errors, the
    share of its wall time on the CPU)."""
    start_at, *rest = args
    time.sleep(max(0.0, start_at - time.time()))  # the processes start their clients together
    w0, c0 = time.perf_counter(), time.process_time()
    samples, errors = asyncio.run(_clients(*rest))
    return samples, errors, (time.process_time() - c0) / max(time.perf_counter() - w0, 1e-9)


def _share(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def level(url, model, prompts, lengths, concurrency, requests, timeout, procs=None,
          usage_stream=False, pool=None) -> dict:  # fmt: skip
    procs = procs or math.ceil(concurrency / CLIENTS_PER_PROC)
    procs = min(procs, concurrency)
    jobs = list(range(max(requests, concurrency)))
    before = server_stats(url)
    t0 = time.perf_counter()
    if procs == 1:
        w0, c0 = time.perf_counter(), time.process_time()
        samples, errors = asyncio.run(_clients(url, model, prompts, lengths, jobs, concurrency,
                                               timeout, usage_stream))  # fmt: skip
        cpu = [(time.process_time() - c0) / max(time.perf_counter() - w0, 1e-9)]
    else:
        start = time.time()
        start_at = start + 1.0  # every process imported and ready by then
        shares = zip(np.array_split(jobs, procs), _share(concurrency, procs))
        parts = [(start_at, url, model, prompts, lengths, [int(j) for j in js], c, timeout,
                  usage_stream) for js, c in shares]  # fmt: skip
        results = pool.map(_proc, parts)
        samples = [s for r in results for s in r[0]]
        errors = [e for r in results for e in r[1]]
        cpu = [r[2] for r in results]
        t0 += start_at - start  # the clients started at start_at, not when the map did
    wall = time.perf_counter() - t0
    if not samples:
        raise ServerError(f"every request at concurrency {concurrency} failed: {errors[0]}")
    total = sum(s.tokens for s in samples)

    def pct(xs, q):
        xs = [x for x in xs if x == x]
        return float(np.percentile(xs, q)) if xs else float("nan")

    ttft, tpot = [s.ttft_s for s in samples], [s.tpot_s for s in samples]
    itl = [x for s in samples for x in s.itl_s]
    row = {
        "concurrency": concurrency, "requests": len(samples), "errors": len(errors),
        "first_error": errors[0] if errors else None, "tokens": total, "wall_s": wall,
        "tok_s": total / wall,
        "tok_s_per_user": float(np.mean([s.tokens / s.seconds for s in samples])),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "itl_per_token": usage_stream, "client_procs": procs, "client_cpu": max(cpu),
    }  # fmt: skip
    after = server_stats(url)
    if before is not None and after is not None:
        row["server"] = stats_delta(before, after, wall)
    return row


def server_stats(url: str) -> dict | None:
    """A kdj server's cumulative host counters (GET /stats), or None from other servers."""
    try:
        r = httpx.get(url + "/stats", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        stats = r.json()
    except ValueError:
        return None
    return stats if isinstance(stats, dict) and "engine" in stats else None


def stats_delta(before: dict, after: dict, wall: float) -> dict:
    """Where a kdj server's host time went over one level of `wall` seconds."""

    def d(group, key):
        return after[group][key] - before[group][key]

    turns, chunks = d("engine", "turns"), d("engine", "chunks")
    widths = {w: n - before["engine"]["widths"].get(w, 0)
              for w, n in after["engine"]["widths"].items()}  # fmt: skip
    lag_n = d("loop_lag", "samples")
    return {
        "method": after.get("method"),
        # the engine thread's wall time: blocked on the device, its own work, idle, delivering
        "wait_share": d("engine", "wait_s") / wall,
        "host_share": (d("engine", "turn_s") - d("engine", "wait_s")) / wall,
        "idle_share": d("worker", "idle_s") / wall,
        "deliver_share": d("worker", "deliver_s") / wall,
        # the device's own waits for the host between chunks queued back to back
        "starved_share": (d("engine", "starved_s") / wall
                          if "starved_s" in after["engine"] else None),
        "turns": turns, "chunks": chunks,
        "chunk_steps": after.get("chunk_steps"),  # each width's steps at the level's end
        # per width, ms a step at each step count run so far (the server's running means)
        "step_ms": after.get("step_ms"),
        "turn_ms": 1e3 * d("engine", "turn_s") / turns if turns else float("nan"),
        "tokens_per_chunk": d("engine", "tokens") / chunks if chunks else float("nan"),
        "prefills": d("engine", "prefills"), "admitted": d("engine", "admitted"),
        "chunks_per_width": {w: n for w, n in widths.items() if n},
        "choices": choices_delta(before["engine"].get("choices", {}),
                                 after["engine"].get("choices", {})),
        # auto at each width the level ran: the model's tok/s per entry, and what the chunks
        # measured (tokens per live row per second) with the entry it runs (why it chose so)
        "pricing": {w: p for w, p in after.get("pricing", {}).items() if w in widths and
                    widths[w]},
        "measured": {w: p for w, p in after.get("measured", {}).items()
                     if widths.get(w.split()[0])},  # "W" (greedy) or "W sampled"
        "loop_lag_mean_ms": 1e3 * d("loop_lag", "total_s") / lag_n if lag_n else float("nan"),
        "loop_lag_max_ms": 1e3 * after["loop_lag"]["max_s"],
        # XLA compiles while the level ran (a warm server should have none)
        "compiles": d("compiles", "count") if "compiles" in after else None,
        "compile_s": d("compiles", "seconds") if "compiles" in after else None,
    }  # fmt: skip


def choices_delta(before: dict, after: dict) -> dict:
    """What the drafting methods chose over a level, per width: each choice's share of the
    pool's steps and the tokens a step of it committed (over all rows)."""
    out = {}
    for w, names in after.items():
        prior = before.get(w, {})
        delta = {n: (s - prior.get(n, [0, 0])[0], t - prior.get(n, [0, 0])[1])
                 for n, (s, t) in names.items()}  # fmt: skip
        total = sum(s for s, _ in delta.values())
        if total:
            out[w] = {n: {"share": s / total, "tokens_per_step": t / s}
                      for n, (s, t) in delta.items() if s}  # fmt: skip
    return out


def first_model(url: str, timeout: float) -> str:
    """The server's first model id; a clear error when nothing answers at `url`."""
    try:
        r = httpx.get(url + "/v1/models", timeout=timeout)
    except httpx.HTTPError as e:
        raise ServerError(f"no server answers at {url} ({type(e).__name__}: {e}); start one "
                          "with `kdj serve` or pass --url") from None  # fmt: skip
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{url}/v1/models gave HTTP {r.status_code} without a model "
                          f"list: {r.text[:200]!r}; is it an OpenAI-compatible server?"
                          ) from None  # fmt: skip


def workload(
    concurrency: list[int], max_tokens: tuple[int, int], requests: int, waves: int, seed: int = 0
) -> tuple[dict[int, int], list[int]]:
    """The sweep's requests: how many each level runs (max(requests, waves x C)), and each
    request's max_tokens, drawn uniformly from max_tokens (lo, hi), seeded. Request i of a
    level asks prompts[i % len(prompts)] for lengths[i] tokens."""
    rng = random.Random(seed)
    per_level = {c: max(requests, waves * c) for c in concurrency}
    return per_level, [rng.randint(*max_tokens) for _ in range(max(per_level.values()))]


def run(url: str, prompts: list[str], concurrency: list[int], max_tokens: tuple[int, int],
        requests: int, seed: int = 0, model: str | None = None, timeout: float = 600,
        warmup: bool = True, waves: int = 1, procs: int | None = None):  # fmt: skip
    """The sweep: one row per concurrency. max_tokens (lo, hi): output lengths drawn
    uniformly (seeded); lo == hi: fixed. warmup: first run every level once unmeasured
    (C requests each), so the server's compiles for those batch shapes fall outside the
    measured rows. waves: each level runs at least waves x C requests. procs: client
    processes per level (default: one per 64 clients)."""
    if not prompts:
        raise ValueError("no prompts")
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"concurrency levels must be >= 1, got {concurrency}")
    if procs is not None and procs < 1:
        raise ValueError(f"client processes must be >= 1, got {procs}")
    url = url.rstrip("/")
    per_level, lengths = workload(concurrency, max_tokens, requests, waves, seed)
    model = model or first_model(url, timeout)
    usage_stream = server_stats(url) is not None  # kdj: tokens per event from usage
    most = max(min(procs or math.ceil(c / CLIENTS_PER_PROC), c) for c in concurrency)
    with contextlib.ExitStack() as stack:
        pool = None  # client processes, started once for the sweep where a level needs them
        if most > 1:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(most))

        def go(c, n):
            return level(url, model, prompts, lengths, c, n, timeout, procs, usage_stream, pool)

        if warmup:
            for c in concurrency:
                go(c, c)
        rows = [go(c, per_level[c]) for c in concurrency]
    return {"url": url, "model": model, "max_tokens": list(max_tokens), "seed": seed,
            "warmup": warmup, "waves": waves, "rows": rows}  # fmt: skip


def table(report: dict) -> str:
    head = f"{'C':>5} {'reqs':>5} {'errs':>5} {'tok/s':>9} {'tok/s/user':>10} " \
           f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} " \
           f"{'host':>5} {'starv':>5} {'jit':>4}"  # fmt: skip
    lines = [head]
    for r in report["rows"]:
        host = r.get("server", {}).get("host_share", float("nan"))
        jit = r.get("server", {}).get("compiles")
        starved = r.get("server", {}).get("starved_share")
        starved = float("nan") if starved is None else starved
        lines.append(f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>5} "
                     f"{r['tok_s']:>9.1f} {r['tok_s_per_user']:>10.1f} "
                     f"{r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>6.0f}ms "
                     f"{r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p99_s'] * 1e3:>6.1f}ms "
                     f"{r['tpot_p50_s'] * 1e3:>7.1f}ms {host:>5.2f} {starved:>5.2f} "
                     f"{'-' if jit is None else jit:>4}")  # fmt: skip
    return "\n".join(lines)


def plot(reports: dict[str, dict], path) -> None:
    """Aggregate and per-user tok/s against concurrency, one line per report (e.g. one per
    server), as a PNG at `path`. Needs matplotlib (kdj[train] or kdj[test])."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the sweep's plot needs matplotlib: pip install matplotlib"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("tok_s", "aggregate tok/s"), ("tok_s_per_user", "tok/s per user"),
              ("ttft_p50_s", "TTFT p50 (s)"))  # fmt: skip
    for ax, (key, label) in zip(axes, panels):
        for name, report in reports.items():
            c = [r["concurrency"] for r in report["rows"]]
            ax.plot(c, [r[key] for r in report["rows"]], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
