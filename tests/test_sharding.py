"""Meshes and sharding rules: identical greedy tokens on every mesh, 1/N of each sharded
parameter per device, clear errors for meshes that do not fit. Runs on 8 virtual CPU
devices (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import kdj
from kdj.sharding import MeshConfig, axis_size, make_mesh
from tests.hf_models import build
from tests.test_speculative import make_drafter

MESHES = Path(__file__).resolve().parent.parent / "configs" / "meshes"
NAMES = ["tp8", "ep8", "ep4-tp2", "dp2-ep4", "dp2-ep4-dpattn"]
VOCAB = 16
NEW = 12  # tokens per prompt: several DFlash / DDTree steps of block 5 / budget 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds_mesh")
    # 8 heads and 8 experts so every mesh of 8 devices divides them
    build("deepseek_v3", path, vocab_size=VOCAB, num_attention_heads=8, num_key_value_heads=8)
    return path


@pytest.fixture(scope="module")
def reference(ckpt):
    target = kdj.load_target(ckpt, dtype="float32")
    drafter = make_drafter(target, layers=2, block=5)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=NEW, stop_tokens=[])
    sp = kdj.generate(target, prompts, drafter=drafter, method="dflash", max_new_tokens=NEW,
                      stop_tokens=[])  # fmt: skip
    assert sp.tokens == ar.tokens
    tree = kdj.generate(target, prompts, drafter=drafter, method="ddtree", tree_budget=8,
                        max_new_tokens=NEW, stop_tokens=[])  # fmt: skip
    assert tree.tokens == ar.tokens
    ids = np.arange(30).reshape(2, 15) % VOCAB
    return dict(target=target, drafter=drafter, prompts=prompts, tokens=ar.tokens,
                logits=kdj.forward(target, ids), ids=ids)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_same_tokens_on_every_mesh(name, ckpt, reference):
    target = kdj.load_target(ckpt, dtype="float32", mesh=MESHES / f"{name}.yaml")
    assert target.sharding is not None and target.sharding.mesh.size == 8
    logits = kdj.forward(target, reference["ids"])
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4, rtol=1e-4)
    prompts = reference["prompts"]
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=NEW, stop_tokens=[])
    assert ar.tokens == reference["tokens"]
    drafter = kdj.Drafter(*[getattr(reference["drafter"], f) for f in ("cfg", "graphdef", "state")])
    for spec in ({"method": "dflash"}, {"method": "ddtree", "tree_budget": 8}):
        sp = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=NEW, stop_tokens=[],
                          **spec)  # fmt: skip
        assert sp.tokens == reference["tokens"], spec


@pytest.mark.parametrize("name", NAMES)
def test_each_device_holds_its_share(name, ckpt):
    target = kdj.load_target(ckpt, dtype="float32", mesh=MESHES / f"{name}.yaml")
    sh = target.sharding
    from flax import nnx

    checked = 0
    for path, var in nnx.to_flat_state(target.state):
        arr = var.get_value()
        n = 1
        for logical in var.get_metadata()["axes"]:
            n *= axis_size(sh.mesh, None if logical is None else getattr(sh.rules, logical))
        for shard in arr.addressable_shards:
            assert shard.data.nbytes * n == arr.nbytes, (path, n)
        checked += n > 1
    assert checked >= 4  # at least the expert weights of both MoE layers are split


def test_mesh_must_match_device_count():
    with pytest.raises(ValueError, match="needs 4 devices, but 8 are available"):
        make_mesh(MeshConfig(expert=4))
    with pytest.raises(ValueError, match="unknown mesh axes"):
        MeshConfig.from_dict({"mesh": {"tensor": 8}})
    with pytest.raises(ValueError, match="unknown sharding rules"):
        MeshConfig.from_dict({"mesh": {"model": 8}, "rules": "zero3"})


def test_axes_that_do_not_divide_fail_before_loading(tmp_path):
    build("deepseek_v3", tmp_path, vocab_size=VOCAB)  # 4 attention heads
    with pytest.raises(ValueError, match="'heads' dimension \\(4\\) does not divide over 8"):
        kdj.load_target(tmp_path, dtype="float32", mesh={"mesh": {"model": 8}, "rules": "tp"})


def test_single_device_mesh_matches_no_mesh(ckpt, reference):
    target = kdj.load_target(ckpt, dtype="float32", mesh=make_mesh(MeshConfig(), jax.devices()[:1]))
    out = kdj.generate(
        target, reference["prompts"], method="ar", max_new_tokens=NEW, stop_tokens=[]
    )
    assert out.tokens == reference["tokens"]
