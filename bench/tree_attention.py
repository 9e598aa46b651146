"""Tree attention per layer at batch 1: Pallas kernel vs the XLA reference, on the GPU.

For contexts 1K, 8K, 32K committed slots and draft budgets B = 0 (plain decode), 16, 64,
256 (T = B + 1 new tokens under a random prefix-closed tree), for the Qwen3-8B GQA shape
(H=32, KVH=8, hd=128) and the DeepSeek-V3 MLA absorbed shape (H=128, C=512, R=64), all bf16:

* time: each op jitted inside an on-device loop of --iters calls (one dispatch, each call's
  q perturbed by the previous output so nothing is hoisted), after a warm-up run;
* bandwidth: bytes that must be read/written once (cache slots < start + T: k and v, or the
  one latent stream; plus q and the output) / time, as a fraction of 4.3 TB/s;
* error: max |kernel - reference| on the same inputs.

    python bench/tree_attention.py --out $OUT/tree_attention.json

--sweep CONFIGS times extra kernel configurations (block_q/block_k/num_warps/num_stages/
num_splits) at the 32K context, to tune the defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

from kdj.models.layers import reference_attention
from kdj.pallas.tree_attention import latent_tree_attention, tree_attention

HBM = harness.HBM_BPS
SHAPES = {  # name: (H, KVH, Dk, Dv, latent)
    "qwen3-8b-gqa": (32, 8, 128, 128, False),
    "deepseek-v3-mla": (128, 1, 576, 512, True),
}


def random_tree(rng, T):
    """[T, T] ancestors-and-self mask of a random tree whose parents precede children."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, T)]
    m = np.eye(T, dtype=bool)
    for i in range(1, T):
        m[i] |= m[parent[i]]
    return m


def make(shape, ctx, T, seed=0):
    H, KVH, Dk, Dv, latent = SHAPES[shape]
    S = -(-(ctx + T) // 256) * 256
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 3)
    bf = jnp.bfloat16
    q = jax.random.normal(keys[0], (1, T, H, Dk), bf)
    k = jax.random.normal(keys[1], (1, KVH, S, Dk), bf)  # kdj's cache layout
    v = None if latent else jax.random.normal(keys[2], (1, KVH, S, Dv), bf)
    start = jnp.array([ctx], jnp.int32)
    tree = jnp.asarray(random_tree(rng, T))[None]
    scale = 1.0 / np.sqrt(Dk)
    nbytes = (ctx + T) * KVH * (Dk + (0 if latent else Dv)) * 2 + T * H * (Dk + Dv) * 2
    return q, k, v, start, tree, scale, nbytes


def op(shape, kind, cfg):
    H, KVH, Dk, Dv, latent = SHAPES[shape]

    def f(q, k, v, start, tree, scale):
        if kind == "ref":
            vv = k[..., :Dv] if latent else v
            return reference_attention(q, k, vv, start, tree, scale)
        interpret = jax.default_backend() == "cpu"  # Pallas runs interpreted on a CPU
        if latent:
            return latent_tree_attention(q, k, start, tree, scale, Dv, interpret=interpret, **cfg)
        return tree_attention(q, k, v, start, tree, scale, interpret=interpret, **cfg)

    return f


def timed(f, args, iters):
    """Seconds per call of f inside one jitted loop, q perturbed by the previous output."""
    q, k, v, start, tree, scale = args

    def body(_, eps, q, k, v, start, tree):
        return (f(q + eps, k, v, start, tree, scale)[0, 0, 0, 0] * 0).astype(q.dtype)

    return harness.looped(body, jnp.zeros((), q.dtype), iters, q, k, v, start, tree)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 64, 256])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", default="", help="JSON list of kernel cfg dicts, at 32K")
    return ap


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    rows = []
    for shape, ctx, budget in itertools.product(args.shapes, args.contexts, args.budgets):
        T = budget + 1
        q, k, v, start, tree, scale, nbytes = make(shape, ctx, T)
        a = (q, k, v, start, tree, scale)
        kern = jax.jit(op(shape, "kernel", {}), static_argnums=5)
        ref = jax.jit(op(shape, "ref", {}), static_argnums=5)
        err = float(jnp.abs(kern(*a).astype(jnp.float32) - ref(*a).astype(jnp.float32)).max())
        row = dict(shape=shape, context=ctx, budget=budget, T=T, bytes=nbytes, max_abs_err=err)
        for kind in ("kernel", "ref"):
            t = timed(op(shape, kind, {}), a, args.iters)
            row[f"{kind}_us"] = t * 1e6
            row[f"{kind}_GBps"] = nbytes / t / 1e9
            row[f"{kind}_frac_hbm"] = nbytes / t / HBM
        print(json.dumps(row), flush=True)
        rows.append(row)
    sweep = []
    for cfg in json.loads(args.sweep or "[]"):
        only = cfg.pop("shape", None)  # a config may name the one shape it is for
        for shape, budget in itertools.product(args.shapes, args.budgets[:2]):
            if only not in (None, shape):
                continue
            q, k, v, start, tree, scale, nbytes = make(shape, 32768, budget + 1)
            try:
                t = timed(op(shape, "kernel", cfg), (q, k, v, start, tree, scale), 10)
                r = dict(shape=shape, budget=budget, cfg=cfg, us=t * 1e6, frac=nbytes / t / HBM)
            except Exception as e:  # a config Triton rejects (e.g. out of shared memory)
                r = dict(shape=shape, budget=budget, cfg=cfg, error=str(e)[:200])
            print(json.dumps(r), flush=True)
            sweep.append(r)
    print(f"\n{'shape':16} {'ctx':>6} {'B':>4} | {'kernel us':>9} {'GB/s':>6} {'%HBM':>5} | "
          f"{'ref us':>9} {'GB/s':>6} {'%HBM':>5} | {'max err':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['shape']:16} {r['context']:>6} {r['budget']:>4} | {r['kernel_us']:9.1f} "
            f"{r['kernel_GBps']:6.0f} {100 * r['kernel_frac_hbm']:5.1f} | {r['ref_us']:9.1f} "
            f"{r['ref_GBps']:6.0f} {100 * r['ref_frac_hbm']:5.1f} | {r['max_abs_err']:8.1e}"
        )
    return harness.write_result(args.out, {"rows": rows, "sweep": sweep}, argv)


if __name__ == "__main__":
    main()
