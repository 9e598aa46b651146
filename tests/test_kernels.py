"""The kernel policy (kdj/kernels.py): defaults per backend and sharding, checks, and that a
policy reaches every layer and is part of the jit key (Pallas kernels interpreted here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdj
from kdj.config import ModelConfig
from kdj.kernels import FAMILIES, KernelPolicy, choose
from kdj.models.drafter import DrafterConfig, build_drafter
from kdj.models.transformer import build_model
from kdj.pallas import expert_gemv, tree_attention
from kdj.sharding import MeshConfig, make_mesh

TINY_MLA = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=64)  # fmt: skip


def test_defaults_per_backend_and_sharding():
    cpu, gpu = KernelPolicy.default("cpu"), KernelPolicy.default("gpu")
    assert cpu == KernelPolicy() and all(getattr(cpu, f) == "xla" for f in FAMILIES)
    assert all(getattr(gpu, f) == "pallas" for f in FAMILIES if f != "dense_mlp")
    assert gpu.dense_mlp == "xla"  # opt-in (kdj/kernels.py: KernelPolicy.default)
    split = KernelPolicy.default("gpu", sharded=True)
    assert split.dense_gemv == split.head_gemv == "xla"  # a pallas_call cannot take split weights
    assert split.replace(dense_gemv="pallas", head_gemv="pallas") == gpu
    # the thresholds do not depend on the backend
    assert (gpu.gemv_min_weights, gpu.gemv_max_weights, gpu.gemv_programs) == (
        1 << 17,
        1 << 24,
        256,
    )


def test_an_unsharded_model_keeps_its_kernels_on_a_multi_device_host():
    """What decides is whether THIS model's weights are split, not how many devices exist
    (8 virtual CPU devices here, tests/conftest.py)."""
    assert jax.device_count() > 1
    assert choose(None, None, backend="gpu") == KernelPolicy.default("gpu")
    one = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    assert choose(None, one, backend="gpu") == KernelPolicy.default("gpu")
    two = make_mesh(MeshConfig(model=2), devices=jax.devices()[:2])
    assert choose(None, two, backend="gpu") == KernelPolicy.default("gpu", sharded=True)
    assert choose(None, two) == KernelPolicy()  # this CPU: the reference
    with pytest.raises(ValueError, match="cannot take weights split over a mesh"):
        choose(KernelPolicy.default("gpu"), two)
    assert choose(KernelPolicy.default("gpu", sharded=True), two).attention == "pallas"


def test_bad_policies_are_refused():
    with pytest.raises(ValueError, match="attention must be 'xla' or 'pallas', not 'triton'"):
        KernelPolicy(attention="triton")
    with pytest.raises(ValueError, match="gemv_min_weights"):
        KernelPolicy(gemv_min_weights=10, gemv_max_weights=5)
    with pytest.raises(ValueError, match=">= 1"):
        KernelPolicy(split_blocks=0)
    with pytest.raises(TypeError, match="KernelPolicy"):
        choose({"dense_gemv": "pallas"})
    cfg = ModelConfig.from_hf(TINY_MLA).with_kernels(KernelPolicy.default("gpu"))
    assert "kernels" not in cfg.to_dict()  # a runtime choice, never saved with the weights
    assert ModelConfig.from_dict(cfg.to_dict()).kernels == KernelPolicy()


def test_a_policy_reaches_every_layer_and_keys_the_jit(monkeypatch):
    """One-token forward of a tiny DeepSeek-V3 under the GPU policy (GEMV window opened to
    its small matrices): the dense, head and expert GEMVs and the latent attention kernel run
    (interpreted) and give the reference's logits; the policy is in the graphdef, so the
    jitted forward traces again for it, and only once."""
    calls = {"gemv": 0, "attention": 0}
    gemv, latent = expert_gemv.expert_gemv, tree_attention.latent_tree_attention

    def count(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return run

    monkeypatch.setattr(expert_gemv, "expert_gemv", count("gemv", gemv))
    monkeypatch.setattr(tree_attention, "latent_tree_attention", count("attention", latent))
    model = build_model(ModelConfig.from_hf(TINY_MLA), jnp.float32)
    ref = kdj.Target.from_model(model)
    assert ref.cfg.kernels == KernelPolicy()  # CPU default
    policy = KernelPolicy.default("gpu").replace(gemv_min_weights=1)
    gpu = ref.with_kernels(policy)
    assert gpu.graphdef != ref.graphdef and gpu.state is ref.state
    assert ref.with_kernels(None) is ref and gpu.with_kernels(policy) is gpu
    for _, module in nnx.iter_modules(gpu.model):
        assert getattr(module, "kernels", policy) == policy
        assert getattr(getattr(module, "cfg", None), "kernels", policy) == policy
    ids = np.array([[5]])
    want = kdj.forward(ref, ids)
    assert calls == {"gemv": 0, "attention": 0}  # the reference: XLA only
    got = kdj.forward(gpu, ids)
    # per layer: q_a, q_b, kv_a, w_uk, w_uv, o; the dense MLP's 2; the MoE's router, 2
    # expert matrices and its shared MLP's 2 (the logits stay one XLA dot)
    assert calls == {"gemv": 6 * 2 + 2 + 5, "attention": 2}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    kdj.forward(gpu, ids)
    assert calls["gemv"] == 19  # the same key: no new trace


def test_the_drafter_takes_its_targets_policy():
    t = ModelConfig.from_hf(TINY_MLA)
    layers = t.replace(family="llama", model_type="qwen3", num_layers=1, qk_norm=True,
                       num_heads=4, num_kv_heads=2, head_dim=16, q_lora_rank=None)  # fmt: skip
    cfg = DrafterConfig(layers=layers, block_size=4, mask_token_id=63, target_layer_ids=(1,),
                        num_target_layers=2)  # fmt: skip
    drafter = kdj.Drafter.from_model(build_drafter(cfg, jnp.float32))
    policy = KernelPolicy.default("gpu")
    moved = drafter.with_kernels(policy)
    assert moved.cfg.layers.kernels == policy and drafter.cfg.layers.kernels == KernelPolicy()
    assert moved.graphdef != drafter.graphdef and moved.with_kernels(policy) is moved
    linears = [m for _, m in nnx.iter_modules(moved.model) if hasattr(m, "kernels")]
    assert len(linears) >= 7 and all(m.kernels == policy for m in linears)  # fc, q/k/v/o, MLP


def test_graph_conditionals_names_command_buffer_kinds_this_xla_knows():
    """The option lists XLA's command buffer kinds by name; XLA parses it on any backend
    (the CPU ignores it), so a renamed kind fails here rather than on the GPU."""
    from kdj.handles import Executables

    assert KernelPolicy().compiler_options() == {}
    options = KernelPolicy(graph_conditionals=True).as_deterministic().compiler_options()
    assert options["xla_allow_excess_precision"] is False
    assert options["xla_gpu_enable_command_buffer"].split(",")[-1] == "CONDITIONAL"

    def step(i, y):  # a branch picked per step inside an on-device loop, as auto's step is
        return jax.lax.switch(i % 2, [lambda z: z * 2, lambda z: z + 1], y)

    def loop(x):
        return jax.lax.fori_loop(0, 4, step, x)

    x = jnp.ones(3)
    program = Executables().get(jax.jit(loop), x, options=options)
    np.testing.assert_array_equal(program(x), jnp.full(3, 7.0))
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(loop).lower(x).compile({"xla_gpu_enable_command_buffer": "+WHILE"})
