"""Autoregressive generation semantics: ragged batches, stop tokens, per-sequence limits,
seeded sampling, caches. Uses a small random Qwen3-format checkpoint (parity is in
test_parity.py; this file checks the decode loop's bookkeeping)."""

from __future__ import annotations

import numpy as np
import pytest

import kdj
from tests.hf_models import build


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    build("qwen3", path)
    return kdj.load_target(path, dtype="float32")


def greedy_reference(target, prompt, n):
    """Greedy continuation by recomputing the full sequence each step (no cache at all)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(kdj.forward(target, [ids])[0, -1].argmax()))
    return ids[len(prompt) :]


def test_cache_decode_equals_full_recompute(target):
    prompt = [3, 14, 15, 92, 65]
    out = kdj.generate(target, [prompt], method="ar", max_new_tokens=12, stop_tokens=[])
    assert out.tokens[0] == greedy_reference(target, prompt, 12)


def test_stop_token_mid_batch_and_per_sequence_limits(target):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    free = kdj.generate(target, prompts, method="ar", max_new_tokens=20, stop_tokens=[])
    # Make the 4th token of sequence 0 a stop token: sequence 0 ends there, others go on.
    stop = free.tokens[0][3]
    cut = kdj.generate(target, prompts, method="ar", max_new_tokens=20, stop_tokens=[stop])
    for full, got in zip(free.tokens, cut.tokens):
        k = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:k]
    assert cut.tokens[0][-1] == stop and len(cut.tokens[0]) <= 4
    assert max(len(t) for t in cut.tokens) > len(cut.tokens[0])  # someone kept going
    limited = kdj.generate(target, prompts, method="ar", max_new_tokens=[2, 7, 1], stop_tokens=[])
    assert [len(t) for t in limited.tokens] == [2, 7, 1]
    assert [t == f[: len(t)] for t, f in zip(limited.tokens, free.tokens)] == [True] * 3


def test_per_sequence_stop_tokens(target):
    prompts = [[1, 2, 3], [1, 2, 3]]
    free = kdj.generate(target, prompts, method="ar", max_new_tokens=10, stop_tokens=[])
    stop = free.tokens[0][2]
    out = kdj.generate(target, prompts, method="ar", max_new_tokens=10, stop_tokens=[[stop], []])
    assert out.tokens[0] == free.tokens[0][: free.tokens[0].index(stop) + 1]
    assert out.tokens[1] == free.tokens[1]


def test_sampling_is_seeded(target):
    prompts = [[5, 6, 7], [8, 9]]
    kw = dict(method="ar", max_new_tokens=24, temperature=1.0, stop_tokens=[])
    a = kdj.generate(target, prompts, seed=1, **kw).tokens
    b = kdj.generate(target, prompts, seed=1, **kw).tokens
    c = kdj.generate(target, prompts, seed=2, **kw).tokens
    assert a == b
    assert a != c


def test_one_seed_is_spread_over_the_prompts_as_the_server_spreads_it(target):
    """seed=s for one prompt samples as seed=[s] (and as a server request with "seed": s);
    over several prompts prompt i draws with spread_seeds(s)[i], equal prompts apart, in a
    static batch and through the pool alike; deterministic mode gives every prompt s."""
    from kdj.decode.sampling import spread_seeds

    kw = dict(method="ar", max_new_tokens=16, temperature=1.0, stop_tokens=[])
    one = kdj.generate(target, [[5, 6, 7]], seed=42, **kw).tokens
    assert one == kdj.generate(target, [[5, 6, 7]], seed=[42], **kw).tokens
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]
    spread = kdj.generate(target, prompts, seed=42, **kw).tokens
    assert spread == kdj.generate(target, prompts, seed=spread_seeds(42, 3), **kw).tokens
    assert spread[0] == one[0] and spread[2] != spread[0]
    assert kdj.generate(target, prompts, seed=42, max_batch=2, **kw).tokens == spread
    same = kdj.generate(target, prompts, seed=42, deterministic=True, **kw).tokens
    assert same == kdj.generate(target, prompts, seed=[42] * 3, deterministic=True, **kw).tokens
    assert same[0] == same[2]


def test_tiny_top_p_is_greedy(target):
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    greedy = kdj.generate(target, prompts, method="ar", max_new_tokens=16, stop_tokens=[])
    nucleus = kdj.generate(
        target, prompts, method="ar", max_new_tokens=16, temperature=1.0, top_p=1e-6,
        seed=3, stop_tokens=[],
    )  # fmt: skip
    assert nucleus.tokens == greedy.tokens


def test_sampling_follows_target_distribution(target):
    """First sampled token over many seeds vs the target's softmax: chi-square test at
    significance 0.001 (fails if sampling ignored temperature or top-p renormalisation)."""
    prompt = [7, 8, 9]
    probs = np.exp(kdj.forward(target, [prompt])[0, -1].astype(np.float64) / 0.7)
    probs /= probs.sum()
    prompts = [prompt] * 400
    counts = np.zeros(target.cfg.vocab_size)
    for seed in range(5):
        out = kdj.generate(target, prompts, method="ar", max_new_tokens=1, temperature=0.7,
                           seed=seed, stop_tokens=[])  # fmt: skip
        for t in out.tokens:
            counts[t[0]] += 1
    n = counts.sum()
    big = probs * n >= 5  # pool rare tokens into one cell so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(probs[big] * n, probs[~big].sum() * n)
    keep = exp > 0
    chi2 = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
    dof = keep.sum() - 1
    # critical value of chi-square at p = 0.001 via Wilson-Hilferty
    z = 3.090
    crit = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit:.1f} (dof {dof})"


def test_stats(target):
    out = kdj.generate(target, [[1, 2], [3, 4, 5]], method="ar", max_new_tokens=8, stop_tokens=[])
    s = out.stats
    assert s["new_tokens"] == 16 and s["steps"] == 7 and s["mean_acceptance"] == 1.0
    assert s["prefill_s"] > 0 and s["decode_s"] > 0 and s["tokens_per_s"] > 0
    assert [len(a) for a in s["acceptance_lengths"]] == [7, 7]


def test_rollback_by_length(target):
    """Entries beyond a sequence's length are dead: prefill [prompt + junk], roll the length
    back to the prompt, decode, and get exactly what decoding the prompt alone gives."""
    import jax.numpy as jnp

    from kdj.cache import init_cache
    from kdj.decode import loop
    from kdj.decode.sampling import request_keys
    from kdj.decode.state import Plan, Prefilled

    prompt, junk = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5]
    clean = kdj.generate(target, [prompt], method="ar", max_new_tokens=8, stop_tokens=[])
    cfg, key = target.cfg, request_keys([0])  # one key per sequence
    cache = init_cache(cfg, 1, 64, target.dtype)
    tokens = jnp.asarray([prompt + junk], jnp.int32)
    args = (key, jnp.float32(1.0), jnp.float32(1.0))
    cache = loop.prefill(
        target.graphdef, target.state, None, None, tokens, jnp.asarray([len(prompt + junk)]),
        cache, None, *args, greedy=True,
    ).tcache  # fmt: skip
    cache = cache.with_lengths(jnp.asarray([len(prompt) - 1]))  # keep prompt[:-1] only
    # re-feed the prompt's last token on top of the rolled-back cache, then decode
    logits, cache, _ = target.model(tokens[:, len(prompt) - 1 : len(prompt)],
                                    cache.lengths, cache)  # fmt: skip
    cache = cache.with_lengths(cache.lengths + 1)
    first = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    out, n, *_ = loop.decode(
        target.graphdef, target.state, None, None, Prefilled(first, cache, None),
        jnp.asarray([8]), jnp.asarray([[-1]]), *args, jnp.float32(1.0), jnp.zeros((1,)),
        plan=Plan(greedy=True, max_steps=8),
    ).output()  # fmt: skip
    assert np.asarray(out)[0, : int(n[0])].tolist() == clean.tokens[0]
