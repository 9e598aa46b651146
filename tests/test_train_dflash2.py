"""Training DFlash2 drafters: the training forward runs the inference layers (convolutions
included), the selector learns the target's choices, a DFlash2 drafter started from a DFlash
one drafts exactly as it does, training moves the new weights and lowers the loss, the
export reloads in the published format, decoding with the trained drafter is lossless, and
bad settings name the field. Tiny random targets, float32 on CPU."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import kdj
from kdj.models.drafter import build_drafter
from kdj.train.config import DrafterShape, OptimConfig, TrainConfig
from kdj.train.forward import selector_loss
from kdj.train.head import head_cross_entropy, head_top_k
from kdj.train.trainer import DrafterTrainer, drafter_config_for
from tests.test_train import (
    BLOCK,
    VOCAB,
    features,
    inference_block,
    optim,
    pattern_data,
    run_blocks,
    tiny_target,
)

D2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4)
# one optim setting per drafter kind, so the tests share each compiled training step
DFLASH_OPTIM = dict(steps=30, labels="target")
DFLASH2_OPTIM = dict(steps=12, labels="target", selector_weight=1.0)
PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 20, 8, 1], [30, 4]]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def shape(**kw) -> DrafterShape:
    return DrafterShape(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1,
                        intermediate_size=48, **kw)  # fmt: skip


def own_data(target, n=16, prompt_len=8, new=40, seed=0):
    """The target's own greedy continuations of random prompts: rows [n, prompt + new] and
    the loss mask on the responses (what regeneration gives the trainer)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, VOCAB - 1, (n, prompt_len)).tolist()
    out = kdj.generate(target, prompts, method="ar", max_new_tokens=new, stop_tokens=[])
    tokens = np.array([p + t for p, t in zip(prompts, out.tokens)], np.int32)
    mask = np.zeros_like(tokens, bool)
    mask[:, prompt_len:] = True
    return tokens, mask


@pytest.fixture(scope="module")
def data(target):
    return own_data(target)


@pytest.fixture(scope="module")
def dflash_dir(target, data, tmp_path_factory):
    """A DFlash drafter trained on the target's own data (it drafts some accepted tokens),
    exported in float32."""
    tr = DrafterTrainer(target, drafter_config_for(target.cfg, shape()),
                        optim(**DFLASH_OPTIM), *data)  # fmt: skip
    for _ in range(30):
        tr.train_step()
    return tr.export(tmp_path_factory.mktemp("dflash") / "d", dtype="float32")


@pytest.fixture(scope="module")
def trained(target, data, dflash_dir):
    """A DFlash2 trainer started from the DFlash drafter, after 12 steps."""
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2))
    tr = DrafterTrainer(target, cfg, optim(**DFLASH2_OPTIM), *data, init_from=dflash_dir)
    start = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
    steps = [tr.train_step() for _ in range(12)]
    return tr, start, steps


def spec_generate(target, drafter, **kw):
    kw = dict(max_new_tokens=24, stop_tokens=[]) | kw
    return kdj.generate(target, PROMPTS, drafter=drafter, method="dflash", **kw)


# ------------------------------------------------------------------ the training forward
def test_training_forward_runs_the_inference_layers(target):
    """The many-blocks training pass equals the inference pass block by block for a DFlash2
    drafter with random convolutions (and the convolutions change the states)."""
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2 | {"input_embedding_scale": 1.5}))
    drafter = build_drafter(cfg, jnp.float32, seed=1)
    plain = build_drafter(dataclasses.replace(cfg, dflash2=None), jnp.float32, seed=1)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB - 1, (2, 20)).astype(np.int32))
    feats = features(target, tokens, cfg)
    anchors = np.array([[0, 5, 9, 16], [3, 4, 12, 16]], np.int32)
    embed = target.model.embed[...]
    h = run_blocks(drafter, embed, feats, tokens, jnp.asarray(anchors))
    for bi, n in np.ndindex(anchors.shape):
        ref = inference_block(drafter, embed, feats[bi : bi + 1], tokens[bi : bi + 1],
                              jnp.int32(anchors[bi, n]))  # fmt: skip
        np.testing.assert_allclose(h[bi, n], ref[0], rtol=1e-5, atol=1e-5)
    assert not np.allclose(h, run_blocks(plain, embed, feats, tokens, jnp.asarray(anchors)))


