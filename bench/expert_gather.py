"""Routed-expert compute for a handful of tokens: does it stream the touched experts' weights
at bandwidth? One MoE layer's experts at a model's shape (random weights), per expert format.

A decode step at small batch routes each token to k experts, and kdj reads only those
experts (kdj.models.deepseek.expert_swiglu_gathered, through ExpertWeight.matvec). Variants:

    kernel   the gathered path under the backend's kernel policy (kdj/pallas/expert_gemv.py's
             GEMV on a GPU; XLA's gather + matvec elsewhere: rows record the backend)
    ragged   jax.lax.ragged_dot over all experts (XLA's grouped GEMM: the CPU path)
    grouped  the Pallas grouped kernel (kdj/pallas/expert_grouped.py), the layer's path for
             many tokens on the GPU: each touched expert read once per block of its rows

Each variant's output is also compared with ragged_dot's (rel_err: max abs difference / max
abs value). With --tiles, the GEMV kernel alone on the gate/up matrix [E, D, 2I] for each
setting "block_k,block_f,num_warps,num_stages" (block_k counts words for int4) and an optional
fifth field, the K slices (expert_gemv's splits; default 1); with
--grouped-tiles, the grouped kernel alone, "block_m,block_k,block_f,num_warps,num_stages" and
an optional sixth field, cols_first (1: the grid launches the column tiles first).

    python bench/expert_gather.py --model moonlight-16b-a3b --assignments 6 96 \\
        --formats float int4 --out r.json

Each case runs `--iters` times inside one jitted fori_loop (no dispatch in the timing), with
the expert ids shifted every call (loop-invariant ids would let XLA hoist the gather out of
the loop). Reported: us per call, the bytes of the distinct experts touched as stored (weights
+ scales), and achieved TB/s.
"""

from __future__ import annotations

import argparse
import functools
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.models.deepseek import (
    ExpertWeight,
    MoE,
    expert_swiglu,
    expert_swiglu_gathered,
    expert_swiglu_grouped,
)
from kdj.pallas import expert_gemv, expert_grouped

VARIANTS = {
    "kernel": functools.partial(expert_swiglu_gathered, **harness.expert_kernels()),
    "ragged": expert_swiglu,
    "grouped": expert_swiglu_grouped,
}


def routed_experts(cfg, fmt: str) -> list[ExpertWeight]:
    """[gate_up, down] of one MoE layer of this shape (random, the same for every format),
    kept in fmt as the model keeps them."""
    moe = MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if fmt != "float":
        moe.quantize(fmt)
    return list(moe.experts())


def stored_bytes(w: ExpertWeight, experts: int) -> int:
    """Bytes of `experts` experts of w as held in HBM (weights + scales)."""
    per = w.value[0].nbytes + (0 if w.scale is None else w.scale[0].nbytes)
    return experts * per


def seconds_per_call(fn, x, iters: int, *operands) -> float:
    """fn(x, ids_shift, *operands) -> like x, chained `iters` times in one jitted loop."""
    body = lambda i, x, *ops: x + 1e-3 * fn(x, i, *ops).astype(x.dtype)  # noqa: E731
    return harness.looped(body, x, iters, *operands)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--assignments", nargs="+", type=int, default=[6, 96])
    p.add_argument("--formats", nargs="+", default=["float"], choices=expert_gemv.FORMATS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--tiles", nargs="*", default=[], help="kernel tile settings to sweep: "
                   "block_k,block_f,num_warps,num_stages[,splits]")  # fmt: skip
    p.add_argument("--grouped-tiles", nargs="*", default=[], help="grouped kernel tile "
                   "settings to sweep: block_m,block_k,block_f,num_warps,num_stages"
                   "[,cols_first]")  # fmt: skip
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    return p


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    cfg = harness.model_config(args.model)
    E, D, I, k = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                  cfg.num_experts_per_tok)  # fmt: skip
    keys = jax.random.split(jax.random.key(0), 4)
    meta = {"model": args.model, "E": E, "D": D, "I": I, "k": k}
    rows = []

    def record(row):
        rows.append(row)
        print(row, flush=True)
        harness.write_result(args.out, {"meta": meta, "rows": rows}, argv)

    for fmt in args.formats:
        experts = routed_experts(cfg, fmt)
        for A in args.assignments:
            for row in case(experts, fmt, A, k, keys, args):
                record(row)
    return rows


