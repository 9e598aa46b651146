"""The drafter's training step: step time, tokens/s, FLOPs and MFU, the chunked lm_head
against the full-logits step in the same run.

    python bench/train_step.py --out $OUT/train_step.json               # the online config
    python bench/train_step.py --chunks 4096 8192 16384 --out r.json    # head_chunk A/B
    python bench/train_step.py --smoke --target tiny.yaml --out r.json  # CPU, a tiny target

The shape is a training config's (--config, default configs/train/smollm2-online.yaml: the
shipped 2-layer drafter, 32 sequences x 640 tokens, 128 blocks of 16 each, target labels);
--batch/--anchors/--max-len/--labels override it. The target is the config's (real weights
for smollm2-135m-instruct; --target: a configs/models name or YAML, random weights) and the
drafter starts from the config's init_from where the target is the real one (the timing does
not depend on the weights; the step-0 loss and hits of the A/B then mean something).
Sequences are random tokens, the loss on their last three quarters.

Cases, each compiled and warmed up (--warmup steps), then --steps steps queued back to back
with one sync at the end, the host's batch making included (as the training loop runs):
    chunked/<c>   DrafterTrainer.train_step with optim.head_chunk c: the product step
    reference     the same step with the [B, N, b-1, V] and [B, S, V] float32 logits made
                  whole (the step before kdj/train/head.py; reference_loss below)
    parts         the frozen target pass alone and the lm_head + cross-entropy with its input
                  gradient alone, chunked and full (the rest of the step is the drafter)
    --profile N   N product steps under jax.profiler.trace, device time summed per kernel and
                  category (bench/profile_step.py's summary): where the step's time goes
The cases start from the same weights and batch: their step-0 loss, acc and tau are reported
side by side (equal up to bf16 rounding).

FLOPs per step are counted from the shapes (step_flops): the target's forward through its
last tapped layer (with labels "target" all of it and the lm_head on every position; with
"distribution" all of it and the lm_head on every draft slot), the drafter's forward and
backward (its fc gets only a weight gradient) and the lm_head on the draft slots, forward
and input gradient. Attention counts every score the dense einsums
compute (context positions past a block's anchor included). MFU is against the H200's bf16
dense spec (989 TFLOP/s) and the 808 TFLOP/s an 8192^3 bf16 matmul reached through jax.jit
on it (shared/reference/ANCHORS.md); --matmul-size measures that rate in this run too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from pathlib import Path

import harness  # bench/ is the script directory
import jax
import jax.numpy as jnp
import numpy as np
import optax
import profile_step
from flax import nnx

from kdj.models.transformer import full_sequence
from kdj.train.config import LABELS, OptimConfig, TrainConfig
from kdj.train.forward import (
    block_labels,
    drafter_blocks,
    head_weight,
    slot_weights,
    target_pass,
)
from kdj.train.head import head_cross_entropy
from kdj.train.trainer import DrafterTrainer, make_optimizer

PEAK_SPEC = 989e12  # H200 SXM bf16 dense tensor-core spec
PEAK_MATMUL = 808e12  # bf16 8192^3 matmul through jax.jit on the H200 (ANCHORS.md)


# ------------------------------------------------------------------------------ FLOPs
def _dims(cfg):
    H = cfg.num_heads
    return cfg.hidden_size, H, cfg.num_kv_heads or H, cfg.head_dim or cfg.hidden_size // H


def layer_flops(cfg, tokens: int, keys: int) -> int:
    """Forward FLOPs of one dense GQA layer on `tokens` tokens, each attending `keys` keys:
    q, k, v, o, the SwiGLU MLP, and the scores and weighted values."""
    D, H, KVH, hd = _dims(cfg)
    proj = 2 * D * H * hd + 2 * D * KVH * hd + 3 * D * cfg.intermediate_size
    return 2 * tokens * proj + 4 * tokens * H * hd * keys


def step_flops(target_cfg, dcfg, batch: int, seq: int, anchors: int, labels: str) -> dict:
    """FLOPs of one training step by part (see the module docstring)."""
    t = target_cfg
    if t.family != "llama" or t.n_routed_experts:
        raise ValueError("step_flops counts dense GQA targets (llama family, no MoE)")
    B, S, N, b = batch, seq, anchors, dcfg.block_size
    D, V = t.hidden_size, t.vocab_size
    tapped = max(dcfg.target_layer_ids) + 1
    head = 2 * D * V
    out = {"target": tapped * layer_flops(t, B * S, S)}
    if labels != "tokens":  # the layers after the last tap, and the lm_head on every
        # position (the argmax) or on every draft slot (the target's distribution)
        rows = B * S if labels == "target" else B * N * (b - 1)
        out["target_labels"] = (t.num_layers - tapped) * layer_flops(t, B * S, S) + rows * head
    dl = dcfg.layers
    _, _, KVH, hd = _dims(dl)
    fc = 2 * B * S * len(dcfg.target_layer_ids) * D * D
    ctx_kv = 2 * B * S * D * 2 * KVH * hd  # each layer's context K/V (shared by all blocks)
    layers = dl.num_layers * (ctx_kv + layer_flops(dl, B * N * b, S + b))
    out["drafter"] = 2 * fc + 3 * layers  # forward + backward; the fc's input is frozen
    out["draft_head"] = 2 * B * N * (b - 1) * head  # the logits and their input gradient
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------ reference
def reference_loss(params, dgraph, tgraph, tstate, batch, cfg):
    """The training loss with every logit made whole: the [B, S, V] target logits for the
    greedy labels and the [B, N, b-1, V] draft logits, float32 (what kdj.train.forward did
    before kdj/train/head.py)."""
    tokens, loss_mask, anchors, ok = batch
    target = nnx.merge(tgraph, tstate)
    drafter = nnx.merge(dgraph, jax.tree.map(lambda p: p.astype(cfg.compute_dtype), params))
    b = drafter.cfg.block_size
    logits_t, taps = full_sequence(tgraph, tstate, tokens, taps=tuple(drafter.cfg.target_layer_ids))
    feats = jax.lax.stop_gradient(taps.reshape(*tokens.shape, -1))
    greedy = jnp.argmax(logits_t, -1).astype(jnp.int32) if cfg.labels == "target" else None
    h = drafter_blocks(drafter, target.embed[...], feats, tokens, anchors)
    logits = target.logits(h[:, :, 1:].astype(target.embed[...].dtype))
    labels, valid = block_labels(tokens, loss_mask, anchors, ok, b, greedy)
    if cfg.labels == "distribution":  # slot k: the target's distribution after a + k - 1
        B, N = anchors.shape
        at = (anchors[:, :, None] + jnp.arange(b - 1)).reshape(B, -1)
        t_logits = jnp.take_along_axis(logits_t, at[..., None], axis=1).reshape(logits.shape)
        gold = jnp.sum(jax.nn.softmax(t_logits.astype(jnp.float32), -1) * logits, -1)
        labels = jnp.argmax(t_logits, -1)
    else:
        gold = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    ce = jax.nn.logsumexp(logits, -1) - gold
    w = jnp.asarray(slot_weights(b, cfg.gamma)) * valid
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    hit = (jnp.argmax(logits, -1) == labels) & valid
    metrics = {
        "acc": jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(valid[..., 0]), 1),
        "tau": jnp.sum(jnp.sum(jnp.cumprod(hit, -1), -1) + ok) / jnp.maximum(jnp.sum(ok), 1),
    }
    return loss, metrics


@functools.partial(
    jax.jit, static_argnames=("optim", "dgraph", "tgraph"), donate_argnames=("params", "opt_state")
)
def reference_step(params, opt_state, tstate, batch, *, optim: tuple, dgraph, tgraph):
    """The trainer's AdamW step (kdj.train.trainer) around reference_loss. optim: OptimConfig
    as a tuple (hashable), as the trainer passes it."""
    cfg = OptimConfig(*optim)
    (loss, metrics), grads = jax.value_and_grad(reference_loss, has_aux=True)(
        params, dgraph, tgraph, tstate, batch, cfg
    )
    updates, opt_state = make_optimizer(cfg).update(grads, opt_state, params)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return optax.apply_updates(params, updates), opt_state, metrics


# ------------------------------------------------------------------------------ cases
def timed_steps(step, warmup: int, steps: int) -> dict:
    """step() -> metrics (one optimiser step, queued): compile + first step, warm-up, then
    `steps` steps back to back with one sync. The first step's metrics are step 0's."""
    t = time.perf_counter()
    first = jax.device_get(step())
    compile_s = time.perf_counter() - t
    for _ in range(warmup - 1):
        out = step()
    if warmup > 1:
        jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(steps):
        out = step()
    jax.block_until_ready(out)
    sec = (time.perf_counter() - t) / steps
    return {"step_ms": 1e3 * sec, "compile_s": compile_s,
            **{f"{k}0": float(first[k]) for k in ("loss", "acc", "tau", "grad_norm")}}  # fmt: skip


def chunked_case(trainer, warmup, steps) -> dict:
    # a step's metrics come out of the same executable as its new weights: syncing on the
    # last metrics waits for the last step
    return timed_steps(trainer.train_step, warmup, steps)


def reference_case(trainer, warmup, steps) -> dict:
    """reference_step on the trainer's weights, optimiser state and batches."""
    state = {"params": trainer.params, "opt_state": trainer.opt_state, "step": 0}
    optim = dataclasses.astuple(trainer.optim)

    def step():
        batch = tuple(jnp.asarray(x) for x in trainer.batch(state["step"]))
        state["params"], state["opt_state"], m = reference_step(
            state["params"], state["opt_state"], trainer.target.state, batch, optim=optim,
            dgraph=trainer.graphdef, tgraph=trainer.target.graphdef,
        )  # fmt: skip
        state["step"] += 1
        return m

    return timed_steps(step, warmup, steps)


