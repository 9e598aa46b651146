"""Log-probabilities (kdj/decode/logprobs.py): each emitted token's, and its top-k
alternatives', equal those of a plain forward of the target over prompt + emitted tokens,
for AR and every speculative method, one-shot and through the slot pool; asking for them
changes no token; the server returns them in OpenAI's shapes. Tiny float32 models."""

from __future__ import annotations

import httpx
import jax
import numpy as np
import pytest

import kdj
from kdj.decode.engine import Engine
from kdj.decode.requests import Request
from tests.test_adaptive import switching  # noqa: F401 (a fixture, for auto)
from tests.test_serve import chat_target, openai_client, run_server  # noqa: F401 (a fixture)
from tests.test_tokenizer import smol  # noqa: F401 (a fixture)

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
    asks, budgets = [None, 1, 4, None, 0], [8, 3, 8, 8, 8]  # 1 ends first: 4 moves to width 1
    ids = [engine.submit(Request(PROMPTS[i % 3], m, [], logprobs=k))
           for i, (k, m) in enumerate(zip(asks, budgets))]  # fmt: skip
    got = {i: ([], []) for i in ids}
    while engine.busy:
        for u in engine.step():
            got[u.id][0].extend(u.tokens)
            assert (u.logprobs is None) == (asks[ids.index(u.id)] is None)
            got[u.id][1].extend(u.logprobs or [])
    want = kdj.generate(target, [PROMPTS[i % 3] for i in range(5)], method="ar",
                        max_new_tokens=budgets, stop_tokens=[], logprobs=4)  # fmt: skip
    for i, k in zip(ids, asks):
        tokens, values = got[i]
        assert tokens == want.tokens[i]
        for x, y in zip(values, want.logprobs[i] if k is not None else [], strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=TOL)
            assert [j for j, _ in x.top] == [j for j, _ in y.top[:k]]
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top[:k]], abs=TOL)
    assert engine.resizes > 0  # the record moved with its slot from width 2 to 1
    with pytest.raises(ValueError, match="logprobs"):
        engine.submit(Request([1], 4, [], logprobs=21))


# ------------------------------------------------------------------------------ the server
def test_text_stream_scores_each_token_where_its_text_starts(smol):  # noqa: F811
    """kdj serve's TextStream fed a real reply's tokens with log-probabilities, in uneven
    pieces (multi-byte characters cut across them): the scored tokens' texts join to the
    reply's text, each at its offset, a character split across tokens counted by the last;
    at a stop string, the tokens whose text starts before it."""
    from kdj.decode.logprobs import TokenLogprob
    from kdj.serve.text import Served, TextStream

    text = (
        "Héllo wörld! 東京は大きい 🙂🙂 and 12345 spaces   then\nnew lines, 🌊🐟🌊🐟🐟 "
        "done."
    )  # emoji of three byte tokens each: a context may start inside one
    ids = smol.encode(text)
    served = Served("m", smol, (), 64, 0.0, 1.0)
    scores = [TokenLogprob(-0.5 * i, [(t, -1.0), (ids[0], -2.0)]) for i, t in enumerate(ids)]
    rng = np.random.default_rng(0)
    for stops in [(), ("大きい",)]:
        stream, got = TextStream(served, stops), ""
        cuts = sorted(rng.choice(len(ids), size=8, replace=False).tolist()) + [len(ids)]
        at = 0
        for end in cuts:
            got += stream.feed(ids[at:end], end == len(ids), scores[at:end])
            assert len(stream.scored) <= len(ids)
            assert all(s.offset < len(got) for s in stream.scored[:-1])
            at = end
        texts = [s.text for s in stream.scored]
        joined = "".join(texts)
        assert [s.offset for s in stream.scored] == [len("".join(texts[:i])) for i in
                                                     range(len(texts))]  # fmt: skip
        assert [s.logprob for s in stream.scored] == [x.logprob for x in scores[: len(texts)]]
        if not stops:
            assert joined == got == text and len(stream.scored) == len(ids)
        else:
            assert joined.startswith(got) and got == text[: text.index(stops[0])]
            assert stream.scored[-1].offset < len(got) <= len(joined)
        # an alternative's text is what it would add in the same place: the token's own
        # text, or "H" (after the unfinished part of a character, which it leaves invalid)
        assert all(s.top[0][0] == s.text for s in stream.scored)
        assert {s.top[1][0] for s in stream.scored} == {"H", "\ufffdH"}


@pytest.fixture(scope="module")
def server(chat_target):  # noqa: F811
    """A DFlash server (the tiny chat model, a random drafter): 2 slots of 64 tokens."""
    from kdj.serve.app import make_app
    from tests.test_speculative import make_drafter

    app = make_app(chat_target, "tiny", drafter=make_drafter(chat_target, 1, ids=(0, 1)),
                   method="dflash", block_size=4, max_batch=2, context=64, max_tokens=8,
                   chunk_steps=4)  # fmt: skip
    with run_server(app) as url:
        yield url