def test_chunked_cross_entropy_through_the_softcap():
    """DFlash2's scaled and capped logits: the chunked loss and its gradient equal autodiff
    of the whole logits; the top-k candidates are lax.top_k's of the mapped logits."""
    from kdj.models.dflash2 import DFlash2Config

    d2 = DFlash2Config(2, 8, 4, 4, output_multiplier=0.7, final_logit_softcapping=3.0)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 40, (3, 5)), jnp.int32)
    weights = jnp.asarray(rng.random((3, 5)), jnp.float32)

    def chunked(h):
        return head_cross_entropy(h, w, labels, weights, 4, d2.logits).loss_sum

    def whole(h):
        logits = d2.logits(h @ w)
        gold = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        return jnp.sum(weights * (jax.nn.logsumexp(logits, -1) - gold))

    np.testing.assert_allclose(chunked(h), whole(h), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(chunked)(h), jax.grad(whole)(h), rtol=1e-4, atol=1e-6)
    values, ids = head_top_k(h, w, 4, 4, d2.logits)
    want_v, want_i = jax.lax.top_k(d2.logits(h @ w), 4)
    np.testing.assert_allclose(values, want_v, rtol=1e-6)
    np.testing.assert_array_equal(ids, want_i)


def test_selector_loss_is_the_cross_entropy_of_the_targets_choice(target):
    """selector_loss against a loop over slots: the score of each candidate given the
    sequence's token before the slot, the cross-entropy where the target's choice is a
    candidate."""
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2))
    sel = build_drafter(cfg, jnp.float32, seed=4).selector
    rng = np.random.default_rng(2)
    B, N, L, k, D = 2, 3, BLOCK - 1, D2["selector_top_k"], target.cfg.hidden_size
    h = jnp.asarray(rng.standard_normal((B, N, L, D)), jnp.float32)
    unary = jnp.asarray(np.sort(rng.standard_normal((B, N, L, k)))[..., ::-1].copy())
    cand = rng.permuted(np.tile(np.arange(VOCAB - 1), (B, N, L, 1)), axis=-1)[..., :k]
    before = jnp.asarray(rng.integers(0, VOCAB, (B, N, L)), jnp.int32)
    # the target's choice: one of the candidates, or in some slots a token outside them
    targets = np.take_along_axis(cand, rng.integers(0, k, (B, N, L, 1)), -1)[..., 0]
    targets = np.where(rng.random((B, N, L)) < 0.2, VOCAB - 1, targets)
    cand = jnp.asarray(cand, jnp.int32)
    weights = jnp.asarray(rng.random((B, N, L)), jnp.float32)
    loss, metrics = selector_loss(sel, h, unary, cand, before, jnp.asarray(targets, jnp.int32),
                                  weights, jnp.ones((B, N), bool))  # fmt: skip
    pred, succ = np.asarray(sel.predecessor_codebook[...]), np.asarray(sel.successor_codebook[...])
    z = np.asarray(sel.hidden_projection(h))
    num = den = 0.0
    for b, n, p in np.ndindex(B, N, L):
        c = np.asarray(cand[b, n, p])
        if targets[b, n, p] not in c:
            continue
        prev = int(before[b, n, p])
        s = np.asarray(unary[b, n, p]) + (pred[prev] * z[b, n, p]) @ succ[c].T
        ce = np.log(np.sum(np.exp(s))) - s[list(c).index(targets[b, n, p])]
        num, den = num + weights[b, n, p] * ce, den + weights[b, n, p]
    np.testing.assert_allclose(loss, num / den, rtol=1e-5)
    assert 1.0 <= metrics["selector_tau"] <= BLOCK and 1.0 <= metrics["top1_tau"] <= BLOCK


def test_the_selector_loss_does_not_move_the_drafters_weights(target):
    """The selector's gradient stops at the drafter's states: with any selector weight every
    weight but the selector's gets the gradient of the drafter loss alone, and the
    selector's gradient scales with the weight."""
    from kdj.train.trainer import _loss

    tokens, mask = pattern_data()
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2))
    tr = DrafterTrainer(target, cfg, optim(**DFLASH2_OPTIM), tokens, mask)
    batch = tuple(jnp.asarray(x) for x in tr.batch(0))

    def grads(weight):
        o = optim(**(DFLASH2_OPTIM | {"selector_weight": weight}))
        g = jax.grad(lambda p: _loss(p, tr.graphdef, target.graphdef, target.state, batch, o)[0])
        return nnx.to_pure_dict(jax.jit(g)(tr.params))

    g0, g1, g2 = grads(0.0), grads(1.0), grads(2.0)
    g0.pop("selector")
    selector, double = g1.pop("selector"), g2.pop("selector")
    jax.tree.map(np.testing.assert_array_equal, g1, g0)
    jax.tree.map(np.testing.assert_array_equal, g2, g0)
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(selector)) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, 2 * a, rtol=1e-5, atol=1e-7),
                 selector, double)  # fmt: skip