def profiled_steps(trainer, steps: int, top: int) -> dict:
    """The product step traced `steps` times after one warm step: profile_step's summary
    (categories, heaviest kernels) of every device kernel in the trace."""
    jax.block_until_ready(trainer.train_step())
    trace_dir = Path(tempfile.mkdtemp(prefix="kdj_train_profile_"))
    with jax.profiler.trace(str(trace_dir)):
        t = time.perf_counter()
        for _ in range(steps):
            out = trainer.train_step()
        jax.block_until_ready(out)
        traced_s = time.perf_counter() - t
    summary = profile_step.summarise(profile_step.read_events(trace_dir), traced_s, steps, None)
    summary["kernels"] = summary["kernels"][:top]
    return {"case": f"profile of {steps} steps", "steps": steps, **summary}


def parts_case(trainer, repeats: int) -> dict:
    """ms of the frozen target pass, and of the draft-slot lm_head + cross-entropy with its
    input gradient chunked and full, at the step's shapes."""
    tgt, cfg, o = trainer.target, trainer.cfg, trainer.optim
    tokens, mask, anchors, ok = (jnp.asarray(x) for x in trainer.batch(0))
    ids = tuple(cfg.target_layer_ids)
    tpass = jax.jit(lambda s, t: target_pass(tgt.graphdef, s, t, ids, o.labels, o.head_chunk))
    out = {"target_pass_ms": 1e3 * harness.chained(lambda: tpass(tgt.state, tokens), repeats)}
    w = head_weight(tgt.model)
    B, N, b = *anchors.shape, cfg.block_size
    key = jax.random.key(0)
    h = jax.random.normal(key, (B, N, b - 1, w.shape[0]), w.dtype)
    soft = o.labels == "distribution"  # labels: the target's states, else token ids
    labels = (jax.random.normal(jax.random.key(1), h.shape, w.dtype) if soft
              else jax.random.randint(key, (B, N, b - 1), 0, w.shape[1]))  # fmt: skip
    weights = jnp.ones((B, N, b - 1), jnp.float32)

    def full(h):
        logits = jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)
        if soft:
            t = jnp.einsum("...d,dv->...v", labels, w, preferred_element_type=jnp.float32)
            gold, best = jnp.sum(jax.nn.softmax(t, -1) * logits, -1), jnp.argmax(t, -1)
        else:
            gold, best = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0], labels
        ce = jax.nn.logsumexp(logits, -1) - gold
        return jnp.sum(weights * ce), jnp.argmax(logits, -1) == best

    heads = {
        "head_chunked_ms": lambda h: head_cross_entropy(h, w, labels, weights, o.head_chunk),
        "head_full_ms": full,
    }
    for name, fn in heads.items():
        grad = jax.jit(jax.value_and_grad(fn, has_aux=True))
        try:
            out[name] = 1e3 * harness.chained(lambda g=grad: g(h), repeats)
        except Exception as e:  # noqa: BLE001 - a part that runs out of memory is a result
            out[name] = repr(e)[:300]
    return out


