"""kdj's public API: load_target, load_drafter, load_tokenizer, generate, forward."""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj import arguments
from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.cost import StepCost
from kdj.decode import autoregressive as ar
from kdj.decode import speculative
from kdj.decode.tree import DraftShape
from kdj.kernels import KernelPolicy, choose
from kdj.models.drafter import DrafterConfig
from kdj.models.layers import set_kernels
from kdj.sharding import Sharding
from kdj.sharding.apply import as_sharding, mark_experts, shard_cache, shard_model
from kdj.tokenizer import Tokenizer, load_tokenizer

BUILTIN_TARGETS = ("smollm2-135m-instruct",)
# Drafters shipped inside the package (kdj/assets/<name>/, published DFlash format).
ASSETS = Path(__file__).resolve().parent / "assets"
BUILTIN_DRAFTERS = ("smollm2-135m-dflash-b16",)
METHODS = arguments.METHODS
DEFAULT_TREE_BUDGET = 64  # DDTree nodes per step when the caller gives none
# method="auto": what a step may verify, chosen per step by the controller. Each entry is
# compiled once into the same program; "chain" means the drafter's full block. A drafting
# step builds the menu's largest tree to forecast every entry, so a big entry costs every
# drafted step: tree256 took the SmolLM2 pair's batch-16 step from 5.2 to 8.6 ms on the H200
# (bench/results/adaptive_smollm2_2026-11-29a.json) for +0.3 tau over tree64.
DEFAULT_MENU = ("none", "chain", "tree16", "tree64")


@dataclasses.dataclass
class Target:
    """A loaded target model: config, NNX graph + params, and its tokenizer when known."""

    cfg: ModelConfig
    graphdef: Any
    state: Any
    dtype: Any
    name: str = ""
    tokenizer: Tokenizer | None = None
    sharding: Sharding | None = None  # mesh + rules the params live on (None: one device)

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state)

    @staticmethod
    def from_model(model, name="", tokenizer=None, mesh=None, kernels=None) -> Target:
        """Wrap an NNX model; with `mesh` (Sharding, MeshConfig or YAML) shard it first.
        kernels: as in `load_target`."""
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
        return dataclasses.replace(self, cfg=model.cfg, graphdef=nnx.graphdef(model))


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated tokens only, cut after the first stop token
    texts: list[str] | None
    stats: dict[str, Any]


# ------------------------------------------------------------------------------ loading
def load_target(
    source, dtype="bfloat16", mesh=None, quantized_experts=False, kernels=None
) -> Target:
    """Load a target from an HF safetensors dir, a .gguf file, a `kdj convert` Orbax dir, or a
    built-in name ("smollm2-135m-instruct").

    quantized_experts: keep an HF checkpoint's INT4 (Kimi K2.5/K2.6) or FP8 block-scaled
    (DeepSeek-V3, Kimi K2) routed experts quantised in device memory and dequantise inside the
    expert compute, only for the experts the tokens route to (about 4x fewer expert bytes than
    bf16 for INT4, 2x for FP8). Default: dequantise everything to `dtype` at load.
    kernels: which kernel each op runs (kdj.kernels.KernelPolicy); default: the measured
    choice for this backend and for whether this model is sharded."""
    from kdj.checkpoints.gguf import read_gguf, smollm2_gguf_path
    from kdj.checkpoints.hf_safetensors import HFCheckpoint
    from kdj.checkpoints.loader import load_hf, load_params
    from kdj.checkpoints.orbax import is_orbax_dir, restore

    dtype = arguments.dtype(dtype)
    sharding = as_sharding(mesh)
    mesh_kw = {} if sharding is None else {"mesh": sharding.mesh, "rules": sharding.rules}
    src = str(source)
    if src in BUILTIN_TARGETS:
        source = smollm2_gguf_path()
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"target {src!r} not found: give an HF checkpoint dir, a .gguf file, a kdj convert dir"
            f" or one of the built-in names {BUILTIN_TARGETS}"
        )
    tokenizer = None
    if quantized_experts and (path.is_file() or is_orbax_dir(path)):
        raise ValueError("quantized_experts applies to HF safetensors checkpoint dirs only")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a target file must be .gguf (or pass a checkpoint dir)")
        hf_cfg, tensors = read_gguf(path)
        cfg = ModelConfig.from_hf(hf_cfg)
        model = load_params(cfg, tensors, dtype=dtype, desc=f"loading {path.name}", **mesh_kw)
        tokenizer = load_tokenizer(path)
    elif is_orbax_dir(path):
        model = restore(path, dtype=dtype, **mesh_kw)
        cfg = model.cfg
    else:
        ckpt = HFCheckpoint(path)
        cfg = ModelConfig.from_json(ckpt.config_path)
        model = load_hf(
            ckpt, cfg, dtype=dtype, quantized_experts=quantized_experts,
            desc=f"loading {path.name}", **mesh_kw,
        )  # fmt: skip
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(path)
        except (FileNotFoundError, ValueError):
            tokenizer = None  # weights without a tokenizer are fine for token-id prompts
    mark_experts(model, sharding)
    graphdef, state = nnx.split(model)
    target = Target(model.cfg, graphdef, state, dtype, path.name, tokenizer, sharding)
    return target.with_kernels(kernels)


