"""bench/profile_step.py on CPU: a tiny Llama traced through kdj's decode loop and through the
roofline step, the trace parsed into per-kernel times; and the GPU branch of the parser on a
hand-made trace (device streams kept, derived lines and duplicates dropped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import profile_step  # noqa: E402

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


def test_profile_step_cpu(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_LLAMA)
    out = tmp_path / "profile.json"
    args = ["--cases", f"{cfg}:2:ar", f"{cfg}:1:step", f"{cfg}:2:auto-skip",
            f"{cfg}:2:auto-first", f"{cfg}:2:ar-xla-dense", "--context", "8", "--steps", "3",
            "--out", str(out), "--trace-dir", str(tmp_path / "traces")]  # fmt: skip
    profile_step.main(args)
    result = json.loads(out.read_text())
    cases = [f"{cfg}:2:ar", f"{cfg}:1:step", f"{cfg}:2:auto-skip", f"{cfg}:2:auto-first",
             f"{cfg}:2:ar-xla-dense"]  # fmt: skip
    assert [c["case"] for c in result["cases"]] == cases
    for case in result["cases"]:
        assert "error" not in case, case.get("error")
        assert list(Path(case["trace_dir"]).rglob("perfetto_trace.json.gz"))
        kernels = case["kernels"]
        assert kernels and all(k["total_us"] > 0 and k["count"] > 0 for k in kernels)
        assert case["kernels_per_step"] >= 10  # 2 layers of attention + MLP, at least
        assert 0 < case["busy_ms_per_step"] <= case["kernel_ms_per_step"] + 1e-9
        assert case["busy_ms_per_step"] <= case["traced_wall_ms_per_step"]
        assert case["wall_ms_per_step"] > 0 and case["compile_s"] > 0
        cats = case["categories"]
        assert sum(c["count"] for c in cats.values()) == sum(k["count"] for k in kernels)
        assert sum(c["total_us"] for c in cats.values()) == pytest.approx(
            case["kernel_ms_per_step"] * 1e3 * case["steps"]
        )
        assert "gemm/matmul" in cats  # XLA:CPU names its dot thunks too
        assert not any(k["name"].startswith("while") for k in kernels)  # the loop's body counts
        assert case["host_python_top_us"]


def test_profile_step_moe_cases_cpu(tmp_path):
    """A tiny DeepSeek-V3 shape: the MoE layer alone (moe-T) and the decode loop with MLA's
    head GEMV switched off (ar-xla-heads) or the GEMV's old 2M-weight floor (ar-xla-small; on
    the CPU both the same XLA path) trace and summarise, and the switch is put back."""
    from test_bench import TINY_MOE

    from kdj.models import layers

    cfg = tmp_path / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE)
    cases = [f"{cfg}:4:moe-3", f"{cfg}:1:ar-xla-heads", f"{cfg}:1:ar-xla-small"]
    out = profile_step.main(["--cases", *cases, "--context", "8", "--steps", "2",
                             "--trace-dir", str(tmp_path / "traces")])  # fmt: skip
    assert [c["case"] for c in out["cases"]] == cases
    for case in out["cases"]:
        assert "error" not in case, case.get("error")
        assert case["kernels"] and case["busy_ms_per_step"] > 0
    assert [c["method"] for c in out["cases"]] == ["moe-3", "ar-xla-heads", "ar-xla-small"]
    assert layers.GEMV_MIN_WEIGHTS == 1 << 17
    with pytest.raises(ValueError, match="moe-T"):
        args = profile_step.argparse.Namespace(steps=1, context=8, dtype="float32")
        profile_step.profile_case(f"{cfg}:1:moe", args, {}, tmp_path)


def test_device_events_gpu_trace():
    gpu, host = "/device:GPU:0", "/host:CPU"
    events = [
        (gpu, "Stream #7(Compute)", "nvjet_hsh_64x8_gemm", 0.0, 5.0, {"hlo_op": "dot.1"}),
        (gpu, "Stream #7(Compute)", "loop_fusion_3", 6.0, 2.0, {}),
        (gpu, "Stream #7(MemcpyD2H)", "MemcpyD2H", 9.0, 1.0, {}),
        (gpu, "Stream #7", "loop_fusion_3", 6.0, 2.0, {}),  # the same kernel on a second line
        (gpu, "XLA Ops", "dot.1", 0.0, 5.0, {}),  # derived from the kernels: not counted
        (host, "python", "$api.py:1 f", 0.0, 20.0, {}),
        (host, "tf_XLAPjRtCpuClient/1", "fusion.9", 0.0, 1.0, {"hlo_op": "fusion.9"}),
    ]
    kernels = profile_step.device_events(events)
    assert [k[0] for k in kernels] == ["nvjet_hsh_64x8_gemm", "loop_fusion_3", "MemcpyD2H"]
    summary = profile_step.summarise(events, traced_s=20e-6, steps=2)
    assert summary["kernels_per_step"] == 1.5
    assert summary["busy_ms_per_step"] == pytest.approx(4e-3)
    assert set(summary["categories"]) == {"gemm/matmul", "fusion/other", "copy/transpose"}
    assert summary["kernels"][0]["hlo_op"] == "dot.1"
    assert profile_step.category("input_scatter_fusion") == "gather/scatter/dus"
    assert profile_step.category("ragged_dot_fusion") == "ragged_dot/grouped"
    assert profile_step.category("void splitKreduce_kernel<32, 16>") == "gemm/matmul"
    assert profile_step.category("loop_convert_fusion") == "fusion/other"