def case(experts, fmt: str, A: int, k: int, keys, args):
    """Rows for A assignments (A // k tokens, k distinct experts each) in one format."""
    wgu = experts[0]
    E, D = wgu.value.shape[0], wd_width(experts)
    N = max(1, A // k)
    rng = np.random.default_rng(A)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    x = jax.random.normal(keys[2], (N, D), jnp.bfloat16)
    weights = jax.nn.softmax(jax.random.normal(keys[3], (N, k)), axis=-1)
    touched = len(np.unique(np.asarray(idx)))
    base = {"format": fmt, "assignments": N * k, "touched": touched,
            "backend": jax.default_backend()}  # fmt: skip

    def timed(name, nbytes, fn, *operands, check=None):
        row = {**base, "variant": name, "bytes": nbytes}
        try:
            s = seconds_per_call(fn, x, args.iters, *operands)
            row |= {"us": s * 1e6, "TBps": nbytes / s / 1e12}
        except Exception as e:  # noqa: BLE001 - a variant that fails to lower is a result
            return {**row, "error": repr(e)[:300]}
        if check is not None:  # max |y - ragged_dot's y| / max |ragged_dot's y|
            try:
                y = np.asarray(jax.jit(check)(x, weights, idx, *experts), np.float32)
                row["rel_err"] = float(np.abs(y - ref).max() / np.abs(ref).max())
            except Exception as e:  # noqa: BLE001 - keep the timing, say why there is no check
                row["check_error"] = repr(e)[:300]
        return row

    # the XLA ragged_dot path (dequantised weights) is every variant's numerical reference
    ref = np.asarray(jax.jit(expert_swiglu)(x, weights, idx, *experts), np.float32)
    nbytes = sum(stored_bytes(w, touched) for w in experts)
    for name in args.variants:
        fn = VARIANTS[name]
        yield timed(name, nbytes, lambda x, i, w, gu, d, fn=fn: fn(x, w, (idx + i) % E, gu, d),
                    weights, *experts, check=fn)  # fmt: skip
    # each kernel alone on gate/up [E, D, 2I], per tile setting: bytes are gate/up's share
    value, scale = wgu.matrix()
    xs, flat = jnp.repeat(x, k, axis=0), idx.reshape(-1)
    sweeps = [("gemv", expert_gemv.expert_gemv, ("block_k", "block_f"), args.tiles),
              ("grouped", expert_grouped.expert_grouped, ("block_m", "block_k", "block_f"),
               args.grouped_tiles)]  # fmt: skip
    for name, kernel, blocks, settings in sweeps:
        for tiles in settings:
            opts = dict(zip((*blocks, "num_warps", "num_stages"), map(int, tiles.split(","))))
            if name == "grouped" and tiles.count(",") == 5:  # a sixth field: the grid order
                opts["cols_first"] = bool(int(tiles.rsplit(",", 1)[1]))
            if name == "gemv" and tiles.count(",") == 4:  # a fifth field: K slices
                opts["splits"] = int(tiles.rsplit(",", 1)[1])

            def alone(x, i, v, s, kernel=kernel, opts=opts):
                y = kernel(xs, (flat + i) % E, v, s, fmt, **opts)
                return y[::k].mean(axis=1, keepdims=True)  # [N, 1]: broadcasts to x

            yield timed(f"{name}_gate_up[{tiles}]", stored_bytes(wgu, touched), alone,
                        value, scale)  # fmt: skip


def wd_width(experts) -> int:
    """The model width D: the down projection's output columns."""
    return experts[1].value.shape[-1]


if __name__ == "__main__":
    main()
