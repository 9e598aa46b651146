"""One-row projections at a model's shapes: XLA's dot against the Pallas GEMV split over K.

A batch-1 decode step multiplies one row by every dense weight matrix (attention
projections, shared experts, a dense MLP, the head). kdj.models.layers.matmul sends those in
its kernel policy's size range through the Pallas GEMV (kdj/pallas/expert_gemv.py), split
over K into `expert_gemv.splits` slices so that a one-row grid still fills the GPU. This script
times, per matrix [K, F] of the model (random bf16 weights):

    xla      jnp.tensordot(x, w): what XLA makes of a one-row dot
    gemv     layers.matmul's kernel path, with its split
    gemv/s   the kernel with s K slices (--splits), to check the split rule

Reported: us per call (a jitted loop of --iters calls, the input changing every call), and
TB/s on the matrix's bytes.

    python bench/dense_gemv.py --model moonlight-16b-a3b --splits 1 4 16 --out r.json
"""

from __future__ import annotations

import argparse
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

from kdj.config import ModelConfig
from kdj.pallas import expert_gemv


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The dense [K, F] matrices of one decode step, by name (one of each kind)."""
    D, H = cfg.hidden_size, cfg.num_heads
    out = {}
    if cfg.kv_lora_rank:  # MLA
        qk = H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if cfg.q_lora_rank:
            out |= {"q_a": (D, cfg.q_lora_rank), "q_b": (cfg.q_lora_rank, qk)}
        else:
            out["q_proj"] = (D, qk)
        out["kv_a"] = (D, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        out["o"] = (H * cfg.v_head_dim, D)
    else:
        hd = cfg.head_dim or D // H
        out |= {"q": (D, H * hd), "k": (D, cfg.num_kv_heads * hd), "o": (H * hd, D)}
    if cfg.n_shared_experts:
        Is = cfg.moe_intermediate_size * cfg.n_shared_experts
        out |= {"shared_gate_up": (D, 2 * Is), "shared_down": (Is, D)}
    out |= {"mlp_gate_up": (D, 2 * cfg.intermediate_size), "mlp_down": (cfg.intermediate_size, D)}
    out["lm_head"] = (D, cfg.vocab_size)
    return out


def gemv(x, w, s: int):
    """The kernel with s K slices (layers.matmul's kernel path with its split replaced)."""
    if w.shape[0] % s:
        raise ValueError(f"{s} K slices do not divide K = {w.shape[0]}")
    K, F = w.shape
    y = expert_gemv.expert_gemv(x.reshape(1, K), np.zeros(1, np.int32), w[None], splits=s)
    return y.astype(x.dtype)


def seconds_per_call(fn, x, w, iters: int) -> float:
    """fn(x [1, K], w) -> [1, F], chained `iters` times in one jitted loop."""
    body = lambda i, x, w: x + 1e-3 * fn(x, w).mean().astype(x.dtype)  # noqa: E731
    return harness.looped(body, x, iters, w)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--splits", nargs="*", type=int, default=[1], help="extra K splits to time")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--out")
    return p


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    cfg = harness.model_config(args.model)
    rows = []
    key = jax.random.key(0)
    for name, (K, F) in shapes(cfg).items():
        w = (jax.random.normal(key, (K, F), jnp.float32) * K**-0.5).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.fold_in(key, 1), (1, K), jnp.bfloat16)
        rule = expert_gemv.splits(1, "float", K, F)
        variants = {"xla": lambda x, w: jnp.tensordot(x, w, axes=1),
                    "gemv": lambda x, w, s=rule: gemv(x, w, s)}  # fmt: skip
        for s in args.splits:
            if s != rule:  # a split that does not divide K is a row saying so
                variants[f"gemv/{s}"] = lambda x, w, s=s: gemv(x, w, s)
        ref = jnp.tensordot(x.astype(jnp.float32), w.astype(jnp.float32), axes=1)
        for variant, fn in variants.items():
            row = {"matrix": name, "K": K, "F": F, "variant": variant, "bytes": w.nbytes,
                   "splits": rule if variant == "gemv" else None}  # fmt: skip
            try:
                sec = seconds_per_call(fn, x, w, args.iters)
                y = jax.jit(fn)(x, w).astype(jnp.float32)
                err = float(jnp.abs(y - ref).max() / jnp.abs(ref).max())
                row |= {"us": sec * 1e6, "TBps": w.nbytes / sec / 1e12, "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a variant that fails to lower is a result
                row["error"] = repr(e)[:300]
            rows.append(row)
            print(row, flush=True)
            harness.write_result(args.out, {"meta": {"model": args.model}, "rows": rows}, argv)
    return rows


if __name__ == "__main__":
    main()
