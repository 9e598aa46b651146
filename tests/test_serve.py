"""Serving: the slot-pool engine (kdj/decode/engine.py) against kdj.generate, and the HTTP
server (kdj/serve) on loopback. A tiny random Qwen3-format model in float32."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj.decode import auto
from kdj.decode.engine import Engine
from kdj.decode.requests import Request
from kdj.decode.tree import DraftShape
from tests.hf_models import build
from tests.test_adaptive import switching  # noqa: F401 (a fixture)
from tests.test_speculative import make_drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    build("qwen3", path)
    return kdj.load_target(path, dtype="float32")


def prompts_and_budgets(target, n, seed=0):
    rng = np.random.default_rng(seed)
    V = target.cfg.vocab_size
    prompts = [rng.integers(1, V, size=int(rng.integers(2, 16))).tolist() for _ in range(n)]
    return prompts, [int(rng.choice([3, 11])) for _ in prompts]


def alone(target, prompts, budgets):
    return [kdj.generate(target, [p], method="ar", max_new_tokens=m).tokens[0]
            for p, m in zip(prompts, budgets)]  # fmt: skip


def test_pool_streams_prompts_token_identical(target):
    prompts, budgets = prompts_and_budgets(target, 7)
    out = kdj.generate(target, prompts, method="ar", max_new_tokens=budgets, max_batch=3)
    assert out.tokens == alone(target, prompts, budgets)
    assert out.stats["max_batch"] == 3 and len(out.tokens) == 7


def test_pool_stop_tokens_cancel_and_bad_requests(target):
    prompts, _ = prompts_and_budgets(target, 3, seed=1)
    ref = alone(target, prompts[:1], [11])[0]
    engine = Engine(target, max_batch=2, cache_size=64, max_new_cap=11, chunk_steps=4)
    stop_at = ref[4]  # the request must end at the first occurrence of this token
    a = engine.submit(Request(prompts[0], 11, [stop_at]))
    b = engine.submit(Request(prompts[1], 11, []))
    c = engine.submit(Request(prompts[2], 11, []))
    engine.cancel(b)
    got, finished = {a: [], c: []}, []
    for _ in range(50):
        if not engine.busy:
            break
        for u in engine.step():
            assert u.id != b or (u.finished and not u.tokens)  # cancelled while waiting
            if u.id in got:
                got[u.id] += u.tokens
            if u.finished:
                finished.append(u.id)
    assert got[a] == ref[: ref.index(stop_at) + 1]
    assert len(got[c]) == 11 and sorted(finished) == [a, b, c] and not engine.busy
    engine.reset()  # after a failed step: a fresh pool that serves again
    d = engine.submit(Request(prompts[0], 11, [stop_at]))
    # one chunk is enough: the host hands out the first token (its prefill's) a call later,
    # and the chunk's report a call after that (the engine's lookahead)
    out = [t for _ in range(3) for u in engine.step() if u.id == d for t in u.tokens]
    assert out == got[a]
    for bad, why in [(Request([], 4, []), "empty"), (Request([1], 0, []), "max_tokens"),
                     (Request([1] * 60, 8, []), "context"),
                     (Request([1], 4, [], top_p=0.0), "top_p"),
                     (Request([1], 4, [], temperature=float("nan")), "got nan")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            engine.submit(bad)


def test_the_host_queues_admission_and_the_next_chunk_while_the_device_runs(target):
    """The pool lives on the device thread: with the device held inside a chunk, the host's
    next turn still queues a newcomer's prefill and the next chunk before it waits for the
    held chunk's report."""
    prompts, _ = prompts_and_budgets(target, 2, seed=2)
    engine = Engine(target, max_batch=4, cache_size=64, max_new_cap=6, widths=(4,))
    gate = threading.Event()
    engine.submit(Request(prompts[0], 6, []))
    engine.device.hold(gate)  # the device is busy until the gate opens
    assert engine.step() == []  # chunk 0 queued behind the gate; its report is read later
    engine.submit(Request(prompts[1], 6, []))
    got = []
    turn = threading.Thread(target=lambda: got.extend(engine.step()))
    turn.start()
    deadline = time.monotonic() + 60
    while engine.stats.chunks < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    queued = engine.stats.chunks
    gate.set()
    turn.join(60)
    assert queued == 2, "the host waited for the device before queueing the next chunk"
    while engine.busy:
        got += engine.step()
    tokens = {u.id: [] for u in got}
    for u in got:
        tokens[u.id] += u.tokens
    assert [tokens[0], tokens[1]] == alone(target, prompts, [6, 6])


def test_chunks_follow_the_host(target):
    """follow_host: chunks start at the bound; a host that keeps the device waiting between
    chunks queued back to back holds them there (counted as starved), whatever the chunks'
    fixed cost; the tokens are the same whatever the chunks' lengths. (The host's nap is
    long beside a chunk even on a loaded machine, where a chunk may take a good part of it.)"""
    prompts, budgets = prompts_and_budgets(target, 5, seed=7)
    engine = Engine(target, max_batch=4, cache_size=64, max_new_cap=11, chunk_steps=2,
                    widths=(4,), follow_host=True)  # fmt: skip
    assert engine.chunk_steps.run == {4: 2}
    ids = [engine.submit(Request(p, m, [])) for p, m in zip(prompts, budgets)]
    got = {i: [] for i in ids}
    while engine.busy:
        time.sleep(0.1)  # a slow host: the device idles between chunks
        for u in engine.step():
            got[u.id] += u.tokens
    assert [got[i] for i in ids] == alone(target, prompts, budgets)
    assert engine.chunk_steps.run == {4: 2} and engine.stats.starved >= 3
    assert engine.stats.starved_s > 3 * 0.05
    assert 2 in engine.chunk_steps.per_step[4]  # each count's seconds per step, as measured
    assert engine.chunk_steps.step_ms()[4][2] > 0


