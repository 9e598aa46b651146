"""The one library of bench/: model and drafter configs, timing with a device sync, kernel
policies for A/B cases, and result files stamped with where they were measured.

Every bench script imports this module (bench/ is the script directory) and nothing else of
bench/. Timing rules, the same in every script:
- jit first, then one warm-up call (compile and first-touch stay out of the timing);
- queue the timed calls back to back and sync once with jax.block_until_ready (what a decode
  loop does), or run them inside one jitted fori_loop (no dispatch at all);
- report seconds per call.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

import kdj
from kdj.cache import init_cache
from kdj.config import ModelConfig, load_yaml
from kdj.models.drafter import DrafterConfig, build_drafter
from kdj.train.config import DrafterShape
from kdj.train.trainer import drafter_config_for

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "models"
DRAFTERS = Path(__file__).resolve().parent / "drafters.yaml"
HBM_BPS = 4.3e12  # practical H200 bandwidth ceiling (a device copy), the fractions' reference


# ------------------------------------------------------------------------------ configs
def model_config(name: str, layers: int | None = None) -> ModelConfig:
    """configs/models/<name>.yaml, or a YAML path; `layers` keeps the first N (a slice)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONFIGS / f"{name}.yaml"
    if not path.exists():
        have = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
        raise FileNotFoundError(f"no model config {path} (configs/models has {have})")
    cfg = ModelConfig.from_hf(load_yaml(path))
    return cfg.replace(num_layers=layers) if layers else cfg


def drafter_config(target: ModelConfig, model: str = "", **shape) -> DrafterConfig:
    """A DFlash drafter config for `target`: the published shape bench/drafters.yaml lists
    for `model` (a configs/models name), else the target's own widths; `shape` overrides
    DrafterShape fields (num_layers, block_size, ...). Feature taps that a shallow target
    (a test's tiny config) cannot give distinctly are its layers, once each."""
    published = yaml.safe_load(DRAFTERS.read_text()).get(Path(model).stem, {})
    fields = {"mask_token_id": target.vocab_size - 1, **published, **shape}
    if "target_layer_ids" not in fields and target.num_layers <= fields.get("num_layers", 4):
        fields["target_layer_ids"] = list(range(target.num_layers))
    return drafter_config_for(target, DrafterShape(**fields))


def random_target(name: str, layers: int | None = None, dtype="bfloat16", mesh=None,
                  seed: int = 0, steady: bool = False) -> kdj.Target:  # fmt: skip
    """A target of config `name` with random weights (speed does not depend on the values,
    except MoE routing, which a random router spreads about uniformly); `steady`: with its
    greedy continuation made robust to numerics (`steady_greedy`)."""
    from kdj.models.transformer import build_model

    model = build_model(model_config(name, layers), jnp.dtype(dtype), seed=seed)
    if steady:
        steady_greedy(model, seed)
    return kdj.Target.from_model(model, name=Path(name).stem, mesh=mesh)


# what a layer's output projections are scaled by in a steady target: small beside the
# embedding in the residual stream, so no routing flip reaches the next token's argmax
STEADY_DAMP = 1e-2


