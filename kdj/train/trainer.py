"""The drafter trainer: one AdamW step with warmup + cosine decay and gradient clipping, float32
master params with a bfloat16 (configurable) forward, Orbax checkpoints with exact resume, and
export to the published DFlash format. Training can start from an existing drafter's weights
(drafter.init_from: continue training with a fresh optimiser and schedule; drafter.grow: a
deeper or wider drafter from a smaller one; drafter.retap: one that taps other target layers).

The target is frozen and only read: its embedding table and lm_head are the drafter's too
(the drafter owns neither), so nothing of the target enters the optimiser.

A DFlash2 drafter (drafter.dflash2) trains its convolutions with its layers and its
candidate selector on the target's own choices (kdj/train/forward.py); init_from a DFlash
drafter starts it drafting exactly as that one does (dflash2_params).

Determinism: the batch of step t (sequences and anchors) is a function of (seed, t) alone,
so a run restored from the checkpoint of step t takes exactly the step t + 1 the
uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from kdj.handles import Drafter, check_pair_configs
from kdj.loading import load_drafter
from kdj.models.dflash2 import DFlash2Config
from kdj.models.drafter import DrafterConfig, build_drafter, default_target_layer_ids
from kdj.train.config import DrafterShape, OptimConfig
from kdj.train.forward import block_loss, sample_anchors, target_pass


def drafter_config_for(target_cfg, shape: DrafterShape) -> DrafterConfig:
    """A Qwen3-style drafter config sized for this target (hidden size and vocabulary are the
    target's; heads, FFN width and feature layers as `shape` says, else the target's)."""
    t = target_cfg
    ids = shape.target_layer_ids or default_target_layer_ids(t.num_layers, shape.num_layers)
    heads = shape.num_heads or t.num_heads
    kv_heads = shape.num_kv_heads or t.num_kv_heads or heads
    if heads % kv_heads:  # GQA: each key/value head serves a whole group of query heads
        raise ValueError(f"drafter.num_heads {heads} must be a multiple of num_kv_heads "
                         f"{kv_heads} (drafter.num_kv_heads, else the target's)")  # fmt: skip
    layers = t.replace(
        family="llama",
        model_type="qwen3",
        num_layers=shape.num_layers,
        qk_norm=True,
        num_heads=heads,
        num_kv_heads=kv_heads,
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
        dflash2=dflash2_config(shape.dflash2, t.hidden_size, t.vocab_size),
    )


_DFLASH2_REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash2_config(fields, hidden_size: int, vocab_size: int) -> DFlash2Config | None:
    """The drafter section's `dflash2` mapping -> DFlash2Config (None: a DFlash drafter).
    A missing, unknown or bad field is a ValueError naming it as drafter.dflash2.<field>."""
    if fields is None:
        return None
    names = [f.name for f in dataclasses.fields(DFlash2Config)]
    if not isinstance(fields, dict):
        raise ValueError(f"drafter.dflash2 must be a mapping of {names}, not {fields!r}")
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"drafter.dflash2: unknown keys {unknown}; expected some of {names}")
    missing = [n for n in _DFLASH2_REQUIRED if n not in fields]
    if missing:
        raise ValueError(f"drafter.dflash2 needs {missing} (DFlash2's dflash_config fields)")
    cfg = DFlash2Config(**fields)
    cfg.check(hidden_size, vocab_size, section="drafter.dflash2")
    return cfg


def shape_fields(cfg: DrafterConfig) -> dict:
    """What must agree between a drafter (or a resume bundle) and the drafter being trained."""
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
        "dflash2": None if cfg.dflash2 is None else dataclasses.asdict(cfg.dflash2),
    }


def _differences(have: dict, want: dict, unset: dict) -> list[str]:
    """One line per field of shape_fields that differs between a checkpoint's (`have`) and
    the configured drafter's (`want`), a dflash2 mapping field by field; fields `unset` in
    the checkpoint (their value there is the one `unset` gives) are not held to anything."""
    bad = []
    for k in want:
        a, b = have[k], want[k]
        if isinstance(a, dict) and isinstance(b, dict):
            bad += _differences({f"{k}.{n}": v for n, v in a.items()},
                                {f"{k}.{n}": v for n, v in b.items()}, {})  # fmt: skip
        elif a != b and a != unset.get(k, object()):
            bad.append(f"{k}: {a} in the checkpoint, {b} configured")
    return bad


def load_init_params(source, drafter_cfg: DrafterConfig, grow: bool = False,
                     retap: bool = False) -> dict:  # fmt: skip
    """The weights of an existing DFlash drafter (a published-format directory or a built-in
    name, read by kdj.load_drafter) as a float32 pure dict for a trainer of `drafter_cfg`.

    Raises ValueError naming every field where the checkpoint and `drafter_cfg` disagree
    (layers, block size, mask token, feature layers, widths, ...); a checkpoint that leaves a
    field unset (num_target_layers -1, vocab_size 0) is not held to it. grow: the checkpoint
    may have fewer layers than `drafter_cfg` (see grown_params). retap: it may tap other
    target layers, as many as `drafter_cfg` taps. A DFlash checkpoint may start a DFlash2
    `drafter_cfg` (dflash2_params then adds what DFlash2 adds); a DFlash2 one must have the
    configured dflash2 fields."""
    loaded = load_drafter(source, dtype=jnp.float32)
    have, want = shape_fields(loaded.cfg), shape_fields(drafter_cfg)
    if have["dflash2"] is None:  # a DFlash drafter: any DFlash2 fields can be added to it
        have["dflash2"] = want["dflash2"]
    unset = {"num_target_layers": -1, "vocab_size": 0}
    if grow:  # the layer count and the FFN width (and the per-layer types) may only increase
        for k in ("num_layers", "intermediate_size"):
            if have[k] > want[k]:
                raise ValueError(
                    f"drafter.grow: {str(source)!r} has {k} {have[k]}, more than the "
                    f"{want[k]} configured"
                )
        for k in ("num_layers", "layer_types", "intermediate_size"):
            have[k] = want[k]
    if retap:  # the feature projection's input width is one state per tapped layer
        if len(have["target_layer_ids"]) != len(want["target_layer_ids"]):
            raise ValueError(
                f"drafter.retap: {str(source)!r} taps {len(have['target_layer_ids'])} target "
                f"layers {list(have['target_layer_ids'])}, the config "
                f"{len(want['target_layer_ids'])} {list(want['target_layer_ids'])}"
            )
        have["target_layer_ids"] = want["target_layer_ids"]
    bad = _differences(have, want, unset)
    if bad:
        raise ValueError(
            f"drafter.init_from {str(source)!r} does not match the drafter to train "
            f"(the config's drafter section and the target): {'; '.join(bad)}"
        )
    return nnx.to_pure_dict(loaded.state)


def _widened_mlp(fresh: dict, init: dict) -> dict:
    """init's SwiGLU in a wider FFN: its hidden units first; the fresh units' rows of the down
    projection zero, so they add nothing until training moves them."""
    gate_up, down = fresh["gate_up"], fresh["down"]["kernel"]
    n = init["gate_up"].shape[-1]
    return dict(
        fresh,
        gate_up=gate_up.at[..., :n].set(init["gate_up"]),
        down=dict(fresh["down"], kernel=jnp.zeros_like(down).at[:n].set(init["down"]["kernel"])),
    )


def grown_params(fresh: dict, init: dict) -> dict:
    """A deeper or wider drafter that drafts exactly as `init` does: init's layers first, then
    the fresh layers as identity blocks (attention output and MLP down projections zero, so
    each adds nothing to the residual stream until training moves them); a wider FFN keeps
    init's hidden units and starts the new ones silent (_widened_mlp)."""
    kept = ("fc", "hidden_norm", "norm", "selector")  # the selector: a DFlash2 drafter's
    out = dict(fresh, **{k: init[k] for k in kept if k in init})
    layers = dict(fresh["layers"])
    for i in layers:
        if i in init["layers"]:
            layer = dict(init["layers"][i])
            layer["mlp"] = _widened_mlp(layers[i]["mlp"], layer["mlp"])
            layers[i] = layer
        else:
            layer = jax.tree.map(lambda x: x, layers[i])
            layer["attn"]["o"]["kernel"] = jnp.zeros_like(layer["attn"]["o"]["kernel"])
            layer["mlp"]["down"]["kernel"] = jnp.zeros_like(layer["mlp"]["down"]["kernel"])
            layers[i] = layer
    out["layers"] = layers
    return out