@pytest.mark.parametrize("fixed_s, floor", [(0.0, 1), (2.0, 5), (8.0, 10)])
def test_chunk_steps_amortise_their_fixed_cost(fixed_s, floor):
    """A chunk of s steps costing fixed_s + 1.4 s: from the bound (16), calm chunks walk down
    while a step costs at most FIXED_SHARE more than at the cheapest count seen, and settle
    at the smallest such count; a device wait doubles the steps again."""
    from kdj.decode.turns import CALM_CHUNKS, FIXED_SHARE, ChunkSteps, TurnStats

    steps, stats = ChunkSteps({1: 16}, follow_host=True), TurnStats()
    for _ in range(CALM_CHUNKS * 40):
        s = steps.run[1]
        steps.observe(1, 0.0, fixed_s + 1.4 * s, s, stats)
    cost = lambda s: fixed_s / s + 1.4  # noqa: E731
    assert cost(floor) <= (1 + FIXED_SHARE) * cost(16) and (
        floor == 1 or cost(floor - 1) > (1 + FIXED_SHARE) * cost(16))  # fmt: skip
    assert steps.run[1] == floor and stats.starved == 0
    steps.observe(1, 99.0, fixed_s + 1.4 * floor, floor, stats)  # the device waited
    assert steps.run[1] == min(16, 2 * floor) and stats.starved == 1
    fixed = ChunkSteps({1: 16}, follow_host=False)
    fixed.observe(1, 1.0, 1.0, 16, stats)  # counted, never acted on
    assert fixed.run == {1: 16} and stats.starved == 2


def test_a_newcomers_first_token_comes_before_its_first_chunk(target):
    """A request's first token (its prefill's) is handed out alone, a turn before the chunk
    it joined reports: the time to first token is the prefill's, not a chunk's."""
    prompts, _ = prompts_and_budgets(target, 1, seed=4)
    ref = alone(target, prompts, [9])[0]
    engine = Engine(target, max_batch=2, cache_size=64, max_new_cap=9, chunk_steps=4,
                    widths=(2,))  # fmt: skip
    engine.submit(Request(prompts[0], 9, []))
    assert engine.step() == []  # its prefill and chunk 0 queued
    first = engine.step()  # chunk 1 queued; the prefill's token, not chunk 0's report
    assert [(u.tokens, u.finished, u.steps) for u in first] == [(ref[:1], False, 0)]
    assert [u.tokens for u in engine.step()] == [ref[1:5]]  # chunk 0: four steps
    rest = []
    while engine.busy:
        rest += [t for u in engine.step() for t in u.tokens]
    assert rest == ref[5:]


def test_a_failed_pool_program_fails_what_follows_until_reset(target):
    """A program that raises on the device thread fails every later one (none runs on a
    pool it left halfway) until reset gives a fresh pool, which serves again."""
    prompts, _ = prompts_and_budgets(target, 1, seed=3)
    engine = Engine(target, max_batch=1, cache_size=64, max_new_cap=4, widths=(1,))
    state = engine.pool.state
    bad = dataclasses.replace(state, done=jnp.zeros((3,), bool))  # not the program's shape
    engine.pool = engine.pool._replace(state=bad)
    engine.submit(Request(prompts[0], 4, []))
    engine.step()
    with pytest.raises(TypeError, match="pool.state.done"):  # the prefill's own error
        engine.step()
    with pytest.raises(RuntimeError, match="earlier pool program failed"):  # the chunk's
        engine.step()
    assert engine.reset() == [0]
    engine.submit(Request(prompts[0], 4, []))
    out = []
    while engine.busy:
        out += engine.step()
    assert [t for u in out for t in u.tokens] == alone(target, prompts, [4])[0]


def test_a_warm_pool_compiles_nothing_while_serving(target):
    """After warm, newcomers arriving in groups of every size, a pool that narrows, widens
    and empties, and cancelled requests compile nothing: a compile while serving stalls every
    stream (an eager read of the newcomers' first tokens once compiled one per group size)."""
    prompts, budgets = prompts_and_budgets(target, 40, seed=5)
    engine = Engine(target, max_batch=16, cache_size=64, max_new_cap=63, chunk_steps=4)
    engine.warm((True,))
    compiles = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        todo = list(zip(prompts, budgets))
        for group in (1, 3, 2, 5, 16, 4, 7, 0, 0, 0, 0, 0, 0, 0, 0, 2):
            ids = [engine.submit(Request(p, m, [])) for p, m in todo[:group]]
            del todo[:group]
            engine.step()
            if len(ids) > 2:
                engine.cancel(ids[1])
        while engine.busy:
            engine.step()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_compiles_are_counted_while_listening():
    from kdj.serve.app import Compiles

    with Compiles() as compiles:
        jax.jit(lambda x: x * 3 + 1)(np.arange(5))
    assert compiles.count == 1 and compiles.seconds > 0
    jax.jit(lambda x: x * 5 + 2)(np.arange(5))
    assert compiles.count == 1  # no longer listening


def test_max_batch_must_be_positive(target):
    with pytest.raises(ValueError, match="max_batch"):
        kdj.generate(target, [[1, 2], [3, 4]], method="ar", max_batch=0)


