"""Roofline of one target forward step: bytes that must move and FLOPs, against measured time.

For each model and expert format, sweep batch B x tokens per sequence per step T (T = 1 is an
autoregressive step; T = 8, 16 are verify sizes) and time ONE jitted target forward of
[B, T] new tokens on top of a cache holding --context tokens per sequence (--repeats steps
queued back to back, one sync at the end, as a decode loop runs them). Account per step:

- bytes: dense weights read once (an untied embedding only gathers B*T rows), plus the
  routed experts ACTUALLY touched (distinct expert ids per MoE layer, from the routing of
  that very step), plus the KV cache read (context + T per sequence) and written (T);
- FLOPs: 2 x tokens x every matmul weight (routed experts: k assignments per token), plus
  attention (scores and values over context + T).

and report the achieved fraction of 4.3 TB/s (ANCHORS.md's practical HBM ceiling) and of a
bf16 matmul rate measured in the same run (an 8192^3 matmul, its calls queued the same way).
For MoE models the MoE layer is also timed alone (B x T tokens through one layer, its calls
queued: routed experts touched at bandwidth, or at matmul rate).

    python bench/roofline.py --models kimi-k2-slice --experts bf16 int4 --out $OUT/roofline.json

With --fit-cost, a kdj.cost.StepCost is fitted to the measured steps (with their residuals)
and saved for method="auto"; --fit-from RUN.json fits it from an earlier run's rows on any
machine, measuring nothing.

Models: "smollm2-135m-instruct" (real weights), a configs/models/<name>.yaml name or a YAML
path (random weights: speed does not depend on the values, except MoE routing, which a random
router spreads about uniformly). --experts bf16 int4 runs both formats on the SAME random
weights: bf16 first, then quantised in place (kdj.models.deepseek.quantize_experts). Writes JSON,
a markdown table (.md) and a plot (.png, when matplotlib is installed) next to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.cli import values
from kdj.config import ModelConfig
from kdj.models.deepseek import quantize_experts, route

HBM_BPS = harness.HBM_BPS
EXPERT_PARAMS = ("w_gate_up", "w_down", "gate_up_scale", "down_scale")


# ------------------------------------------------------------------------------ accounting
def weight_bytes(state, cfg: ModelConfig, tokens: int) -> tuple[int, dict[int, int]]:
    """(dense bytes a step reads, {layer: routed-expert bytes held}). An untied embedding
    only gathers `tokens` rows; everything else is read once."""
    dense, experts = 0, {}
    for path, var in nnx.to_flat_state(state):
        x = var.get_value()
        if path[-1] in EXPERT_PARAMS:
            experts[path[1]] = experts.get(path[1], 0) + x.nbytes
        elif path == ("embed",) and not cfg.tie_word_embeddings:
            dense += tokens * x.shape[1] * x.dtype.itemsize
        else:
            dense += x.nbytes
    return dense, experts


def matmul_params(state, cfg: ModelConfig) -> int:
    """Weights every token multiplies through (routed experts excluded; the embedding
    counts once, as the tied lm_head or not at all)."""
    n = 0
    for path, var in nnx.to_flat_state(state):
        x = var.get_value()
        if path[-1] in EXPERT_PARAMS or x.ndim < 2:
            continue
        if path == ("embed",) and not cfg.tie_word_embeddings:
            continue
        n += int(np.prod(x.shape))
    return n


def step_flops(state, cfg: ModelConfig, B: int, T: int, context: int) -> float:
    tokens = B * T
    flops = 2 * tokens * matmul_params(state, cfg)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    D, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    flops += n_moe * 2 * tokens * k * 3 * D * I
    S = context + T
    if cfg.family == "deepseek":  # absorbed MLA: scores over C + R, values over C
        per = cfg.num_heads * (cfg.latent_dim + cfg.kv_lora_rank)
    else:
        per = cfg.num_heads * 2 * cfg.head_dim
    return flops + cfg.num_layers * 2 * tokens * S * per


def kv_bytes(cfg: ModelConfig, B: int, T: int, context: int, itemsize: int) -> int:
    per_tok = cfg.latent_dim if cfg.family == "deepseek" else 2 * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * B * (context + 2 * T) * per_tok * itemsize  # read context + T, write T


# ------------------------------------------------------------------------------ the step
def touched_experts(model, tokens, start, cache) -> dict[int, int]:
    """{layer: distinct experts routed to by this step's tokens}: the step replayed block by
    block (as Transformer.__call__ runs them), each MoE layer's router applied to its input."""
    graphdef, state = nnx.split(model)
    ids = jax.jit(_routing, static_argnums=0)(graphdef, state, tokens, start, cache)
    return {i: int(np.unique(np.asarray(idx)).size) for i, idx in ids.items()}


def _routing(graphdef, state, tokens, start, cache) -> dict:
    from kdj.models.layers import causal_tree

    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    tree, x, ids = causal_tree(B, T), model.embed[...][tokens], {}
    for i, block in enumerate(model.layers):
        v = cache.v[i] if cache.v else None
        h = block.attn(block.attn_norm(x), positions, start, tree, cache.k[i], v)[0]
        x = x + h
        y = block.mlp_norm(x)
        if model.cfg.is_moe_layer(i):
            moe = block.mlp
            bias = None if moe.bias is None else moe.bias[...]
            ids[i] = route(y.reshape(B * T, -1), moe.router[...], bias, model.cfg)[1]
        x = x + block.mlp(y)
    return ids


def time_step(model, cfg, B, T, context, repeats, mm_rate) -> dict:
    state = nnx.state(model)
    dtype = model.embed[...].dtype
    rng = np.random.default_rng(B * 1000 + T)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    start = jnp.full((B,), context, jnp.int32)
    cache = harness.filled_cache(cfg, B, context + T, context, dtype)
    touched = touched_experts(model, tokens, start, cache) if cfg.n_routed_experts else {}
    forward, box = harness.forward_step(model), [cache]

    def step():
        logits, box[0] = forward(tokens, start, box[0])
        return logits

    t0 = time.perf_counter()
    jax.block_until_ready(step())
    compile_s = time.perf_counter() - t0
    seconds = harness.chained(step, repeats)
    dense, held = weight_bytes(state, cfg, B * T)
    E = cfg.n_routed_experts or 1
    expert = sum(held[layer] * touched[layer] / E for layer in held)
    kv = kv_bytes(cfg, B, T, context, dtype.itemsize)
    total = dense + expert + kv
    flops = step_flops(state, cfg, B, T, context)
    return {
        "batch": B, "tokens_per_seq": T, "context": context, "step_ms": seconds * 1e3,
        "compile_s": compile_s, "bytes": {"dense": dense, "experts_touched": expert, "kv": kv,
                                          "total": total},
        "experts_touched_per_layer": [touched[k] for k in sorted(touched)],
        "flops": flops, "achieved_TBps": total / seconds / 1e12,
        "frac_hbm": total / seconds / HBM_BPS, "frac_matmul": flops / seconds / mm_rate,
        "floor_ms": max(total / HBM_BPS, flops / mm_rate) * 1e3,
    }  # fmt: skip


# ------------------------------------------------------------------------------ MoE alone
def time_moe(model, cfg, B, T, repeats, mm_rate) -> dict:
    """One MoE layer on B*T random tokens: routed experts touched + shared + router bytes."""
    moe = harness.moe_layers(model)[0]
    state = nnx.state(moe)
    dtype = model.embed[...].dtype
    x = jax.random.normal(jax.random.key(B * 1000 + T), (B, T, cfg.hidden_size), dtype)
    bias = None if moe.bias is None else moe.bias[...]
    _, idx = jax.jit(route, static_argnums=3)(x.reshape(B * T, -1), moe.router[...], bias, cfg)
    touched = int(np.unique(np.asarray(idx)).size)
    forward = harness.jit_over_params(moe, lambda m, x: m(x))
    seconds = harness.chained(lambda: forward(x), repeats)
    held = sum(v.get_value().nbytes for p, v in nnx.to_flat_state(state) if p[-1] in EXPERT_PARAMS)
    other = sum(
        v.get_value().nbytes for p, v in nnx.to_flat_state(state) if p[-1] not in EXPERT_PARAMS
    )
    routed = held * touched / cfg.n_routed_experts
    D, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    per_token = (k + cfg.n_shared_experts) * 3 * D * I + D * cfg.n_routed_experts  # + router
    flops = 2 * B * T * per_token
    return {
        "batch": B, "tokens_per_seq": T, "ms": seconds * 1e3, "experts_touched": touched,
        "bytes_routed": routed, "bytes_other": other, "flops": flops,
        "frac_hbm": (routed + other) / seconds / HBM_BPS, "frac_matmul": flops / seconds / mm_rate,
    }  # fmt: skip


# ------------------------------------------------------------------------------ reporting
def markdown(result: dict) -> str:
    lines = [
        "| model | experts | batch | T | step ms | floor ms | GB/step (dense+experts+KV) "
        "| experts touched/layer | TB/s | % of 4.3 TB/s | % of matmul rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b = r["bytes"]
        touched = r["experts_touched_per_layer"]
        mean_touched = f"{np.mean(touched):.0f}" if touched else "-"
        lines.append(
            f"| {r['model']} | {r['experts']} | {r['batch']} | {r['tokens_per_seq']} "
            f"| {r['step_ms']:.3f} | {r['floor_ms']:.3f} | {b['total'] / 1e9:.3f} "
            f"({b['dense'] / 1e9:.2f}+{b['experts_touched'] / 1e9:.2f}+{b['kv'] / 1e9:.2f}) "
            f"| {mean_touched} | {r['achieved_TBps']:.2f} | {100 * r['frac_hbm']:.0f}% "
            f"| {100 * r['frac_matmul']:.1f}% |"
        )
    if result["moe_rows"]:
        lines += [
            "",
            "| model | experts | batch | T | MoE layer ms | experts touched | GB | % of 4.3 TB/s "
            "| % of matmul rate |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["moe_rows"]:
            gb = (r["bytes_routed"] + r["bytes_other"]) / 1e9
            lines.append(
                f"| {r['model']} | {r['experts']} | {r['batch']} | {r['tokens_per_seq']} "
                f"| {r['ms']:.3f} | {r['experts_touched']} | {gb:.3f} "
                f"| {100 * r['frac_hbm']:.0f}% | {100 * r['frac_matmul']:.1f}% |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    """Achieved fraction of HBM bandwidth and of matmul rate against tokens per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list] = {}
    for r in result["rows"]:
        series.setdefault((r["model"], r["experts"], r["tokens_per_seq"]), []).append(r)
    for (model, experts, T), rows in sorted(series.items()):
        n = [r["batch"] * T for r in rows]
        label = f"{model} {experts} T={T}"
        axes[0].plot(n, [100 * r["frac_hbm"] for r in rows], "o-", label=label)
        axes[1].plot(n, [100 * r["frac_matmul"] for r in rows], "o-", label=label)
    for ax, what in zip(axes, ("% of 4.3 TB/s (bytes that must move)", "% of bf16 matmul rate")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens per step (batch x T)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"one target forward step, {jax.devices()[0].device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------ main
def model_tag(name: str, layers: int | None) -> str:
    """The "model" of a run's rows: the name, and "(NL)" for a slice of N layers."""
    return name + (f" ({layers}L)" if layers else "")


def fit_cost(cfg, rows, args, name, fmt) -> None:
    """Fit kdj.cost.StepCost (fixed, per byte, per FLOP) to this model's measured steps, keep
    the measured / predicted ratio of each (`StepCost.with_residuals`), and save it where
    method="auto" can load it (generate(..., cost=path))."""
    from kdj.cost import StepCost

    measured = [(r["batch"], r["tokens_per_seq"], r["context"], r["step_ms"] / 1e3) for r in rows]
    fitted = StepCost.for_config(cfg).fit(measured)
    cost = fitted.with_residuals(measured)  # exact at the measured steps
    path = Path(args.fit_cost)
    if len(args.models) > 1 or len(args.experts) > 1:
        path = path.with_name(f"{path.stem}_{Path(name).stem}_{fmt}{path.suffix}")
    cost.save(path)
    worst = max(abs(fitted.seconds(b, t, c) / s - 1) for b, t, c, s in measured)
    print(f"step cost fitted to {len(measured)} steps (worst relative error before the "
          f"residuals {worst:.0%}): "
          f"fixed {cost.fixed_s * 1e3:.3f} ms, "
          f"{1e-12 / cost.per_byte_s if cost.per_byte_s else float('inf'):.2f} TB/s, "
          f"{1e-12 / cost.per_flop_s if cost.per_flop_s else float('inf'):.0f} TFLOP/s "
          f"-> {path}")  # fmt: skip


def run(args) -> dict:
    dtype = jnp.dtype(args.dtype)
    mm = harness.matmul_rate(args.matmul_size)
    print(f"{jax.devices()[0].device_kind}: bf16 matmul {mm / 1e12:.1f} TFLOP/s")
    result = {"hbm_ceiling_Bps": HBM_BPS, "matmul_flops": mm, "rows": [], "moe_rows": []}
    out = Path(args.out) if args.out else None

    def save():
        if out is not None:
            harness.write_result(out, dict(result), args.argv)
            out.with_suffix(".md").write_text(markdown(result))

    for name in args.models:
        tgt, weights = harness.load(name, args.layers, dtype)
        model = tgt.model
        cfg = model.cfg
        formats = args.experts if cfg.n_routed_experts else ["bf16"]
        for fmt in formats:
            if fmt != "bf16":
                quantize_experts(model, fmt)  # in place, on the same random weights
            tag = {"model": model_tag(name, cfg.num_layers if args.layers else None),
                   "weights": weights, "experts": fmt}  # fmt: skip
            for B in args.batches:
                for T in args.tokens:
                    if args.max_tokens and B * T > args.max_tokens:
                        continue  # too big to time in a sweep (projections predict it)
                    row = {**tag, **time_step(model, cfg, B, T, args.context, args.repeats, mm)}
                    result["rows"].append(row)
                    save()
                    print(
                        f"{row['model']:>24} {fmt:>5} B={B:<4} T={T:<3} {row['step_ms']:9.3f} ms"
                        f"  floor {row['floor_ms']:8.3f}  {row['bytes']['total'] / 1e9:7.3f} GB"
                        f"  {100 * row['frac_hbm']:5.1f}% of 4.3 TB/s"
                        f"  {100 * row['frac_matmul']:5.1f}% of matmul", flush=True,
                    )  # fmt: skip
            if args.fit_cost:
                fit_cost(cfg, [r for r in result["rows"] if r["model"] == tag["model"]
                               and r["experts"] == fmt], args, name, fmt)  # fmt: skip
            if cfg.n_routed_experts:
                for B, T in args.moe_shapes:
                    row = {**tag, **time_moe(model, cfg, B, T, args.repeats, mm)}
                    result["moe_rows"].append(row)
                    save()
                    print(
                        f"{row['model']:>24} {fmt:>5} MoE layer B={B} T={T}: {row['ms']:.3f} ms,"
                        f" {row['experts_touched']} experts, {100 * row['frac_hbm']:.0f}% of "
                        f"4.3 TB/s, {100 * row['frac_matmul']:.1f}% of matmul", flush=True,
                    )  # fmt: skip
        del model, tgt
    save()
    if out is not None and plot(result, out.with_suffix(".png")):
        print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    print(markdown(result))
    return result


def token_shape(text: str) -> tuple[int, int]:
    """--moe-shapes' BxT, both positive."""
    b, x, t = text.partition("x")
    if not (x and b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
        raise argparse.ArgumentTypeError(f"must be BxT, two positive integers (got {text!r})")
    return int(b), int(t)


def parser(prog: str = "roofline") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # every flag says its default
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=["moonlight-16b-a3b"],
        help="smollm2-135m-instruct, configs/models/<name> or a YAML path",
    )
    p.add_argument(
        "--experts",
        nargs="+",
        default=["bf16"],
        choices=["bf16", "int4", "fp8"],
        help="routed-expert formats, bf16 first (MoE models only)",
    )
    p.add_argument(
        "--layers", type=values.POSITIVE, help="keep only the first N layers (a model slice)"
    )
    p.add_argument(
        "--batches", nargs="+", type=values.POSITIVE, default=[1, 4, 16, 64, 256],
        help="batch sizes B",
    )  # fmt: skip
    p.add_argument(
        "--tokens",
        nargs="+",
        type=values.POSITIVE,
        default=[1, 8, 16],
        help="new tokens per sequence per step (1 = AR, 8/16 = verify)",
    )
    p.add_argument(
        "--moe-shapes",
        nargs="+",
        type=token_shape,
        default=[(1, 16), (256, 16)],
        help="BxT token shapes for the MoE layer alone",
    )
    p.add_argument("--context", type=values.COUNT, default=512, help="tokens already in the cache")
    p.add_argument(
        "--max-tokens", type=values.POSITIVE, help="skip steps of more than this many tokens"
    )
    p.add_argument("--dtype", default="bfloat16", help="weights and activations dtype")
    p.add_argument(
        "--repeats", type=values.POSITIVE, default=10, help="steps timed back to back per shape"
    )
    p.add_argument(
        "--matmul-size", type=values.POSITIVE, default=8192,
        help="N of the N^3 matmul that sets the FLOP rate",
    )  # fmt: skip
    p.add_argument("--out", help="JSON path; .md and .png are written beside it")
    p.add_argument(
        "--fit-cost",
        help="also fit a kdj.cost.StepCost to the measured steps and save it here (JSON)",
    )
    p.add_argument("--fit-from", help="an earlier run's JSON: measure nothing, only fit "
                   "--fit-cost to its rows of --models (one) and --experts (one)")  # fmt: skip
    return p


def check_fit(steps: int, source: str | None = None) -> None:
    """--fit-cost fits three rates (fixed, per byte, per FLOP): fewer distinct steps than
    that leave them undetermined, and the cost right only where it was measured."""
    if steps < 3:
        where = f"{source} has" if source else "--batches x --tokens (within --max-tokens) give"
        raise ValueError(f"--fit-cost needs 3 or more distinct (batch, tokens) steps to fit its "
                         f"fixed, per-byte and per-FLOP rates; {where} {steps}")  # fmt: skip


def check_beside(out: Path) -> None:
    """The .md and .png written beside --out replace only an earlier run's (its --out JSON is
    there too), never a file of the user's that happens to share the name."""
    if out.exists():
        return
    for side in (out.with_suffix(".md"), out.with_suffix(".png")):
        if side.exists():
            raise ValueError(f"--out {out} writes {side} beside it, and {side} exists (not "
                             "an earlier run's: it has no JSON beside it); move it or choose "
                             "another --out")  # fmt: skip


def main(argv=None, prog: str = "roofline"):
    argv = sys.argv[1:] if argv is None else argv
    p = parser(prog)
    args = p.parse_args(argv)
    # found before the FLOP-rate matmul and the first model, not after them
    try:
        jnp.dtype(args.dtype)
        for name in args.models:
            if name != "smollm2-135m-instruct":
                harness.model_config(name, args.layers)
        if args.out:
            values.output(args.out, "--out", inputs={"--fit-cost": args.fit_cost,
                                                     "--fit-from": args.fit_from})  # fmt: skip
            check_beside(Path(args.out))
        if args.fit_cost:
            values.output(args.fit_cost, "--fit-cost", inputs={"--fit-from": args.fit_from})
        if args.fit_cost and not args.fit_from:
            steps = {(b, t) for b in args.batches for t in args.tokens
                     if not args.max_tokens or b * t <= args.max_tokens}  # fmt: skip
            check_fit(len(steps))
    except (OSError, TypeError, ValueError) as e:
        p.error(str(e))
    if args.fit_from:
        if not args.fit_cost or len(args.models) != 1 or len(args.experts) != 1:
            p.error("--fit-from needs --fit-cost, one --models and one --experts")
        # rows of a slice are tagged "name (NL)": fit the config of that many layers
        tag = model_tag(args.models[0], args.layers)
        saved = json.loads(Path(args.fit_from).read_text())["rows"]
        rows = [r for r in saved if r["model"] == tag and r["experts"] == args.experts[0]]
        if not rows:
            have = sorted({r["model"] for r in saved})
            p.error(f"{args.fit_from} has no rows of {tag} ({args.experts[0]}); it has {have} "
                    "(pass --layers N for a slice's rows)")  # fmt: skip
        try:
            check_fit(len({(r["batch"], r["tokens_per_seq"]) for r in rows}), args.fit_from)
        except ValueError as e:
            p.error(str(e))
        name = args.models[0]  # its config as the rows were measured (the real one loads)
        real = name == "smollm2-135m-instruct"
        cfg = harness.load(name)[0].cfg if real else harness.model_config(name, args.layers)
        args.argv = argv
        return fit_cost(cfg, rows, args, args.models[0], args.experts[0])
    if len(args.experts) > 2 or len(args.experts) == 2 and args.experts[0] != "bf16":
        p.error("--experts: one format, or bf16 then one quantised format made from its weights")
    if jax.default_backend() == "cpu":  # it runs anyway (a smoke test), slowly, so it says so
        print(f"{prog}: a GPU benchmark running on the CPU: a full-size model's steps take "
              "minutes here (--layers N times a slice)", file=sys.stderr)  # fmt: skip
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    main()
