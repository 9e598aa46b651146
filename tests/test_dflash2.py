"""DFlash2 drafters: the published checkpoint format (written here from scratch, random
weights) loads, kdj's forward and selector walk equal a numpy reference written from the
format, save -> load is bit-exact, decoding with it is lossless, and bad configs say which
field is wrong."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import kdj
from kdj import cache as kvc
from kdj.config import ModelConfig
from tests.hf_models import build

VOCAB, D, LAYERS, H, KVH, HD, FFN = 12, 64, 2, 4, 2, 16, 96
TAPS, GROUP, RANK, TOP_K, BLOCK = 2, 16, 8, 4, 5
IDS = (0, 1)


def published_config(**dflash):
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "attention_bias": False, "hidden_act": "silu", "hidden_size": D, "head_dim": HD,
        "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": H,
        "num_key_value_heads": KVH, "rms_norm_eps": 1e-5, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "num_target_layers": 3, "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "dflash_config": {
            "block_size": BLOCK, "mask_token_id": VOCAB - 1, "target_layer_ids": list(IDS),
            "conv_kernel_size": TAPS, "conv_group_size": GROUP, "selector_rank": RANK,
            "selector_top_k": TOP_K, "output_multiplier": 0.7, "final_logit_softcapping": 6.0,
            **dflash,
        },
    }  # fmt: skip


def published_tensors(seed=0):
    """Random weights under the published names and shapes (torch [out, in] layout)."""
    rng = np.random.default_rng(seed)

    def w(*shape, s=None):
        return (rng.standard_normal(shape) * (s or shape[-1] ** -0.5)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    G = D // GROUP
    t = {"fc.weight": w(D, len(IDS) * D), "hidden_norm.weight": norm(D), "norm.weight": norm(D),
         "candidate_selector.hidden_projection.weight": w(RANK, D),
         "candidate_selector.predecessor_codebook": w(VOCAB, RANK, s=0.5),
         "candidate_selector.successor_codebook": w(VOCAB, RANK, s=0.5)}  # fmt: skip
    for i in range(LAYERS):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
              p + "self_attn.q_proj.weight": w(H * HD, D),
              p + "self_attn.o_proj.weight": w(D, H * HD),
              p + "self_attn.k_proj.weight": w(KVH * HD, D),
              p + "self_attn.v_proj.weight": w(KVH * HD, D),
              p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
              p + "mlp.gate_proj.weight": w(FFN, D), p + "mlp.up_proj.weight": w(FFN, D),
              p + "mlp.down_proj.weight": w(D, FFN)}  # fmt: skip
        for conv in ("attention_conv", "mlp_conv"):
            t[p + conv + ".base_kernel"] = (rng.standard_normal((2, TAPS, D)) * 0.5 + 0.5).astype(
                np.float32
            )
            t[p + conv + ".kernel_projection.weight"] = w(2 * TAPS * G, D, s=0.1)
    return t


def write_published(path, config=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or published_config()))
    save_file(tensors or published_tensors(), str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    build("qwen3", path, vocab_size=VOCAB, num_hidden_layers=3)
    return kdj.load_target(path, dtype="float32")


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return write_published(tmp_path_factory.mktemp("dflash2") / "d")


# ------------------------------------------------------------ the numpy reference
def rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, pos, theta=10000.0):
    """x [T, heads, hd] rotated at positions pos [T] (halves, not interleaved)."""
    half = x.shape[-1] // 2
    ang = pos[:, None] * theta ** (-np.arange(half) / half)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def conv(y, delta, base):
    """y [b, D], delta [b, K, G], base [K, D]: sum_k (base[k] + delta[:, k] per group) y[t-k]."""
    b, G = y.shape[0], delta.shape[-1]
    out = np.zeros_like(y)
    for k in range(base.shape[0]):
        shifted = np.concatenate([np.zeros((k, y.shape[1])), y[: b - k]])[:b]
        out += (base[k][None] + np.repeat(delta[:, k], D // G, axis=-1)) * shifted
    return out


def around(w, name, sub, u):
    """A sublayer inside its convolution pair; w: one layer's weights by published name."""
    b, G = u.shape[0], D // GROUP
    delta = (u @ w[name + ".kernel_projection.weight"].T).reshape(b, 2, TAPS, G)
    y = sub(conv(u, delta[:, 0], w[name + ".base_kernel"][0]))
    return conv(y, delta[:, 1], w[name + ".base_kernel"][1])


