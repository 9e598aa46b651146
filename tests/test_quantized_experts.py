"""Routed experts kept quantised in HBM (INT4 packed, FP8 block-scaled) compute what the
dequantise-at-load path computes: on the real-format kimi_k25 INT4 and deepseek_v3 FP8
checkpoints, on one device and expert-parallel over 8 (virtual CPU) devices."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdj
from kdj.models.deepseek import MoE
from tests.hf_models import build

MESHES = Path(__file__).resolve().parent.parent / "configs" / "meshes"
CASES = {"kimi_k25+int4": "int4", "deepseek_v3+fp8": "fp8"}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    build(request.param, path, vocab_size=32)
    at_load = kdj.load_target(path, dtype="float32")
    kept = kdj.load_target(path, dtype="float32", quantized_experts=True)
    return request.param, path, at_load, kept


def expert_bytes(target) -> int:
    names = ("w_gate_up", "w_down", "gate_up_scale", "down_scale")
    flat = nnx.to_flat_state(target.state)
    return sum(v.get_value().nbytes for p, v in flat if p[-1] in names)


def moe_layers(target):
    return [m for _, m in nnx.iter_modules(target.model) if isinstance(m, MoE)]


def test_experts_stay_quantised(pair):
    name, _, at_load, kept = pair
    layers = moe_layers(kept)
    assert layers and all(m.expert_format == CASES[name] for m in layers)
    m = layers[0]
    E, D, _, I = moe_layers(at_load)[0].w_gate_up.shape
    if CASES[name] == "int4":
        assert m.w_gate_up.dtype == jnp.int32 and m.w_gate_up.shape == (E, D // 8, 2, I)
        assert m.down_scale.shape == (E, I // 32, D)
    else:
        assert m.w_gate_up.dtype == jnp.float8_e4m3fn and m.w_down.shape == (E, I, D)
        assert m.gate_up_scale.shape == (E, D // 16, 2, I // 16)  # the fixture's 16 x 16 blocks


def test_logits_and_greedy_tokens_match(pair):
    _, _, at_load, kept = pair
    ids = np.random.default_rng(0).integers(0, 32, size=(2, 19))
    ref = kdj.forward(at_load, ids)
    np.testing.assert_allclose(kdj.forward(kept, ids), ref, rtol=1e-5, atol=1e-5)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    want = kdj.generate(at_load, prompts, method="ar", max_new_tokens=12, stop_tokens=[]).tokens
    got = kdj.generate(kept, prompts, method="ar", max_new_tokens=12, stop_tokens=[]).tokens
    assert got == want


def test_expert_parallel_mesh_matches(pair):
    _, path, at_load, _ = pair
    kept = kdj.load_target(path, dtype="float32", mesh=MESHES / "ep8.yaml", quantized_experts=True)
    m = moe_layers(kept)[0]
    assert len(m.w_gate_up[...].addressable_shards) == 8
    assert m.w_gate_up[...].addressable_shards[0].data.shape[0] == 1  # one expert per device
    ids = np.random.default_rng(1).integers(0, 32, size=(2, 19))
    np.testing.assert_allclose(
        kdj.forward(kept, ids), kdj.forward(at_load, ids), rtol=1e-5, atol=1e-5
    )
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    want = kdj.generate(at_load, prompts, method="ar", max_new_tokens=8, stop_tokens=[]).tokens
    assert kdj.generate(kept, prompts, method="ar", max_new_tokens=8, stop_tokens=[]).tokens == want


def test_expert_bytes_shrink(pair):
    name, path, _, kept = pair
    bf16 = kdj.load_target(path, dtype="bfloat16")
    ratio = expert_bytes(bf16) / expert_bytes(kept)
    # INT4: 0.5 byte per weight + one float32 scale per 32 -> 2 / 0.625 = 3.2x (3.56x with the
    # bf16 scales real K2.5 checkpoints ship); FP8: 1 byte + a float32 per 16 x 16 block.
    want = 2 / (0.5 + 4 / 32) if CASES[name] == "int4" else 2 / (1 + 4 / 256)
    assert ratio == pytest.approx(want, rel=1e-6)


def test_unquantised_checkpoint_is_refused(tmp_path):
    build("deepseek_v3", tmp_path, vocab_size=32)
    with pytest.raises(ValueError, match="stores its routed experts unquantised"):
        kdj.load_target(tmp_path, dtype="float32", quantized_experts=True)
