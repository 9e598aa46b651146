"""Where the INT4 expert GEMV's time goes: the kernel against versions of itself with parts of
its work taken out (timing diagnostics: their results are wrong on purpose).

kdj's INT4 GEMV (kdj/pallas/expert_gemv.py) streams packed words [E, K/8, F] and, per word,
decodes 8 nibbles (shift, mask, exponent trick) and does 8 FMAs, then applies the group
scales. Variants, all on the same words, tiles and grid:

    kernel     kdj.pallas.expert_gemv.expert_gemv, as the model runs it
    no-scale   the same loop without the group scales (wrong results)
    one-plane  only nibble 0 of each word decoded and multiplied: 1/8 of the ALU work on the
               same bytes (wrong results); what the load pattern alone reaches
    fp-only    all 8 planes multiplied and scaled, but each plane is the word's bits read as
               a float: the kernel's float work without its integer work (the shift and
               mask per nibble, which run on the INT32 pipe at half the FP32 rate) (wrong
               results)
    prefetch   correct: the kernel's loop with the next tile's words loaded one iteration
               ahead (carried in registers), so the loads run under the decode of the tile
               before them; Triton does not pipeline loads that feed no dot
    group-3d   correct: words viewed [E, K/g, g/8, F] so a tile holds whole scale groups
               along an axis of its own; the products are summed per group, then scaled
               once per group (no [groups, g/8, bf] -> [words, bf] reshape of the scales)

    python bench/int4_gemv_parts.py --model kimi-k2-slice --assignments 8 --out r.json

Reported per variant: us per call (a jitted loop of --iters calls, expert ids shifted every
call), TB/s of the selected experts' packed words + scales, and rel_err against the XLA
reference (max abs difference / max abs value; null where the output is not finite).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from roofline import looped_time, model_config  # bench/ is the script directory

from kdj.checkpoints.quant import quant_int4_stacked
from kdj.pallas import expert_gemv

VARIANTS = ("kernel", "no-scale", "one-plane", "fp-only", "prefetch", "group-3d")


def _flat_kernel(ids_ref, x_ref, w_ref, s_ref, o_ref, *, words, wpg, bk, bf, variant):
    """kdj's INT4 loop (whole tiles only), less the part `variant` names."""
    i = pl.program_id(0)
    e, f0, G = ids_ref[i], pl.program_id(1) * bf, bk // wpg

    def words_at(t):
        return plgpu.load(w_ref.at[e, pl.ds(t * bk, bk), pl.ds(f0, bf)]).astype(jnp.int32)

    def body(t, carry):
        if variant == "prefetch":  # this tile's words came in the carry; fetch the next
            acc, w = carry
            nxt = words_at(jnp.minimum(t + 1, words // bk - 1))
        else:
            acc, w = carry, words_at(t)
        part = jnp.zeros((bk, bf), jnp.float32)
        for n in range(1 if variant == "one-plane" else 8):
            xn = plgpu.load(x_ref.at[i * 8 + n, pl.ds(t * bk, bk)]).astype(jnp.float32)
            if variant == "fp-only":  # the raw word as a float: no shift or mask
                plane = lax.bitcast_convert_type(w, jnp.float32)
            else:
                plane = expert_gemv._nibbles(w, n)
            part += xn[:, None] * plane
        if variant == "no-scale":
            return acc + part
        scale = plgpu.load(s_ref.at[e, pl.ds(t * G, G), pl.ds(f0, bf)]).astype(jnp.float32)
        acc = acc + part * jnp.broadcast_to(scale[:, None, :], (G, wpg, bf)).reshape(bk, bf)
        return (acc, nxt) if variant == "prefetch" else acc

    zero = jnp.zeros((bk, bf), jnp.float32)
    init = (zero, words_at(0)) if variant == "prefetch" else zero
    acc = lax.fori_loop(0, words // bk, body, init)
    o_ref[...] = (acc[0] if variant == "prefetch" else acc).sum(axis=0)


def _group_kernel(ids_ref, x_ref, w_ref, s_ref, o_ref, *, words, wpg, bk, bf, variant):
    """Words [E, groups, wpg, F], inputs [8 n, groups, wpg]: sums per group, scaled once."""
    i = pl.program_id(0)
    e, f0, G = ids_ref[i], pl.program_id(1) * bf, bk // wpg
    del variant

    def body(t, acc):
        w = plgpu.load(w_ref.at[e, pl.ds(t * G, G), :, pl.ds(f0, bf)]).astype(jnp.int32)
        part = jnp.zeros((G, wpg, bf), jnp.float32)
        for n in range(8):
            xn = plgpu.load(x_ref.at[i * 8 + n, pl.ds(t * G, G), :]).astype(jnp.float32)
            part += xn[:, :, None] * expert_gemv._nibbles(w, n)
        scale = plgpu.load(s_ref.at[e, pl.ds(t * G, G), pl.ds(f0, bf)]).astype(jnp.float32)
        return acc + part.sum(axis=1) * scale

    acc = lax.fori_loop(0, words // bk, body, jnp.zeros((G, bf), jnp.float32))
    o_ref[...] = acc.sum(axis=0)


def gemv(variant: str, x, ids, value, scale, *, block_k: int = 128, block_f: int = 32,
         num_warps: int = 4):  # fmt: skip
    """y [n, F] float32 of one variant. value int32 [E, K/8, F], scale [E, K/g, F]."""
    if variant == "kernel":
        return expert_gemv.expert_gemv(x, ids, value, scale, "int4", block_k=block_k,
                                       block_f=block_f, num_warps=num_warps)  # fmt: skip
    n, _ = x.shape
    E, words, F = value.shape
    wpg = words // scale.shape[1]
    if words % block_k or F % block_f or block_k % wpg:
        raise ValueError(f"{variant} takes whole tiles: {words} words / {block_k}, {F} / {block_f}")
    xt = expert_gemv.deinterleave(x)
    kernel = _flat_kernel
    if variant == "group-3d":
        value, xt, kernel = (
            value.reshape(E, words // wpg, wpg, F),
            xt.reshape(8 * n, -1, wpg),
            _group_kernel,
        )
    fn = functools.partial(kernel, words=words, wpg=wpg, bk=block_k, bf=block_f, variant=variant)
    return expert_gemv.call(fn, [ids, xt, value, scale], grid=(n, F // block_f),
                            out_block=(None, block_f), out_shape=(n, F), num_warps=num_warps,
                            num_stages=3, interpret=None, name=f"int4_{variant}")  # fmt: skip


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-k2-slice", help="configs/models name or YAML")
    p.add_argument("--experts", type=int, default=48, help="experts held (memory: not all E)")
    p.add_argument("--assignments", nargs="+", type=int, default=[8])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--tiles", nargs="+", default=["128,32,4"], help="block_k,block_f,num_warps")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    E, K, F = (
        min(args.experts, cfg.n_routed_experts),
        cfg.hidden_size,
        2 * cfg.moe_intermediate_size,
    )
    key = jax.random.key(0)
    w = (jax.random.normal(key, (E, K, F), jnp.float32) * 0.02).astype(jnp.bfloat16)
    value, scale = jax.jit(quant_int4_stacked)(w)
    del w
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": args.model,
            "date": time.strftime("%Y-%m-%d"), "E": E, "K": K, "F": F}  # fmt: skip
    rows = []
    for A in args.assignments:
        x = jax.random.normal(jax.random.fold_in(key, A), (A, K), jnp.bfloat16)
        ids = (jnp.arange(A, dtype=jnp.int32) * 5) % E
        ref = expert_gemv.reference(x, ids, value, scale, "int4")
        nbytes = A * (value[0].nbytes + scale[0].nbytes)
        for tiles in args.tiles:
            bk, bf, warps = map(int, tiles.split(","))
            for variant in args.variants:
                run = functools.partial(gemv, variant, block_k=bk, block_f=bf, num_warps=warps)
                row = {"assignments": A, "variant": variant, "tiles": tiles, "bytes": nbytes,
                       "exact": variant in ("kernel", "prefetch", "group-3d")}  # fmt: skip
                try:
                    sec = seconds_per_call(run, x, ids, value, scale, E, args.iters)
                    err = jnp.abs(run(x, ids, value, scale) - ref).max() / jnp.abs(ref).max()
                    err = float(err) if jnp.isfinite(err) else None  # None: non-finite output
                    row |= {"us": sec * 1e6, "TBps": nbytes / sec / 1e12, "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a variant that fails to lower is a result
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print(row, flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


def seconds_per_call(run, x, ids, value, scale, E: int, iters: int) -> float:
    """run(x, ids, value, scale) chained `iters` times in one jitted loop, the ids shifted
    every call (loop-invariant ids would let XLA hoist work out of the loop)."""
    body = lambda i, acc, x, v, s: acc + run(x, (ids + i) % E, v, s)  # noqa: E731
    init = jnp.zeros((x.shape[0], value.shape[2]), jnp.float32)
    return looped_time(body, init, iters, x, value, scale)


if __name__ == "__main__":
    main()