@dataclasses.dataclass
class Drafter:
    """A loaded DFlash drafter: config, NNX graph + params."""

    cfg: DrafterConfig
    graphdef: Any
    state: Any
    name: str = ""

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state)

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

    @staticmethod
    def from_model(model, name="", mesh=None) -> Drafter:
        sharding = as_sharding(mesh)
        if sharding is not None:
            shard_model(model, sharding)
        graphdef, state = nnx.split(model)
        return Drafter(model.cfg, graphdef, state, name, sharding)

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
        from kdj.checkpoints.dflash import save_drafter

        calibration = {"temperature": self.calibration,
                       "realised_acceptance": self.prior_acceptance,
                       "realised_by_entry": self.entry_acceptance}  # fmt: skip
        return save_drafter(self.model, path, calibration=calibration, overwrite=overwrite)


def load_drafter(source, target: Target | None = None, dtype=None, mesh=None) -> Drafter:
    """Load a DFlash drafter (published checkpoint format: a directory, or a built-in name from
    BUILTIN_DRAFTERS). With `target`, check the pair fits (hidden size, vocabulary, feature
    layers) and use the target's dtype."""
    from kdj.checkpoints.dflash import load_drafter_checkpoint
    from kdj.train import calibrate

    if target is not None:
        arguments.loaded(target, Target, "target", "kdj.load_target")
    dtype = arguments.dtype(dtype or (target.dtype if target is not None else "bfloat16"))
    path = Path(source)
    if str(source) in BUILTIN_DRAFTERS and not path.exists():
        path = ASSETS / str(source)
    if not path.exists():
        raise FileNotFoundError(
            f"drafter {str(source)!r} not found (give a DFlash checkpoint dir or one of the "
            f"built-in names {BUILTIN_DRAFTERS})"
        )
    if mesh is None and target is not None:
        mesh = target.sharding  # the drafter lives on its target's mesh
    drafter = Drafter.from_model(load_drafter_checkpoint(path, dtype), path.name, mesh)
    drafter.calibration, drafter.prior_acceptance, drafter.entry_acceptance = calibrate.load(path)
    if target is not None:
        _check_pair(target, drafter, None)
    return drafter


def _check_pair(target: Target, drafter: Drafter, block_size) -> int:
    """Raise if drafter and target do not fit together; return the block size to run."""
    t, d = target.cfg, drafter.cfg
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


# ---------------------------------------------------------------------------- inference
_EXECUTABLES: dict = {}  # (function, graphdef, argument signature, statics) -> compiled


