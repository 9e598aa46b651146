"""The arguments of kdj.generate and kdj.forward, checked and normalised before anything
compiles: pure functions that take what the caller passed and return plain Python values or
raise a TypeError (wrong kind of value) or ValueError (right kind, out of range) naming the
argument and what to pass instead."""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kdj.cost import StepCost
from kdj.decode.logprobs import MAX_TOP

METHODS = ("ar", "dflash", "ddtree", "auto")
COSTS = ("tune", "estimate")  # generate's named cost choices (beside a StepCost or its path)
# The floating dtypes kdj's models and kernels run in (float64 would silently run as float32
# with jax's default x64 off; integer weights would be truncated).
DTYPES = ("float32", "bfloat16")
# A parameter that the method does not use is refused, never ignored.
APPLIES_TO = {
    "block_size": ("dflash", "ddtree", "auto"),
    "tree_budget": ("ddtree",),
    "menu": ("auto",),
    "cost": ("auto",),
    "calibration": ("dflash", "ddtree", "auto"),
}


def dtype(value):
    """A jnp dtype kdj can run its weights in."""
    try:
        dt = jnp.dtype(value)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"dtype {value!r} is not supported: use one of {', '.join(DTYPES)}")
    return dt


def integer(value, name: str, minimum: int | None = None) -> int:
    """`value` as an int; floats (2.5 or 2.0), bools and strings are refused, not truncated."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer (got {value!r})")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer (got {value!r})") from None
    if minimum is not None and n < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {n})")
    return n


def real(value, name: str) -> float:
    """`value` as a finite float (NaN would make every sample token 0)."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or not np.isscalar(value):
        raise TypeError(f"{name} must be a number (got {value!r})")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite (got {x})")
    return x


def sampling(temperature, top_p) -> tuple[float, float]:
    t, p = real(temperature, "temperature"), real(top_p, "top_p")
    if t < 0:
        raise ValueError(f"temperature must be >= 0 (got {t}); 0 is greedy")
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (got {p}); 1 keeps every token")
    return t, p


def calibration(value) -> float:
    c = real(value, "calibration")
    if not c > 0:
        raise ValueError(f"calibration must be a positive temperature (got {c})")
    return c


def loaded(obj, cls, name: str, loader: str):
    """`obj` must be an already loaded kdj object (a Target or Drafter), not its path."""
    if not isinstance(obj, cls):
        hint = f"; load it first: {loader}({obj!r})" if isinstance(obj, str) else ""
        raise TypeError(f"{name} must be a kdj.{cls.__name__} from {loader}, got "
                        f"{type(obj).__name__}{hint}")  # fmt: skip
    return obj


def cost(value):
    """generate's `cost`: None, "tune", "estimate", a kdj.cost.StepCost or its JSON file."""
    if value is None or isinstance(value, StepCost) or (isinstance(value, str) and value in COSTS):
        return value
    choices = ('"tune" (time this machine\'s steps), "estimate" (from the model\'s shapes), a '
               "kdj.cost.StepCost or the path of its JSON file")  # fmt: skip
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"cost must be {choices}; got {type(value).__name__}")
    if not Path(value).is_file():
        raise ValueError(f"cost {str(value)!r} is not a file: cost is {choices}")
    return StepCost.load(value)  # read now: a bad file is named before anything compiles