def served_reference(target, prompt: list[int], k: int):
    """(tokens, logprobs) generate gives the prompt greedily, end-of-turn ids left out (the
    server's text leaves them out, and their log-probabilities with them)."""
    out = kdj.generate(target, [prompt], method="ar", max_new_tokens=8, logprobs=k)
    stops = target.tokenizer.stop_ids
    kept = [(t, x) for t, x in zip(out.tokens[0], out.logprobs[0]) if t not in stops]
    return [t for t, _ in kept], [x for _, x in kept]


def test_server_chat_logprobs_in_openais_shape(chat_target, server):  # noqa: F811
    """Chat with logprobs and top_logprobs through the official client, whole and streamed:
    a content entry per token, its text (joined: the reply), bytes, value and alternatives
    as generate gives them (the server decodes with DFlash: lossless, values from verify)."""
    client = openai_client(server)
    messages = [{"role": "user", "content": "hi"}]
    tok = chat_target.tokenizer
    tokens, want = served_reference(chat_target, tok.encode(tok.apply_chat_template(messages)), 3)
    ask = dict(model="tiny", messages=messages, max_tokens=8, logprobs=True, top_logprobs=3)
    (choice,) = client.chat.completions.create(**ask).choices
    content = choice.logprobs.content
    assert "".join(c.token for c in content) == choice.message.content
    assert [c.token for c in content] == [tok.decode([t]) for t in tokens]
    for c, x in zip(content, want, strict=True):
        assert c.bytes == list(c.token.encode()) and c.logprob == pytest.approx(x.logprob)
        alternatives = [(tok.decode([i]), pytest.approx(v)) for i, v in x.top]
        assert [(a.token, a.logprob) for a in c.top_logprobs] == alternatives
        assert all(a.bytes == list(a.token.encode()) for a in c.top_logprobs)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [c for chunk in chunks for ch in chunk.choices if ch.logprobs
                for c in ch.logprobs.content]  # fmt: skip
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    only = client.chat.completions.create(**{**ask, "top_logprobs": None}).choices[0]
    assert [c.logprob for c in only.logprobs.content] == [c.logprob for c in content]
    assert all(c.top_logprobs == [] for c in only.logprobs.content)  # logprobs=true alone
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_a_completion_tokens_own_logprob_stands_among_equal_texts():
    """Tokens that each begin an unfinished character add "" alike: the token's own value
    keeps its key in completions' top_logprobs, not an alternative's."""
    from kdj.serve.app import completion_top
    from kdj.serve.text import Scored

    got = completion_top(Scored("", 0, -0.77, [("", -1.96), ("x", -2.5), ("", -3.0)]))
    assert got == {"": -0.77, "x": -2.5}


def test_server_completion_logprobs_in_openais_shape(chat_target, server):  # noqa: F811
    """Completions' legacy logprobs, whole and streamed: tokens, token_logprobs,
    top_logprobs (the k alternatives and the token itself) and text offsets; at a stop
    string, the tokens whose text starts before it."""
    client = openai_client(server)
    tokens, want = served_reference(chat_target, chat_target.tokenizer.encode("the cat"), 2)
    ask = dict(model="tiny", prompt="the cat", max_tokens=8, logprobs=2)
    (choice,) = client.completions.create(**ask).choices
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == len(tokens)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want])
    for top, token, x in zip(lp.top_logprobs, lp.tokens, want, strict=True):
        alternatives = {chat_target.tokenizer.decode([i]): v for i, v in x.top}
        assert top == pytest.approx({**alternatives, token: x.logprob})
    pieces = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True)]
    streamed = [(t, v, o) for p in pieces if p for t, v, o in
                zip(p.tokens, p.token_logprobs, p.text_offset)]  # fmt: skip
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
    stop = choice.text[2]  # a stop string cuts the text, and the tokens after it
    cut = client.completions.create(**ask, stop=stop).choices[0]
    assert cut.text == choice.text[: choice.text.index(stop)]
    kept = [t for t, at in zip(lp.tokens, lp.text_offset) if at < len(cut.text)]
    assert cut.logprobs.tokens == kept and len(kept) < len(lp.tokens)


def test_server_refuses_bad_logprobs(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    bad = [("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ("/v1/chat/completions", {**chat, "top_logprobs": 2}, "top_logprobs"),
           ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
           ("/v1/chat/completions", {**chat, "logprobs": 1}, "logprobs"),
           ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
           ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs")]  # fmt: skip
    for path, body, param in bad:
        reply = httpx.post(server + path, json=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
