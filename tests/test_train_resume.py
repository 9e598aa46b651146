"""The resume bundle (kdj/train/resume.py): a trainer's whole state carried between windows."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from kdj.train.config import DrafterShape
from kdj.train.resume import read_bundle, restore_trainers, write_bundle
from kdj.train.trainer import DrafterTrainer, drafter_config_for, lr_schedule
from tests.test_train import BLOCK, VOCAB, optim, pattern_data, tiny_target

N, K = 8, 3  # steps in all, steps before the window ends


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def drafter_cfg(target, **kw):
    shape = dict(num_layers=2, block_size=BLOCK, mask_token_id=VOCAB - 1, intermediate_size=48)
    return drafter_config_for(target.cfg, DrafterShape(**(shape | kw)))


def trainer(target, warmup_frac=0.25, **kw):
    tokens, mask = pattern_data()
    opt = optim(steps=N, warmup_frac=warmup_frac, end_lr_frac=0.1)
    return DrafterTrainer(target, drafter_cfg(target, **kw), opt, tokens, mask)


def weights(tr) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((tr.params, tr.opt_state))]


@pytest.fixture(scope="module")
def window(target, tmp_path_factory):
    """K steps, then the bundle in parts of at most 20,000 bytes, with a second, untrained
    drafter of another width beside it (as online.compare's)."""
    tr, wide = trainer(target), trainer(target, intermediate_size=64)
    for _ in range(K):
        tr.train_step()
    folder = tmp_path_factory.mktemp("window") / "resume"
    stream = {"stream_pos": 40, "magpie_rounds": 2}
    path = write_bundle(folder, {"main": tr, "wide": wide}, "tiny", stream, part_bytes=20_000)
    return tr, wide, path


def test_resumed_training_takes_the_same_steps_as_one_run(target, window):
    """N steps in one go == K steps, the bundle, N - K steps in a fresh trainer: the same
    float32 weights and moments, and the schedule goes on where it stopped (not a new
    warmup)."""
    first, wide, path = window
    manifest = json.loads(path.read_text())
    assert len(manifest["parts"]) >= 3 and all(p["bytes"] <= 20_000 for p in manifest["parts"])
    assert manifest["trainers"]["main"]["step"] == K
    whole = trainer(target)
    lrs = []
    for _ in range(N):
        lrs.append(whole.learning_rate())
        whole.train_step()

    bundle = read_bundle(path.parent)  # the folder or its manifest
    assert bundle.online_state == {"stream_pos": 40, "magpie_rounds": 2}
    resumed, resumed_wide = trainer(target), trainer(target, intermediate_size=64)
    assert resumed.learning_rate() == 0.0  # a fresh trainer starts its warmup
    assert restore_trainers(bundle, {"main": resumed, "wide": resumed_wide}, "tiny") == []
    assert resumed.step == K
    assert resumed.learning_rate() == lrs[K] == pytest.approx(lr_schedule(resumed.optim)(K))
    assert lrs[K] > 0.1 * resumed.optim.lr
    for a, b in zip(weights(resumed_wide), weights(wide)):
        np.testing.assert_array_equal(a, b)
    for _ in range(N - K):
        resumed.train_step()
    assert resumed.step == whole.step == N
    for a, b in zip(weights(resumed), weights(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_bundle_dropped_from_the_config_is_reported(target, window):
    _, _, path = window
    assert restore_trainers(read_bundle(path), {"wide": trainer(target, intermediate_size=64)},
                            "tiny") == ["main"]  # fmt: skip


@pytest.fixture
def copy(window, tmp_path):
    """A copy of the window's bundle to damage."""
    _, _, path = window
    out = tmp_path / "resume"
    out.mkdir()
    for f in path.parent.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out / path.name


def test_a_corrupt_or_missing_part_is_named(copy):
    parts = json.loads(copy.read_text())["parts"]
    bad = copy.parent / parts[1]["file"]
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"part {parts[1]['file']} is corrupt"):
        read_bundle(copy)
    (copy.parent / parts[2]["file"]).unlink()
    bad.write_bytes(bytes(data[:-1]))  # a short part is corrupt too, found first
    with pytest.raises(ValueError, match=f"part {parts[1]['file']} is corrupt"):
        read_bundle(copy)
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(FileNotFoundError, match=f"part {parts[2]['file']} is missing"):
        read_bundle(copy)


def test_a_mismatched_config_names_the_field_and_both_values(target, window):
    _, _, path = window
    bundle = read_bundle(path)
    other = trainer(target, warmup_frac=0.5)
    with pytest.raises(ValueError, match=r"main: optim.warmup_frac is 0.25 in the bundle, 0.5 "
                                         r"configured"):  # fmt: skip
        restore_trainers(bundle, {"main": other}, "tiny")
    shallower = trainer(target, num_layers=1)
    with pytest.raises(ValueError, match="main: drafter.num_layers is 2 in the bundle, 1 conf"):
        restore_trainers(bundle, {"main": shallower}, "tiny")
    with pytest.raises(ValueError, match=r"target: 'tiny' in the bundle, 'other' configured"):
        restore_trainers(bundle, {"main": trainer(target)}, "other")
    with pytest.raises(ValueError, match=r"no state for \['new'\] \(it holds \['main', 'wide'\]"):
        restore_trainers(bundle, {"new": trainer(target)}, "tiny")


def test_a_bundle_is_replaced_only_when_asked(window, copy, tmp_path):
    first, wide, _ = window
    with pytest.raises(FileExistsError, match="a resume bundle is there already"):
        write_bundle(copy.parent, {"main": first}, "tiny")
    old = {p["file"] for p in json.loads(copy.read_text())["parts"]}
    write_bundle(copy.parent, {"main": first}, "tiny", part_bytes=50_000, replace=True)
    new = {p["file"] for p in json.loads(copy.read_text())["parts"]}
    assert {f.name for f in copy.parent.iterdir()} == new | {"resume.json"} and new != old
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "resume.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="is not a resume bundle's manifest"):
        write_bundle(foreign, {"main": first}, "tiny", replace=True)
    assert (foreign / "resume.json").read_text() == '{"a": 1}'
