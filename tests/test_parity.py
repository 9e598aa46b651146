"""Parity with Hugging Face transformers on the same weights (float32, CPU).

Each case saves a small random model with save_pretrained (real safetensors format; FP8 and
INT4 variants re-encoded as DeepSeek-V3 / Kimi K2.5 ship them), loads it with kdj.load_target
and checks (a) full-sequence logits: max |kdj - hf| / max |hf| <= 1e-4, and (b) 64 greedy new
tokens for a batch of ragged prompts, decoded by kdj in ONE batched on-device loop, identical
to HF's greedy continuation of each prompt alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kdj
from tests.hf_models import build

CASES = [
    "llama",
    "qwen2",
    "qwen3",
    "deepseek_v3",  # q-LoRA, n_group 4 / topk_group 2, YaRN, correction bias
    "deepseek_v3_no_qlora",
    "deepseek_v2_lite",  # softmax scoring, greedy top-k, no renormalisation, YaRN mscale 0.707
    "kimi_k2",  # model_type kimi_k2, DeepSeek-V3 weights
    "kimi_k25+int4",  # text_config wrapper, language_model. prefix, INT4 routed experts
    "deepseek_v3+fp8",  # FP8 e4m3 block-scaled linears, sharded with an index
]
NEW = 64
LOGIT_RTOL = 1e-4


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param.replace("+", "_"))
    hf = build(request.param, path)
    target = kdj.load_target(path, dtype="float32")
    return request.param, hf, target


def test_logits_match_hf(pair):
    _, hf, target = pair
    rng = np.random.default_rng(0)
    ids = rng.integers(0, target.cfg.vocab_size, size=(2, 37))
    ours = kdj.forward(target, ids)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= LOGIT_RTOL, f"relative logit error {err:.2e}"


def test_batched_ragged_greedy_matches_hf(pair):
    name, hf, target = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, target.cfg.vocab_size, size=n).tolist() for n in (5, 17, 9)]
    out = kdj.generate(target, prompts, method="ar", max_new_tokens=NEW, stop_tokens=[])
    for p, got in zip(prompts, out.tokens):
        assert got == hf_greedy(hf, p, NEW), name


def test_tapped_hidden_states_match_hf(pair):
    """Any layer's output hidden state comes back with the logits (DFlash's context features):
    kdj tap i == HF hidden_states[i + 1], from the same single forward pass."""
    _, hf, target = pair
    ids = np.arange(12)[None] % target.cfg.vocab_size
    taps = tuple(range(target.cfg.num_layers - 1))  # the last one is HF's post-norm output
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids), output_hidden_states=True).hidden_states
    ours = kdj.api.hidden_states(target, ids, taps)
    for j, i in enumerate(taps):
        want = ref[i + 1][0].numpy()
        assert np.abs(ours[0, :, j] - want).max() <= LOGIT_RTOL * np.abs(want).max()