def dflash2_params(fresh: dict, init: dict) -> dict:
    """A DFlash drafter's weights `init` in a DFlash2 drafter (`fresh`: its random start)
    that drafts exactly as the DFlash one: every convolution the identity (tap 0 of
    base_kernel 1, later taps 0, kernel_projection 0: no input-dependent part) and the
    selector neutral (hidden_projection 0: every pair score is the slot's logit, so the walk
    is the argmax chain). The codebooks keep their random start: through them the zero
    projection gets a gradient from the first step."""
    layers = {}
    for i, layer in init["layers"].items():
        layers[i] = dict(layer)
        for name in ("attention_conv", "mlp_conv"):
            conv = fresh["layers"][i][name]
            base = jnp.zeros_like(conv["base_kernel"]).at[:, 0].set(1.0)
            proj = dict(conv["kernel_projection"])
            proj["kernel"] = jnp.zeros_like(proj["kernel"])
            layers[i][name] = dict(conv, base_kernel=base, kernel_projection=proj)
    selector = dict(fresh["selector"])
    hidden = dict(selector["hidden_projection"])
    hidden["kernel"] = jnp.zeros_like(hidden["kernel"])
    selector["hidden_projection"] = hidden
    return dict(init, layers=layers, selector=selector)


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """The learning rate of each step: linear warmup from 0, then cosine decay to end_lr_frac."""
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=cfg.lr * cfg.end_lr_frac
    )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


