"""Where is the drafter's held-out tau lost: the prompts, or the way training measures it?

The same drafter on four prompt sources, greedy, each set as one batch:
- held-out: first user turns of ShareGPT conversations from 16,000 on (the evaluation's set);
- train: first user turns of conversations 0..15,999, whose sampled answers it trained on;
- magpie: user turns the target writes itself (as the online rounds draw them, new seeds);
- humaneval: the coding set (evaluation only).
Per source: DFlash and DDTree tau from generation, DFlash's per-depth acceptance, and on AR's
own text the teacher-forced figures of bench/train_vs_generation.py: a chain replayed from
every position's accepted length (what generation gets) and the mean over all positions
(what training's `tau` metric estimates). A train >> held-out gap says the prompts it saw;
train ~ held-out with a high mean over positions says the metric, not the distribution.

    python bench/prompt_sources.py --num-prompts 16 --new 96 --out result.json
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import harness  # bench/ is the script directory
import numpy as np
from train_vs_generation import chain_steps, teacher_forced

import kdj
from kdj.train.evaluate import depth_rates
from kdj.train.loop import chat_prompts

SOURCES = ("held-out", "train", "magpie", "humaneval")
CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)  # the target's top-1 probability


def source_prompts(target, name: str, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """n chat prompts (token ids) from one source."""
    from kdj.train.data import humaneval_prompts, sharegpt_split

    if name in ("held-out", "train"):
        train, held = sharegpt_split()
        turns = held if name == "held-out" else train
        return chat_prompts(target.tokenizer, [m for _, m in turns][:n], max_tokens)
    if name == "humaneval":
        return chat_prompts(target.tokenizer, humaneval_prompts()[:n], max_tokens)
    if name == "magpie":
        from kdj.train.online import magpie_prompts

        data = SimpleNamespace(gen_batch_size=2 * n, max_prompt_tokens=max_tokens)
        cfg = SimpleNamespace(data=data)
        online = SimpleNamespace(magpie_max_tokens=160, magpie_temperature=1.0)
        prompts, _ = magpie_prompts(target, 2 * n, cfg, online, seed, capacity=max_tokens + 256)
        if len(prompts) < n:
            raise SystemExit(f"magpie: only {len(prompts)} acceptable turns of {2 * n} drawn")
        return prompts[:n]
    raise SystemExit(f"unknown source {name!r}; choose from {SOURCES}")


def by_confidence(conf: np.ndarray, first_right: np.ndarray) -> list[dict]:
    """Per bin of the target's confidence: the share of positions in it and how often the
    first draft there is right."""
    rows = []
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]):
        m = (conf >= lo) & ((conf < hi) | (hi == 1.0))
        right = float(first_right[m].mean()) if m.any() else None
        rows.append({"bin": [lo, hi], "share": float(m.mean()), "first_draft_right": right})
    return rows


def measure(target, drafter, prompts, new: int, budget: int, generation: bool = True) -> dict:
    """Generation tau (DFlash, DDTree) and the teacher-forced figures on AR's text, each
    pooled over the set as generation's tau is (tokens / steps, not a mean of sequences')."""
    kw = dict(max_new_tokens=new)  # stopping at the end of a turn, as the evaluation does
    ar = kdj.generate(target, prompts, method="ar", **kw)
    b = drafter.cfg.block_size
    forced = [teacher_forced(target, drafter, p, t, b) for p, t in zip(prompts, ar.tokens)]
    lengths = [x for x, _ in forced]
    # the last anchor has no next token to draft
    conf = np.concatenate([c[:-1] for _, c in forced])
    first = np.concatenate([x[:-1] >= 1 for x in lengths])
    made = [m for x in lengths for m in chain_steps(x)]
    out = {
        "prompts": len(prompts),
        "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
        "mean_response_tokens": float(np.mean([len(t) for t in ar.tokens])),
        "replayed_chain_tau": sum(made) / len(made),
        "mean_over_positions": float(np.concatenate(lengths).mean() + 1),
        "first_draft_right": float(first.mean()),
        "by_target_confidence": by_confidence(conf, first),
    }
    if generation:
        chain = kdj.generate(target, prompts, drafter=drafter, method="dflash", **kw).stats
        tree = kdj.generate(target, prompts, drafter=drafter, method="ddtree",
                            tree_budget=budget, **kw)  # fmt: skip
        out["dflash_tau"] = chain["mean_acceptance"]
        out[f"ddtree{budget}_tau"] = tree.stats["mean_acceptance"]
        out["dflash_depth_acceptance"] = depth_rates(chain["acceptance_lengths"], b - 1)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    ap.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts per source")
    ap.add_argument("--new", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--budget", type=int, default=16, help="DDTree's tree budget")
    ap.add_argument("--seed", type=int, default=900_001, help="magpie's draw (not a training seed)")
    ap.add_argument("--teacher-forced-only", action="store_true",
                    help="skip the DFlash / DDTree generation runs")  # fmt: skip
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="also write the result here (JSON)")
    return ap


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    target = kdj.load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = kdj.load_drafter(args.drafter, target=target)
    rows = {}
    for name in args.sources:
        prompts = source_prompts(target, name, args.num_prompts, args.max_prompt_tokens, args.seed)
        rows[name] = r = measure(target, drafter, prompts, args.new, args.budget,
                                 generation=not args.teacher_forced_only)  # fmt: skip
        gen = (f"DFlash {r['dflash_tau']:.3f}, DDTree {args.budget} "
               f"{r[f'ddtree{args.budget}_tau']:.3f}; " if "dflash_tau" in r else "")  # fmt: skip
        print(f"{name}: {gen}teacher-forced chain {r['replayed_chain_tau']:.3f}, mean over "
              f"positions {r['mean_over_positions']:.3f}; first draft right "
              f"{r['first_draft_right']:.3f}", flush=True)  # fmt: skip
    keys = ("drafter", "num_prompts", "new", "budget", "seed", "dtype", "teacher_forced_only")
    meta = {k: getattr(args, k) for k in keys}
    harness.write_result(args.out, {"meta": meta, "sources": rows}, argv)
    return rows


if __name__ == "__main__":
    main()
