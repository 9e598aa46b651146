"""bench/roofline.py runs end to end on a tiny MoE config on CPU (through `kdj bench`) and
writes consistent JSON + markdown; no timing assertions."""

from __future__ import annotations

import json
import sys

import pytest

from kdj.cli import main

TINY_MOE = """
model_type: deepseek_v3
vocab_size: 128
hidden_size: 64
intermediate_size: 96
moe_intermediate_size: 32
num_hidden_layers: 2
num_attention_heads: 4
num_key_value_heads: 4
q_lora_rank: null
kv_lora_rank: 32
qk_nope_head_dim: 16
qk_rope_head_dim: 8
v_head_dim: 16
n_routed_experts: 16
n_shared_experts: 1
num_experts_per_tok: 2
first_k_dense_replace: 1
max_position_embeddings: 256
"""


def load_bench(name: str):
    """bench/<name>.py as a module, its directory on sys.path (its `from roofline import ...`,
    as when it runs)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_roofline_smoke(tmp_path):
    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE)
    out = tmp_path / "roofline.json"
    args = ["--models", str(cfg), "--experts", "bf16", "int4", "--batches", "1", "4",
            "--tokens", "1", "--moe-shapes", "1x4", "--context", "8", "--repeats", "1",
            "--matmul-size", "64", "--out", str(out),
            "--fit-cost", str(tmp_path / "cost.json")]  # fmt: skip
    assert main(["bench", *args]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["experts"], r["batch"]) for r in rows] == [
        ("bf16", 1), ("bf16", 4), ("int4", 1), ("int4", 4)
    ]  # fmt: skip
    for r in rows:
        b = r["bytes"]
        assert b["total"] == b["dense"] + b["experts_touched"] + b["kv"] > 0
        assert r["flops"] > 0 and r["step_ms"] > 0
        # one MoE layer: top-2 of 16 experts, so 1 token touches exactly 2, 4 tokens 2..8
        (touched,) = r["experts_touched_per_layer"]
        assert touched == 2 if r["batch"] == 1 else 2 <= touched <= 8
    bf16, int4 = rows[0], rows[2]  # same weights, same routing; INT4 experts hold fewer bytes
    assert bf16["experts_touched_per_layer"] == int4["experts_touched_per_layer"]
    assert int4["bytes"]["experts_touched"] < bf16["bytes"]["experts_touched"] / 3
    assert len(result["moe_rows"]) == 2
    assert "| % of 4.3 TB/s |" in out.with_suffix(".md").read_text()
    # a step-cost model per expert format, loadable by generate(method="auto", cost=...)
    from kdj.cost import StepCost

    for fmt in ("bf16", "int4"):
        cost = StepCost.load(tmp_path / f"cost_tiny-moe_{fmt}.json")
        assert cost.moe_layers == 1 and cost.num_experts == 16
        assert min(cost.fixed_s, cost.per_byte_s, cost.per_flop_s) >= 0
    # exact at every measured step; --fit-from refits the same cost from the saved rows alone
    for r in rows:
        cost = StepCost.load(tmp_path / f"cost_tiny-moe_{r['experts']}.json")
        assert cost.measured_at(r["batch"], 1)
        assert float(cost.seconds(r["batch"], 1, 8)) == pytest.approx(r["step_ms"] / 1e3)
    refit = ["--models", str(cfg), "--experts", "int4", "--fit-from", str(out),
             "--fit-cost", str(tmp_path / "refit.json")]  # fmt: skip
    assert main(["bench", *refit]) == 0
    assert StepCost.load(tmp_path / "refit.json") == StepCost.load(
        tmp_path / "cost_tiny-moe_int4.json"
    )


def test_expert_gather_smoke(tmp_path):
    """bench/expert_gather.py: every variant and a kernel tile setting run in bf16 and INT4
    and count the bytes of the touched experts as stored. On the CPU the "kernel" variant
    runs XLA's gather (rows say so); the tile rows and "grouped" run Pallas interpreted.
    (FP8's 128 x 128 blocks do not fit this tiny shape; tests/test_moe.py covers its kernel.)"""

    cfg = tmp_path / "tiny-moe.yaml"  # widths of 128: the grouped kernel's smallest INT4 K tile
    cfg.write_text(TINY_MOE.replace("hidden_size: 64", "hidden_size: 128").replace(
        "moe_intermediate_size: 32", "moe_intermediate_size: 128"))  # fmt: skip
    bench = load_bench("expert_gather")
    out = tmp_path / "eg.json"
    args = ["--model", str(cfg), "--assignments", "4", "--formats", "float", "int4",
            "--tiles", "8,32,4,2", "8,32,4,2,2", "--grouped-tiles", "32,128,32,4,2",
            "32,128,32,4,2,1", "--iters", "1", "--out", str(out)]  # fmt: skip
    rows = bench.main(args)
    assert json.loads(out.read_text())["rows"] == rows
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert not any(r["gemv_kernel"] for r in rows)  # no GPU here
    by = {(r["format"], r["variant"]): r for r in rows}
    assert set(v for _, v in by) == {"kernel", "xla", "ragged", "grouped", "grouped-fused",
                                     "gemv_gate_up[8,32,4,2]", "gemv_gate_up[8,32,4,2,2]",
                                     "grouped_gate_up[32,128,32,4,2]",
                                     "grouped_gate_up[32,128,32,4,2,1]"}  # fmt: skip
    assert by["int4", "kernel"]["bytes"] < by["float", "kernel"]["bytes"] / 3
    # every layer variant computes what ragged_dot does (bf16 rounding apart)
    assert all(r["rel_err"] < 0.02 for r in rows if "[" not in r["variant"]), rows


def test_dense_gemv_smoke(tmp_path):
    """bench/dense_gemv.py: every dense matrix of a tiny MoE's decode step, XLA's dot and the
    GEMV (interpreted here) with the split rule's and an extra K split, agree."""

    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE.replace("hidden_size: 64", "hidden_size: 512"))
    bench = load_bench("dense_gemv")
    out = tmp_path / "dg.json"
    rows = bench.main(["--model", str(cfg), "--splits", "2", "--iters", "1", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    assert {r["matrix"] for r in rows} == {
        "q_proj",
        "kv_a",
        "o",
        "shared_gate_up",
        "shared_down",
        "mlp_gate_up",
        "mlp_down",
        "lm_head",
    }
    assert all("error" not in r and r["us"] > 0 and r["rel_err"] < 0.02 for r in rows), rows
    assert {r["variant"] for r in rows if r["matrix"] == "mlp_down"} == {"xla", "gemv", "gemv/2"}


def test_int4_gemv_parts_smoke(tmp_path):
    """bench/int4_gemv_parts.py on a tiny MoE (interpreted): the kernel and the group-3d form
    give the reference's numbers; the diagnostics (work taken out) run and are marked
    inexact, and really are (a test that they measure less work, not the same)."""

    cfg = tmp_path / "tiny-moe.yaml"  # K = 256 inputs: 32 words, 8 scale groups of 4 words
    cfg.write_text(TINY_MOE.replace("hidden_size: 64", "hidden_size: 256"))
    bench = load_bench("int4_gemv_parts")
    out = tmp_path / "parts.json"
    rows = bench.main(["--model", str(cfg), "--assignments", "3", "--tiles", "16,32,4",
                       "--iters", "1", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == rows
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"kernel", "no-scale", "one-plane", "fp-only", "prefetch", "group-3d"}
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert all(by[v]["rel_err"] < 1e-5 for v in ("kernel", "prefetch", "group-3d"))
    assert by["one-plane"]["rel_err"] > 0.1 and by["no-scale"]["rel_err"] > 0.1
    assert by["fp-only"]["rel_err"] is None or by["fp-only"]["rel_err"] > 0.1  # raw words
    assert [r["exact"] for r in rows] == [True, False, False, False, True, True]


def test_tokamax_ragged_smoke(tmp_path):
    """bench/tokamax_ragged.py on a tiny MoE: XLA's ragged_dot and the grouped kernel
    (interpreted) agree; tokamax, never a kdj dependency, is a row saying why it did not run
    when it is not installed."""
    import importlib.util

    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE.replace("hidden_size: 64", "hidden_size: 128"))
    bench = load_bench("tokamax_ragged")
    out = tmp_path / "tk.json"
    rows = bench.main(["--model", str(cfg), "--assignments", "8", "--iters", "1",
                       "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == rows
    assert {(r["matrix"], r["variant"]) for r in rows} == {
        (m, v) for m in ("gate_up", "down") for v in ("lax", "tokamax", "grouped")
    }
    for r in rows:
        if r["variant"] == "tokamax" and importlib.util.find_spec("tokamax") is None:
            assert "No module named 'tokamax'" in r["error"]
        else:
            assert "error" not in r and r["rel_err"] < 0.02, r