def steady_greedy(model, seed: int = 0) -> None:
    """Make a random model decode one continuation whatever the batch or program (benchmarks
    that replay its greedy answers: a random bf16 MoE's argmax and routing are near-ties that
    every change of batch composition flips, so no recording would replay). Every layer's
    output projections (attention's o, the MLPs' and experts' down) are scaled by
    STEADY_DAMP, so the residual stream stays near the token's embedding, and lm_head's
    column perm[t] is that embedding: after token t the argmax is perm[t] by a wide margin.
    Shapes, bytes, FLOPs and the spread of routing over experts are unchanged."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        names = [str(p) for p in path]
        if names[-2:] in (["o", "kernel"], ["down", "kernel"]) or names[-1] == "w_down":
            var.value = var.value * jnp.asarray(STEADY_DAMP, var.value.dtype)
    embed = flat[("embed",)].value if ("embed",) in flat else None
    head = flat.get(("lm_head", "kernel"))
    if embed is None or head is None:
        raise ValueError("steady_greedy needs an embedding and an untied lm_head")
    perm = np.random.default_rng(seed).permutation(embed.shape[0])
    head.value = jnp.zeros_like(head.value).at[:, perm].set(embed.T.astype(head.value.dtype))
    nnx.update(model, nnx.from_flat_state(flat))


def random_drafter(dcfg: DrafterConfig, dtype="bfloat16", mesh=None, seed: int = 1):
    """A randomly initialised drafter (acceptance ~0: its runs measure step cost)."""
    return kdj.Drafter.from_model(build_drafter(dcfg, jnp.dtype(dtype), seed=seed), mesh=mesh)


def load(name: str, layers: int | None = None, dtype="bfloat16") -> tuple[kdj.Target, str]:
    """(target, "real" | "random"): the real SmolLM2-135M-Instruct for that name, a random
    one of configs/models/<name> otherwise."""
    if name == "smollm2-135m-instruct":
        return kdj.load_target(name, dtype=dtype), "real"
    return random_target(name, layers, dtype), "random"


def random_prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed * 1000 + batch)
    return rng.integers(0, vocab, (batch, length)).tolist()


def param_count(state) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


# ------------------------------------------------------------------------------ kernels
# A/B cases as data: name -> the KernelPolicy fields (kdj/kernels.py) that differ from the
# target's own policy; "xla" is the reference implementation of a kernel family.
KERNEL_CASES: dict[str, dict] = {
    "default": {},
    "xla-dense": {"dense_gemv": "xla", "head_gemv": "xla"},  # XLA's one-row dots
    "xla-heads": {"head_gemv": "xla"},  # MLA's absorbed per-head projections on XLA
    "xla-latent": {"latent_attention": "xla"},  # MLA attention on XLA's form
    "xla-experts": {"expert_gemv": "xla", "expert_grouped": "xla"},  # gather / ragged_dot
    "fused-mlp": {"dense_mlp": "pallas"},  # dense MLP blocks as two fused kernels (opt-in)
    # deterministic mode, then with one of its parts back on XLA: where its cost lies
    "deterministic": {"deterministic": True},
    "det-xla-attention": {"deterministic": True, "attention": "xla"},  # XLA attention at T=1
    "det-xla-dense": {"deterministic": True, "dense_gemv": "xla"},  # XLA GEMMs, no fixed tiles
    "det-xla-both": {"deterministic": True, "attention": "xla", "dense_gemv": "xla"},
    "det-unsplit": {"deterministic": True, "fixed_split_inputs": 1 << 30},  # K never sliced
    "det-packed": {"deterministic": True, "attention_nodes_per_tile": 64},  # nodes share tiles
    "packed-tiles": {"attention_nodes_per_tile": 64},  # the same, where deterministic mode runs
    "graph-conditionals": {"graph_conditionals": True},  # lax.cond / switch in CUDA graphs
}


def with_kernels(tgt: kdj.Target, case: str) -> kdj.Target:
    """The target with kernel case `case` of KERNEL_CASES applied to its kernel policy
    (a frozen KernelPolicy, part of the jit key: nothing else changes kernels)."""
    if case not in KERNEL_CASES:
        raise ValueError(f"unknown kernel case {case!r}; known: {sorted(KERNEL_CASES)}")
    if not KERNEL_CASES[case]:
        return tgt
    return tgt.with_kernels(dataclasses.replace(tgt.cfg.kernels, **KERNEL_CASES[case]))


def expert_kernels() -> dict:
    """Keyword arguments giving kdj's expert functions this backend's kernel policy."""
    from kdj.kernels import KernelPolicy

    return {"kernels": KernelPolicy.default(jax.default_backend())}


def clear_compiled(tgt: kdj.Target) -> None:
    """Drop the target's compiled executables, so that the next call's compile is timed."""
    tgt.executables.clear()


# ------------------------------------------------------------------------------ timing
def chained(call, repeats: int) -> float:
    """Seconds per call of `repeats` calls queued back to back and synchronised once, after
    one warm-up call. A call that takes what the previous one returned (a donated cache)
    runs in order while the host queues the next: device time per call unless dispatching
    takes longer than running it."""
    jax.block_until_ready(call())
    t = time.perf_counter()
    for _ in range(repeats):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / repeats


def looped(body, init, iters: int, *operands) -> float:
    """Seconds per iteration of carry = body(i, carry, *operands) run `iters` times inside one
    jitted fori_loop, after a compile + warm-up run. The operands are arguments, not
    constants folded in; body should change its inputs with i so XLA cannot hoist the work."""

    @jax.jit
    def loop(init, *operands):
        return jax.lax.fori_loop(0, iters, lambda i, c: body(i, c, *operands), init)

    jax.block_until_ready(loop(init, *operands))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(init, *operands))
    return (time.perf_counter() - t0) / iters


def matmul_rate(n: int, repeats: int = 10) -> float:
    """bf16 FLOP/s of an n^3 matmul through jax.jit, calls queued as the steps are."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
    f = jax.jit(lambda a, b: a @ b)
    return 2 * n**3 / chained(lambda: f(a, b), repeats)


