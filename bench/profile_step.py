"""Where a decode step's time goes: a profiler trace per case, summed per device kernel.

    python bench/profile_step.py --cases moonlight-16b-a3b:1:ar smollm2-135m-instruct:1:ar \
        smollm2-135m-instruct:1:step smollm2-135m-instruct:1:step-static --out $OUT/prof.json

A case is MODEL:BATCH:METHOD. MODEL: a configs/models name or YAML path (random weights) or
what kdj.load_target takes. METHOD: "ar", kdj's on-device decode loop (what
kdj.generate(method="ar") runs), --steps steps after an untraced prefill of --context random
tokens; "step", the one-step forward bench/roofline.py times, --steps calls queued back to
back; "step-static", that step jitted with the graphdef static and synced after every call
(roofline.py's old timing); "auto-skip", method="auto"'s decode loop with a random 4-layer
block-16 drafter and no probe (every step skips the drafter: the plain path the controller
takes where drafting does not pay), to set against "ar"; "auto-first", the same loop but its
first step drafts (no prior, as when the drafter's calibration promised a win), as real runs at
small batch do; "ar-xla-dense", "ar" with every dense projection left to XLA's dot
(kdj.models.layers.matmul's and head_matmul's one-row Pallas GEMVs switched off), to set
against "ar"; "ar-xla-heads", only head_matmul's (MLA's absorbed projections) switched off;
"ar-xla-small", matmul's GEMV only from 2M weights (its floor before MLA's kv_a and the router
moved to it); "ar-xla-latent", MLA's decode attention on XLA's form below 16K of cache capacity
(the rule before the latent kernel took decode at any capacity); "ar-latent-split8", that
kernel's decode slot splits at least 8 K blocks long (the rule before: now 1);
"ar-gemv-programs-512" / "ar-gemv-programs-1024", the one-row GEMVs split over K to fill 512
(the rule before) / 1024 programs (expert_gemv.PROGRAMS: 256); "moe-T", the first MoE layer of
a 2-layer slice alone on BATCH x T random tokens (roofline.py --moe-shapes' case). A case runs
to compile, timed, then under jax.profiler.trace. Device events (GPU: kernels on the
/device:GPU streams; CPU: XLA thunks on tf_XLA* threads) are summed by name and category, with
busy time and kernels per step and the heaviest Python frames; JSON is saved after each case.
Traced, XLA may run command buffers (CUDA graphs) kernel by kernel: compare wall_ms_per_step.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from roofline import CONFIGS, build, filled_cache, make_forward, model_config, moe_forward  # bench/

import kdj
from kdj.cache import init_cache
from kdj.decode import autoregressive as ar
from kdj.decode import speculative
from kdj.models import layers
from kdj.models.deepseek import MoE
from kdj.models.transformer import build_model
from kdj.pallas import expert_gemv, tree_attention

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


def summarise(events, traced_s: float, steps: int) -> dict:
    kernels = device_events(events)
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
def ar_case(target, B, context, steps, rng):
    """(prepare, run): prepare() prefills a fresh cache; run(prefilled) decodes `steps` steps."""
    g, s, cfg = target.graphdef, target.state, target.cfg
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, context)), jnp.int32)
    lens = jnp.full((B,), context, jnp.int32)
    stop, max_new = jnp.full((B, 1), -1, jnp.int32), jnp.full((B,), steps + 1, jnp.int32)
    key, temp, top_p = jax.random.key(0), jnp.float32(1e-6), jnp.float32(1.0)

    def prepare():
        cache = init_cache(cfg, B, -(-(context + steps + 1) // 128) * 128, target.dtype)
        pre = ar.prefill_and_sample(g, s, tokens, lens, cache, key, temp, top_p, greedy=True)
        return jax.block_until_ready(pre)

    def run(pre):
        out = ar.decode_loop(g, s, pre[1], pre[0], max_new, stop, key, temp, top_p, greedy=True,
                             max_steps=steps + 1)  # fmt: skip
        assert int(out[2]) == steps, f"the decode loop ran {int(out[2])} steps, not {steps}"

    return prepare, run


def auto_skip_case(target, B, context, steps, rng, first_drafts=False):
    """(prepare, run) of method="auto"'s loop whose every step skips the drafter: a random
    4-layer, block-16 drafter at the target's width, the default menu, a prior of 1 token per
    step and a draft pass priced at 1 s, so the first probe is PROBE_MAX steps away. With
    first_drafts, no prior: the first step drafts, then the same (the loop may then take
    fewer steps than asked; times are still per asked step)."""
    import dataclasses

    from kdj.cost import StepCost
    from kdj.train.config import DrafterShape
    from kdj.train.loop import drafter_config_for

    cfg = target.cfg
    n = min(4, cfg.num_layers)
    ids = None if cfg.num_layers > 4 else list(range(n))  # a tiny test target: its layers
    shape = DrafterShape(num_layers=n, block_size=16, mask_token_id=0, target_layer_ids=ids)
    dcfg = drafter_config_for(cfg, shape)
    drafter = kdj.Drafter.from_model(kdj.models.drafter.build_drafter(dcfg, target.dtype))
    n_params = sum(int(x.size) for x in jax.tree.leaves(drafter.state))
    cost = StepCost.for_config(cfg).with_drafter(dcfg, n_params, cfg)
    cost = dataclasses.replace(cost, draft_fixed_s=1.0)  # never pays, probes PROBE_MAX apart
    shapes = kdj.api._menu("auto", None, 16, None)
    if steps >= speculative.PROBE_MAX:
        raise ValueError(f"auto-skip profiles fewer than {speculative.PROBE_MAX} steps")
    tg, ts, dg, ds = target.graphdef, target.state, drafter.graphdef, drafter.state
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, context)), jnp.int32)
    lens = jnp.full((B,), context, jnp.int32)
    stop, max_new = jnp.full((B, 1), -1, jnp.int32), jnp.full((B,), steps + 1, jnp.int32)
    key, temp, top_p, one = jax.random.key(0), jnp.float32(1e-6), jnp.float32(1.0), jnp.float32(1)
    prior = jnp.float32(0 if first_drafts else 1)  # 0: unknown, so the first step drafts
    capacity = -(-(context + steps + 17) // 128) * 128

    def prepare():
        tcache = init_cache(cfg, B, capacity, target.dtype)
        dcache = init_cache(dcfg.layers, B, capacity, target.dtype)
        pre = speculative.prefill(tg, ts, dg, ds, tokens, lens, tcache, dcache, key, temp, top_p,
                                  greedy=True)  # fmt: skip
        return jax.block_until_ready(pre)

    def run(pre):
        out = speculative.decode_loop(tg, ts, dg, ds, pre[1], pre[2], pre[0], max_new, stop, key,
                                      temp, top_p, one, prior, greedy=True, max_steps=steps + 1,
                                      block_size=16, shapes=shapes, cost=cost)  # fmt: skip
        choices = np.asarray(out[4])[: int(out[6])]
        # a drafted first step may commit several tokens: then fewer steps than asked
        assert int(out[6]) == steps or first_drafts, f"{int(out[6])} steps"
        assert (choices[1:] == len(shapes)).all(), f"a probe drafted: {choices}"
        assert (choices[0] != len(shapes)) == first_drafts, "the first step"

    return prepare, run


def step_case(target, B, context, steps, rng, static: bool):
    cfg, g, s = target.cfg, target.graphdef, target.state
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    start = jnp.full((B,), context, jnp.int32)
    forward = make_forward(g, s)

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
    def static_forward(graphdef, state, tokens, start, cache):  # roofline.py's old step
        return nnx.merge(graphdef, state)(tokens, start, cache)[:2]

    def prepare():
        return [jax.block_until_ready(filled_cache(cfg, B, context + 1, context, target.dtype))]

    def run(box):
        for _ in range(steps):
            if static:  # synced after every call, as roofline.median_time does
                logits, box[0] = static_forward(g, s, tokens, start, box[0])
                jax.block_until_ready(logits)
            else:  # queued back to back, as roofline.chained_time does
                logits, box[0] = forward(tokens, start, box[0])
        jax.block_until_ready(logits)

    return prepare, run


def moe_case(name: str, B: int, T: int, steps: int, dtype):
    """(prepare, run) of the first MoE layer of a 2-layer slice of config `name` alone on B * T
    random tokens (what roofline.py --moe-shapes times), `steps` calls queued back to back."""
    model, _ = build(name, 2, jnp.dtype(dtype))
    moe = next(m for _, m in nnx.iter_modules(model) if isinstance(m, MoE))
    forward = moe_forward(moe)
    x = jax.random.normal(jax.random.key(B * 1000 + T), (B, T, model.cfg.hidden_size), dtype)

    def run(_):
        for _ in range(steps):
            y = forward(x)
        jax.block_until_ready(y)

    return lambda: None, run


def _never(x, w) -> bool:
    return False


# "ar" with kdj's trace-time rules changed: (module, attribute) -> the value for the case
SWITCHES = {
    "ar-xla-dense": {(layers, "uses_gemv"): _never, (layers, "uses_head_gemv"): _never},
    "ar-xla-heads": {(layers, "uses_head_gemv"): _never},
    "ar-xla-small": {(layers, "GEMV_MIN_WEIGHTS"): 1 << 21},
    "ar-xla-latent": {(layers, "LATENT_KERNEL_MIN_DECODE_CAPACITY"): 16384},
    "ar-latent-split8": {(tree_attention, "DECODE_MIN_SPLIT_BLOCKS"): 8},
    "ar-gemv-programs-512": {(expert_gemv, "PROGRAMS"): 512},
    "ar-gemv-programs-1024": {(expert_gemv, "PROGRAMS"): 1024},
}


def profile_case(spec: str, args, targets: dict, trace_root: Path) -> dict:
    name, batch, method = spec.rsplit(":", 2)
    B, steps, ctx = int(batch), args.steps, args.context
    moe_tokens = re.fullmatch(r"moe-(\d+)", method)
    if not moe_tokens and method not in (
        "ar", *SWITCHES, "auto-skip", "auto-first", "step", "step-static",
    ):  # fmt: skip
        methods = ", ".join(["ar", *SWITCHES, "auto-skip", "auto-first", "step", "step-static"])
        raise ValueError(f"{spec}: the method must be one of {methods} or moe-T")
    if moe_tokens:
        targets.clear()
        prepare, run = moe_case(name, B, int(moe_tokens[1]), steps, args.dtype)
        return traced(spec, prepare, run, steps, trace_root) | {
            "model": name, "batch": B, "method": method,
        }  # fmt: skip
    if name not in targets:  # a config (random weights) or anything kdj.load_target takes
        targets.clear()  # one model in memory at a time
        if name.endswith((".yaml", ".yml")) or (CONFIGS / f"{name}.yaml").exists():
            model = build_model(model_config(name), jnp.dtype(args.dtype))
            targets[name] = kdj.Target.from_model(model, name)
        else:
            targets[name] = kdj.load_target(name, dtype=args.dtype)
    target, rng = targets[name], np.random.default_rng(B)
    if method in SWITCHES:  # traced afresh with some of kdj's trace-time rules changed
        rules = SWITCHES[method]
        keep = {rule: getattr(*rule) for rule in rules}
        jax.clear_caches()
        try:
            for (module, attr), value in rules.items():
                setattr(module, attr, value)
            traces = trace_root / method  # its own folder: the "ar" case's may exist
            return profile_case(f"{name}:{batch}:ar", args, targets, traces) | {
                "case": spec,
                "method": method,
            }
        finally:
            for (module, attr), value in keep.items():
                setattr(module, attr, value)
            jax.clear_caches()
    if method == "ar":
        prepare, run = ar_case(target, B, ctx, steps, rng)
    elif method in ("auto-skip", "auto-first"):
        prepare, run = auto_skip_case(target, B, ctx, steps, rng, method == "auto-first")
    else:
        prepare, run = step_case(target, B, ctx, steps, rng, method == "step-static")
    return traced(spec, prepare, run, steps, trace_root) | {
        "model": name, "batch": B, "method": method, "context": ctx,
    }  # fmt: skip


def traced(spec: str, prepare, run, steps: int, trace_root: Path) -> dict:
    """Run a case three times (compile, time, trace) and summarise its trace."""
    trace_dir, seconds = trace_root / re.sub(r"[^\w.-]+", "_", spec), []
    trace = jax.profiler.trace(str(trace_dir), create_perfetto_trace=True)
    for scope in (nullcontext(), nullcontext(), trace):  # compile, time, trace
        pre = prepare()
        with scope:
            t0 = time.perf_counter()
            run(pre)
            seconds.append(time.perf_counter() - t0)
    summary = summarise(read_events(trace_dir), seconds[2], steps)
    return {"case": spec, "steps": steps, "compile_s": seconds[0],
            "wall_ms_per_step": seconds[1] * 1e3 / steps, **summary,
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="profile_step", description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", required=True, help="MODEL:BATCH:METHOD ...")
    p.add_argument("--context", type=int, default=512, help="tokens in the cache per sequence")
    p.add_argument("--steps", type=int, default=32, help="decode steps traced per case")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=25, help="kernels printed per case")
    p.add_argument("--out", help="JSON path")
    p.add_argument("--trace-dir", help="where the raw traces go (default: a temporary dir)")
    args = p.parse_args(argv)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cases": [],
              "date": time.strftime("%Y-%m-%d"), "argv": argv or sys.argv[1:]}  # fmt: skip
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
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