# ------------------------------------------------------------------ from a DFlash drafter
def test_dflash2_started_from_dflash_drafts_identically(target, data, dflash_dir):
    """The identity convolutions and the neutral selector: the new DFlash2 drafter's states
    equal the DFlash drafter's bit for bit, its greedy generation takes the same steps, and
    its first drafter loss is the DFlash trainer's; after two steps the zero projections
    have moved (they get a gradient from the start)."""
    dflash = kdj.load_drafter(dflash_dir, target=target, dtype="float32")
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2))
    tr = DrafterTrainer(target, cfg, optim(**DFLASH2_OPTIM), *data, init_from=dflash_dir)
    d2 = tr.drafter()
    assert d2.cfg.dflash2 is not None and dflash.cfg.dflash2 is None
    tokens = jnp.asarray(data[0][:2])
    feats = features(target, tokens, cfg)
    for a in (3, 17):
        args = (target.model.embed[...], feats, tokens, jnp.int32(a))
        np.testing.assert_array_equal(inference_block(d2.model, *args),
                                      inference_block(dflash.model, *args))  # fmt: skip
    ref, new = spec_generate(target, dflash), spec_generate(target, d2)
    assert new.tokens == ref.tokens
    assert new.stats["acceptance_lengths"] == ref.stats["acceptance_lengths"]
    assert max(max(t) for t in ref.stats["acceptance_lengths"]) > 1, "no draft was accepted"
    plain = DrafterTrainer(target, drafter_config_for(target.cfg, shape()),
                           optim(**DFLASH_OPTIM), *data, init_from=dflash_dir)  # fmt: skip
    first = tr.train_step()
    np.testing.assert_allclose(first["draft_loss"], plain.train_step()["loss"], rtol=1e-6)
    tr.train_step()  # (the first step's learning rate is warmup's 0)
    p = nnx.to_pure_dict(tr.params)
    assert np.abs(p["layers"][0]["attention_conv"]["kernel_projection"]["kernel"]).max() > 0
    assert np.abs(p["selector"]["hidden_projection"]["kernel"]).max() > 0


# ------------------------------------------------------------------ training and export
def test_training_lowers_the_loss_and_moves_the_new_weights(target, tmp_path):
    """Steps of a fresh DFlash2 drafter on a learnable pattern lower its drafter loss and its
    selector loss; the convolutions and the selector move; the export is the published
    DFlash2 format and reloads exactly, and saving the reloaded drafter writes the same."""
    tokens, mask = pattern_data()
    cfg = drafter_config_for(target.cfg, shape(dflash2=D2))
    tr = DrafterTrainer(target, cfg, optim(**DFLASH2_OPTIM), tokens, mask)
    start = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
    steps = [tr.train_step() for _ in range(12)]
    for key in ("loss", "draft_loss", "selector_loss"):
        m = np.array([float(s[key]) for s in steps])
        assert m[-3:].mean() < 0.8 * m[:2].mean(), (key, m)
    now = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))
    for i in (0, 1):
        for conv in ("attention_conv", "mlp_conv"):
            a, b = now["layers"][i][conv], start["layers"][i][conv]
            assert not np.array_equal(a["base_kernel"], b["base_kernel"])
            assert not np.array_equal(a["kernel_projection"]["kernel"],
                                      b["kernel_projection"]["kernel"])  # fmt: skip
    a, b = now["selector"], start["selector"]
    for leaf in ("predecessor_codebook", "successor_codebook"):
        assert not np.array_equal(a[leaf], b[leaf]), leaf
    assert not np.array_equal(a["hidden_projection"]["kernel"], b["hidden_projection"]["kernel"])

    path = tr.export(tmp_path / "d2", dtype="float32")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in D2} == D2
    loaded = kdj.load_drafter(path, target=target, dtype="float32")
    assert loaded.cfg.dflash2 == tr.cfg.dflash2
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(loaded.state), now)
    again = loaded.save(tmp_path / "again")
    first = load_file(str(path / "model.safetensors"))
    second = load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_with_the_trained_drafter_is_lossless(target, trained, tmp_path,
                                                          temperature):  # fmt: skip
    """The exported, reloaded DFlash2 drafter (bf16, as published) decodes exactly what
    plain AR decoding does, greedy and sampled, and some drafts are accepted."""
    tr, _, _ = trained
    drafter = kdj.load_drafter(tr.export(tmp_path / "d2"), target=target, dtype="float32")
    kw = dict(max_new_tokens=24, stop_tokens=[], temperature=temperature, seed=3)
    ar = kdj.generate(target, PROMPTS, method="ar", **kw)
    sp = spec_generate(target, drafter, **kw)
    assert sp.tokens == ar.tokens
    if temperature == 0:
        assert max(max(t) for t in sp.stats["acceptance_lengths"]) > 1, "nothing accepted"