def method(name, has_drafter: bool, **given) -> str:
    """The method to run ("auto" without a drafter is "ar"); `given` are the method-specific
    arguments the caller passed (None = not given): one that the method does not use raises."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {METHODS}")
    run = "ar" if name == "auto" and not has_drafter else name
    if run != "ar" and not has_drafter:
        raise ValueError(f"method {name!r} needs a drafter (kdj.load_drafter)")
    for arg, value in given.items():
        if value is not None and run not in APPLIES_TO[arg]:
            plain = " (method 'auto' without a drafter runs 'ar')" if name != run else ""
            uses = " or ".join(repr(m) for m in APPLIES_TO[arg])
            raise ValueError(f"{arg} applies to method {uses} with a drafter, not {run!r}{plain}")
    return run


def _is_ids(p) -> bool:
    """A sequence of token ids: a list, tuple or array (numpy, jax) of at least one axis."""
    return isinstance(p, (list, tuple)) or (hasattr(p, "__array__") and np.ndim(p) >= 1)


def _as_list(value):
    """An array (numpy, jax) as nested Python lists; anything else as it is."""
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        arr = np.asarray(value)
        if arr.ndim and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"token ids must be integers (got an array of dtype {arr.dtype})")
        return arr.tolist()
    return value


def prompts(value) -> list:
    """The batch as a list of prompts (each a str or a sequence of token ids); a str is one
    prompt, a 2-D integer array is one prompt per row."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"prompts are bytes ({bytes(value[:20])!r}): decode them to text first "
                        "(prompts.decode('utf-8'))")  # fmt: skip
    if hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        value = np.asarray(value)
        if value.ndim != 2:
            raise TypeError(
                f"prompts must be a list of prompts; got a {value.ndim}-D array (a batch of "
                "token ids is 2-D: one row per prompt)"
            )
        if not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"prompts must hold integer token ids (got dtype {value.dtype})")
        if not value.size:
            raise ValueError(f"no prompts given (an array of shape {value.shape}): a batch of "
                             "token ids needs at least one row of at least one id")  # fmt: skip
        return value.tolist()
    if not isinstance(value, Sequence):
        raise TypeError(f"prompts must be a str or a list of prompts, got {type(value).__name__}")
    if not value:
        raise ValueError("no prompts given")
    for i, p in enumerate(value):
        if isinstance(p, (bytes, bytearray)):
            raise TypeError(f"prompt {i} is bytes ({bytes(p[:20])!r}): decode it to text first "
                            "(p.decode('utf-8'))")  # fmt: skip
    if not any(isinstance(p, str) or _is_ids(p) for p in value):
        example = [list(value)[:8]]
        raise TypeError(
            f"prompts must be a list of prompts (str or token-id lists); for one prompt of "
            f"token ids write {example}"
        )
    return list(value)


def text(value: str, i: int) -> str:
    """A text prompt must be valid Unicode (no lone surrogates) to be tokenized."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"prompt {i} is not valid Unicode: lone surrogate {value[e.start]!r} at index "
            f"{e.start} (decode the text with errors='replace' or fix its source)"
        ) from None
    return value


def token_ids(value, i: int, vocab_size: int) -> list[int]:
    """Prompt `i` as a non-empty list of in-vocabulary int token ids."""
    if not _is_ids(value):
        raise TypeError(f"prompt {i} must be a str or a list of token ids, got {value!r}")
    ids = _int_ids(value, f"prompt {i}")
    if not ids:
        raise ValueError(f"prompt {i} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        vocab = f"[0, {vocab_size})"
        raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary {vocab}")
    return ids


def _int_ids(row, what: str) -> list[int]:
    out = []
    for t in _as_list(row):
        if _is_ids(t):
            raise TypeError(f"{what} must be a flat list of token ids (it is nested)")
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{what} must hold integer token ids, got {t!r}")
        out.append(int(t))
    return out


def per_sequence(value, n: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{what} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def seeds(value, n: int) -> tuple[list[int], bool]:
    """(one seed per prompt, whether they were given per prompt): `value` one int or a list of
    n ints, each in 0 .. 2**32 - 1."""
    per_prompt = isinstance(value, (list, tuple))
    out = [integer(s, "seed", 0) for s in per_sequence(value, n, "seed")]
    if any(s >= 1 << 32 for s in out):
        raise ValueError(f"seed must be < 2**32 (got {max(out)})")
    return out, per_prompt


def flag(value, name: str) -> bool:
    """`value` as a bool; anything but True or False (1, "yes", None) is refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False (got {value!r})")
    return bool(value)


def logprobs(value) -> int | None:
    """None (no log-probabilities), or the alternatives to return per token, 0 .. MAX_TOP."""
    if value is None:
        return None
    k = integer(value, "logprobs", 0)
    if k > MAX_TOP:
        raise ValueError(f"logprobs must be <= {MAX_TOP} alternatives per token (got {k})")
    return k


def max_new_tokens(value, n: int) -> list[int]:
    return [integer(m, "max_new_tokens", 1) for m in per_sequence(value, n, "max_new_tokens")]


