"""The drafter training loop: AdamW with warmup + cosine decay, gradient clipping, float32
master params with a bfloat16 (configurable) forward, Orbax checkpoints with exact resume,
periodic held-out acceptance, and export to the published DFlash format. Training can start
from an existing drafter's weights (drafter.init_from: continue training a shipped drafter
with a fresh optimiser and schedule).

The target is frozen and only read: its embedding table and lm_head are the drafter's too
(the drafter owns neither), so nothing of the target enters the optimiser.

Determinism: the batch of step t (sequences and anchors) is a function of (seed, t) alone,
so a run restored from the checkpoint of step t takes exactly the step t + 1 the
uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from kdj.handles import Drafter
from kdj.loading import load_drafter
from kdj.models.drafter import DrafterConfig, build_drafter, default_target_layer_ids
from kdj.train.config import DrafterShape, OptimConfig, TrainConfig
from kdj.train.data import settings_diff
from kdj.train.forward import block_loss, sample_anchors, target_features


def drafter_config_for(target_cfg, shape: DrafterShape) -> DrafterConfig:
    """A Qwen3-style drafter config sized for this target (hidden size and vocabulary are the
    target's; heads, FFN width and feature layers as `shape` says, else the target's)."""
    t = target_cfg
    ids = shape.target_layer_ids or default_target_layer_ids(t.num_layers, shape.num_layers)
    heads = shape.num_heads or t.num_heads
    layers = t.replace(
        family="llama",
        model_type="qwen3",
        num_layers=shape.num_layers,
        qk_norm=True,
        num_heads=heads,
        num_kv_heads=shape.num_kv_heads or t.num_kv_heads or heads,
        head_dim=shape.head_dim or t.head_dim or t.hidden_size // heads,
        intermediate_size=shape.intermediate_size or t.intermediate_size,
        qkv_bias=False,
        o_bias=False,
        tie_word_embeddings=False,
        n_routed_experts=0,
        first_k_dense_replace=0,
    )
    return DrafterConfig(
        layers=layers,
        block_size=shape.block_size,
        mask_token_id=shape.mask_token_id,
        target_layer_ids=tuple(int(i) for i in ids),
        num_target_layers=t.num_layers,
    )


def _shape_fields(cfg: DrafterConfig) -> dict:
    """What must agree between a drafter to start from and the drafter being trained."""
    lc = cfg.layers
    return {
        "num_layers": lc.num_layers,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": tuple(cfg.target_layer_ids),
        "num_target_layers": cfg.num_target_layers,
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_heads": lc.num_heads,
        "num_kv_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "vocab_size": lc.vocab_size,
        "rope_theta": lc.rope_theta,
        "layer_types": tuple(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
    }


def load_init_params(source, drafter_cfg: DrafterConfig, grow: bool = False) -> dict:
    """The weights of an existing DFlash drafter (a published-format directory or a built-in
    name, read by kdj.load_drafter) as a float32 pure dict for a trainer of `drafter_cfg`.

    Raises ValueError naming every field where the checkpoint and `drafter_cfg` disagree
    (layers, block size, mask token, feature layers, widths, ...); a checkpoint that leaves a
    field unset (num_target_layers -1, vocab_size 0) is not held to it. grow: the checkpoint
    may have fewer layers than `drafter_cfg` (see grown_params)."""
    loaded = load_drafter(source, dtype=jnp.float32)
    have, want = _shape_fields(loaded.cfg), _shape_fields(drafter_cfg)
    unset = {"num_target_layers": -1, "vocab_size": 0}
    if grow:  # the layer count (and the per-layer types it sizes) may only increase
        if have["num_layers"] > want["num_layers"]:
            raise ValueError(
                f"drafter.grow: {str(source)!r} has {have['num_layers']} layers, more than the "
                f"{want['num_layers']} configured"
            )
        for k in ("num_layers", "layer_types"):
            have[k] = want[k]
    bad = [
        f"{k}: {have[k]} in the checkpoint, {want[k]} configured"
        for k in want
        if have[k] != want[k] and have[k] != unset.get(k, object())
    ]
    if bad:
        raise ValueError(
            f"drafter.init_from {str(source)!r} does not match the drafter to train "
            f"(the config's drafter section and the target): {'; '.join(bad)}"
        )
    return nnx.to_pure_dict(loaded.state)


def grown_params(fresh: dict, init: dict) -> dict:
    """A deeper drafter that drafts exactly as `init` does: init's layers first, then the
    fresh layers as identity blocks (attention output and MLP down projections zero, so each
    adds nothing to the residual stream until training moves them)."""
    out = dict(fresh, fc=init["fc"], hidden_norm=init["hidden_norm"], norm=init["norm"])
    layers = dict(fresh["layers"])
    for i in layers:
        if i in init["layers"]:
            layers[i] = init["layers"][i]
        else:
            layer = jax.tree.map(lambda x: x, layers[i])
            layer["attn"]["o"]["kernel"] = jnp.zeros_like(layer["attn"]["o"]["kernel"])
            layer["mlp"]["down"]["kernel"] = jnp.zeros_like(layer["mlp"]["down"]["kernel"])
            layers[i] = layer
    out["layers"] = layers
    return out


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.end_lr_frac
    )
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def _loss(params, dgraph, tgraph, tstate, batch, compute_dtype, gamma):
    tokens, loss_mask, anchors, ok = batch
    target = nnx.merge(tgraph, tstate)
    low = jax.tree.map(lambda p: p.astype(compute_dtype), params)  # f32 masters -> compute
    drafter = nnx.merge(dgraph, low)
    feats = target_features(tgraph, tstate, tokens, drafter.cfg.target_layer_ids)
    return block_loss(drafter, target, feats, tokens, loss_mask, anchors, ok, gamma)


@functools.partial(
    jax.jit, static_argnames=("optim", "dgraph", "tgraph"), donate_argnames=("params", "opt_state")
)
def _train_step(params, opt_state, tstate, batch, *, optim: tuple, dgraph, tgraph):
    """One AdamW step. optim: OptimConfig as a tuple (hashable: part of the jit key, so
    trainers of one config and graphs share the compiled step through jit's own cache)."""
    cfg = OptimConfig(*optim)
    tx = make_optimizer(cfg)
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(
        params, dgraph, tgraph, tstate, batch, jnp.dtype(cfg.compute_dtype), cfg.gamma
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics


class DrafterTrainer:
    """Trains a DFlash drafter against a frozen kdj target on cached (tokens, loss_mask).

    tokens [N, S] int32 and loss_mask [N, S] bool (True on the response tokens the drafter
    learns to draft) are host arrays; each step takes optim.batch_size rows.

    init_from: an existing DFlash drafter (directory or built-in name) to start from instead
    of the random initialisation (load_init_params; a shape mismatch is a ValueError); with
    grow, it may have fewer layers (grown_params). The optimiser and schedule start fresh
    either way; restore() then overrides both.
    """

    def __init__(
        self,
        target,
        drafter_cfg: DrafterConfig,
        optim: OptimConfig,
        tokens,
        loss_mask,
        out_dir=None,
        init_from=None,
        grow: bool = False,
    ):
        self.target, self.optim, self.cfg = target, optim, drafter_cfg
        self.tokens, self.loss_mask = np.asarray(tokens, np.int32), np.asarray(loss_mask, bool)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        model = build_drafter(drafter_cfg, jnp.float32, seed=optim.seed)
        if init_from is not None:  # replace the random weights before any sharding
            state = nnx.state(model)
            fresh = nnx.to_pure_dict(state)
            init = load_init_params(init_from, drafter_cfg, grow=grow)
            if grow:
                init = grown_params(fresh, init)
            if jax.tree.map(jnp.shape, init) != jax.tree.map(jnp.shape, fresh):
                raise ValueError(f"drafter.init_from {str(init_from)!r}: parameter shapes differ")
            nnx.replace_by_pure_dict(state, init)
            nnx.update(model, state)
        if target.sharding is not None:  # the drafter lives on its target's mesh
            from kdj.sharding.apply import shard_model

            shard_model(model, target.sharding)
        self.graphdef, self.params = nnx.split(model)
        self.opt_state = make_optimizer(optim).init(self.params)
        self.step = 0
        self.data_start = 0  # the step the current data (set_data) started at
        self._ckpt = None

    # ------------------------------------------------------------------ data
    def batch(self, step: int):
        """The batch of `step`: rows of a per-epoch permutation of the current data (seeded by
        epoch, counted from set_data) and random anchors seeded by step. Returns host arrays
        (tokens, loss_mask, anchors, anchor_ok)."""
        n, bs = len(self.tokens), self.optim.batch_size
        per_epoch = max(1, n // bs)
        epoch, i = divmod(step - self.data_start, per_epoch)
        perm = np.random.default_rng([self.optim.seed, epoch]).permutation(n)
        rows = perm[i * bs : (i + 1) * bs]
        if rows.size < bs:  # fewer sequences than one batch: wrap around
            rows = np.resize(perm, bs)
        tokens, mask = self.tokens[rows], self.loss_mask[rows]
        rng = np.random.default_rng([self.optim.seed, 1_000_003, step])
        anchors, ok = sample_anchors(mask, self.optim.anchors_per_seq, self.cfg.block_size, rng)
        return tokens, mask, anchors, ok

    # ------------------------------------------------------------------ steps
    def set_data(self, tokens, loss_mask) -> None:
        """Train on new sequences from the current step on (online distillation): batches
        then walk a fresh permutation of these rows, each row once per pass."""
        self.tokens, self.loss_mask = np.asarray(tokens, np.int32), np.asarray(loss_mask, bool)
        self.data_start = self.step

    def train_step(self) -> dict:
        """One optimiser step. The metrics stay on the device (scalars): reading them is a
        host sync, which the loop does only when it logs."""
        batch = tuple(jnp.asarray(x) for x in self.batch(self.step))
        self.params, self.opt_state, metrics = _train_step(
            self.params,
            self.opt_state,
            self.target.state,
            batch,
            optim=dataclasses.astuple(self.optim),
            dgraph=self.graphdef,
            tgraph=self.target.graphdef,
        )
        self.step += 1
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _manager(self):
        import orbax.checkpoint as ocp

        if self._ckpt is None:
            if self.out_dir is None:
                raise ValueError("checkpoints need an out_dir")
            path = (self.out_dir / "checkpoints").absolute()
            options = ocp.CheckpointManagerOptions(max_to_keep=2)
            self._ckpt = ocp.CheckpointManager(path, options=options)
        return self._ckpt

    def save(self) -> None:
        """Checkpoint params, optimiser state and step (Orbax; blocks until written)."""
        import orbax.checkpoint as ocp

        mgr = self._manager()
        if mgr.latest_step() == self.step:
            return  # this step is on disk already
        state = {"params": self.params, "opt_state": self.opt_state}
        mgr.save(self.step, args=ocp.args.StandardSave(state), force=True)
        mgr.wait_until_finished()

    def restore(self) -> bool:
        """Resume from the newest checkpoint in out_dir/checkpoints; False if there is none."""
        import orbax.checkpoint as ocp

        mgr = self._manager()
        step = mgr.latest_step()
        if step is None:
            return False
        abstract = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, {"params": self.params, "opt_state": self.opt_state}
        )
        state = mgr.restore(step, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], step
        return True

    # ------------------------------------------------------------------ export
    def drafter(self, dtype=None):
        """The current weights as a kdj.Drafter (cast to `dtype`, default the target's)."""
        dtype = jnp.dtype(dtype or self.target.dtype)
        state = jax.tree.map(lambda p: p.astype(dtype), self.params)
        model = nnx.merge(self.graphdef, state)
        return Drafter.from_model(model, "trained", self.target.sharding)

    def export(self, path, dtype="bfloat16") -> Path:
        """Write the published DFlash format (config.json + model.safetensors in `dtype`)."""
        return export_drafter(self.drafter(jnp.float32), path, dtype)


def export_drafter(drafter, path, dtype="bfloat16") -> Path:
    """kdj.Drafter.save (float32), then store the tensors as `dtype` (published drafters are
    bfloat16; half the size, and what the reference implementations load)."""
    from safetensors.flax import save_file
    from safetensors.numpy import load_file

    path = drafter.save(path, overwrite=True)  # a resumed run exports into its own dir again
    file = Path(path) / "model.safetensors"
    tensors = {k: jnp.asarray(v, jnp.dtype(dtype)) for k, v in load_file(str(file)).items()}
    save_file(tensors, str(file))
    return Path(path)


def held_out_tau(
    target, drafter, prompts, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> dict:
    """DFlash on held-out prompts: mean acceptance (tokens per step, bonus included)."""
    import kdj

    out = kdj.generate(
        target,
        prompts,
        drafter=drafter,
        method="dflash",
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
    )
    s = out.stats
    return {
        "tau": s["mean_acceptance"],
        "tokens_per_s": s["tokens_per_s"],
        "new_tokens": s["new_tokens"],
    }


# ---------------------------------------------------------------------- the whole pipeline
def prompt_settings(cfg: TrainConfig) -> dict:
    """The data settings that decide the tokenised training prompts (recorded in prompts.npz)."""
    d = cfg.data
    return {
        "turns": d.turns,
        "max_prompt_tokens": int(d.max_prompt_tokens),
        "num_conversations": int(d.num_conversations),
    }


def _check_prompt_settings(npz: Path, cached: dict | None, asked: dict) -> None:
    """ValueError unless the prompts in `npz` (settings `cached`; None: a file from before
    settings were recorded, which was made with turns "first") suit the config's `asked`."""
    if cached is None:
        if asked["turns"] == "first":
            return  # as before: such a file is trusted for the first-turn prompts
        diff = [
            f"turns: 'first' (a file without recorded settings) cached, {asked['turns']!r} asked"
        ]
    else:
        diff = settings_diff(cached, asked)
    if diff:
        raise ValueError(
            f"the training prompts {npz} were made with other data settings ({'; '.join(diff)}): "
            "delete prompts.npz to tokenise them again, or use another data.cache_dir (or "
            "--prompts folder) made with these settings"
        )


def prepare_prompts(cfg: TrainConfig, tokenizer) -> tuple[list[list[int]], list[int], dict]:
    """Tokenised training prompts and held-out evaluation texts, cached in the data folder
    (prompts.npz, eval_prompts.json) so later runs need neither the dataset packages nor the
    tokenising time. prompts.npz records the data settings it was made with (prompt_settings:
    turns, max_prompt_tokens, num_conversations); a cached file made with other settings is a
    ValueError. data.turns "all" makes one prompt per user turn, with history (see
    kdj.train.data.chat_history_prompt_ids); conv_ids then repeat, one per turn."""
    from kdj.train.data import (
        chat_history_prompt_ids,
        chat_prompt_ids,
        humaneval_prompts,
        sharegpt_split,
        sharegpt_train_turns,
    )

    d = cfg.cache_dir
    d.mkdir(parents=True, exist_ok=True)
    npz, evj = d / "prompts.npz", d / "eval_prompts.json"
    settings = prompt_settings(cfg)
    if npz.exists() and evj.exists():
        with np.load(npz) as z:
            tokens, off, conv = z["tokens"], z["offsets"], z["conv_ids"]
            cached = json.loads(str(z["settings"])) if "settings" in z.files else None
        _check_prompt_settings(npz, cached, settings)
        prompts = [tokens[off[i] : off[i + 1]].tolist() for i in range(len(conv))]
        return prompts, conv.tolist(), json.loads(evj.read_text())
    train, held = sharegpt_split(cfg.data.sharegpt)
    mp = cfg.data.max_prompt_tokens
    if cfg.data.turns == "all":
        turns = sharegpt_train_turns(cfg.data.sharegpt, cfg.data.num_conversations)
        ids = [
            chat_history_prompt_ids(tokenizer, h, m, mp)
            for _, h, m in tqdm(turns, desc="tokenising turns")
        ]
        conv_all = [i for i, _, _ in turns]
    else:
        train = [(i, m) for i, m in train if i < cfg.data.num_conversations]
        ids = [chat_prompt_ids(tokenizer, m, mp) for _, m in tqdm(train, desc="tokenising")]
        conv_all = [i for i, _ in train]
    prompts = [p for p in ids if p is not None]
    conv = [i for i, p in zip(conv_all, ids) if p is not None]
    offsets = np.cumsum([0] + [len(p) for p in prompts])
    np.savez_compressed(
        npz,
        tokens=np.concatenate([np.asarray(p, np.int32) for p in prompts]),
        offsets=offsets,
        conv_ids=np.asarray(conv, np.int64),
        settings=np.asarray(json.dumps(settings)),
    )
    evals = {
        "sharegpt": [m for _, m in held[:256]],
        "sharegpt_conv_ids": [i for i, _ in held[:256]],
    }
    try:
        evals["humaneval"] = humaneval_prompts()
    except (ModuleNotFoundError, FileNotFoundError):
        evals["humaneval"] = []
    evj.write_text(json.dumps(evals))
    return prompts, conv, evals


def chat_prompts(tokenizer, messages, max_tokens: int) -> list[list[int]]:
    from kdj.train.data import chat_prompt_ids

    ids = (chat_prompt_ids(tokenizer, m, max_tokens) for m in messages)
    return [p for p in ids if p is not None]


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Data (prompts -> target responses, cached) -> training (resumable) -> export.
    Returns a summary dict (also written to <out_dir>/summary.json).

    With drafter.init_from, training starts from that drafter's weights, which are first
    evaluated on the same held-out prompts as the final drafter (summary "init_eval" next to
    "final_eval"); a checkpoint in <out_dir>/checkpoints still takes precedence."""
    import kdj
    from kdj.train.data import load_cache, regenerate

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    target = kdj.load_target(cfg.target, dtype=cfg.target_dtype, mesh=cfg.mesh)
    tok = target.tokenizer
    prompts, conv, evals = prepare_prompts(cfg, tok)
    t0 = time.perf_counter()
    regenerate(
        target,
        prompts,
        conv,
        cfg.cache_dir,
        max_new_tokens=cfg.data.max_response_tokens,
        temperature=cfg.data.temperature,
        batch_size=cfg.data.gen_batch_size,
        seed=cfg.optim.seed,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        samples_per_prompt=cfg.data.samples_per_prompt,
        turns=cfg.data.turns,
    )
    gen_s = time.perf_counter() - t0
    tokens, mask, _ = load_cache(cfg.cache_dir, cfg.optim.max_len)
    log(
        f"data: {len(tokens)} sequences ({len(prompts)} prompts, turns {cfg.data.turns}, "
        f"{cfg.data.samples_per_prompt} per prompt), {int(mask.sum())} response tokens, "
        f"regeneration {gen_s:.0f} s"
    )

    dcfg = drafter_config_for(target.cfg, cfg.drafter)
    init_from = cfg.drafter.init_from
    trainer = DrafterTrainer(
        target, dcfg, cfg.optim, tokens, mask, out, init_from=init_from, grow=cfg.drafter.grow
    )
    eval_prompts = chat_prompts(
        tok, evals["sharegpt"][: cfg.eval.num_prompts], cfg.data.max_prompt_tokens
    )

    def evaluate():
        r = held_out_tau(
            target, trainer.drafter(), eval_prompts, cfg.eval.max_new_tokens, cfg.eval.temperature
        )
        return dict(r, step=trainer.step)

    log_path = out / "train_log.jsonl"
    init_eval = None
    if init_from is not None:
        # The starting drafter on the same held-out prompts (before any resume): the baseline
        # the continued drafter is judged against, and the eval program compiled once.
        init_eval = dict(evaluate(), init_from=init_from)
        with log_path.open("a") as logf:
            logf.write(json.dumps({"eval": init_eval}) + "\n")
        log(f"initialised from {init_from}: held-out tau {init_eval['tau']:.2f}")
    if trainer.restore():
        log(f"resumed from step {trainer.step}")

    history, evals_done = [], []
    t_train = time.perf_counter()
    o = cfg.optim
    bar = tqdm(total=o.steps, initial=trainer.step, desc="training drafter", unit="step")
    window = []

    def over_budget() -> bool:  # max_minutes counts from the start of run_training
        return o.max_minutes is not None and (time.perf_counter() - t_start) / 60 > o.max_minutes

    with log_path.open("a") as logf:
        while trainer.step < o.steps:
            if over_budget():  # checked before a step: regeneration may have used it all
                log(f"time budget of {o.max_minutes} min reached at step {trainer.step}")
                break
            m = trainer.train_step()
            window.append(m)
            bar.update(1)
            last = trainer.step == o.steps or over_budget()  # log the final partial window
            if trainer.step % o.log_every == 0 or last:
                avg = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
                avg.update(step=trainer.step, elapsed_s=time.perf_counter() - t_train)
                window = []
                history.append(avg)
                logf.write(json.dumps(avg) + "\n")
                logf.flush()
                bar.set_postfix(loss=f"{avg['loss']:.3f}", tau=f"{avg['tau']:.2f}")
            if cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < o.steps:
                e = evaluate()
                evals_done.append(e)
                logf.write(json.dumps({"eval": e}) + "\n")
                log(f"step {trainer.step}: held-out tau {e['tau']:.2f}")
            if o.ckpt_every and trainer.step % o.ckpt_every == 0:
                trainer.save()
    bar.close()
    train_s = time.perf_counter() - t_train
    trainer.save()
    path = trainer.export(out / "drafter")
    final = evaluate()
    summary = {
        "sequences": len(tokens),
        "prompts": len(prompts),
        "response_tokens": int(mask.sum()),
        "steps": trainer.step,
        "regeneration_s": gen_s,
        "train_s": train_s,
        "final_eval": final,
        "init_from": init_from,
        "init_eval": init_eval,
        "evals": evals_done,
        "first_log": history[0] if history else None,
        "last_log": history[-1] if history else None,
        "drafter": str(path),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    base = f" (init_from {init_eval['tau']:.2f})" if init_eval is not None else ""
    log(
        f"done: {trainer.step} steps in {train_s:.0f} s; held-out tau {final['tau']:.2f}{base}; "
        f"drafter at {path}"
    )
    return summary