@pytest.mark.parametrize("spec", [{"method": "dflash"}, {"method": "ddtree", "tree_budget": 6}],
                         ids=["dflash", "ddtree6"])  # fmt: skip
def test_pool_drafts_token_identical(vocab12_pair, spec):
    """More prompts than slots, ragged, mixed budgets: each prompt's tokens and steps are
    what it gets alone, and drafts were accepted (steps < tokens - 1)."""
    target, drafter = vocab12_pair
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 12, int(n)).tolist() for n in rng.integers(2, 16, 5)]
    budgets = [int(m) for m in rng.choice([7, 23], 5)]
    run = dict(drafter=drafter, max_new_tokens=budgets, stop_tokens=[], **spec)
    out = kdj.generate(target, prompts, max_batch=2, **run)
    alone = [kdj.generate(target, [p], **{**run, "max_new_tokens": m})
             for p, m in zip(prompts, budgets)]  # fmt: skip
    assert out.tokens == [a.tokens[0] for a in alone]
    assert out.stats["request_steps"] == [len(a.stats["acceptance_lengths"][0]) for a in alone]
    assert out.stats["method"] == spec["method"] and out.stats["mean_acceptance"] > 1


@pytest.mark.parametrize("method", ["dflash", "auto"])
def test_pool_drafts_sampled_as_alone(vocab12_pair, method):
    """Sampled DFlash or auto with a seed per prompt: each prompt's samples are what it
    draws alone (per-slot temperatures reach the verify pass's [B, T, V] logits)."""
    target, drafter = vocab12_pair
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    run = dict(drafter=drafter, method=method, max_new_tokens=12, stop_tokens=[],
               temperature=0.9, top_p=0.9)  # fmt: skip
    out = kdj.generate(target, prompts, max_batch=2, seed=[11, 12, 13], **run)
    alone = [kdj.generate(target, [p], seed=[s], **run).tokens[0]
             for p, s in zip(prompts, [11, 12, 13])]  # fmt: skip
    assert out.tokens == alone


def ragged(n, seed):
    """n prompts of 2..15 tokens of the 12-token vocabulary and budgets of 7 or 23."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 12, int(k)).tolist() for k in rng.integers(2, 16, n)]
    return prompts, [int(m) for m in rng.choice([7, 23], n)]


def test_pool_auto_token_identical(vocab12_pair):
    """auto streamed through a pool of 2 (5 ragged prompts, mixed budgets): each prompt's
    tokens are what plain greedy gives it; drafts were accepted, and the menu priced for the
    pool is what ran."""
    target, drafter = vocab12_pair
    prompts, budgets = ragged(5, 7)
    run = dict(drafter=drafter, method="auto", stop_tokens=[])
    out = kdj.generate(target, prompts, max_batch=2, max_new_tokens=budgets, **run)
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=budgets, stop_tokens=[])
    assert out.tokens == ar.tokens
    assert out.stats["method"] == "auto" and out.stats["mean_acceptance"] > 1
    assert out.stats["menu"][0] == "none" and len(out.stats["menu"]) > 1
    assert list(out.stats["menus"]) == [1, 2]  # priced at each width of the pool's ladder
    with pytest.raises(ValueError, match="needs a draft shape"):
        Engine(target, 2, 64, 8, drafter=drafter, menu=(DraftShape("none"),))


def test_auto_says_why_it_drafts_where_it_does(vocab12_pair):
    """The engine's pricing: per width of auto's ladder, each priced entry's predicted tok/s
    (what /stats serves); bench-serve keeps the widths a level ran."""
    from kdj.serve.bench import stats_delta

    target, drafter = vocab12_pair
    menu = auto.parse_menu("auto", ["none", "chain", "tree12"], 6, None)
    engine = Engine(target, 4, 64, 8, drafter=drafter, menu=menu, widths=(1, 4))
    assert engine.pricing()[4]["tree12"] == 0.0  # no prior tau: nothing predicted
    known = dataclasses.replace(drafter, prior_acceptance=2.5)
    engine = Engine(target, 4, 64, 8, drafter=known, menu=menu, widths=(1, 4))
    pricing = engine.pricing()
    assert list(pricing) == [1, 4]
    for w, rates in pricing.items():
        assert list(rates) == [str(s) for s in engine.plans[w].menu] and "none" in rates
        assert all(r > 0 for r in rates.values())
    assert pricing[4]["none"] > pricing[1]["none"]  # four rows a step
    assert Engine(target, 4, 64, 8, drafter=drafter, menu=menu[1:2]).pricing() == {}
    zero = {"turns": 0, "chunks": 0, "wait_s": 0.0, "turn_s": 0.0, "tokens": 0, "prefills": 0,
            "admitted": 0, "widths": {}}  # fmt: skip
    worker = {"idle_s": 0.0, "deliver_s": 0.0}
    lag = {"samples": 0, "total_s": 0.0, "max_s": 0.0}
    before = {"engine": zero, "worker": worker, "loop_lag": lag}
    after = {"engine": {**zero, "turns": 2, "widths": {"1": 0, "4": 3}}, "worker": worker,
             "loop_lag": lag, "pricing": {"1": {"none": 1.0}, "4": {"none": 4.0}}}  # fmt: skip
    assert stats_delta(before, after, 1.0)["pricing"] == {"4": {"none": 4.0}}


# ---------------------------------------------------------------------------- the server
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:;ABCDEFGHIJKLMNOPQRSTUVWXYZ\n"
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The tiny model with a character-level tokenizer (ids < its vocabulary of 96)."""
    path = save_chat_model(tmp_path_factory.mktemp("qwen3chat"))
    target = kdj.load_target(path, dtype="float32")
    assert target.tokenizer is not None and target.tokenizer.vocab_size == target.cfg.vocab_size
    return target


