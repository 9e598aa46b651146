"""Speculative step time (DFlash chain, DDTree at several budgets) against AR step time, each
one jitted on-device loop, in the same run.

For each target shape and batch size: random prompts of --prompt-len tokens, --new greedy
tokens; AR through kdj.generate(method="ar"), DFlash and DDTree through kdj.generate with a
randomly initialised drafter of the published shape (acceptance is then ~0, so every step
commits one token: what is measured is the cost of one draft + tree + verify + walk step).

    python bench/spec_step.py --models smollm2-135m qwen3-8b --batches 1 16 \
        --budgets 16 64 256 512 --out $OUT/spec_step.json

Drafters: SmolLM2-135M gets a 5-layer Qwen3-style drafter at its width (9/3 heads,
head_dim 64, FFN 1536, block 16); Qwen3-8B gets the Qwen3-8B-DFlash-b16 shape (5 layers,
32/8 heads, head_dim 128, FFN 12288, target layers [1, 9, 17, 25, 33]).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from ar_decode import load  # bench/ is the script directory

import kdj
from kdj.models.drafter import DrafterConfig, build_drafter, default_target_layer_ids

DRAFTERS = {  # published-shape drafters: (layers, heads, kv heads, head_dim, FFN, block)
    "smollm2-135m": (5, 9, 3, 64, 1536, 16),
    "qwen3-8b": (5, 32, 8, 128, 12288, 16),
}
# ANCHORS.md: the published reference loops, per step on the SmolLM2 shape
PUBLISHED_REFERENCE_MS = {"smollm2-135m": 135.0}
PUBLISHED_DDTREE_MS = {"smollm2-135m": (76.0, 84.0)}


def drafter_for(target, name):
    n, H, KVH, hd, ffn, block = DRAFTERS[name]
    t = target.cfg
    lc = t.replace(family="llama", model_type="qwen3", num_layers=n, num_heads=H,
                   num_kv_heads=KVH, head_dim=hd, intermediate_size=ffn, qk_norm=True,
                   qkv_bias=False, o_bias=False, tie_word_embeddings=False)  # fmt: skip
    cfg = DrafterConfig(layers=lc, block_size=block, mask_token_id=t.vocab_size - 1,
                        target_layer_ids=default_target_layer_ids(t.num_layers, n),
                        num_target_layers=t.num_layers)  # fmt: skip
    return kdj.Drafter.from_model(build_drafter(cfg, target.dtype))


def step_ms(target, prompts, args, **kw):
    kdj.api._EXECUTABLES.clear()
    runs = []
    for _ in range(args.repeats + 1):  # the first run compiles
        out = kdj.generate(target, prompts, max_new_tokens=args.new, stop_tokens=[], **kw)
        runs.append(out.stats)
    s = runs[1:]
    return {
        "step_ms": statistics.median(r["decode_s"] / r["steps"] for r in s) * 1e3,
        "steps": s[0]["steps"],
        "mean_acceptance": s[0]["mean_acceptance"],
        "compile_s": runs[0]["compile_s"],
        "prefill_ms": statistics.median(r["prefill_s"] for r in s) * 1e3,
    }


def main():
    import sys

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-8b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 512])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smollm2-gguf")
    p.add_argument("--out")
    args = p.parse_args()
    dev = jax.devices()[0]
    rows = []
    for name in args.models:
        target, weights = load(name, args.smollm2_gguf)
        drafter = drafter_for(target, name)
        for batch in args.batches:
            rng = np.random.default_rng(batch)
            prompts = rng.integers(0, target.cfg.vocab_size, (batch, args.prompt_len)).tolist()
            ar = step_ms(target, prompts, args, method="ar")
            df = step_ms(target, prompts, args, method="dflash", drafter=drafter)
            row = {"model": name, "weights": weights, "batch": batch, "ar": ar, "dflash": df,
                   "ratio": df["step_ms"] / ar["step_ms"], "ddtree": {},
                   "published_reference_step_ms": PUBLISHED_REFERENCE_MS.get(name),
                   "published_ddtree_step_ms": PUBLISHED_DDTREE_MS.get(name)}  # fmt: skip
            print(f"{name:>14} ({weights}) B={batch:<3} AR {ar['step_ms']:7.3f} ms  "
                  f"DFlash b{drafter.cfg.block_size} {df['step_ms']:7.3f} ms  "
                  f"ratio {row['ratio']:.2f}x  (tau {df['mean_acceptance']:.2f})")  # fmt: skip
            for budget in args.budgets:
                dd = step_ms(target, prompts, args, method="ddtree", drafter=drafter,
                             tree_budget=budget)  # fmt: skip
                dd["ratio"] = dd["step_ms"] / ar["step_ms"]
                row["ddtree"][budget] = dd
                print(f"{'':>14} DDTree B={budget:<4} {dd['step_ms']:7.3f} ms  "
                      f"ratio {dd['ratio']:.2f}x")  # fmt: skip
            rows.append(row)
        del target, drafter
    result = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind,
              "jax": jax.__version__, "rows": rows,
              "command": "python bench/spec_step.py " + " ".join(sys.argv[1:])}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    jnp.zeros(1)  # initialise the backend before timing anything
    main()
