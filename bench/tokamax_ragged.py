"""tokamax's ragged_dot against kdj's grouped expert kernel and jax.lax.ragged_dot: one MoE
layer's two expert matmuls at a model's shape, rows already sorted by expert.

The MoE issue asks for the expert compute to be chosen per regime by measurement, tokamax's
ragged_dot (Pallas Mosaic GPU) among the candidates. tokamax needs jax >= 0.11.1, so it is
never a kdj dependency: this script imports it if it is installed and otherwise records
that it is not. Variants, per matrix (gate/up [E, D, 2I], down [E, I, D]):

    lax       jax.lax.ragged_dot (XLA's grouped GEMM)
    tokamax   tokamax.ragged_dot(..., implementation="mosaic")
    grouped   kdj.pallas.expert_grouped.expert_grouped (the MoE layer's GPU path; its row-block
              layout, a sort of the ids included)

    python bench/tokamax_ragged.py --model moonlight-16b-a3b --assignments 96 24576 --out r.json

Each case runs --iters calls in one jitted loop, the input rows changing every call. Reported:
us per call, TFLOP/s, TB/s on the touched experts' bytes, and rel_err against lax (max abs
difference / max abs value).
"""

from __future__ import annotations

import argparse
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

from kdj.pallas import expert_grouped

VARIANTS = ("lax", "tokamax", "grouped")


def variant_fn(name: str):
    """f(xs [n, K] sorted by expert, ids [n] sorted, group_sizes [E], w [E, K, F]) -> [n, F]."""
    if name == "lax":
        return lambda xs, ids, gs, w: jax.lax.ragged_dot(xs, w, gs)
    if name == "grouped":
        return lambda xs, ids, gs, w: expert_grouped.expert_grouped(xs, ids, w, out_dtype=xs.dtype)
    import tokamax  # not a kdj dependency: ImportError is a result row
    from absl import flags  # tokamax reads absl flags; this script's argv is not absl's

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return lambda xs, ids, gs, w: tokamax.ragged_dot(xs, w, gs, implementation="mosaic")


def seconds_per_call(fn, xs, iters: int, *operands) -> float:
    """fn(xs, *operands) `iters` times in one jitted loop, the input rows changing every call."""

    def body(i, acc, xs, *ops):
        y = fn(xs + (i * 1e-3).astype(xs.dtype), *ops)
        return acc + y[:1].astype(jnp.float32).sum()

    return harness.looped(body, jnp.float32(0), iters, xs, *operands)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--assignments", nargs="+", type=int, default=[96, 24576])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out")
    return p


def main(argv=None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    cfg = harness.model_config(args.model)
    E, D, I, k = (cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                  cfg.num_experts_per_tok)  # fmt: skip
    key = jax.random.key(0)
    mats = {"gate_up": (E, D, 2 * I), "down": (E, I, D)}
    weights = {m: (jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) * s[1] ** -0.5)
               .astype(jnp.bfloat16) for i, (m, s) in enumerate(mats.items())}  # fmt: skip
    meta = {"model": args.model, "E": E, "D": D, "I": I, "k": k}
    try:
        import tokamax

        meta["tokamax"] = getattr(tokamax, "__version__", "installed")
    except ImportError as e:
        meta["tokamax"] = f"not installed: {e}"
    rows = []
    for A in args.assignments:
        rng = np.random.default_rng(A)
        ids = np.concatenate([rng.choice(E, k, replace=False) for _ in range(max(1, A // k))])
        ids = jnp.asarray(np.sort(ids), jnp.int32)
        gs = jnp.bincount(ids, length=E).astype(jnp.int32)
        touched = int(np.unique(np.asarray(ids)).size)
        for m, w in weights.items():
            xs = jax.random.normal(jax.random.fold_in(key, A), (ids.size, w.shape[1]), jnp.bfloat16)
            ref = np.asarray(jax.jit(variant_fn("lax"))(xs, ids, gs, w), np.float32)
            nbytes, flops = touched * w[0].nbytes, 2 * ids.size * w.shape[1] * w.shape[2]
            for name in args.variants:
                row = {"assignments": int(ids.size), "touched": touched, "matrix": m,
                       "variant": name, "bytes": nbytes, "flops": flops}  # fmt: skip
                try:
                    fn = variant_fn(name)
                    sec = seconds_per_call(fn, xs, args.iters, ids, gs, w)
                    y = np.asarray(jax.jit(fn)(xs, ids, gs, w), np.float32)
                    err = float(np.abs(y - ref).max() / np.abs(ref).max())
                    row |= {"us": sec * 1e6, "TFLOPs": flops / sec / 1e12,
                            "TBps": nbytes / sec / 1e12, "rel_err": err}  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                rows.append(row)
                print(row, flush=True)
                harness.write_result(args.out, {"meta": meta, "rows": rows}, argv)
    return rows


if __name__ == "__main__":
    main()
