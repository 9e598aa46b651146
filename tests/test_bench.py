"""bench/ on CPU: every suite's scripts run end to end on tiny configs and write consistent,
stamped JSON; the suites name only scripts and arguments that exist. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kdj.cli import main

BENCH = Path(__file__).resolve().parent.parent / "bench"

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

TINY_LLAMA = """
model_type: llama
vocab_size: 128
hidden_size: 32
intermediate_size: 64
num_hidden_layers: 2
num_attention_heads: 4
num_key_value_heads: 2
head_dim: 8
max_position_embeddings: 256
"""


def load_bench(name: str):
    """bench/<name>.py as a module, bench/ on sys.path (its `import harness`, as when run)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny(tmp_path):
    """{"moe": path, "llama": path} of the tiny configs."""
    paths = {"moe": tmp_path / "tiny-moe.yaml", "llama": tmp_path / "tiny.yaml"}
    paths["moe"].write_text(TINY_MOE)
    paths["llama"].write_text(TINY_LLAMA)
    return paths


def assert_stamped(result: dict, argv: list[str]):
    meta = result["meta"]
    assert meta["git_sha"] and meta["git_sha"] != "unknown"  # the tests run in a checkout
    assert meta["jax"] and meta["device"] and meta["devices"] >= 1
    assert meta["argv"][1:] == argv


# ------------------------------------------------------------------------------ the suites
def test_every_suite_step_parses():
    """Each suite step names a bench script (or a kdj subcommand) whose parser takes its
    arguments, and writes under the suite's --out."""
    run = load_bench("run")
    assert run.main([]) == 0
    for name, suite in run.SUITES.items():
        assert suite.description and suite.steps, name
        for step in suite.steps:
            argv = [a.format(out="/o", prompts="p.json") for a in step.argv]
            assert any(a.startswith("/o") for a in argv), (name, step.name)
            if argv[0] == "kdj":
                continue  # kdj's own CLI, tested with it
            script = load_bench(Path(argv[0]).stem)
            script.parser().parse_args(argv[1:])


def test_run_dry_run_prints_without_running(tmp_path, capsys):
    run = load_bench("run")
    assert run.main(["decode", "--out", str(tmp_path / "o"), "--dry-run"]) == 0
    assert "decode.py --models" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ harness
def test_write_result_stamps_where_it_was_measured(tmp_path):
    harness = load_bench("harness")
    out = tmp_path / "sub" / "r.json"
    back = harness.write_result(out, {"meta": {"model": "m"}, "rows": [1]}, ["--x", "1"])
    assert json.loads(out.read_text()) == back
    assert back["rows"] == [1] and back["meta"]["model"] == "m"
    assert_stamped(back, ["--x", "1"])


def test_drafter_config_published_shape_and_tiny_targets(tiny):
    harness = load_bench("harness")
    qwen = harness.model_config("qwen3-8b")
    d = harness.drafter_config(qwen, "qwen3-8b")
    assert (d.layers.num_layers, d.layers.num_heads, d.layers.intermediate_size) == (5, 32, 12288)
    assert d.target_layer_ids == (1, 9, 17, 25, 33)  # the published taps
    small = harness.model_config(str(tiny["llama"]))
    d = harness.drafter_config(small, str(tiny["llama"]), num_layers=1, block_size=4)
    assert d.layers.hidden_size == small.hidden_size and d.block_size == 4
    with pytest.raises(FileNotFoundError, match="configs/models has"):
        harness.model_config("no-such-model")
    with pytest.raises(ValueError, match="unknown kernel case"):
        harness.with_kernels(None, "no-such-case")


