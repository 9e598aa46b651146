"""The CLI: `kdj generate` with no model argument runs the embedded default; `kdj convert`
writes an Orbax checkpoint that loads back to identical logits."""

from __future__ import annotations

import ast
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
    run.write_text("decode:\n  max_new_tokens: 3\n  method: ar\n")
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


def test_generate_prints_the_logprobs_generate_returns(tmp_path, capsys):
    """--logprobs 2: per emitted token its text, log-probability and two alternatives, as
    kdj.generate returns them for the same chat prompt."""
    from tests.test_serve import save_chat_model

    path = save_chat_model(tmp_path / "chat")
    argv = ["generate", "--target", str(path), "--prompt", "hi", "--max-new-tokens", "5"]
    assert main([*argv, "--logprobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("--- [0] logprobs: token, log-probability | alternatives") + 1
    target = kdj.load_target(path, dtype="float32")
    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    out = kdj.generate(target, [prompt], max_new_tokens=5, logprobs=2)
    want = []
    for t, x in zip(out.tokens[0], out.logprobs[0], strict=True):
        alternatives = "  ".join(f"{tok.decode([a])!r} {v:.4f}" for a, v in x.top)
        want.append(f"{tok.decode([t])!r:<16} {x.logprob:9.4f}  | {alternatives}")
    assert len(want) == 5 and lines[start : start + 5] == want
    assert lines[start + 5] == "--- [0] finish: length, 5 tokens"
    assert main(argv) == 0  # without the flag: no table
    assert "logprobs" not in capsys.readouterr().out


@pytest.mark.parametrize("chat", ["--chat", "--no-chat"])
def test_generate_on_a_target_without_a_tokenizer_says_what_to_add(tmp_path, chat):
    build("llama", tmp_path / "llama")  # weights and config only
    with pytest.raises(SystemExit, match="llama' has no tokenizer .tokenizer.json or "
                       "tiktoken.model beside its weights. to read --prompt with"):  # fmt: skip
        main(["generate", "--target", str(tmp_path / "llama"), chat])


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
    # --resume-state: the online campaign's next window continues the last one's bundle
    import kdj.train.online

    monkeypatch.setattr(kdj.train.online, "run_online", lambda cfg: seen.update(online=cfg))
    online = ["train-drafter", "--config", "configs/train/smollm2-online.yaml"]
    assert main([*online, "--resume-state", "w/resume/resume.json"]) == 0
    assert seen["online"].online.resume_state == "w/resume/resume.json"
    with pytest.raises(SystemExit, match="--resume-state continues an online campaign"):
        main([*args, "--resume-state", "w/resume/resume.json"])


@pytest.mark.parametrize(
    "argv, msg",
    [(["--init-from", "nope"], "--init-from: drafter 'nope' not found"),
     (["--init-from", "README.md"], "--init-from: README.md is a file: a checkpoint is a dir"),
     (["--target", "nope"], "--target: target 'nope' not found"),
     (["--out-dir", "README.md"], "--out-dir README.md is a file: give a folder"),
     (["--resume-state", "x"], "--resume-state continues an online campaign")],
)  # fmt: skip
def test_train_drafter_checks_its_sources_before_the_data(monkeypatch, argv, msg):
    import kdj.train.loop

    def never(cfg):
        raise AssertionError("training started before its sources were checked")

    monkeypatch.setattr(kdj.train.loop, "run_training", never)
    with pytest.raises(SystemExit, match=f"^kdj train-drafter: {msg}"):
        main(["train-drafter", "--config", "configs/train/smollm2-b16.yaml", *argv])


def test_a_config_of_another_command_says_whose_it_is(no_loading):
    with pytest.raises(SystemExit, match=r"unknown keys .*reads as a training YAML \(kdj "
                       "train-drafter --config\\)"):  # fmt: skip
        main(["generate", "--config", "configs/train/smollm2-b16.yaml"])
    with pytest.raises(SystemExit, match=r"reads as a mesh YAML \(kdj.load_target\(mesh="):
        main(["generate", "--config", "configs/meshes/single.yaml"])
    with pytest.raises(SystemExit, match="reads as a run YAML .kdj generate / serve --config"):
        main(["train-drafter", "--config", "configs/runs/smollm2.yaml"])


def test_train_drafter_names_the_configs_field(monkeypatch, tmp_path):
    (tmp_path / "t.yaml").write_text("drafter:\n  init_from: nope\n")
    with pytest.raises(SystemExit, match=f"{tmp_path}/t.yaml: drafter.init_from: drafter 'nope'"):
        main(["train-drafter", "--config", str(tmp_path / "t.yaml")])


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
            str(prompts), "--datasets", "sharegpt", "--num-prompts", "2", "--max-new-tokens",
            "6", "--budgets", "4", "--temperatures", "0", "--dtype", "float32",
            "--deterministic", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    got = {k: json.loads((out / k / "acceptance.json").read_text()) for k in ("shipped", "copy")}
    assert all(g["meta"]["deterministic"] for g in got.values())
    # the file holds one prompt: the report says one ran, and so does stderr
    assert all(g["meta"]["num_prompts"] == {"sharegpt": 1} for g in got.values())
    res = {k: g["results"]["sharegpt"]["T=0"] for k, g in got.items()}
    assert res["shipped"]["ar"] == res["copy"]["ar"]  # the same run, not a second one
    assert res["shipped"]["dflash"]["tau"] == res["copy"]["dflash"]["tau"] > 1
    assert res["shipped"]["ddtree"]["4"]["tau"] == res["copy"]["ddtree"]["4"]["tau"]
    printed = capsys.readouterr()
    assert "has 1 sharegpt prompts, fewer than --num-prompts 2: running 1" in printed.err
    table = printed.out
    assert "| sharegpt | 0 | shipped |" in table and "| sharegpt | 0 | copy |" in table
    with pytest.raises(SystemExit, match="two drafters are labelled 'copy'"):
        main(["eval-acceptance", "--drafter", str(copy), f"copy={ASSET}", "--out", str(out)])


def test_eval_acceptance_runs_only_the_sets_asked_for(tmp_path):
    prompts = tmp_path / "eval_prompts.json"
    prompts.write_text('{"sharegpt": ["Hi"], "humaneval": []}')
    argv = ["eval-acceptance", "--drafter", "smollm2-135m-dflash-b16", "--prompts", str(prompts),
            "--datasets", "humaneval", "--out", str(tmp_path / "acc")]  # fmt: skip
    with pytest.raises(SystemExit, match=r"list of prompt strings under 'humaneval' .--datasets"):
        main(argv)
    assert not (tmp_path / "acc").exists()


# ------------------------------------------------------ issue 47: what a new user meets
@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the command must have refused its input first."""

    def never(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(kdj, "load_target", never)
    monkeypatch.setattr(kdj, "load_drafter", never)


@pytest.mark.parametrize(
    "argv, msg",
    [(["serve", "--port", "99999"], r"--port: must be in \[1, 65535\] \(got 99999\)"),
     (["serve", "--port", "0"], r"--port: must be in \[1, 65535\]"),
     (["serve", "--max-batch", "0"], "--max-batch: must be >= 1 .got 0"),
     (["serve", "--context", "1"], "--context: must be >= 2"),
     (["serve", "--max-queue", "0"], "--max-queue: must be >= 1"),
     (["serve", "--chunk-steps", "-3"], "--chunk-steps: must be >= 1"),
     (["serve", "--widths", "0", "8"], "--widths: must be >= 1"),
     (["serve", "--widths", "1", "4"], r"--widths 1 4: .*end at --max-batch \(8\)"),
     (["serve", "--grace", "-1"], "--grace: must be >= 0"),
     (["serve", "--max-batch", "2.5"], "--max-batch: must be an integer"),
     (["generate", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
     (["generate", "--top-p", "1.5"], r"--top-p: must be in \(0.0, 1.0\]"),
     (["generate", "--temperature", "inf"], "--temperature: must be finite"),
     (["generate", "--seed", "-1"], "--seed: must be in"),
     (["generate", "--logprobs", "21"], r"--logprobs: must be in \[0, 20\] \(got 21\)"),
     (["generate", "--logprobs", "-1"], r"--logprobs: must be in \[0, 20\]"),
     (["generate", "--dtype", "float64"], "--dtype: invalid choice"),
     (["convert", "smollm2-135m-instruct", "x", "--dtype", "auto"], "--dtype: invalid choice"),
     (["generate", "--method", "ar", "--block-size", "4"], "--block-size applies to"),
     (["generate", "--method", "ar", "--tree-budget", "4"], "--tree-budget applies to"),
     (["generate", "--method", "dflash"], r"needs a drafter \(--drafter\)"),
     (["generate", "--method", "ar", "--drafter", "x"], "--drafter is not used by method 'ar'"),
     (["generate", "--no-chat", "--prompt", ""], "--prompt 0 is empty"),
     (["eval-acceptance", "--drafter", "x", "--budgets", "0"], "--budgets: must be >= 1"),
     (["calibrate", "--drafter", "x", "--temperatures", "0"], "--temperatures: must be > 0"),
     (["tune", "--drafter", "x", "--batch", "0"], "--batch: must be >= 1"),
     (["calibrate", "--drafter", ASSET, "--method", "dflash", "--tree-budget", "8"],
      "--tree-budget applies to --method ddtree, not dflash"),
     (["tune", "--drafter", ASSET, "--menu", "chain", "bogus"], "bad --menu entry 'bogus'"),
     (["tune", "--drafter", ASSET, "--menu", "chain40"], r"--menu entry 'chain40': .*1..15"),
     (["train-drafter", "--config", "c.yaml", "--steps", "0"], "--steps: must be >= 1"),
     # sizes the target's positions cannot hold, from its config, not its weights
     (["generate", "--max-new-tokens", "8192"],
      r"--max-new-tokens 8192 leaves no position for a prompt: .*max_position_embeddings 8192"),
     (["serve", "--max-batch", "1", "--context", "9000"],
      r"--context 9000 exceeds the model's max_position_embeddings \(8192\).*--context 8192"),
     (["tune", "--drafter", ASSET, "--context", "9000"],
      r"kdj tune: --context 9000 exceeds the model's max_position_embeddings \(8192\)")],
)  # fmt: skip
def test_flags_are_checked_before_any_model_loads(no_loading, argv, msg):
    with pytest.raises(SystemExit, match=msg):
        main(argv)


@pytest.mark.parametrize(
    "yaml, msg",
    [("chat: 'no'\n", "chat must be true or false .a YAML boolean., got 'no'"),
     ("decode:\n  deterministic: 'false'\n", "decode.deterministic must be true or false"),
     ("chat: 1\n", "chat must be true or false"),
     ("decode:\n  max_new_tokens: '3'\n", r"decode.max_new_tokens must be an integer"),
     ("decode:\n  temperature: -1\n", "decode.temperature must be >= 0"),
     ("decode:\n  top_p: 0\n", r"decode.top_p must be in \(0, 1\]"),
     ("decode:\n  seed: [1, -2]\n", "decode.seed must be >= 0"),
     ("decode:\n  method: fast\n", "decode.method 'fast' is not one of"),
     ("decode:\n  seed: [1, 2]\n", r"decode.seed has 2 entries, one per prompt, for 1 prompt"),
     ("decode:\n  max_new_tokens: [3, 4]\n", "decode.max_new_tokens has 2 entries"),
     ("decode:\n  method: ar\n  block_size: 4\n", "decode.block_size applies to .* not .*'ar'"),
     ("decode:\n  block_size: 4\n", "decode.block_size applies to .*'auto' without a drafter"),
     ("decode:\n  cost: bogus\n", "decode.cost 'bogus' is not a file.*tune.*estimate"),
     ("decode:\n  method: dflash\n  cost: estimate\n", "decode.cost applies to method auto, not"),
     ("dtype: float64\n", "dtype 'float64' is not supported: use auto .*, float32, bfloat16"),
     ("decode:\n  block_sise: 8\n",
      r"unknown decode keys \['block_sise'\]; expected \[.*'block_size'.*'tree_budget'\]"),
     ("target: 3\n", "target must be a name or path"),
     ("decode:\n  method: ar\n   max_new_tokens: 3\n", r"line 3, column 18: not valid YAML"),
     ("decode: [1\n", r"line 2, column 1: not valid YAML"),
     # an API check of a value the YAML gave names the YAML's field, not a flag never given
     ("decode:\n  method: ar\n  max_new_tokens: 9000\n",
      r"decode.max_new_tokens 9000 leaves no position for a prompt")],
)  # fmt: skip
def test_run_yaml_values_are_checked_before_any_model_loads(no_loading, tmp_path, yaml, msg):
    run = tmp_path / "run.yaml"
    run.write_text(yaml)
    with pytest.raises(SystemExit, match=f"kdj generate: {run}.*{msg}"):
        main(["generate", "--config", str(run)])


def test_a_run_yaml_that_is_not_text_is_named(no_loading, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_bytes(b"\xff\xfe d\x00e\x00")  # UTF-16, as some editors save
    with pytest.raises(SystemExit, match=f"kdj generate: {run}: not a UTF-8 text file"):
        main(["generate", "--config", str(run)])


@pytest.mark.parametrize(
    "yaml, msg",
    [("decode:\n  method: dflash\n", r"method 'dflash' needs a drafter \(a drafter: field in "),
     ("decode:\n  block_size: 4\n", "{run}: decode.block_size applies to"),
     ("target: {asset}\n", r".* not a target: pass it as the drafter \(the run YAML's drafter:\)")],
)  # fmt: skip
def test_serve_names_the_run_yamls_fields_it_has_no_flags_for(no_loading, tmp_path, yaml, msg):
    run = tmp_path / "run.yaml"
    run.write_text(yaml.format(asset=ASSET))
    with pytest.raises(SystemExit, match=f"^kdj serve: {msg.format(run=run)}"):
        main(["serve", "--config", str(run)])


def test_serve_refuses_a_run_yamls_per_prompt_lists(no_loading, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("decode:\n  max_new_tokens: [3, 4]\n")
    with pytest.raises(SystemExit, match=f"kdj serve: {run}: decode.max_new_tokens is a list "
                       ".*kdj serve takes one value"):  # fmt: skip
        main(["serve", "--config", str(run)])


@pytest.mark.parametrize(
    "text, msg",
    [("hello", "cannot read a JSON file"),
     ('["a", "b"]', "expected eval_prompts.json, an object .* under 'sharegpt' .--datasets."),
     ('{"sharegpt": [1]}', "expected eval_prompts.json"),
     ('{"humaneval": ["def f():"]}', "expected eval_prompts.json")],
)  # fmt: skip
def test_eval_acceptance_prompts_file_is_checked_before_any_model_loads(no_loading, tmp_path,
                                                                        text, msg):  # fmt: skip
    path = tmp_path / "eval_prompts.json"
    path.write_text(text)
    argv = ["eval-acceptance", "--drafter", "smollm2-135m-dflash-b16", "--prompts", str(path),
            "--datasets", "sharegpt"]  # fmt: skip
    with pytest.raises(SystemExit, match=f"kdj eval-acceptance: --prompts {path}: {msg}"):
        main(argv)
    path.write_text('{"sharegpt": ["Hi"], "humaneval": []}')
    with pytest.raises(AssertionError, match="a model was loaded"):  # read: the load comes next
        main(argv)


@pytest.mark.parametrize(
    "argv, msg",
    [(["--out", "{tmp}"], "--out {tmp} is a directory: give a file name"),
     (["--out", "{tmp}/file/r.json"], "--out {tmp}/file/r.json: {tmp}/file is a file, not a"),
     (["--plot", "{tmp}/file/r.png"], "--plot {tmp}/file/r.png: {tmp}/file is a file"),
     (["--prompts", "{tmp}/p.json", "--out", "{tmp}/p.json"],
      "--out {tmp}/p.json is the --prompts file: writing there would overwrite it"),
     (["--out", "{tmp}/r.json", "--plot", "{tmp}/r.json"], "--plot {tmp}/r.json is the --out file"),
     (["--max-tokens", "1", "2", "3"], r"--max-tokens: give N, or LO HI .* \(got 1 2 3\)"),
     (["--max-tokens", "9", "2"], "--max-tokens: give N, or LO HI with LO <= HI")],
)  # fmt: skip
def test_bench_serve_checks_what_it_writes_before_the_sweep(monkeypatch, tmp_path, argv, msg):
    from kdj.serve import bench

    def never(*a, **k):
        raise AssertionError("the sweep ran before the arguments were checked")

    monkeypatch.setattr(bench, "run", never)
    (tmp_path / "file").write_text("x")
    (tmp_path / "p.json").write_text('["Hi"]')
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit, match=f"^kdj bench-serve: {msg.format(tmp=tmp_path)}"):
        main(["bench-serve", *argv])
    assert (tmp_path / "p.json").read_text() == '["Hi"]'


def test_bench_serve_makes_the_folders_it_writes_in(monkeypatch, tmp_path):
    from kdj.serve import bench

    report = {"model": "m", "rows": []}
    monkeypatch.setattr(bench, "run", lambda *a, **k: report)
    monkeypatch.setattr(bench, "table", lambda r: "")
    (tmp_path / "p.json").write_text('["Hi"]')
    out = tmp_path / "new" / "sweep.json"
    main(["bench-serve", "--prompts", str(tmp_path / "p.json"), "--out", str(out)])
    assert out.exists()


def test_bench_serve_takes_an_openai_base_url(monkeypatch, tmp_path):
    from kdj.serve import bench

    seen = []
    monkeypatch.setattr(bench, "run", lambda url, *a, **k: seen.append(url) or {"rows": []})
    monkeypatch.setattr(bench, "table", lambda r: "")
    (tmp_path / "p.json").write_text('["Hi"]')
    for url in ("http://h:1/v1", "http://h:1/v1/", "http://h:1"):
        main(["bench-serve", "--url", url, "--prompts", str(tmp_path / "p.json")])
    assert seen == ["http://h:1"] * 3


def test_eval_acceptance_out_is_checked_before_any_model_loads(no_loading, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match=f"--out {tmp_path}/file is a file: give a folder"):
        main(["eval-acceptance", "--drafter", "smollm2-135m-dflash-b16", "--out",
              str(tmp_path / "file")])  # fmt: skip


def test_eval_acceptance_replaces_only_its_own_earlier_report(no_loading, tmp_path):
    """--out's acceptance.json / .png replace an earlier report only: a user's file of that
    name, a plot with no report beside it, or the --prompts file itself is refused before
    any model loads."""
    import json

    base = ["eval-acceptance", "--drafter", "smollm2-135m-dflash-b16", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "acceptance.json").write_text('{"my": "hand-written results"}')
    with pytest.raises(SystemExit, match="acceptance.json exists and is not an earlier"):
        main([*base, str(mine)])
    plot = tmp_path / "plot"
    plot.mkdir()
    (plot / "acceptance.png").write_bytes(b"\x89PNG")
    with pytest.raises(SystemExit, match="acceptance.png exists with no report beside it"):
        main([*base, str(plot)])
    prompts = tmp_path / "acceptance.json"
    prompts.write_text(json.dumps({"sharegpt": ["hi"]}))
    with pytest.raises(SystemExit, match="is the --prompts file: writing there would overwrite"):
        main([*base, str(tmp_path), "--prompts", str(prompts)])
    (mine / "acceptance.json").write_text(json.dumps({"meta": {}, "results": {}}))
    with pytest.raises(AssertionError, match="a model was loaded"):  # an earlier report: on
        main([*base, str(mine), "--prompts", str(prompts)])


def test_method_flag_over_a_run_yaml_drops_what_it_does_not_use(capsys):
    """The README's comparison: the DFlash run YAML decoded plainly with --method ar."""
    argv = ["generate", "--config", "configs/runs/smollm2-dflash.yaml", "--method", "ar",
            "--max-new-tokens", "4", "--no-chat", "--prompt",
            "The capital of France is"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "leaves out the run YAML's decode.block_size, drafter" in captured.err
    assert "compiling" in captured.err  # the status line while it compiles
    assert "--- [0] finish: length, 4 tokens" in captured.out
    assert "--- ar: 4 tokens" in captured.out


def test_method_switch_keeps_what_the_new_method_uses():
    from kdj.cli import parser
    from kdj.cli.generate import settle

    def run(*flags):
        yaml = "configs/runs/smollm2-dflash.yaml"
        return settle(parser().parse_args(["generate", "--config", yaml, *flags]))

    ddtree = run("--method", "ddtree")
    assert ddtree["drafter"] == "smollm2-135m-dflash-b16"
    assert ddtree["decode"]["block_size"] == 16  # ddtree runs the drafter at a block too
    assert run("--method", "auto", "--chat")["decode"]["block_size"] == 16
    assert run("--no-deterministic")["decode"]["deterministic"] is False
    assert run("--deterministic", "--no-chat")["chat"] is False


def test_missing_extras_name_the_install(monkeypatch, no_loading):
    import sys

    loaded = dict(sys.modules)
    for name in [m for m in loaded if m.startswith("kdj.train.") or m == "optax"]:
        monkeypatch.delitem(sys.modules, name)
        # and from its package: the imports below bind fresh modules there, which would
        # outlive this test beside the old ones that sys.modules gets back
        parent, _, child = name.rpartition(".")
        if parent in loaded:
            monkeypatch.delattr(loaded[parent], child, raising=False)
    monkeypatch.setitem(sys.modules, "optax", None)  # as if kdj[train] were not installed
    with pytest.raises(SystemExit, match=r"^kdj train-drafter: this command needs kdj's "
                                         r"\[train\] extras \(optax is not installed\): "
                                         r"pip install -e '\.\[train\]'"):  # fmt: skip
        main(["train-drafter", "--config", "configs/train/smollm2-b16.yaml"])
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[serve\]' in kdj's source"):
        main(["serve"])


def test_acceptance_summary_lists_ddtree():
    from kdj.train.evaluate import compare_table

    report = {"sharegpt": {"T=0": {"ar": {"tau": 1.0, "tokens_per_s": 10.0},
                                   "dflash": {"tau": 2.0, "speedup": 1.1},
                                   "ddtree": {"4": {"tau": 2.5, "speedup": 1.3},
                                              "16": {"error": "x"}}}}}  # fmt: skip
    table = compare_table({"one": report})
    assert "| DDTree 4 | DDTree 16 |" in table
    assert "| sharegpt | 0 | one | 2.000 (1.10x) | 2.500 (1.30x) | - |" in table


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("kdj ")


def test_python_m_kdj_cli_runs_the_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kdj.cli", "serve", "--port", "70000"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode != 0 and "--port: must be in [1, 65535]" in out.stderr


def test_status_line_off_a_terminal_is_one_line():
    import io

    from kdj.cli.status import Status

    stream = io.StringIO()
    with Status("compiling", stream):
        pass
    assert stream.getvalue() == "compiling ...\n"


def test_generate_summary_says_none_for_a_mean_over_no_steps(capsys):
    from kdj.cli.generate import print_stats

    nan = float("nan")
    print_stats({"method": "ddtree", "acceptance_histogram": [], "tree_budget": 29,
                 "tree_budget_requested": 64, "mean_tree_size": nan, "mean_accepted_depth": nan,
                 "new_tokens": 1, "steps": 0, "mean_acceptance": nan, "tokens_per_s": nan,
                 "prefill_s": 0.1, "decode_s": 0.0, "compile_s": 1.0})  # fmt: skip
    out = capsys.readouterr().out
    assert "nan" not in out
    assert "histogram: none (no decode step)" in out
    assert "tree budget 29 (of 64 asked: what fits the cache), mean tree size none" in out
    assert "mean acceptance none, none tok/s" in out


def test_serve_refuses_a_pool_whose_cache_cannot_fit(monkeypatch):
    """Found once the model loaded, before the warm-up, which the OS killed without a word."""
    import socket

    from kdj.cli import serve

    monkeypatch.setattr(serve, "free_memory", lambda: 2**30)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    with pytest.raises(
        SystemExit,
        match=r"a pool of 64 slots x 2048 tokens needs 5.6 GiB of KV "
        r"cache \(90 MiB a slot\), more than the 1.0 GiB free: lower --max-batch",
    ):
        main(["serve", "--max-batch", "64", "--port", port])


def test_calibrate_checks_where_it_saves_before_the_runs(no_loading, tmp_path):
    import shutil

    copy = shutil.copytree(ASSET, tmp_path / "d")
    (copy / "calibration.json").unlink(missing_ok=True)
    (copy / "calibration.json").mkdir()
    with pytest.raises(SystemExit, match=r"--save .*calibration.json is a directory"):
        main(["calibrate", "--drafter", str(copy), "--save"])


def test_generate_logprobs_give_a_split_character_to_the_token_that_completes_it(capsys):
    """Byte tokens of one character each decode alone to U+FFFD: the table shows '' for
    those before its last byte and the character at the last, as kdj serve does."""
    from kdj.checkpoints.gguf import smollm2_gguf_path
    from kdj.cli.generate import print_logprobs
    from kdj.decode.logprobs import TokenLogprob

    tok = kdj.load_tokenizer(smollm2_gguf_path())
    ids = tok.encode("日本")
    assert len(ids) > 2 and tok.decode(ids[:1]) == "\ufffd"
    print_logprobs(tok, ids, [TokenLogprob(-1.0, [(t, -1.0)]) for t in ids], 0)
    pieces = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert "".join(map(ast.literal_eval, pieces)) == "日本" and "\ufffd" not in "".join(pieces)


def test_train_drafter_keeps_out_of_folders_it_did_not_make(monkeypatch, tmp_path):
    """--out-dir: a folder of a user's files is not written into; an earlier run's folder
    whose checkpoints hold another drafter is refused before anything in it changes; one
    whose run left no checkpoints, or checkpoints of this drafter (a later call continues
    them), is taken, and the fields that only choose the first weights may differ."""
    import json

    import kdj.train.loop
    from kdj.checkpoints.gguf import smollm2_gguf_path
    from kdj.train.config import TrainConfig

    yaml = "configs/train/smollm2-b16.yaml"
    monkeypatch.setattr(kdj.train.loop, "run_training", lambda cfg: None)
    args = ["train-drafter", "--config", yaml, "--out-dir"]
    mine = tmp_path / "mine"
    (mine / "drafter").mkdir(parents=True)
    (mine / "drafter" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"mine holds files \(drafter\) and no train_config"):
        main([*args, str(mine)])
    carried = tmp_path / "carried"  # a data cache and a resume bundle carried in: kdj's own
    for part in ("data", "resume", ".gitkeep"):
        (carried / part).mkdir(parents=True)
    assert main([*args, str(carried)]) == 0
    run = tmp_path / "run"
    run.mkdir()
    record = run / "train_config.json"
    record.write_text(json.dumps(TrainConfig.from_yaml(yaml).to_dict()))
    assert main([*args, str(run), "--num-layers", "3"]) == 0  # no checkpoints to restore
    (run / "checkpoints").mkdir()
    before = record.read_text()
    with pytest.raises(SystemExit, match=r"run holds the checkpoints of another drafter "
                       r"\(drafter.num_layers: 4 there, 3 here\)"):  # fmt: skip
        main([*args, str(run), "--num-layers", "3"])
    with pytest.raises(SystemExit, match=r"drafter.target: 'smollm2-135m-instruct' there"):
        main([*args, str(run), "--target", str(smollm2_gguf_path())])
    assert record.read_text() == before
    assert main([*args, str(run), "--init-from", ""]) == 0
    record.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="is not a train_config.json kdj wrote"):
        main([*args, str(run)])


def test_running_out_of_device_memory_is_one_line(monkeypatch, tmp_path):
    """XLA's out-of-memory error ends a command in one line naming what to make smaller,
    not in its traceback; any other error still raises."""
    import kdj.train.loop

    def oom(cfg):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 68089000576 bytes.\n"
                           "Traceback of the allocator ...")  # fmt: skip

    monkeypatch.setattr(kdj.train.loop, "run_training", oom)
    args = ["train-drafter", "--config", "configs/train/smollm2-b16.yaml", "--out-dir"]
    with pytest.raises(SystemExit) as e:
        main([*args, str(tmp_path / "o")])
    said = str(e.value)
    assert said.startswith("kdj train-drafter: the device ran out of memory (RESOURCE_EXHAUSTED")
    assert "optim.batch_size" in said and "allocator" not in said
    monkeypatch.setattr(kdj.train.loop, "run_training", lambda cfg: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main([*args, str(tmp_path / "o")])


def test_flags_stand_for_api_names_only():
    """as_flags: an API name becomes its flag; a quoted key of a file and a call written out
    with its arguments stay as written."""
    from kdj.cli import as_flags

    flags = {"block_size": "--block-size", "kdj.load_target": "--target"}
    said = as_flags("block_size must be >= 2; 'block_size' in d/config.json; load it with "
                    "kdj.load_target(mesh=...) or pass kdj.load_target", flags)  # fmt: skip
    assert said == ("--block-size must be >= 2; 'block_size' in d/config.json; load it with "
                    "kdj.load_target(mesh=...) or pass --target")  # fmt: skip