def save_chat_model(path):
    """A tiny random Qwen3 with a character-level tokenizer and a chat template, at `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    build("qwen3", path)
    tokens = SPECIALS + list(CHARS)
    tokens += [f"<{i}>" for i in range(len(tokens), 96)]  # every id the model can emit
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@contextlib.contextmanager
def run_server(app):
    """uvicorn in a thread on 127.0.0.1, an ephemeral port: its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def served_app(chat_target):
    """4 slots of 64 tokens, their greedy programs compiled before it listens."""
    from kdj.serve.app import make_app

    return make_app(chat_target, "tiny", max_batch=4, context=64, max_tokens=8, max_queue=32,
                    chunk_steps=4, warm=(True,))  # fmt: skip


@pytest.fixture(scope="module")
def server(served_app):
    with run_server(served_app) as url:
        yield url


def pool_reference(target, prompts, budgets):
    """What the server's engine gives alone: its shapes (so its programs are reused)."""
    engine = Engine(target, max_batch=4, cache_size=64, max_new_cap=63, chunk_steps=4)
    ids = [engine.submit(Request(p, m, sorted(target.tokenizer.stop_ids)))
           for p, m in zip(prompts, budgets)]  # fmt: skip
    got = {i: [] for i in ids}
    for _ in range(10 * sum(budgets)):
        if not engine.busy:
            break
        for u in engine.step():
            got[u.id] += u.tokens
    return [got[i] for i in ids]


def text_of(target, tokens):
    stops = target.tokenizer.stop_ids
    return target.tokenizer.decode([t for t in tokens if t not in stops])


def post_all(url, bodies, concurrency):
    async def go():
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def one(body):
                async with limit:
                    return await client.post("/v1/completions", json=body)

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(go())


def test_server_greedy_equals_generate(chat_target, server):
    prompts, budgets = prompts_and_budgets(chat_target, 8, seed=2)
    ref = kdj.generate(chat_target, prompts, method="ar", max_new_tokens=budgets, max_batch=4)
    want = [text_of(chat_target, t) for t in ref.tokens]  # = each alone: the test above
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": m} for p, m in zip(prompts, budgets)]
    for concurrency in (1, 8):
        replies = post_all(server, bodies, concurrency)
        assert [r.status_code for r in replies] == [200] * 8
        assert [r.json()["choices"][0]["text"] for r in replies] == want
    usage = replies[0].json()["usage"]
    assert usage["prompt_tokens"] == len(prompts[0]) and usage["kdj"]["method"] == "ar"
    assert usage["kdj"]["steps"] == usage["completion_tokens"] - 1


@pytest.mark.parametrize("method", ["dflash", "auto"])
def test_server_drafts_greedy_equal_to_generate(chat_target, method):
    """A DFlash or auto server (2 slots, 8 requests at once): the texts plain decoding gives
    (speculative greedy is lossless), usage with the speculative steps."""
    from kdj.serve.app import make_app

    prompts, budgets = prompts_and_budgets(chat_target, 8, seed=2)
    ref = kdj.generate(chat_target, prompts, method="ar", max_new_tokens=budgets, max_batch=4)
    app = make_app(chat_target, "tiny", drafter=make_drafter(chat_target, 1, ids=(0, 1)),
                   method=method,
                   block_size=4, max_batch=2, context=64, max_tokens=8, chunk_steps=4)  # fmt: skip
    bodies = [{"prompt": p, "max_tokens": m} for p, m in zip(prompts, budgets)]
    with run_server(app) as url:
        replies = post_all(url, bodies, 8)
    assert [r.json()["choices"][0]["text"] for r in replies] == [
        text_of(chat_target, t) for t in ref.tokens
    ]
    for r, t in zip(replies, ref.tokens):
        usage = r.json()["usage"]
        stats, n = usage["kdj"], usage["completion_tokens"]
        assert n == len(t) and stats["method"] == method and 0 <= stats["steps"] <= n - 1
        if n > 1:  # the first token comes from prefill, each step commits one or more
            assert stats["mean_acceptance"] == pytest.approx((n - 1) / stats["steps"])


def test_server_many_clients_mixed_lengths(chat_target, server):
    prompts, budgets = prompts_and_budgets(chat_target, 24, seed=3)
    ref = pool_reference(chat_target, prompts, budgets)
    bodies = [{"prompt": p, "max_tokens": m} for p, m in zip(prompts, budgets)]
    replies = post_all(server, bodies, 24)
    got = [r.json() for r in replies]
    assert [g["choices"][0]["text"] for g in got] == [text_of(chat_target, t) for t in ref]
    assert [g["usage"]["completion_tokens"] for g in got] == [len(t) for t in ref]
    assert len({g["id"] for g in got}) == 24


def stream_chunks(url, path, body) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


def stream_text(url, path, body):
    """The streamed text of choice 0, and the last chunk."""
    chunks = stream_chunks(url, path, body)
    pieces = [c["text"] if "text" in c else c["delta"]["content"]
              for chunk in chunks for c in chunk["choices"]]  # fmt: skip
    return "".join(pieces), chunks[-1]