# ------------------------------------------------------------------------------ moe-steps
def test_roofline_smoke(tmp_path, tiny, capsys):
    cfg = tiny["moe"]
    out = tmp_path / "roofline.json"
    args = ["--models", str(cfg), "--experts", "bf16", "int4", "--batches", "1", "2", "4",
            "--tokens", "1", "--moe-shapes", "1x4", "--context", "8", "--repeats", "1",
            "--matmul-size", "64", "--out", str(out),
            "--fit-cost", str(tmp_path / "cost.json")]  # fmt: skip
    assert main(["bench", *args]) == 0
    assert "kdj bench: a GPU benchmark running on the CPU" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert_stamped(result, args)
    rows = result["rows"]
    assert [(r["experts"], r["batch"]) for r in rows] == [
        ("bf16", 1), ("bf16", 2), ("bf16", 4), ("int4", 1), ("int4", 2), ("int4", 4)
    ]  # fmt: skip
    for r in rows:
        b = r["bytes"]
        assert b["total"] == b["dense"] + b["experts_touched"] + b["kv"] > 0
        assert r["flops"] > 0 and r["step_ms"] > 0
        # one MoE layer: top-2 of 16 experts, so 1 token touches exactly 2, 4 tokens 2..8
        (touched,) = r["experts_touched_per_layer"]
        assert touched == 2 if r["batch"] == 1 else 2 <= touched <= 8
    bf16, int4 = rows[0], rows[3]  # same weights, same routing; INT4 experts hold fewer bytes
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


def test_bench_writes_no_file_of_the_users(tmp_path, capsys):
    """kdj bench's --out never lands on its own --fit-cost or --fit-from, and the .md / .png
    it writes beside --out replace only an earlier run's (found before any model runs)."""
    out, notes = tmp_path / "res.json", tmp_path / "res.md"
    notes.write_text("my notes")
    cases = [(["--out", str(out)], "res.md exists"),
             (["--out", str(out), "--fit-cost", str(out)], "--out .* is the --fit-cost file"),
             (["--fit-from", str(out), "--fit-cost", str(out), "--experts", "bf16"],
              "--fit-cost .* is the --fit-from file")]  # fmt: skip
    for argv, msg in cases:
        with pytest.raises(SystemExit):
            main(["bench", "--models", "smollm2-135m-instruct", *argv])
        assert re.search(msg, capsys.readouterr().err)
    assert notes.read_text() == "my notes"
    # three rates need three steps: refused before any model runs, not fitted to zeros
    with pytest.raises(SystemExit):
        main(["bench", "--models", "smollm2-135m-instruct", "--batches", "1", "4", "--tokens",
              "1", "--fit-cost", str(tmp_path / "cost.json")])  # fmt: skip
    assert "needs 3 or more distinct (batch, tokens) steps" in capsys.readouterr().err


def test_bench_refits_the_real_targets_rows(tmp_path):
    """--fit-from with the name --models measures under (the real SmolLM2, which has no
    configs/models YAML): its rows refit to a cost exact at each measured step."""
    from kdj.cost import StepCost

    rows = [{"model": "smollm2-135m-instruct", "experts": "bf16", "batch": b,
             "tokens_per_seq": t, "context": 64, "step_ms": ms}
            for b, t, ms in [(1, 1, 1.0), (8, 1, 1.1), (1, 16, 1.3), (64, 16, 3.0)]]  # fmt: skip
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"rows": rows}))
    cost = tmp_path / "cost.json"
    main(["bench", "--models", "smollm2-135m-instruct", "--experts", "bf16", "--fit-from",
          str(saved), "--fit-cost", str(cost)])  # fmt: skip
    fitted = StepCost.load(cost)
    assert float(fitted.seconds(64, 16, 64)) == pytest.approx(3.0e-3)


