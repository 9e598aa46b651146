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

from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.decode import autoregressive as ar
from kdj.tokenizer import Tokenizer, load_tokenizer

BUILTIN_TARGETS = ("smollm2-135m-instruct",)
METHODS = ("ar", "dflash", "ddtree", "auto")


@dataclasses.dataclass
class Target:
    """A loaded target model: config, NNX graph + params, and its tokenizer when known."""

    cfg: ModelConfig
    graphdef: Any
    state: Any
    dtype: Any
    name: str = ""
    tokenizer: Tokenizer | None = None
    mesh: Any = None

    @property
    def model(self):
        return nnx.merge(self.graphdef, self.state)

    @staticmethod
    def from_model(model, name="", tokenizer=None, mesh=None) -> Target:
        graphdef, state = nnx.split(model)
        dtype = model.embed[...].dtype
        return Target(model.cfg, graphdef, state, dtype, name, tokenizer, mesh)


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]  # generated tokens only, cut after the first stop token
    texts: list[str] | None
    stats: dict[str, Any]


# ------------------------------------------------------------------------------ loading
def load_target(source, dtype="bfloat16", mesh=None) -> Target:
    """Load a target from an HF safetensors dir, a .gguf file, a `kdj convert` Orbax dir, or a
    built-in name ("smollm2-135m-instruct")."""
    from kdj.checkpoints.gguf import read_gguf, smollm2_gguf_path
    from kdj.checkpoints.hf_safetensors import HFCheckpoint
    from kdj.checkpoints.loader import load_params
    from kdj.checkpoints.orbax import is_orbax_dir, restore

    dtype = jnp.dtype(dtype)
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
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a target file must be .gguf (or pass a checkpoint dir)")
        hf_cfg, tensors = read_gguf(path)
        cfg = ModelConfig.from_hf(hf_cfg)
        model = load_params(cfg, tensors, dtype=dtype, mesh=mesh, desc=f"loading {path.name}")
        tokenizer = load_tokenizer(path)
    elif is_orbax_dir(path):
        model = restore(path, dtype=dtype, mesh=mesh)
        cfg = model.cfg
    else:
        ckpt = HFCheckpoint(path)
        cfg = ModelConfig.from_json(ckpt.config_path)
        model = load_params(
            cfg,
            ckpt.tensors(),
            dtype=dtype,
            mesh=mesh,
            total=len(ckpt),
            desc=f"loading {path.name}",
        )
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(path)
        except (FileNotFoundError, ValueError):
            tokenizer = None  # weights without a tokenizer are fine for token-id prompts
    return Target.from_model(model, name=path.name, tokenizer=tokenizer, mesh=mesh)


def load_drafter(source, target: Target | None = None):
    raise NotImplementedError("DFlash drafters arrive with the DFlash issue; use method='ar'")


# ---------------------------------------------------------------------------- inference
_EXECUTABLES: dict = {}  # (function, graphdef, argument signature, statics) -> compiled


def _compiled(fn, graphdef, *args, **static):
    """Ahead-of-time compile `fn` once per signature, so generate() can report compile time
    apart from prefill/decode time and repeated calls reuse the executable."""

    def sig(x):
        return (x.shape, x.dtype, getattr(x, "sharding", None))

    key = (
        fn,
        graphdef,
        tuple(sig(x) for x in jax.tree.leaves(args)),
        tuple(sorted(static.items())),
    )
    if key not in _EXECUTABLES:
        if len(_EXECUTABLES) >= 32:
            _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
        _EXECUTABLES[key] = fn.lower(graphdef, *args, **static).compile()
    return _EXECUTABLES[key]


def _as_token_lists(target: Target, prompts, tokenizer: Tokenizer | None) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (pass tokenizer= or token ids)")
            p = tokenizer.encode(p)
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < target.cfg.vocab_size]
        if bad:
            vocab = target.cfg.vocab_size
            raise ValueError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})"
            )
        out.append(p)
    return out