def test_streaming_and_chat_yield_the_same_text(server):
    body = {"prompt": "hello there", "max_tokens": 12}
    whole = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    text, last = stream_text(server, "/v1/completions",
                             {**body, "stream_options": {"include_usage": True}})  # fmt: skip
    assert text == whole["choices"][0]["text"] and last["usage"] == whole["usage"]
    assert last["choices"] == []  # as OpenAI: the usage comes in a chunk of its own
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    whole = httpx.post(server + "/v1/chat/completions", json=chat, timeout=60).json()
    text, _ = stream_text(server, "/v1/chat/completions", chat)
    assert text == whole["choices"][0]["message"]["content"]
    assert whole["usage"]["prompt_tokens"] == 3 + len("user\nhi\nassistant\n")  # 3 specials


def test_stream_usage_as_each_stream_option_asks(server):
    """No options: no usage in a stream. include_usage: a null usage on every chunk, then
    the whole usage in a last chunk of no choices. continuous_usage_stats: the usage so far
    on every chunk, each choice's finishing one included."""
    body = {"prompt": ["hello there", "a b c"], "max_tokens": 6}
    whole = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["usage"]
    plain = stream_chunks(server, "/v1/completions", body)
    assert all("usage" not in c for c in plain)
    last = stream_chunks(server, "/v1/completions",
                         {**body, "stream_options": {"include_usage": True}})  # fmt: skip
    assert [c["usage"] for c in last[:-1]] == [None] * (len(last) - 1)
    assert last[-1]["choices"] == [] and last[-1]["usage"] == whole
    assert sum(c["choices"][0]["finish_reason"] is not None for c in last[:-1]) == 2
    every = stream_chunks(server, "/v1/completions",
                          {**body, "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
    counts = [c["usage"]["completion_tokens"] for c in every]
    assert counts == sorted(counts) and counts[-1] == whole["completion_tokens"]


def test_bad_requests_get_400_while_others_run(chat_target, server):
    prompts, budgets = prompts_and_budgets(chat_target, 4, seed=4)
    ref = pool_reference(chat_target, prompts, budgets)
    bad = [b"{not json", {"model": "other", "prompt": "hi"}, {"prompt": [5] * 70},
           {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "top_p": 0}]  # fmt: skip

    async def go():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            good = [client.post("/v1/completions", json={"prompt": p, "max_tokens": m})
                    for p, m in zip(prompts, budgets)]  # fmt: skip
            wrong = [client.post("/v1/completions", content=b) if isinstance(b, bytes)
                     else client.post("/v1/completions", json=b) for b in bad]  # fmt: skip
            return await asyncio.gather(*good, *wrong)

    replies = asyncio.run(go())
    good, wrong = replies[:4], replies[4:]
    assert [r.json()["choices"][0]["text"] for r in good] == [text_of(chat_target, t) for t in ref]
    assert [r.status_code for r in wrong] == [400] * len(bad)
    reasons = [r.json()["error"]["message"] for r in wrong]
    for reason, word in zip(reasons, ["JSON", "unknown model", "context", "max_tokens", "top_p"]):
        assert word in reason
    assert httpx.get(server + "/health").json()["status"] == "ok"
    (model,) = httpx.get(server + "/v1/models").json()["data"]
    assert model["id"] == "tiny" and httpx.get(server + "/v1/models/tiny").json() == model
    gone = httpx.get(server + "/v1/models/other")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def drained(url) -> dict:
    """/health once nothing is in flight (or after 5 s)."""
    for _ in range(100):
        health = httpx.get(url + "/health").json()
        if health["in_flight"] == 0:
            break
        time.sleep(0.05)
    return health


def test_disconnect_mid_stream_frees_the_slot(chat_target, served_app, server, monkeypatch):
    # the engine's host turns held once a turn has handed out tokens, so a request that has
    # streamed its first is still running when its client leaves (the tiny model would
    # otherwise finish all 56 tokens in milliseconds)
    engine, held, go = served_app.state.worker.engine, threading.Event(), threading.Event()
    step = engine.step

    def holding_step():
        if held.is_set():
            go.wait(30)
        updates = step()
        if any(u.tokens for u in updates) and not go.is_set():
            held.set()
        return updates

    monkeypatch.setattr(engine, "step", holding_step)
    inbox = served_app.state.worker.inbox

    def leave_while_held(body, holding: int) -> dict:
        held.clear(), go.clear()
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # a first token: the request holds its slots
            assert httpx.get(server + "/health").json()["in_flight"] == holding
        deadline = time.monotonic() + 30
        while inbox.empty() and time.monotonic() < deadline:  # the server saw it leave
            time.sleep(0.01)
        go.set()
        return drained(server)

    # a prompt that runs its whole budget (no end-of-turn token), so it is still running
    prompts, _ = prompts_and_budgets(chat_target, 8, seed=5)
    prompts = [p[:4] for p in prompts]
    ref = pool_reference(chat_target, prompts, [56] * len(prompts))
    long = [p for p, t in zip(prompts, ref) if len(t) == 56]
    assert long, "no prompt of the tiny model runs 56 tokens"
    body = {"prompt": long[0], "max_tokens": 56, "stream": True}
    cancelled = httpx.get(server + "/health").json()["cancelled"]
    health = leave_while_held(body, 1)
    assert health["in_flight"] == 0 and health["cancelled"] == cancelled + 1  # not run out
    assert health["width"] in (1, 4) and health["slots"] == 4  # the ladder of a pool of 4
    health = leave_while_held({**body, "n": 2}, 2)  # both choices hold a slot; both freed
    assert health["in_flight"] == 0 and health["cancelled"] == cancelled + 3
    reply = httpx.post(server + "/v1/completions", json={"prompt": "ok", "max_tokens": 3})
    assert reply.status_code == 200


def test_full_queue_is_refused(target):
    from kdj.serve.worker import Overloaded, Worker

    worker = Worker(Engine(target, max_batch=1, cache_size=32, max_new_cap=4), max_queue=1)

    async def go():
        worker.submit(Request([1, 2], 4, []))
        worker.submit(Request([1, 2], 4, []))
        with pytest.raises(Overloaded, match="busy"):
            worker.submit(Request([1, 2], 4, []))

    asyncio.run(go())  # the worker thread never started: nothing drains the queue
    assert worker.in_flight == 2


def test_bench_serve_smoke(server, tmp_path, capsys, monkeypatch):
    from kdj import cli
    from kdj.serve import bench

    levels, level = [], bench.level

    def counted(url, model, prompts, lengths, concurrency, requests, *args):
        levels.append((concurrency, requests))
        return level(url, model, prompts, lengths, concurrency, requests, *args)

    monkeypatch.setattr(bench, "level", counted)
    prompts = tmp_path / "eval_prompts.json"
    prompts.write_text(json.dumps({"sharegpt": ["hi there", "tell me a story", "why?"]}))
    out = tmp_path / "sweep.json"
    cli.main(["bench-serve", "--url", server, "--concurrency", "1", "3", "--requests", "3",
              "--max-tokens", "2", "6", "--prompts", str(prompts), "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["requests"]) for r in rows] == [(1, 3), (3, 3)]
    assert levels == [(1, 1), (3, 3), (1, 3), (3, 3)]  # the unmeasured pass first
    levels.clear()  # --waves 2: each level runs at least two requests per client
    cli.main(["bench-serve", "--url", server, "--concurrency", "1", "3", "--requests", "3",
              "--waves", "2", "--max-tokens", "2", "--prompts", str(prompts), "--no-warmup",
              "--out", str(out), "--plot", str(tmp_path / "sweep.png")])  # fmt: skip
    assert levels == [(1, 3), (3, 6)]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["requests"] for r in json.loads(out.read_text())["rows"]] == [3, 6]
    levels.clear()  # two client processes share a level's clients and requests
    cli.main(["bench-serve", "--url", server, "--concurrency", "2", "--requests", "4",
              "--procs", "2", "--max-tokens", "2", "--prompts", str(prompts), "--no-warmup",
              "--out", str(out)])  # fmt: skip
    (two,) = json.loads(out.read_text())["rows"]
    assert two["requests"] == 4 and two["client_procs"] == 2 and two["errors"] == 0
    assert two["server"]["turns"] > 0 and two["itl_per_token"]
    assert two["server"]["compiles"] == 0  # the warm server compiles nothing for it
    assert all(r["errors"] == 0 for r in rows)
    # a prompt past the server's context: refused (400), counted, the others still measured
    prompts.write_text(json.dumps({"sharegpt": ["hi there", "word " * 400, "why?"]}))
    cli.main(["bench-serve", "--url", server, "--concurrency", "3", "--requests", "6",
              "--max-tokens", "2", "--prompts", str(prompts), "--no-warmup",
              "--out", str(out)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["errors"] == 2 and row["requests"] == 4 and "context" in row["first_error"]
    prompts.write_text(json.dumps({"sharegpt": ["word " * 400]}))
    with pytest.raises(SystemExit, match="kdj bench-serve: every request at concurrency 1 failed"):
        cli.main(["bench-serve", "--url", server, "--concurrency", "1", "--requests", "2",
                  "--prompts", str(prompts), "--no-warmup"])  # fmt: skip
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 and r["ttft_p50_s"] > 0 for r in rows)
    assert "tok/s/user" in capsys.readouterr().out


def test_stop_strings_and_sampling(server):
    for prompt in ["abc", "hello", "the cat", "xyz 12", "q", "Why?"]:  # one that runs long
        body = {"prompt": prompt, "max_tokens": 20}
        text = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
        text = text["choices"][0]["text"]
        if len(text) >= 6:
            break
    assert len(text) >= 6, "the tiny model ended every prompt too early for this test"
    stop = text[3:5]
    cut = httpx.post(server + "/v1/completions", json={**body, "stop": [stop]}, timeout=60)
    choice = cut.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    # usage counts the tokens up to the one completing the stop string, not those decoded after
    scored = httpx.post(server + "/v1/completions", json={**body, "logprobs": 0}, timeout=60)
    ends = np.cumsum([len(t) for t in scored.json()["choices"][0]["logprobs"]["tokens"]])
    upto = int(np.searchsorted(ends, text.index(stop) + len(stop))) + 1
    assert cut.json()["usage"]["completion_tokens"] == upto
    streamed, last = stream_text(server, "/v1/completions", {**body, "stop": stop})
    assert streamed == choice["text"] and last["choices"][0]["finish_reason"] == "stop"
    sampled = httpx.post(server + "/v1/completions", timeout=60,
                         json={**body, "temperature": 0.8, "top_p": 0.9, "seed": 3})  # fmt: skip
    assert sampled.status_code == 200 and sampled.json()["usage"]["completion_tokens"] >= 1
    again = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert again["text"] == text  # greedy again after the pool ran sampled


# ------------------------------------------------------------- OpenAI's API, its client
def openai_client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_choices(chunks) -> dict[int, str]:
    """The text of each choice index of a chat stream."""
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return texts


def test_openai_client_chat_streaming_n_and_logprobs(server):
    import openai

    client = openai_client(server)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    whole = client.chat.completions.create(**ask)
    (choice,) = whole.choices
    text = choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert streamed_choices(client.chat.completions.create(**ask, stream=True)) == {0: text}
    three = client.chat.completions.create(**ask, n=3)  # greedy: three equal choices
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [text] * 3
    assert three.usage.completion_tokens == 3 * whole.usage.completion_tokens
    assert three.usage.prompt_tokens == whole.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**ask, n=3, stream=True))
    assert streamed_choices(chunks) == {0: text, 1: text, 2: text}
    roles = [(c.index, c.delta.role) for chunk in chunks for c in chunk.choices]
    for i in range(3):  # as OpenAI streams: the role in a choice's first delta only
        mine = [role for index, role in roles if index == i]
        assert mine[0] == "assistant" and not any(mine[1:])
    finished = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [0, 1, 2]
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' must be in") as e:
        client.chat.completions.create(**ask, logprobs=True, top_logprobs=21)
    assert e.value.param == "top_logprobs" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="needs 'logprobs': true"):
        client.chat.completions.create(**ask, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be in"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=6)
    assert client.chat.completions.create(**ask, logprobs=False).choices[0].message.content == text
    scored = client.chat.completions.create(**ask, logprobs=True).choices[0]  # test_logprobs.py
    assert scored.message.content == text == "".join(c.token for c in scored.logprobs.content)


def post_many(url, requests):
    """(path, body) pairs posted at once: their replies."""

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post(p, json=b) for p, b in requests))

    return asyncio.run(go())


