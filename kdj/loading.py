"""Loading: `load_target` and `load_drafter` from checkpoints or built-in names."""

from __future__ import annotations

import os
from pathlib import Path

from flax import nnx

from kdj import arguments
from kdj.checkpoints.dflash import load_calibration, load_drafter_checkpoint, read_drafter_config
from kdj.checkpoints.gguf import read_gguf, smollm2_gguf_path
from kdj.checkpoints.hf_safetensors import HFCheckpoint
from kdj.checkpoints.loader import load_hf, load_params
from kdj.checkpoints.orbax import is_orbax_dir, read_config, restore
from kdj.config import ModelConfig
from kdj.handles import Drafter, Target, check_pair
from kdj.sharding.apply import as_sharding, mark_experts
from kdj.tokenizer import load_tokenizer

BUILTIN_TARGETS = ("smollm2-135m-instruct",)
# Drafters shipped inside the package (kdj/assets/<name>/, published DFlash format).
ASSETS = Path(__file__).resolve().parent / "assets"
BUILTIN_DRAFTERS = ("smollm2-135m-dflash-b16",)


def source_type(source, what: str) -> None:
    """A checkpoint is named by a path or a name: anything else is a TypeError saying so."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"the {what} must be a path or a built-in name (a str or a Path), not "
                        f"{type(source).__name__}")  # fmt: skip


def target_path(source) -> Path:
    """The file or dir of the target `source` (a path or built-in name); FileNotFoundError
    saying what it may be when there is none (the CLI checks this before loading anything)."""
    if str(source) in BUILTIN_TARGETS:
        return smollm2_gguf_path()
    source_type(source, "target")
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"target {str(source)!r} not found: give an HF checkpoint dir, a .gguf file, a kdj "
            f"convert dir or a built-in name ({', '.join(BUILTIN_TARGETS)})"
        )
    return path


def drafter_path(source) -> Path:
    """Where the drafter `source` (a checkpoint dir or built-in name) is, as `target_path`."""
    source_type(source, "drafter")
    path = Path(source)
    if str(source) in BUILTIN_DRAFTERS and not path.exists():
        path = ASSETS / str(source)
    if not path.exists():
        raise FileNotFoundError(
            f"drafter {str(source)!r} not found: give a DFlash checkpoint dir or a built-in "
            f"name ({', '.join(BUILTIN_DRAFTERS)})"
        )
    return path


def check_target(source) -> ModelConfig:
    """The target `source`'s ModelConfig, read from its files without its weights
    (ValueError / FileNotFoundError naming the problem), so the CLI refuses a target, or a
    size it cannot hold, before loading."""
    path = target_path(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a target file must be .gguf (or pass a checkpoint dir)")
        return ModelConfig.from_hf(read_gguf(path)[0])  # the header: tensors are read lazily
    if is_orbax_dir(path):
        return read_config(path)[1]
    return ModelConfig.from_json(HFCheckpoint(path).config_path)


def drafter_config(source):
    """The drafter `source`'s config (DrafterConfig), read and checked without its weights."""
    return read_drafter_config(HFCheckpoint(drafter_path(source)))


def weights_dtype(dtype):
    """`dtype` as a jnp dtype; "auto" is float32 on a CPU (XLA's bfloat16 runs ~3x slower
    there) and bfloat16 on an accelerator."""
    if isinstance(dtype, str) and dtype == "auto":
        import jax

        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return arguments.dtype(dtype)


def load_target(source, dtype="auto", mesh=None, quantized_experts=False, kernels=None) -> Target:
    """Load a target from an HF safetensors dir, a .gguf file, a `kdj convert` Orbax dir, or a
    built-in name ("smollm2-135m-instruct"), in `dtype`: "float32", "bfloat16" or "auto"
    (float32 on a CPU, bfloat16 on a GPU or TPU).

    quantized_experts: keep an HF checkpoint's INT4 (Kimi K2.5/K2.6) or FP8 block-scaled
    (DeepSeek-V3, Kimi K2) routed experts quantised in device memory and dequantise inside the
    expert compute, only for the experts the tokens route to (about 4x fewer expert bytes than
    bf16 for INT4, 2x for FP8). Default: dequantise everything to `dtype` at load.
    kernels: which kernel each op runs (kdj.kernels.KernelPolicy); default: the measured
    choice for this backend and for whether this model is sharded."""
    dtype = weights_dtype(dtype)
    sharding = as_sharding(mesh)
    mesh_kw = {} if sharding is None else {"mesh": sharding.mesh, "rules": sharding.rules}
    path = target_path(source)
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


def load_drafter(source, target: Target | None = None, dtype=None, mesh=None) -> Drafter:
    """Load a DFlash or DFlash2 drafter (published checkpoint formats, told apart by the
    config's architectures: a directory, or a built-in name from BUILTIN_DRAFTERS). With
    `target`, check the pair fits (hidden size, vocabulary, feature layers) and use the
    target's dtype; without, `dtype` as load_target's (default "auto")."""
    if target is not None:
        arguments.loaded(target, Target, "target", "kdj.load_target")
    dtype = weights_dtype(dtype or (target.dtype if target is not None else "auto"))
    path = drafter_path(source)
    if mesh is None and target is not None:
        mesh = target.sharding  # the drafter lives on its target's mesh
    drafter = Drafter.from_model(load_drafter_checkpoint(path, dtype), path.name, mesh)
    drafter.calibration, drafter.prior_acceptance, drafter.entry_acceptance = load_calibration(path)
    if target is not None:
        check_pair(target, drafter)
    return drafter
