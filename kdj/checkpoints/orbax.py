"""`kdj convert`: save converted params with Orbax, restore them without re-converting.

Layout of a converted dir: kdj_config.json (the ModelConfig + dtype; written last, it marks a
finished conversion), params/ (an Orbax StandardCheckpointer checkpoint of the NNX parameter
state) and the target's tokenizer files (tokenizer.json, its chat template, ...). Restoring
goes straight into the target shardings: Orbax reads each array into the sharding of the
abstract target.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from kdj.checkpoints import staging
from kdj.config import ModelConfig
from kdj.models.transformer import abstract_model
from kdj.sharding import named_sharding, single_device_rules

CONFIG_NAME = "kdj_config.json"
# Bumped when a parameter's stored layout changes. 2: MLA's w_uv is held [H, C, v] (it was
# [H, v, C]; 2026-11-30), so an older DeepSeek-family checkpoint would load transposed.
FORMAT = 2


# The tokenizer side files load_tokenizer reads, copied across from an HF checkpoint dir.
TOKENIZER_FILES = (
    "tokenizer.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
    "generation_config.json", "special_tokens_map.json",
)  # fmt: skip


def is_orbax_dir(path: Path) -> bool:
    """A `kdj convert` dir, finished (kdj_config.json) or not (params/ alone)."""
    return (Path(path) / CONFIG_NAME).exists() or (Path(path) / "params").is_dir()


def save(model, path: str | Path, tokenizer=None, tokenizer_source=None) -> Path:
    """Write `model` (and the tokenizer, see save_tokenizer) as a kdj convert dir. Written
    into a temporary sibling and renamed at the end (kdj.checkpoints.staging), kdj_config.json
    last: a dir without it is an unfinished conversion. A non-empty `path` is refused."""
    path = Path(path).absolute()
    with staging.staged(path) as tmp:
        state = nnx.state(model, nnx.Param)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", state)
        if tokenizer is not None:
            save_tokenizer(tokenizer_source, tokenizer, tmp)
        meta = {"config": model.cfg.to_dict(), "dtype": str(model.embed[...].dtype),
                "format": FORMAT}  # fmt: skip
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2))
    return path


def save_tokenizer(source, tokenizer, folder: Path) -> None:
    """Carry the target's tokenizer into `folder`: an HF checkpoint dir's own tokenizer files
    are copied as they are; a GGUF's (built from its metadata) is written out as
    tokenizer.json + its side files (Tokenizer.save)."""
    src = Path(source) if source is not None else None
    if src is not None and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)
    else:
        tokenizer.save(folder)


def read_config(path: str | Path) -> tuple[dict, ModelConfig]:
    """A convert dir's kdj_config.json: (its fields, the ModelConfig), no weights read."""
    path = Path(path).absolute()
    if not (path / CONFIG_NAME).exists():
        raise ValueError(f"{path} is an incomplete kdj convert dir ({CONFIG_NAME}, written "
                         "last, is missing: the conversion was interrupted); delete it and "
                         "convert again")  # fmt: skip
    try:
        meta = json.loads((path / CONFIG_NAME).read_text())
        return meta, ModelConfig.from_dict(meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"corrupt {path / CONFIG_NAME}: {e}") from None
    except ValueError as e:  # a model kdj does not run
        raise ValueError(f"{path / CONFIG_NAME}: {e}") from None


def restore(path: str | Path, dtype=None, mesh=None, rules=None):
    path = Path(path).absolute()
    meta, cfg = read_config(path)
    if not (path / "params").exists():
        raise FileNotFoundError(f"{path} has no params/ checkpoint")
    fmt = meta.get("format", 1)
    if fmt < 2 and cfg.family == "deepseek":
        raise ValueError(f"{path} was converted by an older kdj that held MLA's w_uv as "
                         "[heads, v_head_dim, kv_lora_rank]; convert the source checkpoint "
                         "again with `kdj convert`")  # fmt: skip
    if fmt > FORMAT:
        raise ValueError(f"{path} is checkpoint format {fmt}; this kdj reads up "
                         f"to {FORMAT}")  # fmt: skip
    dtype = jnp.dtype(dtype or meta["dtype"])
    rules = rules or single_device_rules()
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))

    def target(var):
        sharding = named_sharding(mesh, rules, var.get_metadata()["axes"])
        value = var.get_value()
        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    abstract = jax.tree.map(target, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    failure = None
    with _quiet() as quiet:
        try:
            with ocp.StandardCheckpointer() as ckptr:
                state = ckptr.restore(path / "params", abstract)
        except Exception as e:  # TensorStore/Orbax raise many kinds, each with a long dump
            quiet.failed = True
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            failure = first.split(" See full")[0][:160]  # drop the pointer to TensorStore's dump
    if failure is not None:
        raise ValueError(f"{path / 'params'}: cannot read the converted weights ({failure}); "
                         "the files are damaged: run kdj convert again")  # fmt: skip
    return nnx.merge(graphdef, state)


@contextlib.contextmanager
def _quiet():
    """Orbax reports damaged files once per array, in log lines (absl, asyncio's "Task
    exception was never retrieved") and in an "Exception ignored" dump of every abandoned read
    (thousands of lines for a real model), some from TensorStore's threads after restore has
    raised: restore raises one clear error instead, so after a failure all of it stays
    silenced until those reads have stopped reporting."""
    hook = sys.unraisablehook
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [log.level for log in loggers]
    quiet = types.SimpleNamespace(failed=False, swallowed=0)

    def count(unraisable) -> None:
        quiet.swallowed += 1

    sys.unraisablehook = count
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield quiet
    finally:
        gc.collect()
        seen, deadline = -1, time.monotonic() + 10
        while quiet.failed and quiet.swallowed != seen and time.monotonic() < deadline:
            seen = quiet.swallowed
            time.sleep(0.5)
            gc.collect()
        sys.unraisablehook = hook
        for log, level in zip(loggers, levels):
            log.setLevel(level)