def test_sampled_choices_differ_and_keep_the_seed(server):
    body = {"prompt": "the cat", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 3}
    one, three, again, unseeded = post_many(server, [
        ("/v1/completions", body), ("/v1/completions", {**body, "n": 3}),
        ("/v1/completions", {**body, "n": 3}),
        ("/v1/completions", {**body, "n": 3, "seed": None})])  # fmt: skip
    texts = [c["text"] for c in three.json()["choices"]]
    assert len(set(texts)) == 3  # a seed per choice
    assert texts[0] == one.json()["choices"][0]["text"]  # choice 0 keeps the request's seed
    assert [c["text"] for c in again.json()["choices"]] == texts
    assert len({c["text"] for c in unseeded.json()["choices"]}) == 3


def test_completions_take_a_batch_of_prompts(server):
    """/v1/completions with a list of prompts (strings or token-id lists): n choices each, in
    prompt order (index = prompt x n + choice), each the text that prompt gets alone, usage
    over every prompt once; streamed, each index's text the same."""
    client = openai_client(server)
    prompts = ["the cat", "hello", [5, 6, 7]]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=5) for p in prompts]
    both = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in (0, 1)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=5,
                                           stream=True):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: a.choices[0].text for i, a in enumerate(alone)}
    # the last: 39 choices, past the server's 36
    bad = [{"prompt": []}, {"prompt": ["hi", 5]}, {"prompt": [[1, 2], []]}, {"prompt": [[-1]]},
           {"prompt": ["hi"] * 13, "n": 3}]  # fmt: skip
    for reply in post_many(server, [(TEXTS, {"max_tokens": 2, **b}) for b in bad]):
        refused(reply, "prompt", "prompt")