def _loss(params, dgraph, tgraph, tstate, batch, cfg: OptimConfig):
    tokens, loss_mask, anchors, ok = batch
    target = nnx.merge(tgraph, tstate)
    low = jax.tree.map(lambda p: p.astype(jnp.dtype(cfg.compute_dtype)), params)  # f32 masters
    drafter = nnx.merge(dgraph, low)
    selector = drafter.selector is not None  # DFlash2: it learns the target's choices
    tp = target_pass(tgraph, tstate, tokens, drafter.cfg.target_layer_ids, cfg.labels,
                     cfg.head_chunk, greedy=selector)  # fmt: skip
    greedy = tp.greedy if cfg.labels == "target" else None
    return block_loss(drafter, target, tp.features, tokens, loss_mask, anchors, ok, cfg.gamma,
                      greedy, head_chunk=cfg.head_chunk, hidden=tp.hidden, choices=tp.greedy,
                      selector_weight=cfg.effective_selector_weight)  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=("optim", "dgraph", "tgraph"), donate_argnames=("params", "opt_state")
)
def _train_step(params, opt_state, tstate, batch, *, optim: tuple, dgraph, tgraph):
    """One AdamW step. optim: OptimConfig as a tuple (hashable: part of the jit key, so
    trainers of one config and graphs share the compiled step through jit's own cache)."""
    cfg = OptimConfig(*optim)
    tx = make_optimizer(cfg)
    grad_fn = jax.value_and_grad(_loss, has_aux=True)
    (loss, metrics), grads = grad_fn(params, dgraph, tgraph, tstate, batch, cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics


def check_fit(target_cfg, drafter_cfg: DrafterConfig, optim: OptimConfig) -> None:
    """The drafter fits the target, and the optim section fits the drafter."""
    try:
        check_pair_configs(target_cfg, drafter_cfg)
    except ValueError as e:
        raise ValueError(f"the drafter section does not fit the target: {e}") from None
    if optim.selector_weight is not None and drafter_cfg.dflash2 is None:
        raise ValueError(f"optim.selector_weight {optim.selector_weight} is set, but this "
                         "drafter is a DFlash drafter (no drafter.dflash2 section): it has "
                         "no selector to train")  # fmt: skip


def check_drafter(target, drafter_cfg: DrafterConfig, optim: OptimConfig, init_from=None,
                  grow: bool = False, retap: bool = False) -> None:  # fmt: skip
    """What a DrafterTrainer of these arguments would refuse, found without keeping a weight
    (a run checks it before the target answers its prompts): check_fit, the drafter's
    shapes (built abstractly) and init_from's checkpoint against them."""
    check_fit(target.cfg, drafter_cfg, optim)
    nnx.eval_shape(lambda: build_drafter(drafter_cfg, jnp.float32, seed=optim.seed))
    if init_from is not None:
        load_init_params(init_from, drafter_cfg, grow=grow, retap=retap)


class Diverged(ValueError):
    """A run whose loss stopped being finite (a learning rate too high, mostly)."""


def check_finite(window: list[dict], step: int, optim: OptimConfig, name: str = "") -> None:
    """Raise Diverged if a step of `window` (train_step's metrics, the last at `step`) had a
    non-finite loss: called before anything from those steps is logged, saved or exported,
    so a diverged run keeps its last good checkpoint."""
    losses = np.asarray([w["loss"] for w in window], np.float64)
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        at = step - len(window) + 1 + int(bad[0])
        who = f" (drafter {name!r})" if name else ""
        raise Diverged(
            f"training diverged at step {at}{who}: its loss is {losses[bad[0]]} (optim.lr "
            f"{optim.lr}, optim.grad_clip {optim.grad_clip}); nothing after the last "
            "checkpoint is saved: lower optim.lr and run again (it resumes from there)"
        )


class DrafterTrainer:
    """Trains a DFlash (or DFlash2) drafter against a frozen kdj target on cached
    (tokens, loss_mask).

    tokens [N, S] int32 and loss_mask [N, S] bool (True on the response tokens the drafter
    learns to draft) are host arrays; each step takes optim.batch_size rows.

    init_from: an existing DFlash drafter (directory or built-in name) to start from instead
    of the random initialisation (load_init_params; a shape mismatch is a ValueError); with
    grow, it may have fewer layers (grown_params), with retap, tap other target layers. The
    optimiser and schedule start fresh either way; restore() then overrides both.
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
        retap: bool = False,
    ):
        check_fit(target.cfg, drafter_cfg, optim)
        self.target, self.optim, self.cfg = target, optim, drafter_cfg
        self.tokens, self.loss_mask = np.asarray(tokens, np.int32), np.asarray(loss_mask, bool)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        model = build_drafter(drafter_cfg, jnp.float32, seed=optim.seed)
        if init_from is not None:  # replace the random weights before any sharding
            state = nnx.state(model)
            fresh = nnx.to_pure_dict(state)
            init = load_init_params(init_from, drafter_cfg, grow=grow, retap=retap)
            if drafter_cfg.dflash2 is not None and "selector" not in init:  # a DFlash drafter
                init = dflash2_params(fresh, init)
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

    def learning_rate(self) -> float:
        """The learning rate the next step takes: the schedule at the optimiser's own count
        (restored with its state, so a resumed trainer continues the schedule, not restarts)."""
        states = jax.tree.leaves(
            self.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)
        )
        (state,) = [s for s in states if isinstance(s, optax.ScaleByScheduleState)]
        return float(lr_schedule(self.optim)(state.count))

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
