"""The draft's top-K per depth: jax.lax.top_k against kdj's chunked forms
(kdj/decode/tree.py), at a draft's shape [B, depths, V] float32, on the GPU.

A DDTree step takes the K = budget most probable tokens at each of the block's depths from
the drafter's logits. With few rows (batch 1: 15 rows of 49,152) one sort per row leaves
most of the GPU idle. "two-rounds" (top_k_two_rounds) takes the top K of each chunk of
--chunks entries first (kdj's default: tree.TOP_K_CHUNK); "pruned" (top_k_pruned) reads the
rows once for each chunk's maximum and sorts only the K chunks that rank highest
(--pruned-chunks; 0: its own default, tree.pruning_chunk). tree.top_k's rule comes from
what this measures. Each is jitted inside an on-device loop of --iters calls (the input perturbed by
the loop index so nothing is hoisted), after a warm-up run. The inputs are rounded to
eighths, so many entries tie, and every form must give lax.top_k's values and indices
("identical").

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
    p.add_argument("--pruned-chunks", nargs="+", type=int, default=[0, 64, 128])
    p.add_argument("--depths", type=int, default=15)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out")
    return p


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    forms = [("two-rounds", c, functools.partial(trees.top_k_two_rounds, chunk=c))
             for c in args.chunks]  # fmt: skip
    forms += [("pruned", c, functools.partial(trees.top_k_pruned, chunk=c or None))
              for c in args.pruned_chunks]  # fmt: skip
    rows = []
    for B in args.batches:
        x = jax.random.normal(jax.random.key(B), (B, args.depths, args.vocab), jnp.float32)
        x = jnp.round(x * 8) / 8  # ties: top_k must order them as lax.top_k does
        for k in args.ks:
            want = jax.lax.top_k(x, k)
            xla = seconds(lambda x, k: jax.lax.top_k(x, k), x, k, args.iters)
            for form, chunk, fn in forms:
                chunk = chunk or trees.pruning_chunk(args.vocab, k)
                got = jax.jit(fn, static_argnums=1)(x, k)
                same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
                us = seconds(fn, x, k, args.iters) * 1e6
                rows.append({"batch": B, "k": k, "form": form, "chunk": chunk,
                             "lax_us": xla * 1e6, "us": us, "speedup": xla * 1e6 / us,
                             "identical": same})  # fmt: skip
                print(
                    f"B={B:4d} k={k:3d} {form:10s} chunk={chunk:5d}  lax.top_k "
                    f"{xla * 1e6:8.1f} us  {us:8.1f} us  {xla * 1e6 / us:5.2f}x  same {same}"
                )
    if args.out:
        harness.write_result(args.out, {"rows": rows}, argv)
    return rows


if __name__ == "__main__":
    main()
