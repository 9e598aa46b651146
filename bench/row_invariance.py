"""Is a row's result independent of how many rows are in flight? Per op, bitwise, bf16.

    python bench/row_invariance.py --out $OUT/row_invariance.json

Deterministic mode (kdj.generate(deterministic=True)) needs every op on the decode path to
give row i the same bits whether it runs with 1, 16 or 4,096 rows (a 1-token decode, a
16-token verify, a batch of 256 verifies). For each of SmolLM2-135M's projection shapes
(and the lm_head) this runs x[:M] @ W for M in --rows and reports, per M, the share of the
first rows whose bits differ from the M = 1 .. 16 results of the same rows:
- "xla": jnp.dot (what deterministic mode runs today);
- "grouped": kdj's Pallas grouped matmul with one expert and tiles fixed whatever M (its
  K loop and tensor-core tiles do not depend on the row count).
Then XLA's attention (scores over head_dim, softmax, values over the context) at 1 against
16 query rows, and an RMSNorm row at 1 against 16 and 4,096 rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"q/o": (576, 576), "k/v": (576, 192), "gate/up": (576, 1536), "down": (1536, 576),
          "lm_head": (576, 49152)}  # fmt: skip


def grouped(x, w):
    from kdj.pallas.expert_grouped import expert_grouped

    ids = jnp.zeros((x.shape[0],), jnp.int32)
    return expert_grouped(x, ids, w[None], block_m=16, block_k=128, block_f=128, num_warps=8,
                          cols_first=False, out_dtype=jnp.float32)  # fmt: skip


def xla(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def differing(fn, x, w, rows) -> dict:
    """Per M: the share of the elements of rows 0..15 whose bits differ from M = 16's."""
    f = jax.jit(fn)
    ref = np.asarray(f(x[:16], w))
    out = {}
    for M in rows:
        y = np.asarray(f(x[:M], w))[: min(M, 16)]
        out[M] = float(np.mean(y != ref[: len(y)]))
    return out


def attention_rows(S=640, D=64, H=9) -> dict:
    """Scores q.k over D and p.v over S with T = 1 against T = 16 query rows (row 0)."""
    k = jax.random.normal(jax.random.key(1), (1, H, S, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(2), (1, H, S, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.key(3), (1, H, 16, D), jnp.bfloat16)

    @jax.jit
    def attend(q):
        s = jnp.einsum("bhtd,bhsd->bhts", q, k, preferred_element_type=jnp.float32)
        p = jax.nn.softmax(s, axis=-1)
        return s, p, jnp.einsum("bhts,bhsd->bhtd", p.astype(v.dtype), v,
                                preferred_element_type=jnp.float32)  # fmt: skip

    one, wide = attend(q[:, :, :1]), attend(q)
    x = jax.random.normal(jax.random.key(4), (4096, 576), jnp.float32)
    norm = jax.jit(lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5))
    rows = {M: float(np.mean(np.asarray(norm(x[:M]))[:1] != np.asarray(norm(x[:1]))))
            for M in (16, 4096)}  # fmt: skip
    names = ("scores", "softmax", "values")
    out = {n: float(np.mean(np.asarray(a[:, :, 0]) != np.asarray(b[:, :, 0])))
           for n, a, b in zip(names, one, wide)}  # fmt: skip
    return {**out, "rmsnorm": rows}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 16, 64, 256, 1024, 4096])
    p.add_argument("--out", required=True)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    x = jax.random.normal(jax.random.key(0), (max(args.rows), 1536), jnp.bfloat16)
    res = {"matmul": {}, "attention": attention_rows()}
    for name, (K, N) in SHAPES.items():
        w = (jax.random.normal(jax.random.key(K + N), (K, N), jnp.float32) / K**0.5).astype(
            jnp.bfloat16
        )
        res["matmul"][name] = {impl: differing(fn, x[:, :K], w, args.rows)
                               for impl, fn in (("xla", xla), ("grouped", grouped))}  # fmt: skip
        print(name, res["matmul"][name], flush=True)
    print("attention", res["attention"])
    harness.write_result(Path(args.out), res, argv)


if __name__ == "__main__":
    main()