def attention(w, u, c, ctx_pos, blk_pos):
    """The block u [b, D] attends [context c ; block], no mask (KV injection)."""
    b = u.shape[0]
    q = rms((u @ w["self_attn.q_proj.weight"].T).reshape(b, H, HD), w["self_attn.q_norm.weight"])
    kv_in, pos = np.concatenate([c, u]), np.concatenate([ctx_pos, blk_pos])
    k = rms((kv_in @ w["self_attn.k_proj.weight"].T).reshape(-1, KVH, HD),
            w["self_attn.k_norm.weight"])  # fmt: skip
    q, k = rope(q, blk_pos), rope(k, pos)
    v = (kv_in @ w["self_attn.v_proj.weight"].T).reshape(-1, KVH, HD)
    k, v = np.repeat(k, H // KVH, axis=1), np.repeat(v, H // KVH, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", a, v).reshape(b, H * HD) @ w["self_attn.o_proj.weight"].T


def mlp(w, u):
    g = u @ w["mlp.gate_proj.weight"].T
    return (g / (1 + np.exp(-g)) * (u @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T


def reference_draft(t, cfg, embed, head, feats, last, start):
    """One DFlash2 draft (batch 1): context feats [C, K*D] at positions 0 .. C - 1, the block
    [last, mask ...] at start .. start + b - 1 -> (final hidden [b, D], logits [b - 1, V],
    greedy selector path [b - 1])."""
    ex = cfg["dflash_config"]
    t = {k: v.astype(np.float64) for k, v in t.items()}
    b = ex["block_size"]
    c = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    block = [last] + [ex["mask_token_id"]] * (b - 1)
    x = embed[block].astype(np.float64)
    ctx_pos, blk_pos = np.arange(len(feats)), start + np.arange(b)
    for i in range(LAYERS):
        w = {k[len(f"layers.{i}.") :]: v for k, v in t.items() if k.startswith(f"layers.{i}.")}
        u = rms(x, w["input_layernorm.weight"])
        x = x + around(w, "attention_conv", lambda y: attention(w, y, c, ctx_pos, blk_pos), u)  # noqa: B023
        u = rms(x, w["post_attention_layernorm.weight"])
        x = x + around(w, "mlp_conv", lambda y: mlp(w, y), u)  # noqa: B023
    h = rms(x, t["norm.weight"])
    cap = ex["final_logit_softcapping"]
    logits = cap * np.tanh(head(h[1:]) * ex["output_multiplier"] / cap)
    z = h[1:] @ t["candidate_selector.hidden_projection.weight"].T
    prev, path = last, []
    for j in range(b - 1):
        cand = np.argsort(-logits[j], kind="stable")[: ex["selector_top_k"]]
        edge = (t["candidate_selector.predecessor_codebook"][prev] * z[j]) @ t[
            "candidate_selector.successor_codebook"
        ][cand].T
        prev = int(cand[np.argmax(logits[j][cand] + edge)])
        path.append(prev)
    return h, logits, np.array(path)


def kdj_draft(drafter, target, feats, last, start, temperature=0.0, seed=0):
    """kdj's draft of the same block: the pieces step.draft composes."""
    model = nnx.merge(drafter.graphdef, drafter.state)
    tmodel = nnx.merge(target.graphdef, target.state)
    cfg = model.cfg
    cache = kvc.init_cache(cfg.layers, 1, 64, jnp.float32)
    cache = model.add_context(jnp.asarray(feats)[None], jnp.zeros((1,), jnp.int32), cache)
    cache = cache.with_lengths(jnp.array([len(feats)], jnp.int32))
    b = cfg.block_size
    block = jnp.array([[last] + [cfg.mask_token_id] * (b - 1)], jnp.int32)
    positions = start + jnp.arange(b, dtype=jnp.int32)[None]
    h = model(tmodel.embed[...][block], positions, cache)
    logits = model.logits(tmodel.logits(h[:, 1:]))
    from kdj.decode.step import path_keys

    keys = path_keys(jax.random.key(seed)[None], positions[:, 1:])
    chain = model.selector.walk(h[:, 1:], logits, jnp.array([last]), keys, jnp.float32(temperature))
    return np.asarray(h[0]), np.asarray(logits[0]), np.asarray(chain[0])


# ------------------------------------------------------------------------- tests
def test_published_checkpoint_loads_and_matches_the_reference(target, published):
    drafter = kdj.load_drafter(published, target=target)
    d2 = drafter.cfg.dflash2
    assert d2 is not None and (d2.conv_kernel_size, d2.selector_top_k) == (TAPS, TOP_K)
    assert drafter.cfg.block_size == BLOCK and drafter.cfg.target_layer_ids == IDS
    tmodel = nnx.merge(target.graphdef, target.state)
    embed = np.asarray(tmodel.embed[...], np.float64)

    def head(h):
        return np.asarray(tmodel.logits(jnp.asarray(h, jnp.float32)), np.float64)

    rng = np.random.default_rng(1)
    feats = rng.standard_normal((7, len(IDS) * D)).astype(np.float32)
    cfg = published_config()
    for last in (3, 8):
        ref_h, ref_logits, ref_path = reference_draft(
            load_file(str(published / "model.safetensors")), cfg, embed, head, feats, last, 7
        )
        h, logits, path = kdj_draft(drafter, target, feats, last, 7)
        np.testing.assert_allclose(h, ref_h, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(logits, ref_logits, rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(path, ref_path)
    # the walk is not the argmax of each slot (else the selector would not be tested)
    differs = False
    for last in range(VOCAB):
        _, logits, path = kdj_draft(drafter, target, feats, last, 7)
        differs |= bool((path != logits.argmax(-1)).any())
    assert differs


def test_sampled_path_stays_among_candidates_and_varies_with_the_key(target, published):
    drafter = kdj.load_drafter(published, target=target)
    feats = np.random.default_rng(2).standard_normal((5, len(IDS) * D)).astype(np.float32)
    _, logits, greedy = kdj_draft(drafter, target, feats, 4, 5)
    paths = {tuple(kdj_draft(drafter, target, feats, 4, 5, 2.0, seed)[2]) for seed in range(12)}
    top = np.argsort(-logits, axis=-1)[:, :TOP_K]
    assert all(all(tok in top[j] for j, tok in enumerate(p)) for p in paths)
    assert len(paths) > 1
    assert tuple(kdj_draft(drafter, target, feats, 4, 5, 0.0, 3)[2]) == tuple(greedy)


def test_save_load_roundtrip_is_bit_exact(target, published, tmp_path):
    drafter = kdj.load_drafter(published, target=target)
    drafter.save(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    pub = published_config()["dflash_config"]
    assert {k: cfg["dflash_config"][k] for k in pub} == pub
    saved, original = (
        load_file(str(tmp_path / "s" / "model.safetensors")),
        load_file(str(published / "model.safetensors")),
    )
    assert saved.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(saved[name], original[name], err_msg=name)
    again = kdj.load_drafter(tmp_path / "s", target=target)
    assert again.cfg == drafter.cfg
    for a, b in zip(jax.tree.leaves(drafter.state), jax.tree.leaves(again.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("spec", [{"method": "dflash"}, {"method": "ddtree", "tree_budget": 6}],
                         ids=["dflash", "ddtree"])  # fmt: skip
def test_decoding_with_a_dflash2_drafter_is_lossless(target, published, spec):
    drafter = kdj.load_drafter(published, target=target)
    prompts = [[1, 2, 3, 4, 5], [7, 3], [9, 9, 1, 0, 4, 2, 6, 8]]
    kw = dict(max_new_tokens=30, stop_tokens=[])
    ar = kdj.generate(target, prompts, method="ar", **kw)
    sp = kdj.generate(target, prompts, drafter=drafter, **spec, **kw)
    assert sp.tokens == ar.tokens
    assert max(max(t) for t in sp.stats["acceptance_lengths"]) > 1, "no draft was accepted"
    # sampling: a token is keyed by its position, so the sampled path leaves it AR's
    kw = dict(kw, temperature=1.0, seed=3)
    ar = kdj.generate(target, prompts, method="ar", **kw)
    sp = kdj.generate(target, prompts, drafter=drafter, **spec, **kw)
    assert sp.tokens == ar.tokens
    if spec["method"] == "dflash":  # the slot pool (per-slot temperatures) keys its own way
        pooled = kdj.generate(target, prompts, drafter=drafter, max_batch=2, **spec, **kw)
        assert pooled.tokens == kdj.generate(target, prompts, method="ar", max_batch=2, **kw).tokens


@pytest.mark.parametrize(
    "change,match",
    [
        ({"dflash_config": {"selector_rank": None}}, "dflash_config.selector_rank"),
        ({"dflash_config": {"conv_kernel_size": None}}, "dflash_config.conv_kernel_size"),
        ({"dflash_config": {"conv_group_size": 24}}, "conv_group_size 24 does not divide"),
        ({"dflash_config": {"selector_top_k": 99}}, "selector_top_k 99 exceeds"),
        ({"dflash_config": {"selector_rank": 0}}, "selector_rank must be a positive"),
        ({"is_causal": True}, "is_causal"),
    ],
)
def test_bad_config_names_the_field(tmp_path, target, change, match):
    cfg = published_config()
    for k, v in change.get("dflash_config", {}).items():
        if v is None:
            del cfg["dflash_config"][k]
        else:
            cfg["dflash_config"][k] = v
    cfg.update({k: v for k, v in change.items() if k != "dflash_config"})
    path = write_published(tmp_path / "d", cfg)
    with pytest.raises(ValueError, match=match):
        kdj.load_drafter(path, target=target)


def test_bad_tensors_name_the_tensor(tmp_path, target):
    t = published_tensors()
    t["layers.1.mlp_conv.base_kernel"] = t["layers.1.mlp_conv.base_kernel"][:, :1]
    with pytest.raises(ValueError, match=r"layers\.1\.mlp_conv\.base_kernel"):
        kdj.load_drafter(write_published(tmp_path / "a", tensors=t), target=target)
    t = published_tensors()
    del t["candidate_selector.successor_codebook"]
    with pytest.raises(ValueError, match="selector.successor_codebook"):
        kdj.load_drafter(write_published(tmp_path / "b", tensors=t), target=target)
    v1 = published_config()
    v1["architectures"] = ["DFlashDraftModel"]  # DFlash2 tensors under a DFlash config
    with pytest.raises(ValueError, match="has no place in this DFlashDrafter"):
        kdj.load_drafter(write_published(tmp_path / "c", v1), target=target)
    with pytest.raises(ValueError, match="is a DFlash drafter checkpoint"):
        ModelConfig.from_json(tmp_path / "a" / "config.json")  # a DFlash2 drafter's