def refused(reply, param, *words):
    """A 400 in OpenAI's error shape naming `param` and saying each of `words`."""
    assert reply.status_code == 400, reply.text
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for word in words:
        assert word in err["message"], err


CHATS, TEXTS = "/v1/chat/completions", "/v1/completions"  # the two endpoints
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_n_and_max_completion_tokens(server):
    bad_n = [0, -1, 1.5, True, "2", 37]  # 37: past the server's 4 slots + 32 queued
    replies = post_many(server, [(CHATS, {**HI, "n": n}) for n in bad_n])
    for reply in replies:
        refused(reply, "n", "'n' must be")
    assert "in [1, 36]" in replies[-1].json()["error"]["message"]
    chat = {"messages": HI["messages"]}
    full, short, new, same, both, legacy = post_many(server, [
        (CHATS, {**chat, "max_tokens": 12}), (CHATS, {**chat, "max_tokens": 2}),
        (CHATS, {**chat, "max_completion_tokens": 2}),
        (CHATS, {**chat, "max_tokens": 2, "max_completion_tokens": 2}),
        (CHATS, {**chat, "max_tokens": 12, "max_completion_tokens": 2}),
        (TEXTS, {"prompt": "hi", "max_completion_tokens": 2})])  # fmt: skip
    assert full.json()["usage"]["completion_tokens"] > 2  # so the budget of 2 cuts it
    assert new.json()["usage"]["completion_tokens"] == 2
    assert new.json()["choices"] == short.json()["choices"] == same.json()["choices"]
    assert new.json()["choices"][0]["finish_reason"] == "length"
    refused(both, "max_completion_tokens", "'max_completion_tokens' (2) and 'max_tokens' (12)")
    refused(legacy, "max_completion_tokens", "unrecognized field")
    huge = httpx.post(server + CHATS, json={**chat, "max_tokens": 10**6}, timeout=60)
    refused(huge, "max_tokens", "'max_tokens' must be in [1, ")


def test_a_default_max_tokens_shrinks_to_the_room_a_prompt_leaves(server):
    """Without max_tokens a long prompt gets the room left in its slot (64 tokens here, the
    default 8); an explicit max_tokens past it, or a prompt that fills the slot, is a 400
    naming the field and the context."""
    long, asked, full = post_many(server, [
        (TEXTS, {"prompt": [7] * 60}), (TEXTS, {"prompt": [7] * 60, "max_tokens": 5}),
        (TEXTS, {"prompt": [7] * 64})])  # fmt: skip
    assert long.status_code == 200, long.text
    assert 1 <= long.json()["usage"]["completion_tokens"] <= 4
    refused(asked, "max_tokens", "the prompt (60 tokens) + max_tokens (5) exceed the context of "
                                 "64 tokens: ask for 4 or fewer")  # fmt: skip
    refused(full, "prompt", "the prompt (64 tokens) leaves no room for a reply")


