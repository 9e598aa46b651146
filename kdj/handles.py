"""The handles a user holds: a loaded `Target` (with its compiled programs) and a `Drafter`."""

from __future__ import annotations

import collections
import dataclasses
import threading
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from kdj.checkpoints.dflash import save_drafter
from kdj.config import ModelConfig
from kdj.kernels import KernelPolicy, choose
from kdj.models.drafter import DrafterConfig
from kdj.models.layers import set_kernels
from kdj.sharding import Sharding
from kdj.sharding.apply import as_sharding, shard_model
from kdj.tokenizer import Tokenizer


class Executables:
    """Ahead-of-time compiled programs, one per (function, argument signature, statics),
    least recently used dropped past `capacity`. Compiling ahead of time lets generate()
    report compile time apart from prefill and decode time. Threads may compile at once (a
    server warming its pool): the table is locked, the compiles are not."""

    # a serving pool: widths x (admission buckets + auto's menu entries) x modes, and resizes
    def __init__(self, capacity: int = 512):
        self.capacity = capacity
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, fn, *args, options: dict | None = None, **static):
        """The compiled `fn` for these arguments (compiled on first use, with XLA compiler
        `options`: KernelPolicy.compiler_options). Array leaves enter the key by shape, dtype
        and sharding; everything else (NNX graph definitions, which are pytree structure,
        `options` and `static`) by value."""

        def sig(x):
            return (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x

        leaves, treedef = jax.tree.flatten(args)
        options = dict(options or {})
        key = (fn, treedef, tuple(sig(x) for x in leaves), tuple(sorted(static.items())),
               tuple(sorted(options.items())))  # fmt: skip
        with self._lock:
            if key in self._programs:
                self._programs.move_to_end(key)
                return self._programs[key]
        program = fn.lower(*args, **static).compile(options or None)
        with self._lock:
            self._programs[key] = program
            while len(self._programs) > self.capacity:
                self._programs.popitem(last=False)
        return program

    def compiled(self, fn) -> list:
        """The programs compiled for `fn`, least recently used first (e.g. to dump HLO)."""
        return [program for key, program in self._programs.items() if key[0] is fn]

    def clear(self) -> None:
        """Drop every compiled program (benchmarks switching kernels, tests patching code)."""
        self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)


@dataclasses.dataclass
class Target:
    """A loaded target model: config, NNX graph + params, its tokenizer when known, and the
    programs compiled for it."""

    cfg: ModelConfig
    graphdef: Any
    state: Any
    dtype: Any
    name: str = ""
    tokenizer: Tokenizer | None = None
    sharding: Sharding | None = None  # mesh + rules the params live on (None: one device)
    executables: Executables = dataclasses.field(
        default_factory=Executables, repr=False, compare=False
    )

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state)

    def __repr__(self) -> str:  # the dataclass's would print every weight
        c = self.cfg
        shape = [f"layers={c.num_layers}", f"hidden={c.hidden_size}",
                 f"heads={c.num_heads}", f"vocab={c.vocab_size}"]  # fmt: skip
        if c.family == "llama":
            shape[2] += f"/{c.num_kv_heads}kv"
        if c.n_routed_experts:
            shape.append(f"experts={c.n_routed_experts} top-{c.num_experts_per_tok}")
        tok = Path(self.tokenizer.name).name if self.tokenizer is not None else None
        return (f"Target({self.name!r}, {c.model_type}, {', '.join(shape)}, "
                f"dtype={_dtype_name(self.dtype)}, params={_params(self.state)}, "
                f"mesh={_mesh(self.sharding)}, tokenizer={tok!r}, "
                f"compiled={len(self.executables)})")  # fmt: skip

    @staticmethod
    def from_model(model, name="", tokenizer=None, mesh=None, kernels=None) -> Target:
        """Wrap an NNX model; with `mesh` (Sharding, MeshConfig or YAML) shard it first.
        kernels: as in `kdj.load_target`."""
        sharding = as_sharding(mesh)
        if sharding is not None:
            shard_model(model, sharding)
        graphdef, state = nnx.split(model)
        dtype = model.embed[...].dtype
        target = Target(model.cfg, graphdef, state, dtype, name, tokenizer, sharding)
        return target.with_kernels(kernels)

    def with_kernels(self, kernels: KernelPolicy | None = None) -> Target:
        """This target's weights under kernel policy `kernels` (None: the default for this
        backend and sharding, kdj.kernels.choose): a new Target, compiled anew."""
        kernels = choose(kernels, self.sharding)
        if kernels == self.cfg.kernels:
            return self
        model = self.model
        set_kernels(model, kernels)
        return dataclasses.replace(
            self, cfg=model.cfg, graphdef=nnx.graphdef(model), executables=Executables()
        )


