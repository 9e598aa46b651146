"""Where a decode step's time goes: a profiler trace per case, summed per device kernel.

    python bench/profile_step.py --cases moonlight-16b-a3b:1:ar smollm2-135m-instruct:1:ar \
        moonlight-16b-a3b:1:ar:xla-dense moonlight-16b-a3b:256:moe-16 --out $OUT/prof.json

A case is MODEL:BATCH:WHAT[:KERNELS]. MODEL: a configs/models name or YAML path (random
weights) or "smollm2-135m-instruct" (real). WHAT: a generate method ("ar", "dflash",
"ddtree<budget>", "auto"; speculative ones with a random drafter of the published shape;
"ddtree<budget>-allpairs", "-laxtop" or "-pruned" (or -allpairs then one of the other two):
DDTree with a part of the tree build swapped for another, for an A/B in one call: the
beam extended by top_k over all budget x K pairs, the build before kdj's pruning; the
vocabulary's top-K in one round of jax.lax.top_k per (sequence, depth), where kdj may take
two rounds; or by tree.top_k_pruned, chunk maxima first),
--steps decode steps after a prompt of --context random tokens (--prompts: held-out chat
prompts of at most --context tokens; --drafter: a real drafter, e.g. to see auto's own
step against the fixed method it picks), kernels counted in the decode loop's executable
only (device events whose HLO module matches --module); "step",
one target forward step queued --steps times (what bench/roofline.py times); "moe-T", the
first MoE layer of a 2-layer slice alone on BATCH x T random tokens. KERNELS: a kernel case of
bench/harness.py (KERNEL_CASES: the target's kernel policy with some fields changed).

A case runs to compile, timed, then under jax.profiler.trace. Device events (GPU: kernels on
the /device:GPU streams; CPU: XLA thunks on tf_XLA* threads) are summed by name and category,
with busy time and kernels per step and the heaviest Python frames; JSON is saved after each
case. Traced, XLA may run command buffers (CUDA graphs) kernel by kernel: compare
wall_ms_per_step, which is untraced.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from contextlib import ExitStack, nullcontext
from pathlib import Path
from unittest import mock

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

import kdj
from kdj.decode import tree as trees

CATEGORIES = (  # (category, pattern): first match on the lower-cased kernel name wins
    ("attention", r"attention|attn|flash|fmha|mha"),
    ("ragged_dot/grouped", r"ragged|grouped|group_gemm"),
    ("gemm/matmul", r"gemm|gemv|splitk|matmul|cublas|cutlass|nvjet|xmma|wgmma|dot|convolution|ynn"),
    ("gather/scatter/dus", r"gather|scatter|dynamic.update.slice|dynamic.slice"),
    ("copy/transpose", r"copy|memcpy|memset|transpose"),
    ("reduce/softmax", r"reduce|softmax|argmax|argmin|sort|top.?k|cumsum"),
)
CONTAINER = re.compile(r"(while|call|conditional)\b")  # CPU thunks that run others inside
TRACER = re.compile(r"profiler|contextlib")  # host frames of starting/stopping the trace
DERIVED = ("xla ops", "xla modules", "steps", "tensorflow", "framework", "source", "launch")


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "fusion/other")


# ------------------------------------------------------------------------------ the trace
def read_events(trace_dir: Path) -> list[tuple[str, str, str, float, float, dict]]:
    """(process, thread, name, start us, duration us, args) of every complete event of the
    newest trace under trace_dir: perfetto_trace.json.gz (or the *.trace.json.gz it is made
    from), else the XSpace (*.xplane.pb) read through jax.profiler.ProfileData."""
    files = sorted(trace_dir.rglob("*.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        xspaces = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        if not xspaces:
            raise FileNotFoundError(f"no trace under {trace_dir}: {list(trace_dir.rglob('*'))}")
        data = jax.profiler.ProfileData.from_file(str(xspaces[-1]))
        return [(pl.name, ln.name, e.name, e.start_ns / 1e3, e.duration_ns / 1e3, dict(e.stats))
                for pl in data.planes for ln in pl.lines for e in ln.events]  # fmt: skip
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events  # process, thread
             if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")}  # fmt: skip
    return [(names.get((e["pid"], None), ""), names.get((e["pid"], e.get("tid")), ""), e["name"],
             float(e["ts"]), float(e.get("dur", 0)), e.get("args", {}))
            for e in events if e.get("ph") == "X"]  # fmt: skip


def in_module(events, module: str | None) -> list:
    """The events of HLO modules matching `module` (None: all). Events naming no module
    (copies) are dropped with the filter on, unless no event names one."""
    if module is None or not any("hlo_module" in e[5] for e in events):
        return events
    pattern = re.compile(module)
    return [e for e in events if pattern.search(e[5].get("hlo_module", "\0"))]


def device_events(events) -> list[tuple[str, float, float, str, str]]:
    """(name, start, duration, thread, hlo_op) of device work, by start. GPU: events on the
    /device:* processes' stream threads (not derived lines such as "XLA Ops"). CPU: XLA thunks
    (events naming an hlo_op) on tf_XLA* threads, less while/call thunks (their body counts)."""
    dev = [e for e in events if e[0].startswith("/device:")]
    if dev:
        out = [e for e in dev if e[1].lower().startswith("stream")]
        out = out or [e for e in dev if not e[1].lower().startswith(DERIVED)]
        uniq = {e[2:5]: (*e[2:5], e[1], e[5].get("hlo_op", "")) for e in out}
        return sorted(uniq.values(), key=lambda e: e[1])  # a kernel on two lines counts once
    ops = [e for e in events if e[1].startswith("tf_XLA") and "hlo_op" in e[5]]
    out = [(*e[2:5], e[1], e[5]["hlo_op"]) for e in ops if not CONTAINER.match(e[5]["hlo_op"])]
    return sorted(out, key=lambda e: e[1])


def summarise(events, traced_s: float, steps: int, module: str | None = None) -> dict:
    kernels = device_events(in_module(events, module))
    if not kernels:
        raise RuntimeError(f"no device events among the trace's {len(events)} events")
    wall_us = traced_s * 1e6
    by_name = defaultdict(lambda: {"total_us": 0.0, "count": 0, "hlo_op": ""})
    cats = defaultdict(lambda: {"total_us": 0.0, "count": 0})
    for name, _, dur, _, op in kernels:
        for k in (by_name[name], cats[category(name)]):
            k["total_us"] += dur
            k["count"] += 1
        by_name[name]["hlo_op"] = by_name[name]["hlo_op"] or op
    for k in (*by_name.values(), *cats.values()):
        k["us_per_step"], k["share_of_wall"] = k["total_us"] / steps, k["total_us"] / wall_us
    host, threads = defaultdict(float), defaultdict(int)
    for proc, thread, name, _, dur, _ in events:
        threads[f"{proc} | {thread}"] += 1  # what the trace holds, to check the classification
        if proc.startswith("/host") and not thread.startswith("tf_") and not TRACER.search(name):
            host[name] += dur
    kernel_us, busy_us, end = sum(k["total_us"] for k in cats.values()), 0.0, -float("inf")
    for _, ts, dur, *_ in kernels:  # busy: the union of the kernels' intervals
        busy_us, end = busy_us + max(0.0, ts + dur - max(ts, end)), max(end, ts + dur)
    return {
        "traced_wall_ms_per_step": traced_s * 1e3 / steps, "kernels_per_step": len(kernels) / steps,
        "busy_ms_per_step": busy_us / 1e3 / steps,
        "kernel_ms_per_step": kernel_us / 1e3 / steps, "kernel_share_of_wall": kernel_us / wall_us,
        "device_threads": sorted({k[3] for k in kernels}), "trace_threads": dict(threads),
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["total_us"])),
        "kernels": [{"name": n, "category": category(n), **k}
                    for n, k in sorted(by_name.items(), key=lambda kv: -kv[1]["total_us"])],
        "host_python_top_us": dict(sorted(host.items(), key=lambda kv: -kv[1])[:25]),
    }  # fmt: skip


# ------------------------------------------------------------------------------ the cases
def all_pairs_beams(top_lp, top_tok, budget: int):
    """kdj.decode.tree._beams before pruning: each depth takes top_k over all budget x K
    (beam, token) pairs (the same result; the "-allpairs" cases time it)."""
    K = top_lp.shape[1]
    s0 = jnp.concatenate([top_lp[0], jnp.full((budget - K,), -jnp.inf)])
    t0 = jnp.concatenate([top_tok[0], jnp.zeros((budget - K,), jnp.int32)])

    def extend(prev, x):
        lp_d, tok_d = x
        score, flat = jax.lax.top_k((prev[:, None] + lp_d[None, :]).reshape(-1), budget)
        return score, (score, tok_d[flat % K], flat // K)

    _, (s, t, p) = jax.lax.scan(extend, s0, (top_lp[1:], top_tok[1:]))
    scores = jnp.concatenate([s0[None], s])
    tokens = jnp.concatenate([t0[None], t]).astype(jnp.int32)
    parents = jnp.concatenate([jnp.full((1, budget), -1), p]).astype(jnp.int32)
    return scores, tokens, parents


def tree_patch(variant: str):
    """The part of kdj's tree build a "ddtree<budget>-<variant>" case swaps for the bench's."""
    if variant == "allpairs":  # the beam build before pruning
        return mock.patch.object(trees, "_beams", all_pairs_beams)
    if variant == "laxtop":  # the vocabulary's top-K in one round
        return mock.patch.object(trees, "top_k", lambda x, k: jax.lax.top_k(x, k))
    if variant == "pruned":  # the vocabulary's top-K pruned by chunk maxima
        return mock.patch.object(trees, "top_k", lambda x, k: trees.top_k_pruned(x, k))
    raise ValueError(f"unknown tree build variant {variant!r}")


def case_drafter(tgt, name: str, args):
    """The speculative cases' drafter: --drafter's (loaded once, in main), else a random one
    of the published shape."""
    if args.real_drafter is not None:
        return args.real_drafter
    return harness.random_drafter(harness.drafter_config(tgt.cfg, name), args.dtype)


def case_prompts(tgt, B: int, args) -> list:
    """B prompts: --prompts' held-out ShareGPT turns (chat template, at most --context
    tokens), cycled; else B of --context random tokens."""
    if not args.prompts:
        return harness.random_prompts(tgt.cfg.vocab_size, B, args.context)
    from kdj.train.loop import chat_prompts

    held = json.loads(Path(args.prompts).read_text())["sharegpt"]
    prompts = chat_prompts(tgt.tokenizer, held, args.context)
    return [prompts[i % len(prompts)] for i in range(B)]


def generate_case(tgt, name: str, B: int, method: str, args):
    """(run, steps of a run, module) of kdj.generate: `args.steps` decode steps after the
    case's prompts (case_prompts); run() returns the decode seconds."""
    method, *variants = method.split("-")
    patches, kw = [tree_patch(v) for v in variants], {"method": method}
    if method != "ar":
        kw["drafter"] = case_drafter(tgt, name, args)
        if method.startswith("ddtree"):
            kw |= {"method": "ddtree", "tree_budget": int(method[6:])}
    prompts = case_prompts(tgt, B, args)
    box = {}

    def run():
        with ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            out = kdj.generate(tgt, prompts, max_new_tokens=args.steps + 1, stop_tokens=[], **kw)
        box["steps"] = out.stats["steps"]
        return out.stats["decode_s"]

    tgt.executables.clear()  # the decode loop traces and compiles again, with this case's
    jax.clear_caches()  # tree build (both: the programs and JAX's trace cache)
    return run, box, args.module