def _compiled(fn, *args, **static):
    """Ahead-of-time compile `fn` once per signature, so generate() can report compile time
    apart from prefill/decode time and repeated calls reuse the executable. Arguments that
    are not arrays (NNX graph definitions) are static and part of the signature."""

    def sig(x):
        return (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x

    key = (fn, tuple(sig(x) for x in jax.tree.leaves(args)), tuple(sorted(static.items())))
    if key not in _EXECUTABLES:
        if len(_EXECUTABLES) >= 32:
            _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
        _EXECUTABLES[key] = fn.lower(*args, **static).compile()
    return _EXECUTABLES[key]


def _output_specs(exe, like):
    """Shapes of `like` with the shardings the compiled prefill `exe` gives its outputs: the
    decode loop is compiled for exactly what it will be handed (XLA may lay a cache out
    differently from how it was passed in, e.g. a single KV head split by head_dim)."""

    def spec(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(spec, like, tuple(exe.output_shardings))


def _as_token_lists(target: Target, prompts, tokenizer: Tokenizer | None) -> list[list[int]]:
    out = []
    for i, p in enumerate(arguments.prompts(prompts)):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (pass tokenizer= or token ids)")
            p = tokenizer.encode(arguments.text(p, i))
        out.append(arguments.token_ids(p, i, target.cfg.vocab_size))
    return out


def _stop_matrix(rows) -> np.ndarray:
    """Per-sequence stop ids as [B, K] int32, padded with -1 (K a multiple of 4, so calls
    with a few stop ids more or less share a compile)."""
    width = _round_up(max(1, max(len(r) for r in rows)), 4)
    return np.array([r + [-1] * (width - len(r)) for r in rows], np.int32)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def generate(
    target: Target,
    prompts,
    drafter=None,
    method: str = "auto",
    max_new_tokens=256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    block_size=None,
    tree_budget=None,
    stop_tokens=None,
    tokenizer: Tokenizer | None = None,
    mesh=None,
    cache_size: int | None = None,
    menu=None,
    cost=None,
    calibration: float | None = None,
) -> GenerateOutput:
    """Generate for a batch of prompts (strings or token-id lists of any lengths).

    method "ar" is plain decoding; "dflash" verifies the drafter's chain, "ddtree" a tree of
    `tree_budget` nodes. "auto" is "ar" without a drafter; with one, every step picks from
    `menu` (default DEFAULT_MENU: "none", "chain", "chainN", "treeN") what maximises expected
    tokens per second, from the drafter's confidence (temperature-scaled by `calibration`)
    and `cost` (a kdj.cost.StepCost or its JSON path, as `kdj bench` fits it; default: a
    conservative estimate from the target's shapes). calibration defaults to the drafter's
    fitted forecast temperature (kdj.train.calibrate). Before compiling, auto drops the
    entries that cannot pay at this batch size at the drafter's calibrated tokens per step
    (speculative.paying_menu; stats["menu"] lists the rest); with none left it runs plain
    decoding, every step a "skip". max_new_tokens
    may be one int or one per prompt; stop_tokens one list or one list per prompt (default:
    the tokenizer's end-of-turn ids, else the config's eos). cache_size fixes the KV-cache
    capacity (default: the longest prompt + max_new_tokens, rounded up to a multiple of 128
    within max_position_embeddings). A tree (tree_budget, a menu's treeN) larger than the
    cache can hold after the shortest prompt is cut to that size: stats["tree_budget"] /
    stats["menu"] say what ran. Bad arguments raise TypeError/ValueError before anything
    compiles (kdj.arguments); an argument the method does not use is refused, not ignored.
    """
    arguments.loaded(target, Target, "target", "kdj.load_target")
    if drafter is not None:
        arguments.loaded(drafter, Drafter, "drafter", "kdj.load_drafter")
    method = arguments.method(method, drafter is not None, block_size=block_size,
                              tree_budget=tree_budget, menu=menu)  # fmt: skip
    temperature, top_p = arguments.sampling(temperature, top_p)
    seed = arguments.integer(seed, "seed")
    if calibration is not None:
        calibration = arguments.calibration(calibration)
    menu = arguments.menu(menu)
    speculative_ = method in ("dflash", "ddtree", "auto")
    if speculative_:
        if block_size is not None:
            block_size = arguments.integer(block_size, "block_size")
        block_size = _check_pair(target, drafter, block_size)
    if method == "ddtree":
        tree_budget = DEFAULT_TREE_BUDGET if tree_budget is None else tree_budget
        tree_budget = arguments.integer(tree_budget, "tree_budget", 1)
    if speculative_:
        calibration = drafter.calibration if calibration is None else calibration
        shapes = _menu(method, menu, block_size, tree_budget)
        if len(shapes) > 1:
            cost = _step_cost(target.cfg) if cost is None else cost
            cost = cost if isinstance(cost, StepCost) else StepCost.load(cost)
            if not cost.draft_bytes:  # a target-only fit: add this drafter's pass
                n_params = sum(int(x.size) for x in jax.tree.leaves(drafter.state))
                cost = cost.with_drafter(drafter.cfg, n_params, target.cfg)
    if mesh is not None and as_sharding(mesh) != target.sharding:
        raise ValueError("the target lives on another mesh: load it with load_target(mesh=...)")
    sharding = target.sharding
    if speculative_ and sharding is not None and drafter.sharding != sharding:
        drafter = dataclasses.replace(
            Drafter.from_model(drafter.model, drafter.name, sharding),
            calibration=drafter.calibration,
            prior_acceptance=drafter.prior_acceptance,
            entry_acceptance=drafter.entry_acceptance,
        )
    if speculative_:
        drafter = drafter.with_kernels(target.cfg.kernels)  # the drafter follows its target
    tokenizer = tokenizer or target.tokenizer
    ids = _as_token_lists(target, prompts, tokenizer)
    B = len(ids)
    max_new = arguments.max_new_tokens(max_new_tokens, B)
    # A batch split over devices must divide evenly: pad with one-token dummy sequences.
    shards = 1 if sharding is None else sharding.size("batch")
    pad = -B % shards
    ids, max_new = ids + [[0]] * pad, max_new + [1] * pad
    lens = [len(p) for p in ids]
    capacity = arguments.cache_capacity(
        lens, max_new, cache_size, target.cfg.max_position_embeddings
    )
    default_stop = tokenizer.stop_ids if tokenizer is not None else target.cfg.eos_token_ids
    stop_rows = arguments.stop_rows(stop_tokens, B, sorted(default_stop), target.cfg.vocab_size)
    stop = jnp.asarray(_stop_matrix(stop_rows))
    stop = jnp.concatenate([stop, jnp.full((pad, stop.shape[1]), -1, jnp.int32)])
    if speculative_:  # no step can verify more nodes than the cache has room for
        requested = tree_budget
        shapes = arguments.cap_trees(shapes, arguments.tree_cap(capacity, lens[:B]))
        tree_budget = shapes[0].size if method == "ddtree" else None

    if method == "auto" and len(shapes) > 1:
        context = float(np.mean(lens) + np.mean(max_new) / 2)  # mean over the decode
        priors = (drafter.prior_acceptance, drafter.entry_acceptance)
        shapes = speculative.paying_menu(shapes, cost, B + pad, context, *priors)
    # method "auto" where no draft size can pay at this batch size (or menu=["none"])
    plain = method == "auto" and all(s.kind == "none" for s in shapes)

    P = _round_up(max(lens), 16)  # bucket prompt lengths so similar batches share a compile
    tokens = np.zeros((B + pad, P), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    sampling = dict(
        key=jax.random.key(seed),
        temperature=jnp.float32(max(temperature, 1e-6)),
        top_p=jnp.float32(top_p),
    )
    run = (
        _run_ar
        if method == "ar" or plain
        else functools.partial(_run_speculative, drafter, block_size, shapes, cost, calibration)
    )
    res = run(target, jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), capacity,
              jnp.asarray(max_new, jnp.int32), stop, sampling, temperature == 0.0)  # fmt: skip

    n_out = res["n_out"][:B]
    toks = [res["out"][b, : n_out[b]].tolist() for b in range(B)]
    texts = None
    if tokenizer is not None:
        stops = set(default_stop) if stop_tokens is None else set(stop.ravel().tolist())
        texts = [tokenizer.decode([t for t in seq if t not in stops]) for seq in toks]
    new = int(n_out.sum())
    # taus[b]: tokens committed per decode step while sequence b was running
    taus = [[int(t) for t in row if t > 0] for row in res["taus"][:B]]
    flat = [t for row in taus for t in row]
    decode_s = res["decode_s"]
    stats = {
        "method": method,
        "batch": B,
        "steps": res["steps"],
        "new_tokens": new,
        "acceptance_lengths": taus,
        "mean_acceptance": float(np.mean(flat)) if flat else float("nan"),
        "acceptance_histogram": np.bincount(flat, minlength=2)[1:].tolist() if flat else [],
        "compile_s": res["compile_s"],
        "prefill_s": res["prefill_s"],
        "decode_s": decode_s,
        # the first token of each sequence comes from prefill; decode produced the rest
        "tokens_per_s": (new - B) / decode_s if decode_s > 0 else float("nan"),
    }
    if speculative_ and plain:  # auto ran plain decoding: every step skipped the drafter
        res["expected"] = [[1.0] * len(row) for row in taus]
        res["choices"] = [len(shapes)] * res["steps"]
    if speculative_:
        stats["block_size"] = block_size
        # the drafter's own forecast of each step's tau (DDTree Proposition 1), beside the
        # realised tau: their gap is the calibration error (last steps cut by a stop or
        # max_new_tokens realise less than forecast)
        exp = [[float(e) for e, t in zip(er, tr) if t > 0]
               for er, tr in zip(res["expected"][:B], res["taus"][:B])]  # fmt: skip
        pairs = [(e, t) for er, tr in zip(exp, taus) for e, t in zip(er, tr)]
        stats["expected_acceptance"] = exp
        stats["mean_expected_acceptance"] = float(np.mean([e for e, _ in pairs] or np.nan))
        stats["calibration_error"] = float(np.mean([abs(e - t) for e, t in pairs] or np.nan))
    if method == "auto":
        # per step, for the whole batch; "skip": a plain step that did not run the drafter
        names = [str(s) for s in shapes] + ["skip"]
        picked = [names[i] for i in res["choices"][: res["steps"]]]
        stats["menu"] = names[:-1]
        stats["draft_choices"] = picked
        stats["draft_choice_counts"] = {n: picked.count(n) for n in names}
    if method == "ddtree":
        sizes = [int(s) for row in res["sizes"][:B] for s in row if s > 0]
        stats["tree_budget"] = tree_budget  # what ran: capped by what fits in the cache
        stats["tree_budget_requested"] = requested
        stats["mean_tree_size"] = float(np.mean(sizes)) if sizes else float("nan")
        stats["mean_accepted_depth"] = stats["mean_acceptance"] - 1
    return GenerateOutput(tokens=toks, texts=texts, stats=stats)


def _timed(prefill, decode):
    """Run prefill() then decode(prefill result) with device syncs between; returns
    (decode outputs as numpy, prefill seconds, decode seconds). decode returns only what the
    host needs: a final KV cache brought back would cost seconds at large batch (gigabytes
    through freshly allocated host memory) and is not part of decoding."""
    t0 = time.perf_counter()
    pre = jax.block_until_ready(prefill())
    t1 = time.perf_counter()
    out = jax.tree.map(np.asarray, decode(pre))
    return out, t1 - t0, time.perf_counter() - t1


def _run_ar(target, tokens, lens, capacity, max_new, stop, sampling, greedy):
    key, temp, topp = sampling["key"], sampling["temperature"], sampling["top_p"]
    B = tokens.shape[0]
    cache = shard_cache(init_cache(target.cfg, B, capacity, target.dtype), target.sharding)
    t0 = time.perf_counter()
    pre = _compiled(ar.prefill_and_sample, target.graphdef, target.state, tokens, lens, cache,
                    key, temp, topp, greedy=greedy)  # fmt: skip
    first_shape, cache_spec = _output_specs(pre, (jnp.zeros((B,), jnp.int32), cache))
    dec = _compiled(ar.decode_loop, target.graphdef, target.state, cache_spec, first_shape, max_new,
                    stop, key, temp, topp, greedy=greedy, max_steps=int(max_new.max()))  # fmt: skip
    compile_s = time.perf_counter() - t0
    (out, n_out, steps), pre_s, dec_s = _timed(
        lambda: pre(target.state, tokens, lens, cache, key, temp, topp),
        lambda r: dec(target.state, r[1], r[0], max_new, stop, key, temp, topp)[:3],  # no cache
    )
    taus = [[1] * (int(n) - 1) for n in n_out]  # AR: one token per decode step
    return dict(out=out, n_out=n_out, steps=int(steps), taus=taus, compile_s=compile_s,
                prefill_s=pre_s, decode_s=dec_s)  # fmt: skip


def _menu(method, menu, block_size, tree_budget) -> tuple[DraftShape, ...]:
    """The static tuple of DraftShapes the step may verify, parsed and checked."""
    if method == "dflash":
        return (DraftShape("chain", block_size - 1),)
    if method == "ddtree":
        return (DraftShape("tree", tree_budget),)
    shapes = []
    for item in DEFAULT_MENU if menu is None else menu:
        item = str(item)
        kind = item.rstrip("0123456789")
        size = item[len(kind) :]
        if kind == "chain":
            size = size or block_size - 1
        try:
            shape = DraftShape(kind, int(size or 0))
        except ValueError as e:
            msg = f"bad menu entry {item!r}: {e}; use none, chain, chainN or treeN"
            raise ValueError(msg) from None
        if kind == "chain" and not 1 <= shape.size <= block_size - 1:
            raise ValueError(f"menu entry {item!r}: a chain holds 1..{block_size - 1} drafts")
        shapes.append(shape)
    if not shapes or len(set(shapes)) != len(shapes):
        raise ValueError(f"menu needs distinct entries (got {list(menu or DEFAULT_MENU)})")
    return tuple(shapes)


@functools.cache
def _step_cost(cfg) -> StepCost:
    return StepCost.for_config(cfg)


def _run_speculative(drafter, block_size, shapes, cost, calibration, target, tokens, lens,
                     capacity, max_new, stop, sampling, greedy):  # fmt: skip
    key, temp, topp = sampling["key"], sampling["temperature"], sampling["top_p"]
    cal = jnp.float32(calibration)
    # each entry's tau before the first draft (0 = unknown: the first step drafts)
    known = drafter.prior_acceptance > 0
    prior = jnp.asarray([speculative.entry_tau(s, drafter.prior_acceptance,
                                               drafter.entry_acceptance) if known else 0.0
                         for s in shapes], jnp.float32)  # fmt: skip
    B = tokens.shape[0]
    tcache = shard_cache(init_cache(target.cfg, B, capacity, target.dtype), target.sharding)
    dcache = shard_cache(
        init_cache(drafter.cfg.layers, B, capacity, target.dtype), drafter.sharding
    )
    tg, ts, dg, ds = target.graphdef, target.state, drafter.graphdef, drafter.state
    t0 = time.perf_counter()
    pre = _compiled(speculative.prefill, tg, ts, dg, ds, tokens, lens, tcache, dcache, key, temp,
                    topp, greedy=greedy)  # fmt: skip
    first_shape, tspec, dspec = _output_specs(pre, (jnp.zeros((B,), jnp.int32), tcache, dcache))
    dec = _compiled(speculative.decode_loop, tg, ts, dg, ds, tspec, dspec, first_shape, max_new,
                    stop, key, temp, topp, cal, prior, greedy=greedy,
                    max_steps=int(max_new.max()),
                    block_size=block_size, shapes=shapes, cost=cost)  # fmt: skip
    compile_s = time.perf_counter() - t0
    (out, n_out, taus, sizes, choices, expected, steps), pre_s, dec_s = _timed(
        lambda: pre(ts, ds, tokens, lens, tcache, dcache, key, temp, topp),
        lambda r: dec(ts, ds, r[1], r[2], r[0], max_new, stop, key, temp, topp, cal, prior)[:7],
    )
    return dict(out=out, n_out=n_out, steps=int(steps), taus=taus, sizes=sizes, choices=choices,
                expected=expected, compile_s=compile_s, prefill_s=pre_s,
                decode_s=dec_s)  # fmt: skip


def forward(target: Target, token_ids) -> np.ndarray:
    """Full-sequence logits [B, T, V] float32 with no cache reuse (parity and research)."""
    arguments.loaded(target, Target, "target", "kdj.load_target")
    cfg = target.cfg
    arr = arguments.forward_tokens(token_ids, cfg.vocab_size, cfg.max_position_embeddings)
    return np.asarray(_forward(target.graphdef, target.state, jnp.asarray(arr, jnp.int32))[0])


def hidden_states(target: Target, token_ids, layers) -> np.ndarray:
    """Output hidden states of the given decoder layers, [B, T, len(layers), D] float32
    (HF `hidden_states[id + 1]`), from one full-sequence pass with no cache reuse."""
    arr = np.asarray(token_ids, np.int32).reshape(-1, np.shape(token_ids)[-1])
    taps = tuple(int(i) for i in layers)
    if any(not 0 <= i < target.cfg.num_layers for i in taps):
        raise ValueError(f"layer ids {taps} outside [0, {target.cfg.num_layers})")
    out = _forward(target.graphdef, target.state, jnp.asarray(arr), taps=taps)[1]
    return np.asarray(out, np.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "taps"))
def _forward(graphdef, state, tokens, taps=()):
    """Full-sequence pass from an empty cache: (logits [B, T, V], taps [B, T, K, D] or None)."""
    model = nnx.merge(graphdef, state)
    B, T = tokens.shape
    cache = init_cache(model.cfg, B, T, model.embed[...].dtype)
    logits, _, tapped = model(tokens, jnp.zeros((B,), jnp.int32), cache, taps=taps)
    return logits, tapped
