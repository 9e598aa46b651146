"""The draft's top-K per depth: jax.lax.top_k against the two-round top_k
(kdj/decode/tree.py top_k_two_rounds), at a draft's shape [B, depths, V] float32, on the GPU.

A DDTree step takes the K = budget most probable tokens at each of the block's depths from
the drafter's logits. With few rows (batch 1: 15 rows of 49,152) one sort per row leaves
most of the GPU idle; the two-round top_k sorts chunks of --chunks entries first (kdj's
default: tree.TOP_K_CHUNK); tree.top_k picks one round or two by what this measures. Each
is jitted inside an on-device loop of --iters calls (the input perturbed by the loop index
so nothing is hoisted), after a warm-up run. The inputs are rounded to eighths, so many
entries tie, and both must give the same values and indices ("identical").

    python bench/top_k.py --out $OUT/top_k.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

from kdj.decode import tree as trees


def seconds(fn, x, k: int, iters: int) -> float:
    def body(i, acc, x):
        values, tokens = fn(x + i.astype(x.dtype) * 1e-6, k)
        return acc + values[..., 0].sum() + tokens[..., -1].sum().astype(acc.dtype)

    return harness.looped(body, jnp.float32(0), iters, x)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    p.add_argument("--ks", nargs="+", type=int, default=[16, 64])
    p.add_argument("--chunks", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--depths", type=int, default=15)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out")
    return p


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    rows = []
    for B in args.batches:
        x = jax.random.normal(jax.random.key(B), (B, args.depths, args.vocab), jnp.float32)
        x = jnp.round(x * 8) / 8  # ties: top_k must order them as lax.top_k does
        for k in args.ks:
            want = jax.lax.top_k(x, k)
            xla = seconds(lambda x, k: jax.lax.top_k(x, k), x, k, args.iters)
            for chunk in args.chunks:
                fn = functools.partial(trees.top_k_two_rounds, chunk=chunk)
                got = jax.jit(fn, static_argnums=1)(x, k)
                same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
                two = seconds(fn, x, k, args.iters)
                rows.append({"batch": B, "k": k, "chunk": chunk, "lax_us": xla * 1e6,
                             "two_round_us": two * 1e6, "speedup": xla / two,
                             "identical": same})  # fmt: skip
                us = f"lax.top_k {xla * 1e6:8.1f} us  two rounds {two * 1e6:8.1f} us"
                print(f"B={B:4d} k={k:3d} chunk={chunk:5d}  {us}  {xla / two:5.2f}x  same {same}")
    if args.out:
        harness.write_result(args.out, {"rows": rows}, argv)
    return rows


if __name__ == "__main__":
    main()
