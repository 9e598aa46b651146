"""The replay drafter (benchmarks only, kdj/replay.py): greedy decoding with it equals plain
decoding token for token (chain and tree, ragged static batches and the slot pool, prompts it
never recorded included); its acceptance falls as its corruption rises and calibration finds
a rate for a requested tau; bad input says what is wrong; bench/replay_table.py runs on a
tiny MoE shape."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kdj
from kdj import replay
from kdj.config import ModelConfig
from kdj.models.replay import ReplayDrafter
from kdj.models.transformer import build_model
from tests.test_bench import TINY_MOE, load_bench

VOCAB, BLOCK, NEW = 64, 6, 24
SPECS = [{"method": "dflash"}, {"method": "ddtree", "tree_budget": 8}]


@pytest.fixture(scope="module")
def target():
    cfg = ModelConfig(family="llama", model_type="llama", vocab_size=VOCAB, hidden_size=32,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=256)  # fmt: skip
    return kdj.Target.from_model(build_model(cfg, jnp.float32, seed=0), name="tiny")


@pytest.fixture(scope="module")
def rec(target):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 9, 2)]
    return replay.record(target, prompts, NEW)


def same_as_ar(target, prompts, out):
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=NEW, stop_tokens=[])
    return out.tokens == ar.tokens


@pytest.mark.parametrize("spec", SPECS, ids=["dflash", "ddtree8"])
def test_greedy_equals_ar_in_a_ragged_static_batch(target, rec, spec):
    drafter = replay.replay_drafter(target, rec, 0.3, block_size=BLOCK)
    out = kdj.generate(target, rec.prompts, drafter=drafter, max_new_tokens=NEW, stop_tokens=[],
                       **spec)  # fmt: skip
    assert out.tokens == rec.continuations  # the recording is plain greedy decoding
    assert same_as_ar(target, rec.prompts, out)
    assert max(max(t) for t in out.stats["acceptance_lengths"]) > 1


@pytest.mark.parametrize("spec", SPECS, ids=["dflash", "ddtree8"])
def test_greedy_equals_ar_through_the_pool(target, rec, spec):
    """Two slots refilled with new requests, one prompt never recorded."""
    drafter = replay.replay_drafter(target, rec, 0.2, block_size=BLOCK)
    prompts = [*rec.prompts, [3, 1, 4, 1, 5, 9, 2, 6]]
    out = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=NEW, stop_tokens=[],
                       max_batch=2, **spec)  # fmt: skip
    assert out.tokens[:4] == rec.continuations
    assert same_as_ar(target, prompts, out)
    assert out.stats["mean_acceptance"] > 1.5


def test_tau_falls_as_corruption_rises_and_calibration_finds_a_rate(target, rec):
    drafter = replay.replay_drafter(target, rec, 0.0, block_size=BLOCK)
    taus = [replay.measure_tau(target, replay.with_corruption(drafter, c), rec)
            for c in (0.0, 0.3, 1.0)]  # fmt: skip
    assert taus[0] > 0.8 * BLOCK  # every context recorded: only the budget's end cuts a block
    assert taus[0] > taus[1] > taus[2]
    assert taus[2] == pytest.approx(1.0, abs=0.05)
    cal = replay.calibrate(target, rec, 3.0, block_size=BLOCK, prompts=None)
    assert 0 < cal.corrupt < 1 and cal.tau == pytest.approx(3.0, abs=0.3)
    assert cal.drafter.prior_acceptance == cal.tau and "benchmarks only" in cal.drafter.name
    with pytest.raises(ValueError, match="out of reach"):
        replay.calibrate(target, rec, BLOCK + 2.0, block_size=BLOCK)


def test_bad_input_says_what_is_wrong(target, rec):
    for rate in (-0.1, 1.5, True, "0.3", float("nan")):
        with pytest.raises(ValueError, match="corrupt must be a probability"):
            replay.replay_drafter(target, rec, rate)
    with pytest.raises(ValueError, match="recording is empty"):
        replay.replay_drafter(target, replay.Recording([], [], VOCAB), 0.1)
    with pytest.raises(ValueError, match="no continuation of 2 tokens"):
        replay.replay_drafter(target, replay.Recording([[1]], [[2]], VOCAB), 0.1)
    other = replay.Recording(rec.prompts, rec.continuations, VOCAB + 1)
    with pytest.raises(ValueError, match=r"vocabulary \(65\) does not match the target's \(64\)"):
        replay.replay_drafter(target, other, 0.1)
    with pytest.raises(ValueError, match="block_size"):
        replay.replay_drafter(target, rec, 0.1, block_size=1)
    with pytest.raises(ValueError, match="at least one prompt"):
        replay.record(target, [], NEW)


def test_the_replay_takes_in_no_features(target, rec):
    drafter = replay.replay_drafter(target, rec, 0.1, block_size=BLOCK).model
    assert isinstance(drafter, ReplayDrafter)
    cache = object()
    assert drafter.add_context(jnp.ones((1, 2, 32)), jnp.zeros((1,), jnp.int32), cache) is cache


def test_bench_replay_table_runs_on_a_tiny_moe(tmp_path):
    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE)
    out = tmp_path / "table.json"
    argv = ["--model", str(cfg), "--dtype", "float32", "--taus", "3", "--clients", "2",
            "--methods", "ar", "dflash", "--prompt-len", "8", "--max-new", "16",
            "--block-size", "5", "--calibrate-prompts", "4", "--out", str(out)]  # fmt: skip
    load_bench("replay_table").main(argv)
    result = json.loads(out.read_text())
    assert result["meta"]["drafter"] == "replay (benchmarks only)"
    assert [c["tau_requested"] for c in result["calibration"]] == [3.0]
    rows = result["rows"]
    assert [r["method"] for r in rows] == ["ar", "dflash"]
    assert all(r["clients"] == 2 and r["requests"] == 4 and r["tokens"] == 64 for r in rows)
    assert rows[0]["tau"] == 1.0 and rows[1]["tau"] > 1.5
    assert result["meta"]["weights"].startswith("random, steady")
    assert all(r["same_as_recording"] == 1.0 for r in rows)
    # a known rate runs as given, with no calibration: the row says the tau it reached
    given = tmp_path / "given.json"
    load_bench("replay_table").main([*argv[:4], "--corrupt", "0.0", *argv[6:-1], str(given)])
    again = json.loads(given.read_text())
    assert again["calibration"] == [] and again["rows"][1]["corrupt"] == 0.0
    assert again["rows"][1]["tau"] >= rows[1]["tau"]  # uncorrupted: at least the calibrated
    with pytest.raises(SystemExit, match=r"--corrupt 1.5: a rate must be in \[0, 1\]"):
        load_bench("replay_table").main(["--corrupt", "1.5", "--out", str(tmp_path / "x")])


def test_a_steady_random_target_decodes_one_chain_in_bf16(tmp_path):
    """bench/harness.py steady_greedy: a random bf16 MoE whose greedy answer after token t
    is perm[t], by a margin no numerics flip: the same through a pool of 3 and a static
    batch (what lets the replay table's recordings replay on a GPU)."""
    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE)
    harness = load_bench("harness")
    model = build_model(harness.model_config(str(cfg)), jnp.bfloat16, seed=0)
    harness.steady_greedy(model, seed=0)
    target = kdj.Target.from_model(model, name="tiny")
    rng = np.random.default_rng(0)
    V = target.cfg.vocab_size
    prompts = [rng.integers(0, V, int(rng.integers(4, 12))).tolist() for _ in range(7)]
    pooled = kdj.generate(target, prompts, method="ar", max_new_tokens=24, stop_tokens=[],
                          max_batch=3).tokens  # fmt: skip
    static = kdj.generate(target, prompts, method="ar", max_new_tokens=24, stop_tokens=[]).tokens
    assert pooled == static
    perm = np.random.default_rng(0).permutation(V)
    for p, seq in zip(prompts, pooled):
        chain = [p[-1], *seq]
        assert all(perm[a] == b for a, b in zip(chain, chain[1:]))
