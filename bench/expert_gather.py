"""Routed-expert compute for a handful of tokens: which formulation streams the touched experts'
weights at bandwidth? One MoE layer's experts at a model's shape (random bf16 weights).

A decode step at batch 1 routes each token to k experts; kdj gathers those experts' weights
(kdj.models.deepseek.expert_swiglu_gathered). A profile of the Moonlight shape on the H200 put
that gather at 237 us per layer for 6 experts (~0.3 TB/s) and the down projection's gather at
22 us (~1.5 TB/s). The variants here differ only in how the weights are addressed:

    gathered    kdj's current path: w[idx] gathers [A, D, 2, I] and [A, I, D], then einsums
    unpinned    the same without the optimisation barrier after the gather
    flat        gate_up viewed as [E, D * 2I] rows before the gather (one contiguous row each)
    sliced      one dynamic slice + matvec per assignment (A static; XLA can feed a slice of
                the stacked weights to the GEMM by address, without a copy)
    ragged      jax.lax.ragged_dot over all E experts (the grouped-GEMM path)

    python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 96 --out r.json

Each variant runs `--iters` times inside one jitted fori_loop (no dispatch in the timing),
with the expert ids shifted every call (loop-invariant ids would let XLA hoist the gather out
of the loop; the runs of 2026-11-29 in BENCHMARKS.md predate this and kept the ids fixed);
reported: us per call, the bytes of the distinct experts touched, and achieved TB/s.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdj.config import ModelConfig, load_yaml
from kdj.models.deepseek import expert_swiglu, expert_swiglu_gathered


def unpinned(x, weights, idx, w_gate_up, w_down):
    """gathered without the optimisation barrier kdj puts after the gather (which stops XLA
    from fusing the gather into its consumer)."""
    N, k = idx.shape
    flat = idx.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)
    h = jnp.einsum("nd,ndci->nci", xs, w_gate_up[flat])
    h = jax.nn.silu(h[:, 0]) * h[:, 1]
    y = jnp.einsum("ni,nid->nd", h.astype(x.dtype), w_down[flat])
    return (y.reshape(N, k, -1) * weights[..., None].astype(y.dtype)).sum(1).astype(x.dtype)


def flat_gathered(x, weights, idx, w_gate_up, w_down):
    """gathered, with gate_up rows [E, D * 2 * I] so each gathered expert is one row."""
    N, k = idx.shape
    E, D, _, I = w_gate_up.shape
    flat = idx.reshape(-1)
    gu = w_gate_up.reshape(E, D * 2 * I)[flat].reshape(-1, D, 2, I)
    xs = jnp.repeat(x, k, axis=0)
    h = jnp.einsum("nd,ndci->nci", xs, gu)
    h = jax.nn.silu(h[:, 0]) * h[:, 1]
    y = jnp.einsum("ni,nid->nd", h.astype(x.dtype), w_down[flat])
    return (y.reshape(N, k, -1) * weights[..., None].astype(y.dtype)).sum(1).astype(x.dtype)


def sliced(x, weights, idx, w_gate_up, w_down):
    """One dynamic slice of each stacked weight per assignment (A is static and small)."""
    N, k = idx.shape
    out = jnp.zeros_like(x, dtype=jnp.float32)
    for t in range(N):
        for j in range(k):
            e = idx[t, j]
            gu = jax.lax.dynamic_index_in_dim(w_gate_up, e, keepdims=False)  # [D, 2, I]
            h = jnp.einsum("d,dci->ci", x[t], gu, preferred_element_type=jnp.float32)
            h = (jax.nn.silu(h[0]) * h[1]).astype(x.dtype)
            wd = jax.lax.dynamic_index_in_dim(w_down, e, keepdims=False)  # [I, D]
            y = jnp.dot(h, wd, preferred_element_type=jnp.float32)
            out = out.at[t].add(weights[t, j] * y)
    return out.astype(x.dtype)


VARIANTS = {
    "gathered": expert_swiglu_gathered,
    "unpinned": unpinned,
    "flat": flat_gathered,
    "sliced": sliced,
    "ragged": expert_swiglu,
}


def time_variant(fn, x, weights, idx, wgu, wd, iters: int) -> float:
    """Seconds per call, from `iters` calls chained in one jitted loop."""

    E = wgu.shape[0]

    @jax.jit
    def loop(x, weights, idx, wgu, wd):
        def body(i, x):
            # other experts every call: loop-invariant ids would let XLA hoist the gather
            return x + 1e-3 * fn(x, weights, (idx + i) % E, wgu, wd)

        return jax.lax.fori_loop(0, iters, body, x)

    jax.block_until_ready(loop(x, weights, idx, wgu, wd))  # compile + warm
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, weights, idx, wgu, wd))
    return (time.perf_counter() - t0) / iters


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--assignments", nargs="+", type=int, default=[6, 96])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from pathlib import Path

    path = Path(args.model)
    if not path.exists():
        path = Path(__file__).resolve().parent.parent / "configs" / "models" / f"{args.model}.yaml"
    cfg = ModelConfig.from_hf(load_yaml(path))
    E, D, I, k = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                  cfg.num_experts_per_tok)  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 4)
    wgu = (jax.random.normal(keys[0], (E, D, 2, I), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wd = (jax.random.normal(keys[1], (E, I, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    rows = []
    for A in args.assignments:
        N = max(1, A // k)
        rng = np.random.default_rng(A)
        idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
        x = jax.random.normal(keys[2], (N, D), jnp.bfloat16)
        weights = jax.nn.softmax(jax.random.normal(keys[3], (N, k)), axis=-1)
        touched = len(np.unique(np.asarray(idx)))
        nbytes = touched * 3 * D * I * 2
        for name in args.variants:
            if name == "sliced" and N * k > 32:
                continue  # unrolled per assignment: only for a handful
            try:
                s = time_variant(VARIANTS[name], x, weights, idx, wgu, wd, args.iters)
                row = {"assignments": N * k, "touched": touched, "variant": name,
                       "us": s * 1e6, "TBps": nbytes / s / 1e12}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a variant that fails to lower is a result
                row = {"assignments": N * k, "variant": name, "error": repr(e)[:300]}
            rows.append(row)
            print(row, flush=True)
            if args.out:
                meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                        "model": args.model, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
                Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