def copy_bandwidth(gib: float = 4.0, repeats: int = 10) -> float:
    """Device read+write bytes/s of y = x + 1 over a large bf16 array."""
    x = jnp.ones((int(gib * 2**30 / 2),), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / chained(lambda: f(x), repeats)


def timed_generate(tgt, prompts, repeats: int, **kw) -> tuple[dict, list]:
    """kdj.generate from a fresh compile, then `repeats` timed runs: (stats of the median run
    by decode time with "compile_s" of the first, its tokens). Stop tokens are off so every
    run does the same work."""
    clear_compiled(tgt)
    outs = [kdj.generate(tgt, prompts, stop_tokens=[], **kw) for _ in range(repeats + 1)]
    timed = sorted(outs[1:], key=lambda o: o.stats["decode_s"])
    mid = timed[len(timed) // 2]
    stats = {**mid.stats, "compile_s": outs[0].stats["compile_s"]}
    stats["step_ms"] = 1e3 * stats["decode_s"] / max(stats["steps"], 1)
    return stats, mid.tokens


# ------------------------------------------------------------------------------ one step
def jit_over_params(module, call, **jit_kw):
    """call(module, *args) jitted over the module's flat parameter leaves, the graph
    definition closed over; returns f(*args). (A jit taking the graphdef as a static
    argument hashes the whole graph on every call: host time a step timing would count.)
    jit_kw's argnums count the leaves as 0."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)

    @functools.partial(jax.jit, **jit_kw)
    def run(leaves, *args):
        return call(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), *args)

    return functools.partial(run, leaves)


def forward_step(model):
    """forward(tokens, start, cache) -> (logits, cache, donated) of one target step."""
    return jit_over_params(model, lambda m, *a: m(*a)[:2], donate_argnums=3)


def filled_cache(cfg: ModelConfig, batch: int, capacity: int, context: int, dtype, seed=0):
    """A cache of random entries (never time on zeros) holding `context` tokens each."""
    cache = init_cache(cfg, batch, capacity, dtype)
    keys = jax.random.split(jax.random.key(seed), 2 * cfg.num_layers)
    k = [jax.random.normal(keys[i], x.shape, x.dtype) for i, x in enumerate(cache.k)]
    v = [jax.random.normal(keys[-1 - i], x.shape, x.dtype) for i, x in enumerate(cache.v)]
    return dataclasses.replace(cache, k=k, v=v, lengths=jnp.full((batch,), context, jnp.int32))


def moe_layers(model) -> list:
    from kdj.models.deepseek import MoE

    return [m for _, m in nnx.iter_modules(model) if isinstance(m, MoE)]


# ------------------------------------------------------------------------------ results
def git_sha() -> str:
    """KDJ_GIT_SHA when set (a copy of the tree on a device machine, whose .git, if any, need
    not be the tree's), else the checkout's commit (+ "-dirty" with uncommitted changes)."""
    if os.environ.get("KDJ_GIT_SHA"):
        return os.environ["KDJ_GIT_SHA"]
    try:
        run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True,
                                check=True)  # fmt: skip
        sha = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp(argv: list[str] | None = None) -> dict:
    """Where and how a result was measured."""
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "git_sha": git_sha(), "jax": jax.__version__, "python": platform.python_version(),
        "device": dev.device_kind, "platform": dev.platform, "devices": jax.device_count(),
        "argv": [Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # they change programs, not argv
    }  # fmt: skip


def write_result(path, result: dict, argv: list[str] | None = None) -> dict:
    """Write result + {"meta": stamp(argv)} as JSON at path (folders made); returns it."""
    out = {"meta": {**stamp(argv), **result.pop("meta", {})}, **result}
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
    return out
