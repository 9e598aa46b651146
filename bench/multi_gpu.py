"""Meshes compared on one multi-GPU host: tensor parallel, expert parallel, and expert parallel
with data-parallel attention, for AR, DFlash and DDTree, with identical greedy tokens.

For N = the number of local devices, the meshes are tp (model=N, rules tp), ep (expert=N,
rules ep) and ep_dp_attn (data=2 x expert=N/2, rules ep_dp_attn). On each mesh, for each
batch: greedy tokens/s and step time of AR, DFlash (chain) and DDTree (--budget) through
kdj.generate with a random drafter of the published shape (so tau ~ 1: step costs, not
speedups), and a per-step split by ablation: one attention sub-layer and one MoE layer timed
alone on the mesh at the verify shape (their difference to the whole step, scaled by layer
counts, is the rest: embedding, head, norms, collectives between layers).
Tokens of every mesh must equal those of the first mesh (greedy, same weights).

    python bench/multi_gpu.py --model moonlight-16b-a3b --batches 1 16 64 256 \\
        --out $OUT/multi_gpu.json          # on a multi-GPU machine (NCCL_NVLS_ENABLE=0)

On CPU with XLA_FLAGS=--xla_force_host_platform_device_count=8 it runs on virtual devices
(tests/test_bench.py runs a tiny config that way).
"""

from __future__ import annotations

import argparse
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp

import kdj
from kdj.sharding import MeshConfig, make_mesh


def meshes(n: int) -> dict[str, MeshConfig]:
    out = {"tp": MeshConfig(model=n, rules="tp"), "ep": MeshConfig(expert=n, rules="ep")}
    if n >= 2 and n % 2 == 0:
        out["ep_dp_attn"] = MeshConfig(data=2, expert=n // 2, rules="ep_dp_attn")
    return out


def layer_split(target, B: int, T: int, repeats: int) -> dict:
    """Seconds of one attention sub-layer and one MoE (or MLP) layer alone, on the mesh."""
    from flax import nnx

    from kdj.cache import init_cache
    from kdj.models.layers import causal_tree
    from kdj.sharding.apply import shard_cache

    model, cfg = target.model, target.cfg
    moe_i = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)), cfg.num_layers - 1)
    block = model.layers[moe_i]
    x = jnp.ones((B, T, cfg.hidden_size), target.dtype)
    cache = shard_cache(init_cache(cfg, B, 1024, target.dtype), target.sharding)
    start = jnp.full((B,), 512, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    gd, st = nnx.split(block)

    @jax.jit
    def attn(st, x, k, v):
        b = nnx.merge(gd, st)
        return b.attn(x, positions, start, causal_tree(B, T), k, v)[0]

    @jax.jit
    def mlp(st, x):
        return nnx.merge(gd, st).mlp(x)

    v0 = cache.v[moe_i] if cache.v else None
    return {
        "attention_s": harness.chained(lambda: attn(st, x, cache.k[moe_i], v0), repeats),
        "moe_or_mlp_s": harness.chained(lambda: mlp(st, x), repeats),
        "layer": moe_i,
    }


def run(args) -> dict:
    n = jax.device_count()
    cfg = harness.model_config(args.model, args.layers)
    dcfg = harness.drafter_config(cfg, args.model, num_layers=args.drafter_layers,
                                  block_size=args.block)  # fmt: skip
    result = {"model": args.model, "layers": cfg.num_layers, "rows": []}
    reference: dict = {}
    for mesh_name, mc in meshes(n).items():
        sharding = make_mesh(mc)
        target = harness.random_target(args.model, args.layers, args.dtype, mesh=sharding)
        drafter = harness.random_drafter(dcfg, args.dtype, mesh=sharding)
        for B in args.batches:
            prompts = harness.random_prompts(cfg.vocab_size, B, args.prompt_len)
            row = {"mesh": mesh_name, "axes": dict(sharding.mesh.shape), "batch": B}
            methods = {"ar": {}, "dflash": {"drafter": drafter},
                       "ddtree": {"drafter": drafter, "tree_budget": args.budget}}  # fmt: skip
            for method, kw in methods.items():
                outs = [kdj.generate(target, prompts, method=method, max_new_tokens=args.new,
                                     stop_tokens=[], **kw) for _ in range(2)]  # fmt: skip
                s = outs[1].stats
                key = (method, B)
                same = reference.setdefault(key, outs[1].tokens) == outs[1].tokens
                row[method] = {"tokens_per_s": s["tokens_per_s"], "tau": s["mean_acceptance"],
                               "step_ms": 1e3 * s["decode_s"] / max(s["steps"], 1),
                               "same_tokens_as_first_mesh": same}  # fmt: skip
            T = {"ar": 1, "dflash": args.block, "ddtree": args.budget + 1}
            row["split"] = {m: layer_split(target, B, t, args.repeats) for m, t in T.items()}
            result["rows"].append(row)
            print(f"{mesh_name:>11} B={B:<4} " + "  ".join(
                f"{m} {row[m]['step_ms']:8.3f} ms/step {row[m]['tokens_per_s']:9.1f} tok/s"
                f"{'' if row[m]['same_tokens_as_first_mesh'] else ' TOKENS DIFFER'}"
                for m in ("ar", "dflash", "ddtree")), flush=True)  # fmt: skip
            harness.write_result(args.out, dict(result), args.argv)
        del target, drafter
    return harness.write_result(args.out, result, args.argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--layers", type=int, help="keep the first N layers (a slice)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