@dataclasses.dataclass
class Drafter:
    """A loaded DFlash drafter: config, NNX graph + params, and method="auto"'s priors."""

    cfg: DrafterConfig
    graphdef: Any
    state: Any
    name: str = ""
    sharding: Sharding | None = None
    # forecast temperature for method="auto" (kdj.train.calibrate; calibration.json beside
    # the checkpoint), 1.0 = trust the drafter's probabilities as they are
    calibration: float = 1.0
    # tau its calibration run realised (0: unknown): method="auto"'s forecast before the
    # first draft, so a batch where drafting cannot pay need not draft to find out
    prior_acceptance: float = 0.0
    # tau each method="auto" menu entry realised in that run, by name ("chain15", "tree64";
    # {}: unknown, the prior stands for every entry): prices the menu before compiling
    entry_acceptance: dict = dataclasses.field(default_factory=dict)

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state)

    def __repr__(self) -> str:  # the dataclass's would print every weight
        c, lc = self.cfg, self.cfg.layers
        dtype = _dtype_name(jax.tree.leaves(self.state)[0].dtype)
        return (f"Drafter({self.name!r}, layers={lc.num_layers}, hidden={lc.hidden_size}, "
                f"block_size={c.block_size}, target_layer_ids={list(c.target_layer_ids)}, "
                f"dtype={dtype}, params={_params(self.state)}, mesh={_mesh(self.sharding)}, "
                f"calibration={self.calibration:g})")  # fmt: skip

    @staticmethod
    def from_model(model, name="", mesh=None) -> Drafter:
        sharding = as_sharding(mesh)
        if sharding is not None:
            shard_model(model, sharding)
        graphdef, state = nnx.split(model)
        return Drafter(model.cfg, graphdef, state, name, sharding)

    def on(self, sharding) -> Drafter:
        """This drafter with its params on `sharding` (its target's mesh), priors kept."""
        if self.sharding == sharding:
            return self
        moved = Drafter.from_model(self.model, self.name, sharding)
        return dataclasses.replace(
            moved,
            calibration=self.calibration,
            prior_acceptance=self.prior_acceptance,
            entry_acceptance=self.entry_acceptance,
        )

    def with_kernels(self, kernels: KernelPolicy) -> Drafter:
        """This drafter's weights under kernel policy `kernels` (its target's)."""
        if kernels == self.cfg.layers.kernels:
            return self
        model = self.model
        set_kernels(model, kernels)
        return dataclasses.replace(self, cfg=model.cfg, graphdef=nnx.graphdef(model))

    def save(self, path, overwrite: bool = False) -> Path:
        """Write the published DFlash checkpoint format (config.json + model.safetensors) and
        the calibration (calibration.json). A non-empty directory is refused unless
        overwrite=True, which replaces only those files (kdj.checkpoints.dflash.save_drafter)."""
        calibration = {"temperature": self.calibration,
                       "realised_acceptance": self.prior_acceptance,
                       "realised_by_entry": self.entry_acceptance}  # fmt: skip
        return save_drafter(self.model, path, calibration=calibration, overwrite=overwrite)


def _params(state) -> str:
    n = sum(int(x.size) for x in jax.tree.leaves(state))
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _dtype_name(dtype) -> str:
    return getattr(dtype, "name", None) or str(dtype)


def _mesh(sharding: Sharding | None) -> str | None:
    if sharding is None:
        return None
    return " x ".join(f"{axis}={n}" for axis, n in sharding.mesh.shape.items())


def check_pair(target: Target, drafter: Drafter, block_size=None) -> int:
    """Raise if drafter and target do not fit together; return the block size to run."""
    return check_pair_configs(target.cfg, drafter.cfg, block_size)


def check_pair_configs(t, d, block_size=None) -> int:
    """check_pair on the configs alone (a ModelConfig, a DrafterConfig): no weights needed."""
    if d.layers.hidden_size != t.hidden_size:
        raise ValueError(
            f"drafter hidden size {d.layers.hidden_size} does not match the target's "
            f"{t.hidden_size}: this drafter was made for another target"
        )
    if d.layers.vocab_size not in (0, t.vocab_size):
        raise ValueError(
            f"drafter vocabulary {d.layers.vocab_size} does not match the target's {t.vocab_size}"
        )
    if d.num_target_layers > 0 and d.num_target_layers != t.num_layers:
        raise ValueError(
            f"drafter was made for a target with {d.num_target_layers} layers; this target has "
            f"{t.num_layers}"
        )
    bad = [i for i in d.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(
            f"drafter target_layer_ids {list(d.target_layer_ids)} reach outside the target's "
            f"{t.num_layers} layers"
        )
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"drafter mask_token_id {d.mask_token_id} outside the target vocabulary")
    k = d.block_size if block_size is None else int(block_size)
    if not 2 <= k <= d.block_size:
        raise ValueError(f"block_size must be in [2, {d.block_size}] for this drafter (got {k})")
    return k