def step_case(tgt, B: int, args):
    """(run, steps, module) of one target forward step queued `args.steps` times."""
    cfg, ctx = tgt.cfg, args.context
    tokens = jnp.asarray(np.random.default_rng(B).integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    start = jnp.full((B,), ctx, jnp.int32)
    forward = harness.forward_step(tgt.model)

    def run():
        box = [harness.filled_cache(cfg, B, ctx + 1, ctx, tgt.dtype)]
        jax.block_until_ready(box[0])
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logits, box[0] = forward(tokens, start, box[0])
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    return run, {"steps": args.steps}, None


def moe_case(name: str, B: int, T: int, args):
    """(run, steps, module) of the first MoE layer of a 2-layer slice of config `name` alone
    on B * T random tokens (what roofline.py --moe-shapes times), queued `args.steps` times."""
    tgt = harness.random_target(name, 2, args.dtype)
    moes = harness.moe_layers(tgt.model)
    if not moes:
        raise ValueError(f"{name} has no MoE layer in its first two layers")
    forward = harness.jit_over_params(moes[0], lambda m, x: m(x))
    x = jax.random.normal(jax.random.key(B * 1000 + T), (B, T, tgt.cfg.hidden_size), tgt.dtype)

    def run():
        t0 = time.perf_counter()
        for _ in range(args.steps):
            y = forward(x)
        jax.block_until_ready(y)
        return time.perf_counter() - t0

    return run, {"steps": args.steps}, None


GENERATE = re.compile(r"ar|dflash|ddtree\d+(-allpairs)?(-laxtop|-pruned)?|auto")


def profile_case(spec: str, args, targets: dict, trace_root: Path) -> dict:
    parts = spec.rsplit(":", 3) if spec.count(":") >= 3 else [*spec.rsplit(":", 2), "default"]
    name, batch, what, kernels = parts
    if kernels not in harness.KERNEL_CASES:
        raise ValueError(f"{spec}: kernel case {kernels!r} is not one of "
                         f"{sorted(harness.KERNEL_CASES)}")  # fmt: skip
    B, moe = int(batch), re.fullmatch(r"moe-(\d+)", what)
    if moe:
        targets.clear()
        run, steps, module = moe_case(name, B, int(moe[1]), args)
    elif GENERATE.fullmatch(what) or what == "step":
        if name not in targets:
            targets.clear()  # one model in memory at a time
            targets[name] = harness.load(name, dtype=args.dtype)[0]
        tgt = harness.with_kernels(targets[name], kernels)
        if GENERATE.fullmatch(what):
            run, steps, module = generate_case(tgt, name, B, what, args)
        else:
            run, steps, module = step_case(tgt, B, args)
    else:
        raise ValueError(f"{spec}: WHAT must be ar, dflash, ddtree<budget>, auto, step or moe-T")
    return traced(spec, run, steps, module, trace_root) | {
        "model": name, "batch": B, "method": what, "kernel_case": kernels, "context": args.context,
    }  # fmt: skip


def traced(spec: str, run, steps: dict, module, trace_root: Path) -> dict:
    """Run a case three times (compile, time, trace) and summarise its trace."""
    trace_dir, seconds = trace_root / re.sub(r"[^\w.-]+", "_", spec), []
    trace = jax.profiler.trace(str(trace_dir), create_perfetto_trace=True)
    for scope in (nullcontext(), nullcontext(), trace):  # compile, time, trace
        with scope:
            seconds.append(run())
    n = steps["steps"]
    summary = summarise(read_events(trace_dir), seconds[2], n, module)
    return {"case": spec, "steps": n, "compile_s": seconds[0],
            "wall_ms_per_step": seconds[1] * 1e3 / n, **summary,
            "trace_dir": str(trace_dir)}  # fmt: skip


def report(r: dict, top: int) -> None:
    print(f"=== {r['case']}: {r['wall_ms_per_step']:.3f} ms/step untraced, "
          f"{r['traced_wall_ms_per_step']:.3f} traced, device busy {r['busy_ms_per_step']:.3f}, "
          f"{r['kernels_per_step']:.0f} kernels/step")  # fmt: skip
    print("  ".join(f"{c} {v['us_per_step']:.1f} us" for c, v in r["categories"].items()))
    for k in r["kernels"][:top]:
        print(f"  {k['us_per_step']:9.1f} us/step {k['count'] / r['steps']:6.1f}x "
              f"{100 * k['share_of_wall']:5.1f}%  {k['category']:<18} "
              f"{k['name'][:80]}")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="profile_step", description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", required=True, help="MODEL:BATCH:WHAT[:KERNELS] ...")
    p.add_argument("--context", type=int, default=512, help="tokens in the cache per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps traced per case")
    p.add_argument("--module", default="decode", help="regex of the decode loop's HLO module")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", help="a drafter kdj.load_drafter takes (default: random)")
    p.add_argument("--prompts", help="eval_prompts.json: held-out chat prompts (real target)")
    p.add_argument("--top", type=int, default=25, help="kernels printed per case")
    p.add_argument("--out", help="JSON path")
    p.add_argument("--trace-dir", help="where the raw traces go (default: a temporary dir)")
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    args.real_drafter = kdj.load_drafter(args.drafter, dtype=args.dtype) if args.drafter else None
    result = {"cases": []}
    trace_root = Path(args.trace_dir or tempfile.mkdtemp(prefix="kdj_profile_"))
    targets: dict = {}
    for spec in args.cases:
        try:
            r = profile_case(spec, args, targets, trace_root)
            report(r, args.top)
        except Exception as e:  # one GPU call runs every case: record why, go on
            traceback.print_exc()
            r = {"case": spec, "error": f"{type(e).__name__}: {e}"}
        result["cases"].append(r)
        harness.write_result(args.out, dict(result), argv)
    return harness.write_result(args.out, result, argv)


if __name__ == "__main__":
    main()
