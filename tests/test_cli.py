"""The CLI: `kdj generate` with no model argument runs the embedded default; `kdj convert`
writes an Orbax checkpoint that loads back to identical logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kdj
from kdj.cli import main
from tests.hf_models import build

ASSET = str(Path(kdj.__file__).parent / "assets" / "smollm2-135m-dflash-b16")


def test_generate_default_model(capsys):
    assert main(["generate", "--max-new-tokens", "16"]) == 0
    out = capsys.readouterr().out
    assert "The capital of Australia is Canberra." in out
    assert "tok/s" in out and "prefill" in out


def test_generate_config_file(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("decode:\n  max_new_tokens: 3\n  method: ar\n  cost: estimate\n")
    assert main(["generate", "--config", str(run), "--prompt", "Hi"]) == 0
    assert "3 tokens" in capsys.readouterr().out
    run.write_text("decoding: {}\n")
    with pytest.raises(SystemExit, match="unknown keys"):
        main(["generate", "--config", str(run)])


def test_convert_roundtrip(tmp_path, capsys):
    src = tmp_path / "hf"
    build("deepseek_v3", src)
    assert main(["convert", str(src), str(tmp_path / "orbax"), "--dtype", "float32"]) == 0
    a = kdj.load_target(src, dtype="float32")
    b = kdj.load_target(tmp_path / "orbax", dtype="float32")
    assert b.cfg == a.cfg
    ids = np.arange(20).reshape(2, 10) % a.cfg.vocab_size
    np.testing.assert_array_equal(kdj.forward(a, ids), kdj.forward(b, ids))
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["convert", str(src), str(tmp_path / "orbax")])
    # a checkpoint from before MLA's w_uv layout change is refused, not loaded transposed
    import json

    meta_path = tmp_path / "orbax" / "kdj_config.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == 2
    del meta["format"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="older kdj .* w_uv"):
        kdj.load_target(tmp_path / "orbax", dtype="float32")
    meta_path.write_text(json.dumps(meta | {"format": 3}))
    with pytest.raises(ValueError, match="format 3"):
        kdj.load_target(tmp_path / "orbax", dtype="float32")


@pytest.fixture(scope="module")
def saved_drafter(tmp_path_factory):
    """A random 1-layer drafter for the built-in target, saved once for both methods."""
    from tests.test_speculative import make_drafter

    target = kdj.load_target("smollm2-135m-instruct", dtype="float32")
    path = tmp_path_factory.mktemp("drafter") / "d"
    make_drafter(target, layers=1, block=4, ids=(3, 20), mask=0).save(path)
    return path


@pytest.mark.parametrize(
    "flags, expect",
    [
        (["--method", "dflash", "--block-size", "3"], "dflash:"),
        (["--method", "ddtree", "--tree-budget", "8"], "tree budget 8, mean tree size 8.0"),
    ],
)
def test_generate_with_a_drafter_prints_acceptance(saved_drafter, capsys, flags, expect):
    argv = ["generate", "--drafter", str(saved_drafter), "--max-new-tokens", "16", *flags]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "The capital of Australia is Canberra." in out
    assert "histogram" in out and expect in out


def test_train_drafter_overrides_reach_the_config(monkeypatch):
    """train-drafter's flags override the YAML's fields before training starts."""
    import kdj.train.loop

    seen = {}
    monkeypatch.setattr(kdj.train.loop, "run_training", lambda cfg: seen.setdefault("cfg", cfg))
    args = ["train-drafter", "--config", "configs/train/smollm2-b16-ablate.yaml", "--steps",
            "7", "--num-layers", "2", "--init-from", "", "--out-dir", "out/x"]  # fmt: skip
    assert main(args) == 0
    cfg = seen["cfg"]
    assert (cfg.optim.steps, cfg.drafter.num_layers, cfg.out_dir) == (7, 2, "out/x")
    assert cfg.drafter.init_from is None
    assert tuple(cfg.drafter.target_layer_ids) == (1, 10, 18, 27)  # fixed across depths


def test_eval_acceptance_compares_drafters_against_one_ar_run(tmp_path, capsys):
    """Several drafters in one process: a report each, one shared AR run, a side-by-side
    table; in deterministic mode two copies of one drafter get the same tau."""
    import json
    import shutil

    copy = shutil.copytree(ASSET, tmp_path / "copy")
    prompts = tmp_path / "eval_prompts.json"
    prompts.write_text(json.dumps({"sharegpt": ["Name three colours."]}))
    out = tmp_path / "acc"
    argv = ["eval-acceptance", "--drafter", f"shipped={ASSET}", str(copy), "--prompts",
            str(prompts), "--datasets", "sharegpt", "--num-prompts", "1", "--max-new-tokens",
            "6", "--budgets", "4", "--temperatures", "0", "--dtype", "bfloat16",
            "--deterministic", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    got = {k: json.loads((out / k / "acceptance.json").read_text()) for k in ("shipped", "copy")}
    assert all(g["meta"]["deterministic"] for g in got.values())
    res = {k: g["results"]["sharegpt"]["T=0"] for k, g in got.items()}
    assert res["shipped"]["ar"] == res["copy"]["ar"]  # the same run, not a second one
    assert res["shipped"]["dflash"]["tau"] == res["copy"]["dflash"]["tau"] > 1
    assert res["shipped"]["ddtree"]["4"]["tau"] == res["copy"]["ddtree"]["4"]["tau"]
    table = capsys.readouterr().out
    assert "| sharegpt | 0 | shipped |" in table and "| sharegpt | 0 | copy |" in table
    with pytest.raises(SystemExit, match="two drafters are labelled 'copy'"):
        main(["eval-acceptance", "--drafter", str(copy), f"copy={ASSET}", "--out", str(out)])


def test_eval_acceptance_runs_only_the_sets_asked_for(tmp_path):
    prompts = tmp_path / "eval_prompts.json"
    prompts.write_text('{"sharegpt": ["Hi"], "humaneval": []}')
    argv = ["eval-acceptance", "--drafter", "smollm2-135m-dflash-b16", "--prompts", str(prompts),
            "--datasets", "humaneval", "--out", str(tmp_path / "acc")]  # fmt: skip
    with pytest.raises(SystemExit, match=r"no prompts for \['humaneval'\]"):
        main(argv)
    assert not (tmp_path / "acc").exists()