def _stop_ids(row, vocab_size: int) -> list[int]:
    out = []
    for t in row:
        if isinstance(t, str):
            raise TypeError(
                f"stop_tokens are token ids, not strings (got {t!r}): use "
                "tokenizer.token_id(text) or tokenizer.encode(text)"
            )
        t = integer(t, "a stop token id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token id {t} outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out


def stop_rows(stop_tokens, n: int, default, vocab_size: int) -> list[list[int]]:
    """Per-sequence stop ids: None (the default), one list of ids for every prompt, or one
    list per prompt."""
    if stop_tokens is None:
        return [list(default)] * n
    if isinstance(stop_tokens, (int, np.integer)) and not isinstance(stop_tokens, bool):
        raise TypeError(f"stop_tokens is a list of token ids, not an int: write [{stop_tokens}]")
    if isinstance(stop_tokens, str) or not isinstance(stop_tokens, (list, tuple)):
        raise TypeError(
            f"stop_tokens must be a list of token ids or one list per prompt, got {stop_tokens!r}"
        )
    nested = [isinstance(s, (list, tuple)) for s in stop_tokens]
    if not any(nested):
        return [_stop_ids(stop_tokens, vocab_size)] * n
    if not all(nested) or any(isinstance(t, (list, tuple)) for s in stop_tokens for t in s):
        raise TypeError(
            f"stop_tokens must be one list of token ids, or one list per prompt "
            f"(e.g. [[2], [2, 7]]); got {stop_tokens!r}"
        )
    return [_stop_ids(s, vocab_size) for s in per_sequence(stop_tokens, n, "stop_tokens")]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cache_capacity(lens, max_new, cache_size, max_positions: int) -> int:
    """KV-cache slots: `cache_size`, or the longest prompt + max_new_tokens rounded up to a
    multiple of 128 (so similar batches share a compile) but never past the model's
    max_position_embeddings."""
    need = max(n + m for n, m in zip(lens, max_new))
    if cache_size is None:
        capacity = min(_round_up(need, 128), max(max_positions, need))
    else:
        capacity = integer(cache_size, "cache_size", 1)
    for i, (n, m) in enumerate(zip(lens, max_new)):
        if n + m > capacity:
            raise ValueError(
                f"prompt {i} has {n} tokens; with max_new_tokens={m} it needs {n + m} cache "
                f"slots but the cache holds {capacity}"
            )
    if capacity > max_positions and cache_size is not None:
        raise ValueError(f"cache_size {capacity} exceeds the model's max_position_embeddings "
                         f"({max_positions})")  # fmt: skip
    if capacity > max_positions:
        i = max(range(len(lens)), key=lambda i: lens[i] + max_new[i])
        raise ValueError(
            f"prompt {i} has {lens[i]} tokens; with max_new_tokens={max_new[i]} it needs "
            f"{need} positions, more than the model's max_position_embeddings "
            f"({max_positions}): shorten the prompt or max_new_tokens"
        )
    return capacity


def tree_cap(capacity: int, lens) -> int:
    """The most draft-tree nodes a step can ever verify: the cache slots after the shortest
    prompt and its root token (nodes past the cache end are never valid)."""
    return max(1, capacity - 1 - min(lens))


def cap_trees(shapes, cap: int) -> tuple:
    """Shapes with every tree cut to `cap` nodes (duplicates a cut makes dropped, order kept)."""
    out = []
    for s in shapes:
        if s.kind == "tree" and s.size > cap:
            s = type(s)("tree", cap)
        if s not in out:
            out.append(s)
    return tuple(out)


def menu(value):
    """None (the default menu) or a non-empty list of entry names."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"menu must be a list of entries such as ['none', 'tree16'], got {value!r}")
    if not value:
        raise ValueError("menu is empty: give at least one entry (none, chain, chainN, treeN)")
    return list(value)


def forward_tokens(token_ids, vocab_size: int, max_positions: int) -> np.ndarray:
    """forward's input as an int32 [B, T] array of equal-length rows of in-vocabulary ids."""
    rows = _as_list(token_ids)
    if isinstance(rows, Sequence) and rows and not any(_is_ids(r) for r in rows):
        rows = [rows]
    if not isinstance(rows, Sequence) or not rows or not all(_is_ids(r) for r in rows):
        raise ValueError("forward takes token ids of shape [B, T] (equal lengths)")
    ids = [_int_ids(r, f"forward row {i}") for i, r in enumerate(rows)]
    lengths = [len(r) for r in ids]
    if len(set(lengths)) > 1:
        i = next(i for i, n in enumerate(lengths) if n != lengths[0])
        raise ValueError(
            f"forward takes token ids of shape [B, T] (equal lengths): row {i} has {lengths[i]} "
            f"tokens, row 0 has {lengths[0]}; pad them or call forward once per row"
        )
    arr = np.asarray(ids, np.int64)
    if arr.size == 0:
        raise ValueError("forward needs at least one token")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"token id outside the vocabulary [0, {vocab_size})")
    if arr.shape[1] > max_positions:
        raise ValueError(
            f"forward got {arr.shape[1]} tokens per row; the model's max_position_embeddings "
            f"({max_positions}) is the most it can place"
        )
    return arr.astype(np.int32)
