"""Deterministic mode's fixed-tile matmuls at a model's shapes: which tiles keep a batch-1
decode cheap, and what they cost a large verify.

Deterministic mode (KernelPolicy.fixed_tiles) runs every dense matmul on kdj's grouped Pallas
kernel with one tile configuration for every row count, so a row's sums run in one order in
a decode and in a verify. At one row a [K, F] weight gets ceil(F / block_f) programs: five
for a 576-wide projection, on a GPU of 132 SMs. For each dense matrix of a decode step and
each --tiles candidate (block_m,block_k,block_f,num_warps) this times x[:M] @ W at --rows M
(a jitted loop, the input changing every call) beside the default mode's path for that M
(layers.matmul under the GPU policy: the Pallas GEMV at one row in its size range, XLA's dot
otherwise), and checks that the candidate gives rows 0..15 the same bits at every M as at
M = 16. "step_us" sums a decode step's matrices (each layer's, and the head once).

    python bench/fixed_tiles.py --model smollm2-135m --out $OUT/fixed_tiles.json
"""

from __future__ import annotations

import argparse
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
from dense_gemv import seconds_per_call
from dense_gemv import shapes as dense_shapes
from row_invariance import differing

from kdj.config import ModelConfig
from kdj.kernels import KernelPolicy
from kdj.models import layers

TODAY = "64,64,128,4"  # KernelPolicy.FIXED_TILES


def step_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """{name: (K, F, times per decode step)}: a dense GQA model's fused QKV, o, fused
    gate/up, down (once a layer) and the head; other families the matrices of
    dense_gemv.shapes, once each."""
    if cfg.kv_lora_rank or cfg.n_routed_experts:
        return {n: (K, F, 1) for n, (K, F) in dense_shapes(cfg).items()}
    D, L, hd = cfg.hidden_size, cfg.num_layers, cfg.head_dim or cfg.hidden_size // cfg.num_heads
    return {
        "qkv": (D, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, L),
        "o": (cfg.num_heads * hd, D, L),
        "gate_up": (D, 2 * cfg.intermediate_size, L),
        "down": (cfg.intermediate_size, D, L),
        "lm_head": (D, cfg.vocab_size, 1),
    }


def tiles_of(text: str) -> dict:
    bm, bk, bf, warps = (int(v) for v in text.split(","))
    return dict(block_m=bm, block_k=bk, block_f=bf, num_warps=warps)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="configs/models name or YAML")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 17, 136, 1088, 4352])
    p.add_argument("--tiles", nargs="+", default=[TODAY, "64,64,64,4", "64,64,32,4",
                   "16,64,32,4", "16,64,64,4", "32,64,32,2"])  # fmt: skip
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", required=True)
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    cfg = harness.model_config(args.model)
    gpu = KernelPolicy.default("gpu")
    key = jax.random.key(0)
    rows, steps = [], {}
    variants = {"default": None} | {f"tiles {t}": tiles_of(t) for t in args.tiles}
    for name, (K, F, times) in step_shapes(cfg).items():
        w = (jax.random.normal(key, (K, F), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.fold_in(key, K), (max(args.rows + [16]), K), jnp.bfloat16)
        for variant, tiles in variants.items():
            if tiles is None:
                fn = lambda x, w: layers.matmul(x, w, gpu)  # noqa: E731
            else:
                fn = lambda x, w, t=tiles: layers.fixed_tile_matmul(x, w, t)  # noqa: E731
            base = {"matrix": name, "K": K, "F": F, "variant": variant}
            try:
                # the worst M: rows 0..15's share of bits that differ from M = 16's
                same = None if tiles is None else max(differing(fn, x, w, args.rows).values())
            except Exception as e:  # noqa: BLE001 - a tile set that fails to lower is a result
                rows.append(base | {"error": repr(e)[:300]})
                continue
            for M in args.rows:
                row = base | {"M": M, "bits_differ": same}
                if tiles is not None:
                    row["programs"] = -(-F // tiles["block_f"]) * -(-M // tiles["block_m"])
                row["us"] = seconds_per_call(fn, x[:M], w, args.iters) * 1e6
                steps.setdefault(variant, {}).setdefault(M, 0.0)
                steps[variant][M] += times * row["us"]
                rows.append(row)
                print(row, flush=True)
            result = {"meta": {"model": args.model}, "rows": rows, "step_us": steps}
            harness.write_result(args.out, result, argv)
    for variant, by_m in steps.items():
        print(f"{variant:22s} " + "  ".join(f"M={m}: {us:9.1f} us" for m, us in by_m.items()))
    return {"rows": rows, "step_us": steps}


if __name__ == "__main__":
    main()