def _per_sequence(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _stop_matrix(stop_tokens, n: int, default) -> np.ndarray:
    """Per-sequence stop ids as [B, K] int32, padded with -1."""
    if stop_tokens is None:
        rows = [list(default)] * n
    elif stop_tokens and all(isinstance(s, (list, tuple)) for s in stop_tokens):
        rows = _per_sequence([list(s) for s in stop_tokens], n, "stop_tokens")
    else:
        rows = [list(stop_tokens)] * n
    width = max(1, max(len(r) for r in rows))
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
) -> GenerateOutput:
    """Generate for a batch of prompts (strings or token-id lists of any lengths).

    method "ar" is plain decoding; "auto" picks "ar" when no drafter is given. max_new_tokens
    may be one int or one per prompt; stop_tokens one list or one list per prompt (default:
    the tokenizer's end-of-turn ids, else the config's eos). cache_size fixes the KV-cache
    capacity (default: the longest prompt + max_new_tokens, rounded up).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if method == "auto":
        method = "ar" if drafter is None else "dflash"
    if method != "ar":
        raise NotImplementedError(f"method {method!r} arrives with its own issue; use 'ar'")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    tokenizer = tokenizer or target.tokenizer
    ids = _as_token_lists(target, prompts, tokenizer)
    B = len(ids)
    max_new = [int(m) for m in _per_sequence(max_new_tokens, B, "max_new_tokens")]
    if min(max_new) < 1:
        raise ValueError("max_new_tokens must be >= 1")
    lens = [len(p) for p in ids]
    need = max(n + m for n, m in zip(lens, max_new))
    capacity = cache_size or _round_up(need, 128)
    for i, (n, m) in enumerate(zip(lens, max_new)):
        if n + m > capacity:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={m} it needs {n + m} cache "
                f"slots but the cache holds {capacity}"
            )
    if capacity > target.cfg.max_position_embeddings:
        raise ValueError(
            f"a cache of {capacity} positions exceeds the model's max_position_embeddings "
            f"({target.cfg.max_position_embeddings})"
        )
    default_stop = tokenizer.stop_ids if tokenizer is not None else target.cfg.eos_token_ids
    stop = jnp.asarray(_stop_matrix(stop_tokens, B, sorted(default_stop)))

    P = _round_up(max(lens), 16)  # bucket prompt lengths so similar batches share a compile
    tokens = np.zeros((B, P), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    greedy = temperature == 0.0
    key = jax.random.key(seed)
    temp = jnp.float32(max(temperature, 1e-6))
    topp = jnp.float32(top_p)
    max_steps = max(max_new)
    cache = init_cache(target.cfg, B, capacity, target.dtype)
    args = (jnp.asarray(tokens), jnp.asarray(lens, jnp.int32))

    t0 = time.perf_counter()
    pre = _compiled(
        ar.prefill_and_sample, target.graphdef, target.state, *args, cache, key, temp, topp,
        greedy=greedy,
    )  # fmt: skip
    first_shape = jax.ShapeDtypeStruct((B,), jnp.int32)
    dec = _compiled(
        ar.decode_loop, target.graphdef, target.state, cache, first_shape,
        jnp.asarray(max_new, jnp.int32), stop, key, temp, topp, greedy=greedy, max_steps=max_steps,
    )  # fmt: skip
    t1 = time.perf_counter()
    first, cache = pre(target.state, *args, cache, key, temp, topp)
    first.block_until_ready()
    t2 = time.perf_counter()
    out, n_out, steps, cache = dec(
        target.state, cache, first, jnp.asarray(max_new, jnp.int32), stop, key, temp, topp
    )
    out, n_out, steps = np.asarray(out), np.asarray(n_out), int(steps)
    t3 = time.perf_counter()

    toks = [out[b, : n_out[b]].tolist() for b in range(B)]
    texts = None
    if tokenizer is not None:
        stops = set(default_stop) if stop_tokens is None else set(stop.ravel().tolist())
        texts = [tokenizer.decode([t for t in seq if t not in stops]) for seq in toks]
    new = int(n_out.sum())
    decode_s = t3 - t2
    stats = {
        "method": "ar",
        "batch": B,
        "steps": steps,
        "new_tokens": new,
        "acceptance_lengths": [[1] * int(n - 1) for n in n_out],  # AR: one token per step
        "mean_acceptance": 1.0,
        "compile_s": t1 - t0,
        "prefill_s": t2 - t1,
        "decode_s": decode_s,
        # the first token of each sequence comes from prefill; decode produced the rest
        "tokens_per_s": (new - B) / decode_s if decode_s > 0 else float("nan"),
    }
    return GenerateOutput(tokens=toks, texts=texts, stats=stats)


def forward(target: Target, token_ids) -> np.ndarray:
    """Full-sequence logits [B, T, V] float32 with no cache reuse (parity and research)."""
    arr = np.asarray(token_ids)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.dtype == object:
        raise ValueError("forward takes token ids of shape [B, T] (equal lengths)")
    if arr.size == 0:
        raise ValueError("forward needs at least one token")
    if arr.min() < 0 or arr.max() >= target.cfg.vocab_size:
        raise ValueError(f"token id outside the vocabulary [0, {target.cfg.vocab_size})")
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
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _, tapped = model(tokens, positions, cache, taps=taps)
    return logits, tapped
