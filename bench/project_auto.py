"""Projected decode throughput of AR, DFlash, DDTree and kdj's adaptive controller ("auto") on a
target we only have with random weights (default: the Moonlight-16B-A3B shape, an MoE).

Random weights give the target's step times but no acceptance, so this CPU-only script
combines three measurements, none of them new:

- the target's step time for B sequences x T new tokens, measured on the GPU by

      python bench/roofline.py --models moonlight-16b-a3b --tokens 1 16 17 65 257 \\
          --batches 1 4 16 64 256 --out roofline.json --fit-cost cost.json

  (T = 1 + draft nodes: AR 1, DFlash chain 15 -> 16, DDTree budgets 16/64/256 -> 17/65/257);
  a (B, T) pair missing there (skipped as too large) falls back to the fitted cost model's
  prediction at the roofline's context, marked "predicted";
- the kdj.cost.StepCost fitted by that run, plus the draft pass of a DFlash drafter of the
  published shape at the target's width (bench/drafters.yaml; params counted from abstract
  shapes);
- tau (tokens committed per step) and the drafter's calibrated forecast of it
  (mean_expected_acceptance) of every method on the real SmolLM2 pair, each taken at the
  batch closest to 16 (tau hardly depends on the batch).

Per draft shape and batch B:  step = target step(B, 1 + nodes) + draft_seconds(B, context)
(no draft pass for AR) and tokens/s = B * tau_real / step. "auto" replays the controller with
the real pair's forecasts as gains (kdj.decode.auto): if `drafting_pays` says no, it
decodes plainly (= AR); otherwise it verifies the `choose` argmax and gets that shape's
projected tokens/s, with the draft pass of the largest tree left on the menu. Before that, as
kdj.generate does, the menu is trimmed to the entries `paying_menu` says can pay at the batch
size, each priced at its real-pair tau (none left: auto = AR). Every number written is a
projection.

    python bench/project_auto.py --roofline roofline.json --cost cost.json \\
        --real smollm2_methods.json --out projected_auto.json

Writes JSON, a markdown table (.md, also printed) and a plot (.png) next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # post-processing only

import harness  # noqa: E402  (bench/ is the script directory)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from kdj.cost import StepCost  # noqa: E402
from kdj.decode import auto as controller  # noqa: E402
from kdj.decode.tree import DraftShape  # noqa: E402
from kdj.models.drafter import DrafterConfig, build_drafter  # noqa: E402

PLOTTED = {"ar": "AR", "dflash": "DFlash (chain 15)", "auto": "auto (kdj controller)"}


# ------------------------------------------------------------------------------ inputs
def load_roofline(path, model: str, experts: str) -> tuple[dict, int]:
    """({(batch, tokens_per_seq): measured seconds}, the context it was measured at) from
    bench/roofline.py's JSON: rows of this expert format (and model, when there are several);
    rows without a positive step_ms (or marked skipped) count as missing."""
    rows = [r for r in json.loads(Path(path).read_text())["rows"]
            if r.get("experts", "bf16") == experts]  # fmt: skip
    if len({r["model"] for r in rows}) > 1:
        rows = [r for r in rows if r["model"].startswith(Path(model).stem)]
    if len({r["model"] for r in rows}) != 1:
        raise ValueError(f"{path}: want rows of one model for {model} ({experts} experts)")
    steps = {}
    for r in rows:
        ms = r.get("step_ms")
        if not r.get("skipped") and isinstance(ms, (int, float)) and ms > 0:
            steps[(r["batch"], r["tokens_per_seq"])] = ms / 1e3
    return steps, int(rows[0].get("context", 512))


def load_real(path, methods) -> dict:
    """{method: {"tau", "forecast", "batch"}} from the real pair's JSON, each method at the
    batch closest to 16 that measured it (forecast: mean_expected_acceptance, AR: 1)."""
    rows = json.loads(Path(path).read_text())["rows"]
    out = {}
    for name in methods:
        have = [r for r in rows if name in r["methods"]]
        if not have:
            raise ValueError(f"{path}: no row measured method {name!r}")
        row = min(have, key=lambda r: (abs(r["batch"] - 16), r["batch"]))
        m = row["methods"][name]
        forecast = 1.0 if name == "ar" else m.get("mean_expected_acceptance", m["tau"])
        out[name] = {"tau": float(m["tau"]), "forecast": float(forecast), "batch": row["batch"]}
    return out


def drafter_params(dcfg: DrafterConfig) -> int:
    """Parameter count of the drafter, from abstract shapes (nothing allocated)."""
    abstract = nnx.eval_shape(lambda: build_drafter(dcfg))
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    return sum(int(np.prod(v.get_value().shape)) for _, v in flat)


# ------------------------------------------------------------------------------ projection
def menu(chain: int, budgets) -> dict[str, DraftShape]:
    """Method name (as in the real pair's JSON) -> the draft shape it verifies."""
    shapes = {"ar": DraftShape("none"), "dflash": DraftShape("chain", chain)}
    return shapes | {f"ddtree{b}": DraftShape("tree", b) for b in budgets}


def project(steps, roof_ctx, cost, real, shapes, batches, context) -> list[dict]:
    """One row per batch: every method's projected tokens/s and step time, auto's choice."""
    names = list(shapes)
    rows = []
    for B in batches:
        methods = {}
        for name, shape in shapes.items():
            T = 1 + shape.size
            measured = (B, T) in steps
            target_s = steps[(B, T)] if measured else float(cost.seconds(B, T, roof_ctx))
            nodes = shape.size if shape.kind == "tree" else 0  # the tree the draft builds
            draft_s = 0.0 if shape.kind == "none" else float(cost.draft_seconds(B, context, nodes))
            step = target_s + draft_s
            tau = 1.0 if name == "ar" else real[name]["tau"]
            methods[name] = {
                "tokens_per_s": B * tau / step, "step_ms": step * 1e3, "tau": tau,
                "target_ms": target_s * 1e3, "draft_ms": draft_s * 1e3, "tokens_per_seq": T,
                "target_step": "measured" if measured else "predicted",
            }  # fmt: skip
        # the controller: the menu trimmed to the entries the cost model says can pay at this
        # batch (priced at the real pair's tau), then fed the real pair's forecasts for every
        # sequence of the batch
        measured = {str(s): real[n]["tau"] for n, s in shapes.items() if s.kind != "none"}
        kept = controller.paying_menu(tuple(shapes.values()), cost, B, context,
                                       max(measured.values()), measured)  # fmt: skip
        kept_names = [n for n in names if shapes[n] in kept]
        pays, choice = False, "ar"
        if len(kept) > 1:
            gains = jnp.asarray([[real[n]["forecast"]] * B for n in kept_names])  # [S, B]
            active = jnp.ones((B,), bool)
            pays = bool(controller.drafting_pays(kept, gains, active, cost, context))
            # drafting pays => some shape beats plain even with the draft paid, so `choose`
            # (draft sunk) never picks "none" then: auto is one of the kept fixed methods
            if pays:
                choice = kept_names[int(controller.choose(kept, gains, active, cost, context))]
        auto = {**methods[choice], "choice": choice, "drafting_pays": pays,
                "menu": [str(s) for s in kept]}  # fmt: skip
        if choice != "ar":  # a drafting step builds the menu's largest tree, not its own
            m = methods[choice]
            draft_s = float(cost.draft_seconds(B, context, controller.largest_tree(kept)))
            step = m["target_ms"] / 1e3 + draft_s
            auto.update(tokens_per_s=B * m["tau"] / step, step_ms=step * 1e3,
                        draft_ms=draft_s * 1e3)  # fmt: skip
        methods["auto"] = auto
        best = max(names, key=lambda n: methods[n]["tokens_per_s"])
        rows.append({
            "batch": B, "methods": methods, "best_fixed": best,
            "auto_over_best_fixed": auto["tokens_per_s"] / methods[best]["tokens_per_s"],
            "auto_over_ar": auto["tokens_per_s"] / methods["ar"]["tokens_per_s"],
        })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------ reporting
def markdown(result: dict) -> str:
    names = [*result["shapes"], "auto"]
    lines = [
        f"Projected tokens/s (step ms) of {result['model']}, context {result['context']}; "
        f"tau from the real SmolLM2 pair; * = target step predicted by the cost model, "
        f"not measured.",
        "",
        "| batch | "
        + " | ".join(names)
        + " | auto choice | best fixed | auto / best | auto / AR |",
        "|---" * (len(names) + 5) + "|",
    ]
    for r in result["rows"]:
        cells = []
        for n in names:
            m = r["methods"][n]
            star = "*" if m["target_step"] == "predicted" else ""
            cells.append(f"{m['tokens_per_s']:.0f}{star} ({m['step_ms']:.2f})")
        lines.append(
            f"| {r['batch']} | " + " | ".join(cells) + f" | {r['methods']['auto']['choice']} "
            f"| {r['best_fixed']} | {r['auto_over_best_fixed']:.2f} | {r['auto_over_ar']:.2f} |"
        )
    lines += ["", "| method | real-pair tau | forecast | at batch |", "|---|---|---|---|"]
    for n, v in result["real_pair"].items():
        lines.append(f"| {n} | {v['tau']:.2f} | {v['forecast']:.2f} | {v['batch']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    batches = [r["batch"] for r in result["rows"]]
    for name in [*result["shapes"], "auto"]:
        ms = [r["methods"][name] for r in result["rows"]]
        label = PLOTTED.get(name, name.replace("ddtree", "DDTree "))
        style = dict(lw=2.5, color="k") if name == "auto" else {}
        (line,) = ax.plot(batches, [m["tokens_per_s"] for m in ms], "o-", label=label, **style)
        pred = [(b, m["tokens_per_s"]) for b, m in zip(batches, ms)
                if m["target_step"] == "predicted"]  # fmt: skip
        if pred:  # predicted target step: hollow marker
            ax.plot(*zip(*pred), "o", mfc="white", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("projected tokens/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(f"projected: {result['model']} step times x SmolLM2-pair tau "
                 "(hollow: predicted step)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="project_auto", description=__doc__.splitlines()[0])
    p.add_argument("--roofline", required=True, help="bench/roofline.py JSON")
    p.add_argument("--cost", required=True, help="StepCost JSON fitted by that run")
    p.add_argument("--real", required=True, help="per-method tau of the real SmolLM2 pair")
    p.add_argument("--out", required=True, help="JSON path; .md and .png are written beside it")
    p.add_argument("--model", default="moonlight-16b-a3b", help="configs/models name or YAML")
    p.add_argument("--experts", default="bf16", help="roofline rows of this expert format")
    p.add_argument("--drafter-shape", default="moonlight-16b-a3b",
                   help="the bench/drafters.yaml shape priced for the draft pass")  # fmt: skip
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256])
    p.add_argument("--context", type=int, default=512 + 64, help="prompt + half the new tokens")
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)

    cfg = harness.model_config(args.model)
    steps, roof_ctx = load_roofline(args.roofline, args.model, args.experts)
    dcfg = harness.drafter_config(cfg, args.drafter_shape)
    n_params = drafter_params(dcfg)
    cost = StepCost.load(args.cost).with_drafter(dcfg, n_params, cfg)
    shapes = menu(dcfg.block_size - 1, args.budgets)
    real = load_real(args.real, shapes)
    result = {
        "projected": True,
        "model": args.model,
        "inputs": {"roofline": args.roofline, "cost": args.cost, "real": args.real},
        "context": args.context,
        "roofline_context": roof_ctx,
        "drafter": {
            "layers": dcfg.layers.num_layers,
            "heads": dcfg.layers.num_heads,
            "kv_heads": dcfg.layers.num_kv_heads,
            "head_dim": dcfg.layers.head_dim,
            "ffn": dcfg.layers.intermediate_size,
            "block_size": dcfg.block_size,
            "params": n_params,
        },
        "shapes": {n: str(s) for n, s in shapes.items()},
        "real_pair": real,
        "rows": project(steps, roof_ctx, cost, real, shapes, args.batches, args.context),
    }
    out = Path(args.out)
    result = harness.write_result(out, result, argv)
    table = markdown(result)
    out.with_suffix(".md").write_text(table)
    plot(result, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