# ------------------------------------------------------------------------------ main
def setup(args):
    """(config, target, target kind, drafter config, init_from, grow, tokens, loss_mask)."""
    cfg = TrainConfig.from_yaml(args.config)
    o = dataclasses.replace(
        cfg.optim,
        batch_size=args.batch or cfg.optim.batch_size,
        anchors_per_seq=args.anchors or cfg.optim.anchors_per_seq,
        max_len=args.max_len or cfg.optim.max_len,
        labels=args.labels or cfg.optim.labels,
    )
    cfg = dataclasses.replace(cfg, optim=o)
    target, kind = harness.load(args.target or cfg.target, dtype=cfg.target_dtype)
    fields = dataclasses.asdict(cfg.drafter)
    init_from, grow = fields.pop("init_from"), fields.pop("grow")
    if kind != "real":  # a random target: no trained drafter fits it
        init_from, grow = None, False
    if max(fields["target_layer_ids"] or [0]) >= target.cfg.num_layers:
        fields.pop("target_layer_ids")  # a shallow target's own rule (harness.drafter_config)
    dcfg = harness.drafter_config(target.cfg, "", **fields)
    rng = np.random.default_rng(0)
    S = o.max_len
    tokens = rng.integers(0, target.cfg.vocab_size, (2 * o.batch_size, S)).astype(np.int32)
    mask = np.broadcast_to(np.arange(S) >= S // 4, tokens.shape).copy()
    return cfg, target, kind, dcfg, init_from, grow, tokens, mask


def markdown(rows: list[dict]) -> str:
    cols = ["case", "step ms", "seq tokens/s", "draft slots/s", "TFLOP/s", "MFU 989", "MFU 808",
            "speedup", "loss0", "acc0", "tau0"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['case']} | {r['step_ms']:.2f} | {r['seq_tokens_per_s']:,.0f} | "
            f"{r['draft_slots_per_s']:,.0f} | {r['tflops']:.1f} | {r['mfu_spec']:.1%} | "
            f"{r['mfu_matmul']:.1%} | {r.get('speedup', 1.0):.2f}x | {r['loss0']:.4f} | "
            f"{r['acc0']:.4f} | {r['tau0']:.4f} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(harness.ROOT / "configs/train/smollm2-online.yaml"))
    p.add_argument("--target", help="default: the config's (configs/models name or YAML: random)")
    p.add_argument("--batch", type=int, help="sequences per step (default: the config's)")
    p.add_argument("--anchors", type=int, help="blocks per sequence (default: the config's)")
    p.add_argument("--max-len", type=int, help="tokens per sequence (default: the config's)")
    p.add_argument("--labels", choices=LABELS, help="default: the config's")
    p.add_argument(
        "--chunks", type=int, nargs="*", help="head_chunk values (default: the config's)"
    )
    p.add_argument("--no-reference", action="store_true", help="skip the full-logits case")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timing (compile: 1)")
    p.add_argument("--matmul-size", type=int, default=8192, help="n^3 matmul rate; 0: skip")
    p.add_argument("--smoke", action="store_true",
                   help="a CPU-sized shape: 2 x 48 tokens, 4 blocks each, 2 steps")  # fmt: skip
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also trace N product steps, time per kernel and category")  # fmt: skip
    p.add_argument("--top", type=int, default=30, help="kernels kept in the profile")
    p.add_argument("--out")
    return p


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.smoke:
        args.batch, args.anchors, args.max_len = args.batch or 2, args.anchors or 4, 48
        args.steps, args.warmup = min(args.steps, 2), 1
        args.matmul_size = min(args.matmul_size, 64)
    cfg, target, kind, dcfg, init_from, grow, tokens, mask = setup(args)
    o = cfg.optim
    B, S, N, b = o.batch_size, o.max_len, o.anchors_per_seq, dcfg.block_size
    flops = step_flops(target.cfg, dcfg, B, S, N, o.labels)
    measured = harness.matmul_rate(args.matmul_size) if args.matmul_size else None
    meta = {
        "config": args.config, "target": target.name, "weights": kind, "init_from": init_from,
        "batch": B, "max_len": S, "anchors": N, "block_size": b, "labels": o.labels,
        "drafter_layers": dcfg.layers.num_layers, "target_layer_ids": dcfg.target_layer_ids,
        "seq_tokens": B * S, "draft_slots": B * N * (b - 1), "flops": flops,
        "peak_spec": PEAK_SPEC, "peak_matmul": PEAK_MATMUL, "matmul_rate_measured": measured,
    }  # fmt: skip
    print(f"{jax.devices()[0].device_kind}: {B} x {S} tokens, {N} blocks of {b}, labels "
          f"{o.labels}; {flops['total'] / 1e12:.2f} TFLOP per step "
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items() if k != "total"))  # fmt: skip
    if measured:
        print(f"bf16 {args.matmul_size}^3 matmul: {measured / 1e12:.1f} TFLOP/s")
    rows, result = [], {"meta": meta}

    def trainer_for(chunk):
        optim = dataclasses.replace(o, head_chunk=chunk)
        return DrafterTrainer(target, dcfg, optim, tokens, mask, init_from=init_from, grow=grow)

    cases = [(f"chunked/{c}", c) for c in (args.chunks or [o.head_chunk])]
    if not args.no_reference:
        cases.append(("reference", o.head_chunk))
    for name, chunk in cases:
        row = {"case": name, "head_chunk": None if name == "reference" else chunk}
        try:
            run = reference_case if name == "reference" else chunked_case
            row |= run(trainer_for(chunk), args.warmup, args.steps)
            sec = row["step_ms"] / 1e3
            row |= {"seq_tokens_per_s": B * S / sec, "draft_slots_per_s": B * N * (b - 1) / sec,
                    "tflops": flops["total"] / sec / 1e12,
                    "mfu_spec": flops["total"] / sec / PEAK_SPEC,
                    "mfu_matmul": flops["total"] / sec / PEAK_MATMUL}  # fmt: skip
            if measured:
                row["mfu_measured"] = flops["total"] / sec / measured
        except Exception as e:  # noqa: BLE001 - a case that runs out of memory is a result
            row["error"] = repr(e)[:300]
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:  # the process's peak so far (cases run in order)
            row["peak_gb_so_far"] = stats["peak_bytes_in_use"] / 2**30
        rows.append(row)
        print(row, flush=True)
        result = harness.write_result(args.out, {"meta": meta, "rows": rows}, argv)
    ref = next((r for r in rows if r["case"] == "reference" and "error" not in r), None)
    for r in rows:
        if ref and "error" not in r:
            r["speedup"] = ref["step_ms"] / r["step_ms"]
    parts = parts_case(trainer_for(cases[0][1]), max(args.steps // 2, 1))
    print(parts)
    result = harness.write_result(args.out, {"meta": meta, "rows": rows, "parts": parts}, argv)
    if args.profile:
        prof = profiled_steps(trainer_for(cases[0][1]), args.profile, args.top)
        print(f"{prof['case']}: {prof['traced_wall_ms_per_step']:.1f} ms a step traced, "
              f"device busy {prof['busy_ms_per_step']:.1f}")  # fmt: skip
        for name, c in prof["categories"].items():
            print(f"  {name:<20} {c['us_per_step'] / 1e3:8.2f} ms a step")
        for k in prof["kernels"]:
            print(f"  {k['us_per_step'] / 1e3:8.2f} ms {k['count'] / prof['steps']:6.1f}x  "
                  f"{k['category']:<20} {k['name'][:70]}")  # fmt: skip
        result = harness.write_result(args.out, dict(result, profile=prof), argv)
    print(markdown(rows))
    return result


if __name__ == "__main__":
    main()