# ------------------------------------------------------------------------------ moe-kernels
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
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["meta"]["E"] == 16
    assert_stamped(saved, args)
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert all(r["backend"] == "cpu" for r in rows)  # XLA's gather for "kernel" here
    by = {(r["format"], r["variant"]): r for r in rows}
    assert set(v for _, v in by) == {"kernel", "ragged", "grouped",
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


def test_pool_step_smoke(tmp_path, tiny):
    """bench/pool_step.py: the pool's step per method on a tiny dense model; auto's row says
    which of its entries its steps ran."""
    bench = load_bench("pool_step")
    argv = ["--model", str(tiny["llama"]), "--dtype", "float32", "--width", "2", "--slots", "64",
            "--prompt", "4", "--new", "6", "--block", "4", "--repeats", "1", "--methods", "ar",
            "ddtree3", "auto:chain2,tree3", "--out", str(tmp_path / "p.json")]  # fmt: skip
    res = bench.main(argv)
    assert_stamped(res, argv)
    rows = res["rows"]
    assert set(rows) == {"ar", "ddtree3", "auto:chain2,tree3"}
    assert all(r["ms_per_step"] > 0 and r["steps"] >= 1 for r in rows.values())
    assert rows["auto:chain2,tree3"]["menu"] == ["chain2", "tree3"]
    assert set(rows["auto:chain2,tree3"]["choices"]) <= {"chain2", "tree3"}
    assert sum(rows["ddtree3"]["choices"].values()) > 0
    with pytest.raises(SystemExit, match="'tree3' is not ar, dflash, ddtreeN"):
        bench.main([*argv[:-6], "--methods", "tree3"])
    # several chunk lengths: a row each, and the chunk's own cost fitted apart from its steps'
    res = bench.main([*argv[:-6], "--methods", "ar", "--chunk-steps", "1", "3", "--lookahead",
                      "1", "--out", str(tmp_path / "c.json")])  # fmt: skip
    assert set(res["rows"]) == {"ar@1", "ar@3"}
    assert res["rows"]["ar@1"]["chunks"] > res["rows"]["ar@3"]["chunks"]
    assert set(res["chunk_cost"]["ar"]) == {"chunk_ms", "step_ms"}


def test_fixed_tiles_smoke(tmp_path, tiny):
    """bench/fixed_tiles.py: a tiny dense model's fused QKV, o, gate/up, down and head, the
    default path and two tile sets (interpreted here), each tile set's bits the same at every
    row count, and a decode step's sum per variant and row count."""
    bench = load_bench("fixed_tiles")
    out = tmp_path / "ft.json"
    res = bench.main(["--model", str(tiny["llama"]), "--rows", "1", "5", "--tiles", "16,16,16,4",
                      "16,32,32,4", "--iters", "1", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["rows"] == res["rows"]
    rows = res["rows"]
    assert {r["matrix"] for r in rows} == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert {(r["K"], r["F"]) for r in rows if r["matrix"] == "qkv"} == {(32, 64)}
    assert all(r["bits_differ"] == 0.0 for r in rows if r["variant"] != "default")
    assert set(res["step_us"]) == {"default", "tiles 16,16,16,4", "tiles 16,32,32,4"}


def test_tokamax_ragged_smoke(tmp_path):
    """bench/tokamax_ragged.py on a tiny MoE: XLA's ragged_dot and the grouped kernel
    (interpreted) agree; tokamax, never a kdj dependency, is a row saying why it did not run
    when it is not installed."""
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


# ------------------------------------------------------------------------------ decode, pair
def test_decode_smoke(tmp_path, tiny):
    """bench/decode.py: AR and DDTree through kdj.generate on random prompts, the DDTree step
    against AR's, and the AR step's bytes."""
    bench = load_bench("decode")
    out = tmp_path / "decode.json"
    args = ["--models", str(tiny["llama"]), "--batches", "2", "--methods", "ar", "ddtree4",
            "--prompt-len", "5", "--new", "6", "--repeats", "1", "--copy-gib",
            "0.001", "--drafter-layers", "1", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    result = bench.main(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert_stamped(result, args)
    rows = result["rows"]
    assert [r["method"] for r in rows] == ["ar", "ddtree4"]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["steps"] > 0 for r in rows)
    assert rows[0]["step_vs_ar"] == 1.0 and rows[0]["tau"] == 1.0
    b = rows[0]["bytes_per_step"]
    assert b["total"] == b["dense"] + b["experts"] + b["kv"] > 0 and b["experts"] == 0


def test_adaptive_sweep_is_lossless_in_float32(tiny):
    """bench/adaptive.py's sweep on a tiny random pair in float32: DDTree gives AR's greedy
    tokens for every sequence; the row is summarised."""
    harness, bench = load_bench("harness"), load_bench("adaptive")
    tgt = harness.random_target(str(tiny["llama"]), dtype="float32")
    dcfg = harness.drafter_config(tgt.cfg, "", num_layers=1, block_size=4)
    drafter = harness.random_drafter(dcfg, "float32")
    prompts = harness.random_prompts(tgt.cfg.vocab_size, 3, 6)
    (row,) = bench.sweep(tgt, drafter, prompts, [2], ["ar", "ddtree4"], new=6, repeats=1,
                         cost=None)  # fmt: skip
    assert row["batch"] == 2 and set(row["methods"]) == {"ar", "ddtree4"}
    assert all(m["identical_to_ar"] == 1.0 for m in row["methods"].values()), row
    assert row["methods"]["ddtree4"]["tau"] >= 1.0 and row["best_fixed"] in row["methods"]


# ------------------------------------------------------------------------------ profile
def test_profile_step_cpu(tmp_path, tiny):
    """bench/profile_step.py: a tiny Llama traced through kdj.generate (the decode loop's
    kernels only), a speculative method, and the one-step forward; the trace parsed into
    per-kernel times."""
    bench = load_bench("profile_step")
    cfg = tiny["llama"]
    cases = [f"{cfg}:2:ar", f"{cfg}:1:step", f"{cfg}:2:ddtree4", f"{cfg}:2:ar:default"]
    out = tmp_path / "profile.json"
    args = ["--cases", *cases, "--context", "8", "--steps", "3", "--dtype", "float32",
            "--out", str(out), "--trace-dir", str(tmp_path / "traces")]  # fmt: skip
    bench.main(args)
    result = json.loads(out.read_text())
    assert_stamped(result, args)
    assert [c["case"] for c in result["cases"]] == cases
    for case in result["cases"]:
        assert "error" not in case, case.get("error")
        assert list(Path(case["trace_dir"]).rglob("perfetto_trace.json.gz"))
        kernels = case["kernels"]
        assert kernels and all(k["total_us"] > 0 and k["count"] > 0 for k in kernels)
        assert case["kernels_per_step"] >= 10  # 2 layers of attention + MLP, at least
        assert 0 < case["busy_ms_per_step"] <= case["kernel_ms_per_step"] + 1e-9
        assert case["wall_ms_per_step"] > 0 and case["compile_s"] > 0
        cats = case["categories"]
        assert sum(c["count"] for c in cats.values()) == sum(k["count"] for k in kernels)
        assert sum(c["total_us"] for c in cats.values()) == pytest.approx(
            case["kernel_ms_per_step"] * 1e3 * case["steps"]
        )
        assert "gemm/matmul" in cats  # XLA:CPU names its dot thunks too
        assert not any(k["name"].startswith("while") for k in kernels)  # the loop's body counts
        assert case["host_python_top_us"]
    by = {c["case"]: c for c in result["cases"]}
    # the decode loop's module alone: AR's prefill kernels are not counted in its steps
    ar = by[f"{cfg}:2:ar"]
    assert ar["steps"] == 3 and ar["kernel_case"] == "default"
    assert by[f"{cfg}:2:ar:default"]["kernels_per_step"] == ar["kernels_per_step"]


def test_profile_step_tree_variants_trace_their_own_build(tmp_path, tiny, monkeypatch):
    """A "ddtree<budget>-allpairs" case traces the decode loop with the bench's unpruned beam
    build, "-laxtop" with a one-round vocabulary top-K, "-pruned" with the top-K pruned by
    chunk maxima, a plain "ddtree<budget>" case with kdj's own, also after a variant ran."""
    from kdj.decode import tree as trees

    bench = load_bench("profile_step")
    traced = {"kdj": 0, "allpairs": 0, "kdjtop": 0, "pruned": 0}

    def counted(name, build):
        def counting(*args, **kw):
            traced[name] += 1
            return build(*args, **kw)

        return counting

    monkeypatch.setattr(trees, "_beams", counted("kdj", trees._beams))
    monkeypatch.setattr(bench, "all_pairs_beams", counted("allpairs", bench.all_pairs_beams))
    monkeypatch.setattr(trees, "top_k", counted("kdjtop", trees.top_k))
    monkeypatch.setattr(trees, "top_k_pruned", counted("pruned", trees.top_k_pruned))
    cfg = tiny["llama"]
    cases = [("ddtree4-allpairs", {"allpairs", "kdjtop"}), ("ddtree4", {"kdj", "kdjtop"}),
             ("ddtree4-laxtop", {"kdj"}), ("ddtree4-pruned", {"kdj", "pruned"})]  # fmt: skip
    for case, by in cases:
        before = dict(traced)
        out = bench.main(["--cases", f"{cfg}:2:{case}", "--context", "8", "--steps", "2",
                          "--dtype", "float32", "--trace-dir", str(tmp_path / case)])  # fmt: skip
        assert "error" not in out["cases"][0], out["cases"][0].get("error")
        assert out["cases"][0]["method"] == case
        assert {k for k in traced if traced[k] > before[k]} == by, case


def test_profile_step_moe_layer_and_bad_cases(tmp_path, tiny):
    """A tiny DeepSeek-V3 shape: the MoE layer alone (moe-T) traces and summarises; a case
    with an unknown method or kernel case is a row saying so, and the run goes on."""
    bench = load_bench("profile_step")
    cfg = tiny["moe"]
    cases = [f"{cfg}:4:moe-3", f"{cfg}:1:moe", f"{cfg}:1:ar:no-such-case"]
    out = bench.main(["--cases", *cases, "--context", "8", "--steps", "2", "--dtype",
                      "float32", "--trace-dir", str(tmp_path / "traces")])  # fmt: skip
    moe, bad_method, bad_kernels = out["cases"]
    assert "error" not in moe and moe["kernels"] and moe["busy_ms_per_step"] > 0
    assert moe["method"] == "moe-3"
    assert "moe-T" in bad_method["error"]
    assert "no-such-case" in bad_kernels["error"]


def test_kernel_cases_are_policies(tiny):
    """Every kernel case is a target whose KernelPolicy has the case's fields (no module
    patched); the target itself keeps its policy."""
    pytest.importorskip("kdj.kernels")  # the policy of issue 22's kernel item
    harness = load_bench("harness")
    tgt = harness.random_target(str(tiny["moe"]), dtype="float32")
    before = tgt.cfg.kernels
    for case, fields in harness.KERNEL_CASES.items():
        policy = harness.with_kernels(tgt, case).cfg.kernels
        assert all(getattr(policy, k) == v for k, v in fields.items()), case
    assert tgt.cfg.kernels == before


def test_device_events_gpu_trace():
    bench = load_bench("profile_step")
    gpu, host = "/device:GPU:0", "/host:CPU"
    loop = {"hlo_module": "jit_decode_loop"}
    events = [
        (gpu, "Stream #7(Compute)", "nvjet_hsh_64x8_gemm", 0.0, 5.0, {"hlo_op": "dot.1", **loop}),
        (gpu, "Stream #7(Compute)", "loop_fusion_3", 6.0, 2.0, loop),
        (gpu, "Stream #7(MemcpyD2H)", "MemcpyD2H", 9.0, 1.0, {}),
        (gpu, "Stream #7", "loop_fusion_3", 6.0, 2.0, loop),  # the same kernel on a second line
        (gpu, "XLA Ops", "dot.1", 0.0, 5.0, {}),  # derived from the kernels: not counted
        (gpu, "Stream #7(Compute)", "prefill_gemm", 12.0, 3.0, {"hlo_module": "jit_prefill"}),
        (host, "python", "$api.py:1 f", 0.0, 20.0, {}),
        (host, "tf_XLAPjRtCpuClient/1", "fusion.9", 0.0, 1.0, {"hlo_op": "fusion.9"}),
    ]
    kernels = bench.device_events(events)
    assert [k[0] for k in kernels] == [
        "nvjet_hsh_64x8_gemm", "loop_fusion_3", "MemcpyD2H", "prefill_gemm"
    ]  # fmt: skip
    summary = bench.summarise(events, traced_s=20e-6, steps=2, module="decode")
    assert summary["kernels_per_step"] == 1.0  # the copy and the prefill's GEMM left out
    assert summary["busy_ms_per_step"] == pytest.approx(3.5e-3)
    assert set(summary["categories"]) == {"gemm/matmul", "fusion/other"}
    assert summary["kernels"][0]["hlo_op"] == "dot.1"
    everything = bench.summarise(events, traced_s=20e-6, steps=2)
    assert everything["kernels_per_step"] == 2.0
    assert bench.category("input_scatter_fusion") == "gather/scatter/dus"
    assert bench.category("ragged_dot_fusion") == "ragged_dot/grouped"
    assert bench.category("void splitKreduce_kernel<32, 16>") == "gemm/matmul"
    assert bench.category("loop_convert_fusion") == "fusion/other"


# ------------------------------------------------------------------------------ attention
def test_tree_attention_smoke(tmp_path, monkeypatch):
    """bench/tree_attention.py on a tiny GQA shape (the kernel interpreted): the kernel agrees
    with the XLA reference and every row is timed (tests/test_tree_attention.py covers MLA)."""
    bench = load_bench("tree_attention")
    monkeypatch.setitem(bench.SHAPES, "tiny-gqa", (4, 2, 16, 16, False))
    out = tmp_path / "ta.json"
    result = bench.main(["--shapes", "tiny-gqa", "--contexts", "40", "--budgets",
                         "0", "3", "--iters", "1", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert [(r["shape"], r["budget"]) for r in rows] == [
        ("tiny-gqa", 0), ("tiny-gqa", 3)
    ]  # fmt: skip
    for r in rows:
        assert r["max_abs_err"] < 1e-2 and r["kernel_us"] > 0 and r["ref_us"] > 0


# ------------------------------------------------------------------------------ acceptance
def test_train_vs_generation_chain_replay():
    """bench/train_vs_generation.py's replay: a chain at anchor p accepts lengths[p] drafts
    and commits them plus the bonus token, then anchors past them."""
    bench = load_bench("train_vs_generation")
    assert bench.chain_tau(np.array([0, 0, 0, 0])) == 1.0
    # anchor 0 accepts 2 (3 tokens), anchor 3 accepts 1 (2 tokens), anchor 5 is the last
    assert bench.chain_steps(np.array([2, 9, 9, 1, 9, 0])) == [3, 2]
    assert bench.chain_tau(np.array([2, 9, 9, 1, 9, 0])) == pytest.approx(5 / 2)


def test_prompt_sources_bins_by_the_targets_confidence():
    """bench/prompt_sources.py: each position falls in one bin of the target's top-1
    probability (1.0 in the last), and a bin's rate is its positions' share of right first
    drafts; an empty bin says so rather than 0."""
    bench = load_bench("prompt_sources")
    conf = np.array([0.1, 0.2, 0.95, 1.0, 0.6, 0.3])
    right = np.array([False, True, True, True, False, True])
    rows = bench.by_confidence(conf, right)
    assert [r["bin"] for r in rows] == [[0.0, 0.3], [0.3, 0.5], [0.5, 0.7], [0.7, 0.9],
                                        [0.9, 1.0]]  # fmt: skip
    assert [r["share"] for r in rows] == pytest.approx([2 / 6, 1 / 6, 1 / 6, 0, 2 / 6])
    assert [r["first_draft_right"] for r in rows] == [0.5, 1.0, 0.0, None, 1.0]


# ------------------------------------------------------------------------------ train
def test_train_step_flops_count_the_shapes(tiny):
    """bench/train_step.py's FLOPs per step, by hand for SmolLM2 (D 576, 9/3 heads of 64,
    FFN 1536, 30 layers, V 49,152) and its 2-layer drafter tapping layers 1, 10, 18, 27, at
    the online config's 32 x 640 tokens with 128 blocks of 16."""
    bench, harness = load_bench("train_step"), load_bench("harness")
    target = harness.model_config("smollm2-135m")
    shape = dict(num_layers=2, block_size=16, mask_token_id=3, intermediate_size=1536,
                 target_layer_ids=[1, 10, 18, 27])  # fmt: skip
    drafter = harness.drafter_config(target, "", **shape)
    tokens, slots, blocks_tokens = 32 * 640, 32 * 128 * 15, 32 * 128 * 16
    proj = 2 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)  # q, o; k, v; the MLP
    layer = tokens * (proj + 4 * 9 * 64 * 640)  # scores and values over all 640 positions
    plain = bench.step_flops(target, drafter, 32, 640, 128, "tokens")
    assert plain["target"] == 28 * layer  # through layer 27, the last tap
    assert plain["draft_head"] == 2 * 2 * slots * 576 * 49152  # logits + input gradient
    fc = 2 * tokens * 4 * 576 * 576
    draft_layer = 2 * tokens * 576 * 384 + blocks_tokens * (proj + 4 * 9 * 64 * (640 + 16))
    assert plain["drafter"] == 2 * fc + 3 * 2 * draft_layer
    assert plain["total"] == plain["target"] + plain["drafter"] + plain["draft_head"]
    greedy = bench.step_flops(target, drafter, 32, 640, 128, "target")
    assert greedy["target_labels"] == 2 * layer + 2 * tokens * 576 * 49152
    assert greedy["total"] == plain["total"] + greedy["target_labels"]
    soft = bench.step_flops(target, drafter, 32, 640, 128, "distribution")
    assert soft["target_labels"] == 2 * layer + slots * 2 * 576 * 49152  # a row per draft slot
    moe = harness.model_config(str(tiny["moe"]))
    with pytest.raises(ValueError, match="dense GQA"):
        bench.step_flops(moe, harness.drafter_config(moe, ""), 2, 32, 2, "tokens")


def test_campaign_plot_follows_the_shipped_drafter_and_branches_the_compared(tmp_path):
    """The shipped line continues `main` unless a window names another; compared drafters
    branch off at their window's start; tokens accumulate over rounds."""
    plot = load_bench("campaign_plot")

    def ev(tau, **drafters):
        return {"eval": {"tau": tau, "drafters": {k: {"tau": v} for k, v in drafters.items()}}}

    rows = [
        {"call": "w1", **ev(1.0, main=1.0)},
        {"call": "w1", "response_tokens": 2_000_000},
        {"call": "w1", **ev(1.2, main=1.2)},
        {"call": "w2", **ev(1.1, main=1.1, wide=1.1)},
        {"call": "w2", "response_tokens": 1_000_000},
        {"call": "w2", **ev(1.3, main=1.25, wide=1.3)},
    ]
    lines = plot.curves(rows, {"w2": "wide"})
    assert lines["shipped"] == [(0.0, 1.0), (2.0, 1.2), (2.0, 1.1), (3.0, 1.3)]
    assert lines["w2 main"] == [(2.0, 1.2), (2.0, 1.1), (3.0, 1.25)]  # off the shipped line
    assert plot.main(["--log", str(_jsonl(tmp_path, rows)), "--lineage", "w2=wide",
                      "--out", str(tmp_path / "c.png")]) == 0  # fmt: skip
    assert (tmp_path / "c.png").stat().st_size > 0


def _jsonl(tmp_path, rows):
    path = tmp_path / "campaign.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_step_smoke_with_profile(tmp_path, tiny):
    """bench/train_step.py on a tiny target: the product step's row, its parts, and with
    --profile a per-category and per-kernel summary of traced steps (CPU thunks here)."""
    bench = load_bench("train_step")
    out = tmp_path / "ts.json"
    res = bench.main(["--smoke", "--target", str(tiny["llama"]), "--no-reference",
                      "--matmul-size", "0", "--profile", "2", "--top", "5",
                      "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text())["profile"]["steps"] == 2
    assert [r["case"] for r in res["rows"]] == ["chunked/8192"] and "error" not in res["rows"][0]
    prof = res["profile"]
    assert prof["kernels_per_step"] > 0 and 0 < len(prof["kernels"]) <= 5
    assert sum(c["total_us"] for c in prof["categories"].values()) > 0


def test_profile_step_real_prompts_and_drafter(tmp_path):
    """profile_step's --prompts: held-out chat prompts of at most --context tokens, cycled to
    the batch; --drafter: loaded once and shared by the cases."""
    from types import SimpleNamespace
    from unittest import mock

    from kdj.tokenizer import load_tokenizer

    bench = load_bench("profile_step")
    held = ["What is the capital of Australia?", "Write a haiku about rain. " * 40]
    path = tmp_path / "eval_prompts.json"
    path.write_text(json.dumps({"sharegpt": held}))
    tgt = SimpleNamespace(tokenizer=load_tokenizer("smollm2-135m-instruct"))
    args = SimpleNamespace(prompts=str(path), context=64, drafter="x", dtype="float32")
    prompts = bench.case_prompts(tgt, 3, args)
    assert len(prompts) == 3 and prompts[0] == prompts[2] != prompts[1]
    assert all(0 < len(p) <= 64 for p in prompts)
    loads = []
    with mock.patch.object(bench.kdj, "load_drafter", lambda *a, **k: loads.append(a) or object()):
        cases = ["no-such-model:1:dflash", "no-such-model:1:auto"]  # each fails, recorded
        res = bench.main(["--cases", *cases, "--drafter", "x", "--trace-dir", str(tmp_path)])
    assert [bool(r.get("error")) for r in res["cases"]] == [True, True]
    assert loads == [("x",)]
    args.real_drafter = drafter = object()
    assert bench.case_drafter(tgt, "m", args) is drafter


def test_serve_sweep_closed_loop_runs_the_servers_pool(vocab12_pair):
    """The ceiling's in-process pool: make_app's engine (serving_engine) under a closed loop
    of W clients never holds more than W requests, and hands out exactly plain decoding's
    tokens for every request."""
    import kdj
    from kdj.decode.requests import Request
    from kdj.serve.app import serving_engine

    sweep = load_bench("serve_sweep")
    target, _ = vocab12_pair
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 12, int(k)).tolist() for k in rng.integers(2, 9, 7)]
    budgets = [int(m) for m in rng.integers(2, 12, 7)]
    engine = serving_engine(target, max_batch=4, context=32)
    peak, submit = [0], engine.submit

    def counted(request):
        rid = submit(request)
        live = len(engine.waiting) + sum(r is not None for r in engine.slots)
        peak[0] = max(peak[0], live)
        return rid

    engine.submit = counted
    tokens = sweep.closed_loop(engine, [Request(p, m, []) for p, m in zip(prompts, budgets)], 3)
    alone = kdj.generate(target, prompts, method="ar", max_new_tokens=budgets, stop_tokens=[])
    assert tokens == sum(len(t) for t in alone.tokens) == sum(budgets)
    assert peak[0] == 3 and not engine.busy


def test_serve_sweep_config_flags():
    """A --configs entry YAML@FLAGS starts its server with those flags: the YAML alone is
    the run, the flags ride on the server's command line and into its plot label."""
    sweep = load_bench("serve_sweep")
    args = sweep.parser().parse_args(
        ["--prompts", "p.json", "--configs", "a.yaml", "a.yaml@--chunk-steps 4", "--out", "o"]
    )
    assert args.configs == ["a.yaml", "a.yaml@--chunk-steps 4"]
    assert [sweep.label(c) for c in args.configs] == ["a", "a --chunk-steps 4"]
    plain, flagged = (sweep.server_command(c, args) for c in args.configs)
    assert (
        flagged == plain + ["--chunk-steps", "4"] and plain[plain.index("--config") + 1] == "a.yaml"
    )


@pytest.mark.parametrize("family", ["moe", "llama"])
def test_a_random_model_keeps_each_layers_update_on_the_embeddings_scale(tiny, family):
    """A random init draws every weight at 1 / sqrt(its fan-in), whatever its layout ([D, 2,
    F] gate_up, [E, D, 2, I] experts, [D, KVH, G, hd] qkv): no layer's update to the residual
    stream outgrows the embedding, which a benchmark's random target relies on (a steady
    greedy answer; activations nowhere near bf16's range)."""
    import jax.numpy as jnp
    from flax import nnx

    from kdj.models.transformer import build_model, full_hidden

    harness = load_bench("harness")
    model = build_model(harness.model_config(str(tiny[family])), jnp.float32, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)
    graphdef, state = nnx.split(model)
    _, tapped = full_hidden(graphdef, state, tokens, taps=(0, 1))
    x = model.embed[...][tokens]
    rms = lambda a: float(jnp.sqrt(jnp.mean(a**2)))  # noqa: E731
    for i in range(2):
        update = tapped[:, :, i] - (x if i == 0 else tapped[:, :, i - 1])
        assert 0.05 < rms(update) / rms(x) < 3.0, (family, i, rms(update), rms(x))