# ------------------------------------------------------------------ bad settings
@pytest.mark.parametrize(
    "dflash2,match",
    [
        (D2 | {"kernel_size": 2}, r"drafter\.dflash2: unknown keys \['kernel_size'\]"),
        ({k: v for k, v in D2.items() if k != "selector_rank"},
         r"drafter\.dflash2 needs \['selector_rank'\]"),
        (D2 | {"conv_group_size": 7}, r"drafter\.dflash2\.conv_group_size 7 does not divide"),
        (D2 | {"selector_top_k": 99}, r"drafter\.dflash2\.selector_top_k 99 exceeds"),
        (D2 | {"selector_rank": 0}, r"drafter\.dflash2\.selector_rank must be a positive"),
        (D2 | {"output_multiplier": -1.0}, r"drafter\.dflash2\.output_multiplier must be pos"),
        ([2, 8, 4, 4], r"drafter\.dflash2 must be a mapping"),
    ],
)  # fmt: skip
def test_bad_dflash2_fields_name_the_field(target, dflash2, match):
    with pytest.raises(ValueError, match=match):
        drafter_config_for(target.cfg, shape(dflash2=dflash2))


@pytest.mark.parametrize("weight", [-0.5, float("nan"), "high", True])
def test_bad_selector_weight_names_the_field(weight):
    with pytest.raises(ValueError, match="optim.selector_weight must be a finite number >= 0"):
        OptimConfig(selector_weight=weight)
    with pytest.raises(ValueError, match="optim.selector_weight"):
        TrainConfig.from_dict({"optim": {"selector_weight": weight}})


def test_dflash2_settings_on_a_dflash_drafter_are_refused(target, data, dflash_dir, trained,
                                                          tmp_path):  # fmt: skip
    """optim.selector_weight for a DFlash drafter, a DFlash2 checkpoint as init_from of a
    DFlash drafter, or of a DFlash2 drafter with other DFlash2 fields: each names the field."""
    dflash_cfg = drafter_config_for(target.cfg, shape())
    with pytest.raises(ValueError, match="optim.selector_weight 0.5 is set, but .* DFlash "
                                         "drafter .no drafter.dflash2"):  # fmt: skip
        DrafterTrainer(target, dflash_cfg, optim(selector_weight=0.5), *data)
    d2_dir = trained[0].export(tmp_path / "d2")
    with pytest.raises(ValueError, match=r"dflash2: \{.*\} in the checkpoint, None configured"):
        DrafterTrainer(target, dflash_cfg, optim(), *data, init_from=d2_dir)
    other = drafter_config_for(target.cfg, shape(dflash2=D2 | {"selector_rank": 8}))
    with pytest.raises(ValueError, match="dflash2.selector_rank: 4 in the checkpoint, 8 config"):
        DrafterTrainer(target, other, optim(), *data, init_from=d2_dir)


def test_the_smollm2_dflash2_config_starts_from_the_shipped_drafter():
    """configs/train/smollm2-dflash2.yaml parses; its DFlash2 fields build a drafter for
    SmolLM2 (checked against the GGUF's config) that may start from the shipped DFlash
    weights; its compare entry is the same drafter as DFlash, without a selector weight."""
    from kdj.checkpoints.gguf import read_gguf, smollm2_gguf_path
    from kdj.config import ModelConfig
    from kdj.train.trainer import load_init_params

    cfg = TrainConfig.from_yaml("configs/train/smollm2-dflash2.yaml")
    target_cfg = ModelConfig.from_hf(read_gguf(smollm2_gguf_path())[0])
    dcfg = drafter_config_for(target_cfg, cfg.drafter)
    assert dcfg.dflash2.selector_top_k == 16 and cfg.optim.labels == "target"
    params = load_init_params(cfg.drafter.init_from, dcfg)
    assert "selector" not in params  # a DFlash drafter: the trainer adds DFlash2's weights
    entry = cfg.online.compare["dflash"]
    assert entry.drafter == dataclasses.replace(cfg.drafter, dflash2=None)
    assert dataclasses.replace(cfg.optim, **entry.optim).selector_weight is None
