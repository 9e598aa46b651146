"""Does the drafter accept at generation time what its training forward says it would?

On held-out prompts: greedy AR text, then the training forward (kdj.train.forward) drafts a
block at EVERY position of that text, teacher-forced; each position's accepted length is the
run of drafts matching the text. Replaying those lengths as a chain (anchor, accept k, next
anchor k + 1 further on) must give the DFlash generation's tau on the same prompts, up to the
last step's cut; a gap would be a train/inference mismatch (features, positions, masks).
Also printed: the mean over all positions (what training's `tau` metric estimates).

    python bench/train_vs_generation.py --num-prompts 6 --new 64 --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np

import kdj
from kdj.models.transformer import full_sequence
from kdj.train.forward import drafter_blocks
from kdj.train.loop import chat_prompts


def teacher_forced(target, drafter, prompt, text, b: int) -> tuple[np.ndarray, np.ndarray]:
    """For each position p of the response (anchor = token p), teacher-forced: the drafts
    accepted from it, and the target's top-1 probability there (its distribution for token
    p + 1, which the first draft from p must match). One target pass gives both."""
    seq = list(prompt) + list(text)
    # room for the last blocks' labels, in steps of 128 so that prompts share compiled passes
    padded = seq + [0] * (-(-(len(seq) + b) // 128) * 128 - len(seq))
    tokens = jnp.asarray([padded], jnp.int32)
    logits, taps = full_sequence(target.graphdef, target.state, tokens,
                                 taps=tuple(drafter.cfg.target_layer_ids))  # fmt: skip
    feats = jnp.asarray(taps, jnp.float32).reshape(1, len(padded), -1)
    anchors = jnp.arange(len(prompt), len(seq), dtype=jnp.int32)[None]
    h = drafter_blocks(drafter.model, target.model.embed[...], feats, tokens, anchors)
    pred = np.asarray(jnp.argmax(target.model.logits(h[:, :, 1:]), -1))[0]  # [N, b - 1]
    truth = np.array(seq + [-1] * b)
    lengths = np.array([np.cumprod(pred[i] == truth[a + 1 : a + b]).sum()
                        for i, a in enumerate(range(len(prompt), len(seq)))])  # fmt: skip
    probs = jax.nn.softmax(logits[0, len(prompt) : len(seq)].astype(jnp.float32), -1)
    return lengths, np.asarray(probs.max(-1))


def chain_steps(lengths: np.ndarray) -> list[int]:
    """Tokens each step of a chain commits when it accepts lengths[p] drafts at anchor p
    (+1 bonus) and anchors again past them."""
    p, made = 0, []
    while p < len(lengths) - 1:
        made.append(int(lengths[p]) + 1)
        p += made[-1]
    return made


def chain_tau(lengths: np.ndarray) -> float:
    """Tokens per step of that chain."""
    made = chain_steps(lengths)
    return sum(made) / max(len(made), 1)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="smollm2-135m-dflash-b16")
    ap.add_argument("--prompts", default=".traincache/data/eval_prompts.json")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="also write the result here (JSON)")
    return ap


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    target = kdj.load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = kdj.load_drafter(args.drafter, target=target)
    held = json.load(open(args.prompts))["sharegpt"][: args.num_prompts]
    prompts = chat_prompts(target.tokenizer, held, 512)
    kw = dict(max_new_tokens=args.new, stop_tokens=[])
    ar = kdj.generate(target, prompts, method="ar", **kw)
    gen = kdj.generate(target, prompts, drafter=drafter, method="dflash", **kw)
    b = drafter.cfg.block_size
    lengths = [teacher_forced(target, drafter, p, t, b)[0] for p, t in zip(prompts, ar.tokens)]
    out = {
        "generation_tau": gen.stats["mean_acceptance"],
        "replayed_chain_tau": float(np.mean([chain_tau(x) for x in lengths])),
        "mean_over_positions": float(np.mean([x.mean() + 1 for x in lengths])),
    }
    print(out)
    meta = {k: getattr(args, k) for k in ("drafter", "num_prompts", "new", "dtype")}
    harness.write_result(args.out, {"meta": meta, **out}, argv)
    return out


if __name__ == "__main__":
    main()
