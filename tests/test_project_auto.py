"""bench/project_auto.py on CPU: a real roofline run of a tiny MoE (through `kdj bench`) with a
fitted cost, synthetic real-pair taus; end to end, then the controller's replay at the two
extremes of the cost model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from kdj.cli import main as kdj_main
from kdj.cost import StepCost
from tests.test_bench import TINY_MOE

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import project_auto  # noqa: E402

FORECAST = {"dflash": 2.0, "ddtree16": 2.5, "ddtree64": 4.0, "ddtree256": 6.0}


def real_rows():
    """Batch 8 is the closest to 16, so its taus count; the others are decoys."""
    rows = []
    for batch, scale in ((1, 0.5), (8, 1.0), (32, 0.25)):
        methods = {"ar": {"tokens_per_s": 100.0 * batch, "tau": 1.0}}
        for name, f in FORECAST.items():
            methods[name] = {"tau": scale * (f - 0.2), "mean_expected_acceptance": f}
        methods["auto"] = {"tau": 3.0, "mean_expected_acceptance": 3.1}
        rows.append({"batch": batch, "methods": methods})
    return {"meta": {"pair": "synthetic"}, "rows": rows}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("project_auto")
    cfg = d / "tiny-moe.yaml"
    cfg.write_text(TINY_MOE)
    args = ["--models", str(cfg), "--batches", "1", "4", "--tokens", "1", "16", "17",
            "--moe-shapes", "1x1", "--context", "8", "--repeats", "1", "--matmul-size", "64",
            "--out", str(d / "roofline.json"), "--fit-cost", str(d / "cost.json")]  # fmt: skip
    assert kdj_main(["bench", *args]) == 0
    (d / "real.json").write_text(json.dumps(real_rows()))
    return d


def project(d, cost_path, out):
    return project_auto.main([
        "--roofline", str(d / "roofline.json"), "--cost", str(cost_path),
        "--real", str(d / "real.json"), "--out", str(out), "--model", str(d / "tiny-moe.yaml"),
        "--batches", "1", "4", "16", "--context", "12",
    ])  # fmt: skip


def with_coefficients(d, name, **coef):
    path = d / name
    # synthetic coefficients: the fitted residuals (ratios to the fitted model) no longer apply
    dataclasses.replace(StepCost.load(d / "cost.json"), residuals=(), **coef).save(path)
    return path


def test_end_to_end(inputs):
    out = inputs / "projected.json"
    result = project(inputs, inputs / "cost.json", out)
    assert out.exists() and out.with_suffix(".md").exists() and out.with_suffix(".png").exists()
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "| batch | ar | dflash | ddtree16 | ddtree64 | ddtree256 | auto |" in (
        out.with_suffix(".md").read_text()
    )
    assert result["real_pair"]["ddtree64"] == {"tau": 3.8, "forecast": 4.0, "batch": 8}
    assert [r["batch"] for r in result["rows"]] == [1, 4, 16]
    steps = json.loads((inputs / "roofline.json").read_text())["rows"]
    measured = {(r["batch"], r["tokens_per_seq"]): r["step_ms"] for r in steps}
    for row in result["rows"]:
        B, m = row["batch"], row["methods"]
        assert m["ar"]["draft_ms"] == 0 and m["dflash"]["draft_ms"] > 0
        assert m["dflash"]["tokens_per_seq"] == 16 and m["ddtree256"]["tokens_per_seq"] == 257
        for name in ("ar", "dflash", "ddtree16", "ddtree64", "ddtree256"):
            x = m[name]
            key = (B, x["tokens_per_seq"])
            assert x["target_step"] == ("measured" if key in measured else "predicted")
            if key in measured:
                assert x["target_ms"] == pytest.approx(measured[key])
            assert x["step_ms"] == pytest.approx(x["target_ms"] + x["draft_ms"])
            assert x["tokens_per_s"] == pytest.approx(B * x["tau"] / x["step_ms"] * 1e3)
        best = max(m[n]["tokens_per_s"] for n in result["shapes"])
        assert m[row["best_fixed"]]["tokens_per_s"] == best
        assert row["auto_over_best_fixed"] == pytest.approx(m["auto"]["tokens_per_s"] / best)
        assert m["auto"]["choice"] in result["shapes"]


def test_free_verify_picks_the_biggest_tree(inputs):
    cost = with_coefficients(inputs, "free.json", fixed_s=1e-3, per_byte_s=0.0, per_flop_s=0.0)
    result = project(inputs, cost, inputs / "free_out.json")
    for row in result["rows"]:
        auto, tree = row["methods"]["auto"], row["methods"]["ddtree256"]
        assert auto["drafting_pays"] and auto["choice"] == "ddtree256"
        # every drafted step builds the 256-node tree: the smaller entries do not pay for it
        assert auto["menu"] == ["none", "tree256"]
        assert auto["tokens_per_s"] == tree["tokens_per_s"]


def test_compute_bound_verify_is_plain_decoding(inputs):
    cost = with_coefficients(inputs, "dear.json", fixed_s=0.0, per_byte_s=0.0, per_flop_s=1e-9)
    result = project(inputs, cost, inputs / "dear_out.json")
    for row in result["rows"]:
        auto, ar = row["methods"]["auto"], row["methods"]["ar"]
        assert not auto["drafting_pays"] and auto["choice"] == "ar"
        assert auto["menu"] == ["none"]  # paying_menu dropped every draft shape
        assert auto["tokens_per_s"] == ar["tokens_per_s"]
        assert row["auto_over_ar"] == 1.0
