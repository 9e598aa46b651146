"""Bad input gets a clear error naming the problem, before any compilation."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import kdj
from kdj.checkpoints.hf_safetensors import HFCheckpoint
from tests.hf_models import build


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build("llama", path)
    return path


@pytest.fixture(scope="module")
def target(ckpt):
    return kdj.load_target(ckpt, dtype="float32")


def copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_source():
    with pytest.raises(FileNotFoundError, match="not found"):
        kdj.load_target("/nonexistent/model")


def test_missing_config(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        kdj.load_target(path)


def test_missing_weights(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        kdj.load_target(path)


def test_corrupt_config(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    (path / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="corrupt"):
        kdj.load_target(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(ckpt, tmp_path, damage):
    path = copy(ckpt, tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(ValueError, match="corrupt safetensors"):
        kdj.load_target(path)


def test_missing_tensor(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    from safetensors.numpy import save_file

    tensors = {n: np.array(HFCheckpoint(path).raw(n)) for n in HFCheckpoint(path).names()}
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 tensors.*layers.1.mlp.down"):
        kdj.load_target(path)


def test_unknown_model_type(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_bigcode"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model_type 'gpt_bigcode'"):
        kdj.load_target(path)


def test_shape_mismatch(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] += 8  # config no longer matches the weights
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tensor shape mismatch.*mlp"):
        kdj.load_target(path)


def test_unexpected_tensor(ckpt, tmp_path):
    path = copy(ckpt, tmp_path)
    from safetensors.numpy import save_file

    tensors = {n: np.array(HFCheckpoint(path).raw(n)) for n in HFCheckpoint(path).names()}
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        kdj.load_target(path)


def test_prompt_longer_than_cache(target):
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens.*cache holds 32"):
        kdj.generate(target, [[1] * 5, [1] * 40], method="ar", max_new_tokens=4, cache_size=32)


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        kdj.generate(target, [[1, 2], []], method="ar")


def test_token_out_of_vocab(target):
    with pytest.raises(ValueError, match="token id 96 outside the vocabulary"):
        kdj.generate(target, [[1, 96]], method="ar")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        kdj.forward(target, [[-1, 2]])


def test_text_prompt_without_tokenizer(target):
    with pytest.raises(ValueError, match="need a tokenizer"):
        kdj.generate(target, ["hello"], method="ar")


def test_bad_decode_arguments(target):
    with pytest.raises(ValueError, match="unknown method"):
        kdj.generate(target, [[1]], method="beam")
    with pytest.raises(ValueError, match="top_p"):
        kdj.generate(target, [[1]], method="ar", top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries for 2 prompts"):
        kdj.generate(target, [[1], [2]], method="ar", max_new_tokens=[3])
