"""`kdj bench-serve`: a load generator for an OpenAI-compatible server (kdj serve or any other).

At each concurrency C, C clients stream chat completions back to back until
max(requests, waves x C) have completed (one wave: every client's first request, which all
arrive at once; later waves see the server in its steady state). Per request: time to first
token (TTFT), inter-token latency (ITL: (end - first token) / (tokens - 1)) and tokens per
second seen by its user; per level:
aggregate tokens per second (all completion tokens / wall time) and p50 / p99 of the rest,
over the requests that completed; refused or failed ones are counted (`errors`, with the
first one's message), and a level where every request failed stops the sweep.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import NamedTuple

import httpx
import numpy as np


class Sample(NamedTuple):
    ttft_s: float
    itl_s: float  # nan for a one-token reply
    seconds: float
    tokens: int


async def one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None:
                first = time.perf_counter()
            if "usage" in chunk:
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = end if first is None else first
    itl = (end - first) / (tokens - 1) if tokens > 1 else float("nan")
    return Sample(first - t0, itl, end - t0, tokens)


async def level(url, model, prompts, lengths, concurrency, requests, timeout) -> dict:
    jobs = list(range(max(requests, concurrency)))
    samples: list[Sample] = []
    errors: list[str] = []  # refused or failed requests: counted, the level goes on
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:

        async def user():
            while jobs:
                i = jobs.pop()
                try:
                    samples.append(await one(client, model, prompts[i % len(prompts)],
                                             lengths[i % len(lengths)]))  # fmt: skip
                except (RuntimeError, httpx.HTTPError) as e:
                    errors.append(str(e) or type(e).__name__)

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    if not samples:
        raise RuntimeError(f"every request at concurrency {concurrency} failed: {errors[0]}")
    total = sum(s.tokens for s in samples)

    def pct(xs, q):
        xs = [x for x in xs if x == x]
        return float(np.percentile(xs, q)) if xs else float("nan")

    ttft, itl = [s.ttft_s for s in samples], [s.itl_s for s in samples]
    return {
        "concurrency": concurrency, "requests": len(samples), "errors": len(errors),
        "first_error": errors[0] if errors else None, "tokens": total, "wall_s": wall,
        "tok_s": total / wall,
        "tok_s_per_user": float(np.mean([s.tokens / s.seconds for s in samples])),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
    }  # fmt: skip


def run(url: str, prompts: list[str], concurrency: list[int], max_tokens: tuple[int, int],
        requests: int, seed: int = 0, model: str | None = None, timeout: float = 600,
        warmup: bool = True, waves: int = 1):  # fmt: skip
    """The sweep: one row per concurrency. max_tokens (lo, hi): output lengths drawn
    uniformly (seeded); lo == hi: fixed. warmup: first run every level once unmeasured
    (C requests each), so the server's compiles for those batch shapes fall outside the
    measured rows. waves: each level runs at least waves x C requests."""
    if not prompts:
        raise ValueError("no prompts")
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    rng = random.Random(seed)
    per_level = {c: max(requests, waves * c) for c in concurrency}
    lengths = [rng.randint(*max_tokens) for _ in range(max(per_level.values()))]
    if model is None:
        model = httpx.get(url + "/v1/models", timeout=timeout).json()["data"][0]["id"]
    if warmup:
        for c in concurrency:
            asyncio.run(level(url, model, prompts, lengths, c, c, timeout))
    rows = [asyncio.run(level(url, model, prompts, lengths, c, per_level[c], timeout))
            for c in concurrency]  # fmt: skip
    return {"url": url, "model": model, "max_tokens": list(max_tokens), "seed": seed,
            "warmup": warmup, "waves": waves, "rows": rows}  # fmt: skip


def table(report: dict) -> str:
    head = f"{'C':>5} {'reqs':>5} {'errs':>5} {'tok/s':>9} {'tok/s/user':>10} " \
           f"{'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}"  # fmt: skip
    lines = [head]
    for r in report["rows"]:
        lines.append(f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>5} "
                     f"{r['tok_s']:>9.1f} {r['tok_s_per_user']:>10.1f} "
                     f"{r['ttft_p50_s'] * 1e3:>7.0f}ms {r['ttft_p99_s'] * 1e3:>6.0f}ms "
                     f"{r['itl_p50_s'] * 1e3:>6.1f}ms {r['itl_p99_s'] * 1e3:>6.1f}ms")  # fmt: skip
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
