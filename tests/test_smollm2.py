"""The embedded default model end to end: real SmolLM2-135M-Instruct weights (GGUF), its
tokenizer and chat template, against Hugging Face transformers on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import kdj

# float32 on CPU: different summation orders only; greedy tokens must agree exactly.
LOGIT_ATOL = 2e-3
QUESTION = "What is the capital of Australia?"


@pytest.fixture(scope="session")
def target():
    return kdj.load_target("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def hf_model(hf_reference):
    config, tensors = hf_reference
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model.tie_weights()
    return model


def chat_ids(target, text):
    tok = target.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_logits_match_transformers(target, hf_model):
    ids = chat_ids(target, QUESTION)
    ours = kdj.forward(target, [ids])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(ours - ref).max() <= LOGIT_ATOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_answer_and_batched_ragged_prompts_match_transformers(target, hf_model):
    questions = [QUESTION, "Write a haiku about the sea.", "2+2="]
    prompts = [chat_ids(target, q) for q in questions]
    out = kdj.generate(target, prompts, method="ar", max_new_tokens=24)
    assert out.texts[0] == "The capital of Australia is Canberra."
    stop = target.tokenizer.stop_ids
    for p, got in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([p]), max_new_tokens=24, do_sample=False,
                eos_token_id=sorted(stop), pad_token_id=0,
            )[0, len(p) :].tolist()  # fmt: skip
        assert got == ref


def test_text_prompts_use_the_target_tokenizer(target):
    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    out = kdj.generate(target, [prompt], method="ar", max_new_tokens=16)
    assert out.texts == ["The capital of Australia is Canberra."]
    assert out.tokens[0][-1] in tok.stop_ids  # cut after the first stop token
