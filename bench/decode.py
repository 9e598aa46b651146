"""Decode speed of AR, DFlash and DDTree on random prompts: tokens/s, step time, and for AR the
bytes a step must move against the device's copy bandwidth.

For each model and batch: random prompts of --prompt-len tokens, --new greedy tokens (stop
tokens off) through kdj.generate, median of --repeats runs after a compile run. DFlash and
DDTree use a randomly initialised drafter of the published shape (bench/drafters.yaml), so
acceptance is ~0 and every step commits about one token: what is measured is the cost of one
draft + verify step, given as a ratio to the AR step of the same run.

    python bench/decode.py --models smollm2-135m-instruct qwen3-8b moonlight-16b-a3b \\
        --batches 1 32 --methods ar dflash ddtree16 ddtree64 --out $OUT/decode.json

Models: "smollm2-135m-instruct" (real weights) or a configs/models name (random weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import harness  # bench/ is the script directory
from flax import nnx


def step_bytes(tgt, batch: int, context: int) -> dict:
    """Bytes one AR step must move: weights read once (for MoE only the routed experts that
    `batch` tokens touch, the expected count under uniform routing), plus the KV cache in use."""
    cfg = tgt.cfg
    dense = expert = 0
    for path, var in nnx.to_flat_state(tgt.state):
        nbytes = var.get_value().nbytes
        if path[-1] in ("w_gate_up", "w_down", "gate_up_scale", "down_scale"):
            expert += nbytes
        elif path != ("embed",) or cfg.tie_word_embeddings:  # an untied table is only gathered
            dense += nbytes
    touched = 0.0
    if cfg.n_routed_experts:
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        touched = 1 - (1 - k / E) ** batch  # expected share of experts touched per layer
    per_tok = cfg.latent_dim if cfg.family == "deepseek" else 2 * cfg.num_kv_heads * cfg.head_dim
    kv = cfg.num_layers * batch * context * per_tok * tgt.dtype.itemsize
    total = dense + expert * touched + kv
    return {"dense": dense, "experts": expert * touched, "kv": kv, "total": total}


def method_kwargs(name: str, drafter) -> dict:
    """generate() arguments of a method name: ar, dflash, ddtree<budget>."""
    if name == "ar":
        return {"method": "ar"}
    if name == "dflash":
        return {"method": "dflash", "drafter": drafter}
    if name.startswith("ddtree") and name[6:].isdigit():
        return {"method": "ddtree", "drafter": drafter, "tree_budget": int(name[6:])}
    raise ValueError(f"unknown method {name!r}: ar, dflash or ddtree<budget>")


def run(args) -> dict:
    bandwidth = harness.copy_bandwidth(args.copy_gib)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    result = {"copy_bw_Bps": bandwidth, "rows": []}
    for name in args.models:
        tgt, weights = harness.load(name, dtype=args.dtype)
        drafter = None
        if any(m != "ar" for m in args.methods):
            shape = {"num_layers": args.drafter_layers} if args.drafter_layers else {}
            dcfg = harness.drafter_config(tgt.cfg, name, **shape)
            drafter = harness.random_drafter(dcfg, args.dtype)
        for batch in args.batches:
            prompts = harness.random_prompts(tgt.cfg.vocab_size, batch, args.prompt_len)
            ar_ms = None
            for method in args.methods:
                kw = method_kwargs(method, drafter)
                s, _ = harness.timed_generate(tgt, prompts, args.repeats, max_new_tokens=args.new,
                                              **kw)  # fmt: skip
                row = {"model": name, "weights": weights, "batch": batch, "method": method,
                       "tokens_per_s": s["tokens_per_s"], "step_ms": s["step_ms"],
                       "steps": s["steps"], "tau": s["mean_acceptance"],
                       "compile_s": s["compile_s"], "prefill_ms": 1e3 * s["prefill_s"]}  # fmt: skip
                if method == "ar":
                    ar_ms = s["step_ms"]
                    b = step_bytes(tgt, batch, args.prompt_len + args.new // 2)
                    row |= {
                        "bytes_per_step": b,
                        "floor_ms": 1e3 * b["total"] / bandwidth,
                        "frac_of_copy_bw": b["total"] / (s["step_ms"] / 1e3) / bandwidth,
                    }
                if ar_ms:
                    row["step_vs_ar"] = s["step_ms"] / ar_ms
                result["rows"].append(row)
                harness.write_result(args.out, dict(result), args.argv)
                print(f"{name:>22} ({weights}) B={batch:<4} {method:>10} "
                      f"{row['tokens_per_s']:10.1f} tok/s  step {row['step_ms']:8.3f} ms"
                      f"  x AR {row.get('step_vs_ar', float('nan')):.2f}", flush=True)  # fmt: skip
        del tgt, drafter
    return harness.write_result(args.out, result, args.argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "qwen3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--methods", nargs="+", default=["ar", "dflash", "ddtree16", "ddtree64"],
                   help="ar, dflash, ddtree<budget>; put ar first for the ratios")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drafter-layers", type=int, help="override the published drafter depth")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth probe")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path)
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
