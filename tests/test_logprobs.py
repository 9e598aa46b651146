"""Log-probabilities (kdj/decode/logprobs.py): each emitted token's, and its top-k
alternatives', equal those of a plain forward of the target over prompt + emitted tokens,
for AR and every speculative method, one-shot and through the slot pool; asking for them
changes no token; the server returns them in OpenAI's shapes. Tiny float32 models."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kdj
from kdj.decode.engine import Engine
from kdj.decode.requests import Request
from tests.test_adaptive import switching  # noqa: F401 (a fixture, for auto)

K = 3  # alternatives asked per token
TOL = 1e-4


def reference(target, prompt, tokens):
    """[T, V] log-softmax of a plain forward's logits at the positions that predicted each
    of `tokens` (generated after `prompt`)."""
    logits = kdj.forward(target, [prompt + tokens])[0]
    P = len(prompt)
    return np.asarray(jax.nn.log_softmax(logits[P - 1 : P - 1 + len(tokens)], axis=-1))


def assert_matches(target, prompts, tokens, logprobs, k=K):
    """Each token's log-probability and its k alternatives (ids by rank, values) against
    the plain forward."""
    for prompt, toks, got in zip(prompts, tokens, logprobs, strict=True):
        assert len(got) == len(toks) > 0
        want = reference(target, prompt, toks)
        chosen = [x.logprob for x in got]
        np.testing.assert_allclose(chosen, want[np.arange(len(toks)), toks], atol=TOL)
        for x, row in zip(got, want):
            ranked = np.argsort(-row, kind="stable")[:k]
            assert [i for i, _ in x.top] == ranked.tolist()
            np.testing.assert_allclose([v for _, v in x.top], row[ranked], atol=TOL)


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]
METHODS = [("ar", {}), ("dflash", {}), ("ddtree", {"tree_budget": 6}),
           ("auto", {"menu": ["none", "chain2", "tree3"], "cost": "estimate"})]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method,kw", METHODS, ids=[m for m, _ in METHODS])
def test_logprobs_equal_a_plain_forward_and_change_no_token(vocab12_pair, method, kw,
                                                           temperature, request):  # fmt: skip
    """Every method (auto switching pseudo-randomly between its entries and plain steps),
    greedy and sampled with a seed: the tokens of logprobs=None, and the values of a
    plain forward, the accepted drafts' from verify included."""
    if method == "auto":
        request.getfixturevalue("switching")
    target, drafter = vocab12_pair
    args = dict(method=method, max_new_tokens=12, stop_tokens=[], temperature=temperature,
                top_p=0.9, seed=5, drafter=None if method == "ar" else drafter, **kw)  # fmt: skip
    off = kdj.generate(target, PROMPTS, **args)
    on = kdj.generate(target, PROMPTS, logprobs=K, **args)
    assert on.tokens == off.tokens and off.logprobs is None
    assert_matches(target, PROMPTS, on.tokens, on.logprobs)
    if method != "ar":  # drafts were accepted: some values came from verify's rows
        assert max(max(t) for t in on.stats["acceptance_lengths"]) > 1
    if method == "auto":  # and some from skipped steps
        assert "skip" in on.stats["draft_choices"]


def test_logprobs_bounds(vocab12_pair):
    target, _ = vocab12_pair
    out = kdj.generate(target, [[1, 2]], method="ar", max_new_tokens=3, logprobs=0)
    assert all(x.top == [] for x in out.logprobs[0])
    wide = kdj.generate(target, [[1, 2]], method="ar", max_new_tokens=3, logprobs=20)
    assert [len(x.top) for x in wide.logprobs[0]] == [12] * 3  # the vocabulary's 12 tokens
    for bad, err in [(21, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)]:
        with pytest.raises(err, match="logprobs"):
            kdj.generate(target, [[1, 2]], method="ar", max_new_tokens=3, logprobs=bad)


@pytest.mark.parametrize("method,kw", METHODS[:2], ids=["ar", "dflash"])
def test_the_pool_returns_what_generate_does(vocab12_pair, method, kw):
    """Prompts streamed through the slot pool (max_batch): generate's tokens and values."""
    target, drafter = vocab12_pair
    args = dict(method=method, max_new_tokens=[5, 12, 9], stop_tokens=[], logprobs=2,
                drafter=None if method == "ar" else drafter, **kw)  # fmt: skip
    alone = kdj.generate(target, PROMPTS, **args)
    pooled = kdj.generate(target, PROMPTS, max_batch=2, **args)
    assert pooled.tokens == alone.tokens
    assert_matches(target, PROMPTS, pooled.tokens, pooled.logprobs, k=2)


def test_a_pool_switches_between_requests_with_and_without_logprobs(vocab12_pair):
    """Requests with log-probabilities are a mode of their own: in one engine beside others
    without, each gets its tokens (those it gets alone) and only they get values, each with
    its own k."""
    target, _ = vocab12_pair
    engine = Engine(target, max_batch=2, cache_size=32, max_new_cap=8, chunk_steps=3)
    asks = [None, 1, 4, None, 0]
    ids = [engine.submit(Request(PROMPTS[i % 3], 8, [], logprobs=k)) for i, k in enumerate(asks)]
    got = {i: ([], []) for i in ids}
    while engine.busy:
        for u in engine.step():
            got[u.id][0].extend(u.tokens)
            assert (u.logprobs is None) == (asks[ids.index(u.id)] is None)
            got[u.id][1].extend(u.logprobs or [])
    want = kdj.generate(target, [PROMPTS[i % 3] for i in range(5)], method="ar",
                        max_new_tokens=8, stop_tokens=[], logprobs=4)  # fmt: skip
    for i, k in zip(ids, asks):
        tokens, values = got[i]
        assert tokens == want.tokens[i]
        for x, y in zip(values, want.logprobs[i] if k is not None else [], strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=TOL)
            assert [j for j, _ in x.top] == [j for j, _ in y.top[:k]]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top[:k]], abs=TOL)
    with pytest.raises(ValueError, match="logprobs"):
        engine.submit(Request([1], 4, [], logprobs=21))