def test_fields_kdj_does_not_honour_are_refused(server):
    refuse = [(CHATS, {"presence_penalty": 0.5}), (CHATS, {"frequency_penalty": -1}),
              (TEXTS, {"presence_penalty": 1}), (CHATS, {"logit_bias": {"5": 10}}),
              (CHATS, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
              (CHATS, {"tool_choice": "auto"}), (CHATS, {"functions": [{"name": "f"}]}),
              (CHATS, {"response_format": {"type": "json_object"}}), (TEXTS, {"best_of": 2}),
              (TEXTS, {"echo": True}), (TEXTS, {"suffix": "x"}),
              (CHATS, {"top_k": 5}), (TEXTS, {"messages": []}),
              (TEXTS, {"stream_options": {"include_usage": True}})]  # fmt: skip
    accept = [(CHATS, {"presence_penalty": 0, "frequency_penalty": None, "logprobs": False}),
              (CHATS, {"response_format": {"type": "text"}, "user": "ann", "tools": []}),
              (CHATS, {"stream": True, "stream_options": {"include_usage": True}}),
              (TEXTS, {"best_of": 1, "echo": False, "logprobs": None, "n": None})]  # fmt: skip
    base = {CHATS: HI, TEXTS: {"prompt": "hi", "max_tokens": 3}}
    replies = post_many(server, [(p, {**base[p], **extra}) for p, extra in refuse + accept])
    for reply, (_, extra) in zip(replies, refuse):
        (name,) = extra
        refused(reply, name, f"'{name}'")
    for reply in replies[len(refuse) :]:
        assert reply.status_code == 200, reply.text
    unknown, moved = post_many(server, [
        (CHATS, {**HI, "top_k": 5, "min_p": 0.1}),
        (CHATS, {**HI, "presence_penalty": 1, "logit_bias": {"5": 1}})])  # fmt: skip
    refused(unknown, "top_k", "'top_k', 'min_p'")  # every offending field, not the first
    assert "stream_options" in unknown.json()["error"]["message"]  # what kdj takes, all of it
    refused(moved, "presence_penalty", "'logit_bias'")


def test_messages_are_checked(server):
    def chat(*messages):
        return (CHATS, {"messages": list(messages), "max_tokens": 3})

    user = {"role": "user", "content": "hi"}
    bad = [chat({"role": "wizard", "content": "hi"}), chat({"role": "user", "content": 5}),
           chat("hi"), chat({"content": "hi"}), chat({**user, "name": "ann"}),
           chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
           (CHATS, {"max_tokens": 3})]  # fmt: skip
    good = [chat(user), chat({"role": "user", "content": [{"type": "text", "text": "h"},
                                                          {"type": "text", "text": "i"}]}),
            chat({"role": "system", "content": "be brief"}, user),
            chat({"role": "developer", "content": "be brief"}, user),
            chat({"role": "assistant", "content": "hello", "tool_calls": None}, user)]  # fmt: skip
    replies = post_many(server, bad + good)
    for reply, word in zip(replies, ["role", "content", "object", "role", "name", "text only",
                                     "non-empty list"]):  # fmt: skip
        refused(reply, "messages", word)
    text = [r.json()["choices"][0]["message"]["content"] for r in replies[len(bad) :]]
    assert text[0] == text[1] and text[2] == text[3]  # parts joined; developer as system


def test_every_error_in_openai_shape(server, monkeypatch):
    from kdj.serve import app

    def shape(reply, status, code):
        assert reply.status_code == status, reply.text
        assert set(reply.json()) == {"error"}
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
        return err

    assert "/nope" in shape(httpx.get(server + "/nope"), 404, "not_found")["message"]
    err = shape(httpx.get(server + "/v1/chat/completions"), 405, "method_not_allowed")
    assert err["type"] == "invalid_request_error" and "GET" in err["message"]
    shape(httpx.post(server + "/health"), 405, "method_not_allowed")
    refused(httpx.post(server + TEXTS, content=b"[1"), None, "malformed JSON")
    for bad in (b"NaN", b"Infinity", b"-Infinity"):  # Python reads them; JSON has no such number
        body = b'{"prompt": "hi", "max_tokens": 2, "temperature": %s}' % bad
        refused(httpx.post(server + TEXTS, content=body), None, "malformed JSON", "not a JSON")

    def broken(*args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "parse", broken)
    err = shape(httpx.post(server + TEXTS, json={"prompt": "hi"}), 500, None)
    assert err["type"] == "server_error" and "a bug" in err["message"]


def test_bench_workload_is_the_same_requests_at_every_sweep():
    from kdj.serve import bench

    per_level, lengths = bench.workload([1, 4, 16], (16, 512), requests=8, waves=2, seed=3)
    assert per_level == {1: 8, 4: 8, 16: 32} and len(lengths) == 32
    assert all(16 <= n <= 512 for n in lengths) and len(set(lengths)) > 1
    # a sweep of fewer levels (the engine's ceiling at one width) asks the same requests
    assert bench.workload([4], (16, 512), requests=8, waves=2, seed=3)[1] == lengths[:8]
    assert bench.workload([2], (7, 7), requests=1, waves=3) == ({2: 6}, [7] * 6)
