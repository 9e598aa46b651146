"""Serving: the slot-pool engine (kdj/decode/engine.py) against kdj.generate, and the HTTP
server (kdj/serve) on loopback. A tiny random Qwen3-format model in float32."""

from __future__ import annotations

import numpy as np
import pytest

import kdj
from kdj.decode.engine import Engine, Request
from tests.hf_models import build


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
            assert u.id != b or u.finished
            if u.id in got:
                got[u.id] += u.tokens
            if u.finished:
                finished.append(u.id)
    assert got[a] == ref[: ref.index(stop_at) + 1]
    assert len(got[c]) == 11 and sorted(finished) == [a, c] and not engine.busy
    for bad, why in [(Request([], 4, []), "empty"), (Request([1], 0, []), "max_tokens"),
                     (Request([1] * 60, 8, []), "context"),
                     (Request([1], 4, [], top_p=0.0), "top_p")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            engine.submit(bad)


def test_max_batch_must_be_positive(target):
    with pytest.raises(ValueError, match="max_batch"):
        kdj.generate(target, [[1, 2], [3, 4]], method="ar", max_batch=0)
