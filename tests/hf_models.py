"""Small random Hugging Face models saved with save_pretrained: real-format test checkpoints.

Each builder returns (torch reference model in eval mode, checkpoint dir). FP8 and INT4 variants
quantise the saved tensors with kdj.quant and load the DEQUANTISED values back
into the torch model, so the reference computes exactly what the checkpoint encodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kdj.checkpoints.hf_safetensors import HFCheckpoint
from kdj.quant import dequant_fp8, dequant_int4, quant_fp8, quant_int4

DENSE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
MLA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
           n_group=1, topk_group=1)  # fmt: skip
YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, mscale=1.0,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)  # fmt: skip


def _deepseek_v3(**kw):
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**{**MLA, **kw}))
    with torch.no_grad():  # a non-zero correction bias, so "selection only" is actually tested
        for layer in m.model.layers[MLA["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return m


BUILDERS = {
    "llama": lambda **o: LlamaForCausalLM(LlamaConfig(**{**DENSE, **o}, tie_word_embeddings=True)),
    "qwen2": lambda **o: Qwen2ForCausalLM(Qwen2Config(**{**DENSE, **o})),
    "qwen3": lambda **o: Qwen3ForCausalLM(Qwen3Config(**{**DENSE, "head_dim": 32, **o})),
    "deepseek_v3": lambda **o: _deepseek_v3(
        q_lora_rank=48, n_group=4, topk_group=2, rope_scaling=YARN, **o
    ),
    "deepseek_v3_no_qlora": lambda **o: _deepseek_v3(q_lora_rank=None, **o),
    "deepseek_v2_lite": lambda **o: DeepseekV2ForCausalLM(
        DeepseekV2Config(
            **{**MLA, "q_lora_rank": None, "topk_method": "greedy",
               "rope_scaling": {**YARN, "mscale": 0.707}, **o}
        )
    ),
}  # fmt: skip


def build(kind: str, path: Path, seed: int = 0, **overrides):
    """Save a random model of `kind` to path; returns the torch reference model.
    `overrides` change config fields (e.g. vocab_size=8 for sampling tests)."""
    torch.manual_seed(seed)
    base = kind.split("+")[0]
    builder = "deepseek_v3" if base in ("kimi_k2", "kimi_k25") else base
    model = BUILDERS[builder](**overrides).eval()
    # Random models have small logit gaps; widen the output layer so greedy ties are unlikely.
    if not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    if base == "kimi_k2":
        _retype(path, "kimi_k2")
    elif base == "kimi_k25":
        _wrap_kimi_k25(path)
    if kind.endswith("+fp8"):
        _quantise(model, path, "fp8")
    elif kind.endswith("+int4"):
        _quantise(model, path, "int4")
    return model


def _retype(path: Path, model_type: str):
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg))


def _wrap_kimi_k25(path: Path):
    """Rewrite as Kimi K2.5/K2.6's wrapper: text_config, language_model. prefix, a vision tower."""
    text = json.loads((path / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 8}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(wrapper))
    ckpt = HFCheckpoint(path)
    tensors = {"language_model." + n: np.array(ckpt.raw(n)) for n in ckpt.names()}
    tensors["vision_tower.patch_embed.weight"] = np.ones((8, 3), np.float32)
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"))


def _quantise(model, path: Path, fmt: str):
    """FP8: every linear except router/lm_head/embeddings (as DeepSeek-V3 ships). INT4: routed
    experts only (as Kimi K2.5/K2.6 ship). Written as two shards with an index."""
    ckpt = HFCheckpoint(path)
    out: dict[str, np.ndarray] = {}
    deq: dict[str, np.ndarray] = {}
    for name in ckpt.names():
        w = np.array(ckpt.raw(name), np.float32)
        linear = name.endswith("_proj.weight") and w.ndim == 2
        if fmt == "fp8" and linear:
            q, s = quant_fp8(w, block=16)  # small blocks so tiny tensors span several blocks
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = dequant_fp8(q, s, block=16)
        elif fmt == "int4" and linear and ".experts." in name:
            p, s = quant_int4(w)
            base = name[: -len(".weight")]
            out[base + ".weight_packed"], out[base + ".weight_scale"] = p, s
            out[base + ".weight_shape"] = np.array(w.shape, np.int32)
            deq[name.removeprefix("language_model.")] = dequant_int4(p, s, w.shape)
        else:
            out[name] = w
    (path / "model.safetensors").unlink()
    names = sorted(out)
    half = len(names) // 2
    index = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: out[n] for n in part}, str(path / fname))
        index.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    if fmt == "fp8":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
        (path / "config.json").write_text(json.dumps(cfg))
    state = model.state_dict()
    for name, w in deq.items():
        state[name] = torch.from_numpy(w)
    _load_unfused(model, state)


def _load_unfused(model, state):
    """Load per-expert HF names into a transformers-v5 model (whose experts are fused)."""
    fused = dict(model.state_dict())
    for key in list(fused):
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            pre = key.rsplit(".", 1)[0]
            n = fused[key].shape[0]
            if key.endswith("gate_up_proj"):
                gate_up = [
                    torch.cat([state[f"{pre}.{e}.{p}_proj.weight"] for p in ("gate", "up")])
                    for e in range(n)
                ]
                fused[key] = torch.stack(gate_up)
            else:
                fused[key] = torch.stack([state[f"{pre}.{e}.down_proj.weight"] for e in range(n)])
        elif key in state:
            fused[key] = state[key]
    model.load_state_dict(fused)
