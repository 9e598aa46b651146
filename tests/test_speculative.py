"""Speculative decoding, DFlash (chain) and DDTree (tree): lossless (greedy token for token,
sampling in distribution), batched with ragged prompts, stop tokens, cache end, block size at
call time.

Targets are small random HF checkpoints; the small vocabulary (12 tokens) makes a random
drafter right often enough that multi-token acceptance and ragged progress really happen
(the tests assert that they did)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.decode import tree as trees
from kdj.decode.sampling import target_probs
from kdj.models.drafter import DrafterConfig, build_drafter, default_target_layer_ids
from tests.hf_models import build

VOCAB = 12


def make_drafter(target, layers=2, block=6, seed=0, ids=None, mask=None):
    t = target.cfg
    lc = t.replace(family="llama", model_type="qwen3", num_layers=layers, qk_norm=True,
                   num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                   qkv_bias=False, o_bias=False, rope_scaling=None)  # fmt: skip
    cfg = DrafterConfig(
        layers=lc, block_size=block, mask_token_id=t.vocab_size - 1 if mask is None else mask,
        target_layer_ids=ids or default_target_layer_ids(t.num_layers, layers),
        num_target_layers=t.num_layers,
    )  # fmt: skip
    return kdj.Drafter.from_model(build_drafter(cfg, target.dtype, seed=seed))


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek_v3"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, path, vocab_size=VOCAB, num_hidden_layers=3)
    target = kdj.load_target(path, dtype="float32")
    # ascending taps, as published drafters have (the published spacing gives (1, 0) for a
    # 3-layer target); the random drafter's drafts are accepted by chance, and these are
    return request.param, target, make_drafter(target, ids=(0, 1))


# DFlash, and DDTree with a small budget (a few siblings, so paths leave the chain and the
# cache is compacted) and with one larger than the vocabulary can fill at depth 1
SPECS = [("dflash", {}), ("ddtree", {"tree_budget": 6}), ("ddtree", {"tree_budget": 40})]


@pytest.fixture(params=SPECS, ids=["dflash", "ddtree6", "ddtree40"])
def spec(request):
    method, kw = request.param
    return dict(method=method, **kw)


def prompts_for(target, lens=(5, 17, 9, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, target.cfg.vocab_size, n).tolist() for n in lens]


def test_greedy_equals_ar_ragged_batch_with_mid_batch_stop(pair, spec):
    name, target, drafter = pair
    prompts = prompts_for(target)
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=40, stop_tokens=[])
    sp = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=40, stop_tokens=[], **spec)
    assert sp.tokens == ar.tokens, name
    assert max(max(t) for t in sp.stats["acceptance_lengths"]) > 1, "no draft was ever accepted"
    for toks, taus in zip(sp.tokens, sp.stats["acceptance_lengths"]):
        assert sum(taus) + 1 == len(toks)  # first token from prefill, the rest from the steps
    # a stop token that sequence 1 emits mid-way: it ends there, the others run on
    stop = ar.tokens[1][10]
    ar_s = kdj.generate(target, prompts, method="ar", max_new_tokens=40, stop_tokens=[stop])
    sp_s = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=40, stop_tokens=[stop],
                        **spec)  # fmt: skip
    assert sp_s.tokens == ar_s.tokens
    assert len(sp_s.tokens[1]) <= 11 and sp_s.tokens[1][-1] == stop


# Block size at call time and the cache end are plumbing that every method and family shares:
# each runs once per method and once per family (a diagonal), not on all nine pairs.
DIAGONAL = pytest.mark.parametrize(
    "pair,spec", [("llama", SPECS[2]), ("qwen3", SPECS[1]), ("deepseek_v3", SPECS[0])],
    indirect=True, ids=["llama-ddtree40", "qwen3-ddtree6", "deepseek_v3-dflash"],
)  # fmt: skip


@DIAGONAL
def test_block_size_lowered_at_call_time(pair, spec):
    _, target, drafter = pair
    prompts = prompts_for(target, (7, 3))
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=25, stop_tokens=[])
    for k in (2, 4):
        sp = kdj.generate(target, prompts, drafter=drafter, block_size=k, max_new_tokens=25,
                          stop_tokens=[], **spec)  # fmt: skip
        assert sp.tokens == ar.tokens
        assert max(max(t) for t in sp.stats["acceptance_lengths"]) <= k


@pytest.mark.parametrize("budget", [1, 512])
def test_ddtree_budget_extremes(budget, tmp_path_factory):
    """Budget 1 (a one-node tree) and 512 (more nodes than a small vocabulary can fill at the
    first depths, and more than the cache end leaves room for) still equal AR."""
    path = tmp_path_factory.mktemp("extremes")
    build("llama", path, vocab_size=VOCAB, num_hidden_layers=2)
    target = kdj.load_target(path, dtype="float32")
    drafter = make_drafter(target, layers=1, block=4)
    prompts = prompts_for(target, (6, 3))
    kw = dict(max_new_tokens=30, stop_tokens=[])
    ar = kdj.generate(target, prompts, method="ar", **kw)
    sp = kdj.generate(target, prompts, drafter=drafter, method="ddtree", tree_budget=budget, **kw)
    assert sp.tokens == ar.tokens
    assert sp.stats["mean_tree_size"] <= budget


@DIAGONAL
def test_generate_to_exactly_the_cache_capacity(pair, spec):
    """A step near the end must neither write outside the cache nor commit tokens whose K/V
    could not be stored: run until prompt + new tokens == capacity exactly."""
    _, target, drafter = pair
    prompts = prompts_for(target, (20, 11))
    kw = dict(max_new_tokens=[44, 53], stop_tokens=[], cache_size=64)
    ar = kdj.generate(target, prompts, method="ar", **kw)
    sp = kdj.generate(target, prompts, drafter=drafter, **spec, **kw)
    assert [len(t) for t in sp.tokens] == [44, 53]
    assert sp.tokens == ar.tokens


# ------------------------------------------------------------------------ sampling
def exact_joint(target, prompt, n, temperature):
    """Exact target distribution of the first n sampled tokens, [V] * n (small V only)."""
    V = target.cfg.vocab_size
    joint = np.ones([1] * 0)
    prefixes = [[]]
    for _ in range(n):
        logits = kdj.forward(target, [prompt + p for p in prefixes])[:, -1].astype(np.float64)
        p = np.exp((logits - logits.max(-1, keepdims=True)) / temperature)
        p /= p.sum(-1, keepdims=True)
        joint = (joint.reshape(-1, 1) * p).reshape(-1)
        prefixes = [q + [t] for q in prefixes for t in range(V)]
    return joint.reshape([V] * n)


def chi_square_p_ok(samples, probs, alpha=1e-3):
    """Pearson chi-square of sample counts against probs, pooling cells with expected < 5.
    Returns True when the samples are consistent with probs at significance alpha."""
    from scipy.stats import chi2

    counts = np.bincount(samples, minlength=probs.size).astype(float)
    exp = probs.reshape(-1) * len(samples)
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    stat = ((obs - exp) ** 2 / exp)[keep].sum()
    return chi2.sf(stat, keep.sum() - 1) > alpha


REAL_ACCEPT_TREE = trees.accept_tree


def broken_accept_tree(tree, valid, logits, key, temperature, top_p, limit, **kw):
    """The classic bug: walk correctly, but draw the bonus from the target's p at the last
    node, ignoring that its drafted children were just rejected (p minus those is right)."""
    path, a, _ = REAL_ACCEPT_TREE(tree, valid, logits, key, temperature, top_p, limit, **kw)
    last = jnp.take_along_axis(path, a[:, None], axis=1)[:, 0]
    row = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    p = target_probs(row, temperature, top_p)
    bonus = jax.random.categorical(jax.random.fold_in(key[0], 99), jnp.log(p), axis=-1)
    return path, a, bonus.astype(jnp.int32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sampling")
    build("qwen3", path, vocab_size=6, num_hidden_layers=2)
    target = kdj.load_target(path, dtype="float32")
    return target, make_drafter(target, layers=1, block=4, seed=3)


def sampled_triples(target, drafter, prompt, n, seed, spec):
    out = kdj.generate(target, [prompt] * n, drafter=drafter, max_new_tokens=3, temperature=0.9,
                       seed=seed, stop_tokens=[], **spec)  # fmt: skip
    V = target.cfg.vocab_size
    t = np.array(out.tokens)
    return (t[:, 0] * V + t[:, 1]) * V + t[:, 2], out


@pytest.mark.parametrize(
    "spec", [{"method": "dflash"}, {"method": "ddtree", "tree_budget": 4}], ids=["dflash", "ddtree"]
)
def test_sampling_is_lossless_and_the_test_catches_a_wrong_bonus(tiny, monkeypatch, spec):
    """The joint law of the first three sampled tokens (6^3 cells) over 6000 independent
    sequences must match the exact target law (chi-square, significance 0.001); the same test
    must reject an acceptance rule that draws the bonus from p instead of p minus the draft."""
    target, drafter = tiny
    prompt = [1, 2, 3, 4]
    probs = exact_joint(target, prompt, 3, 0.9)
    good, out = sampled_triples(target, drafter, prompt, 6000, seed=0, spec=spec)
    hist = out.stats["acceptance_histogram"]
    assert sum(hist[1:]) > 500, f"too few accepted drafts to test acceptance: {hist}"
    assert chi_square_p_ok(good, probs)
    monkeypatch.setattr(trees, "accept_tree", broken_accept_tree)
    target.executables.clear()
    jax.clear_caches()  # jit caches traces: make it re-trace with the broken rule
    try:
        bad, _ = sampled_triples(target, drafter, prompt, 6000, seed=0, spec=spec)
    finally:
        target.executables.clear()
        jax.clear_caches()
    assert not chi_square_p_ok(bad, probs)


def test_a_top_p_below_float32s_smallest_normal_keeps_the_top_token():
    """top_p in (0, 1] may be a denormal (or round to one): flushed to 0 on the device, it
    must still keep the top token, not every token."""
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0]])
    for top_p in (1e-30, 1e-40, 1e-45, 5e-324):
        assert target_probs(logits, 1.0, jnp.float32(top_p)).tolist() == [[0, 1, 0, 0]], top_p


def test_sampling_is_seeded(tiny):
    target, drafter = tiny
    kw = dict(drafter=drafter, method="dflash", max_new_tokens=12, temperature=1.0,
              stop_tokens=[])  # fmt: skip
    a = kdj.generate(target, [[1, 2], [3]], seed=5, **kw).tokens
    assert a == kdj.generate(target, [[1, 2], [3]], seed=5, **kw).tokens
    assert a != kdj.generate(target, [[1, 2], [3]], seed=6, **kw).tokens


# -------------------------------------------------------------- format and bad input
def test_checkpoint_roundtrip_in_published_format(pair, tmp_path):
    import json

    _, target, drafter = pair
    drafter.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.cfg.target_layer_ids)
    from kdj.checkpoints.hf_safetensors import HFCheckpoint

    names = set(HFCheckpoint(tmp_path / "d").names())
    assert {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith("model.") for n in names)
    loaded = kdj.load_drafter(tmp_path / "d", target=target)
    from kdj.checkpoints.dflash import drafter_config_to_hf

    assert drafter_config_to_hf(loaded.cfg) == drafter_config_to_hf(drafter.cfg)
    for a, b in zip(jax.tree.leaves(drafter.state), jax.tree.leaves(loaded.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_pairs_raise_clear_errors(pair, tmp_path):
    _, target, drafter = pair
    d = drafter.cfg
    with pytest.raises(ValueError, match="block_size must be in"):
        kdj.generate(target, [[1, 2]], drafter=drafter, method="dflash", block_size=1)
    with pytest.raises(ValueError, match="needs a drafter"):
        kdj.generate(target, [[1, 2]], method="ddtree")
    with pytest.raises(ValueError, match="tree_budget must be >= 1"):
        kdj.generate(target, [[1, 2]], drafter=drafter, method="ddtree", tree_budget=0)
    with pytest.raises(ValueError, match="tree_budget applies to method 'ddtree'"):
        kdj.generate(target, [[1, 2]], drafter=drafter, method="dflash", tree_budget=8)
    wrong = kdj.Drafter(d.__class__(**{**d.__dict__, "layers": d.layers.replace(hidden_size=32)}),
                        drafter.graphdef, drafter.state)  # fmt: skip
    with pytest.raises(ValueError, match="hidden size 32 does not match"):
        kdj.generate(target, [[1, 2]], drafter=wrong, method="dflash")
    wrong = kdj.Drafter(d.__class__(**{**d.__dict__, "layers": d.layers.replace(vocab_size=999)}),
                        drafter.graphdef, drafter.state)  # fmt: skip
    with pytest.raises(ValueError, match="vocabulary 999 does not match"):
        kdj.generate(target, [[1, 2]], drafter=wrong, method="dflash")
    wrong = kdj.Drafter(d.__class__(**{**d.__dict__, "target_layer_ids": (0, 7)}),
                        drafter.graphdef, drafter.state)  # fmt: skip
    with pytest.raises(ValueError, match="target_layer_ids .* reach outside"):
        kdj.generate(target, [[1, 2]], drafter=wrong, method="dflash")
    # a checkpoint without a mask token, and a missing directory
    drafter.save(tmp_path / "d")
    import json

    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no mask_token_id"):
        kdj.load_drafter(tmp_path / "d", target=target)
    with pytest.raises(FileNotFoundError):
        kdj.load_drafter(tmp_path / "missing", target=target)


def test_default_target_layer_ids_formula():
    assert default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)  # Kimi K2
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B
    assert default_target_layer_ids(30, 1) == (15,)


def test_drafter_config_refuses_repeated_taps():
    """A 4-layer target has no 5 distinct taps at the default spacing ((1, 1, 1, 1, 1): the
    target would return one feature for fc's five). Found running bench/multi_gpu.py on a
    4-layer slice, where it failed inside the prefill with a shape error."""
    lc = kdj.load_target("smollm2-135m-instruct", dtype="float32").cfg
    kw = dict(layers=lc, block_size=4, mask_token_id=0, num_target_layers=4)
    with pytest.raises(ValueError, match="repeat a layer"):
        DrafterConfig(**kw, target_layer_ids=default_target_layer_ids(4, 5))
    assert DrafterConfig(**kw, target_layer_ids=(2,)).num_features == 1


@pytest.mark.parametrize("spec", [{"method": "dflash"}, {"method": "ddtree", "tree_budget": 16}])
def test_trained_smollm2_drafter_is_lossless(spec):
    """The real pair: SmolLM2 with kdj's trained drafter (kdj/assets), greedy == AR."""
    target = kdj.load_target("smollm2-135m-instruct", dtype="float32")
    drafter = kdj.load_drafter("smollm2-135m-dflash-b16", target=target)
    tok = target.tokenizer
    questions = ("Write a haiku about rain.", "How do I sort a list in Python?")
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=32)
    sp = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=32, **spec)
    assert sp.tokens == ar.tokens
    assert sp.stats["mean_acceptance"] > 1.0  # trained: it does get drafts accepted
