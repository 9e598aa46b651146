"""The resume bundle: a trainer's whole state, carried from one GPU window to the next, so
one learning-rate schedule spans windows instead of restarting in each.

Nothing on the GPU machine survives a window and files come back in pieces of at most
16 MiB, so the state is written as a folder of small parts plus a JSON manifest:

    resume.json            the manifest (below)
    part-000-<sha>.bin     consecutive slices of one safetensors file, each at most
    part-001-<sha>.bin     `part_bytes` (default 15 MiB); <sha> is the first 12 hex
    ...                    digits of the part's SHA-256

Concatenated in the manifest's order, the parts are one safetensors file holding, for each
trainer ("main" and every online.compare drafter), its float32 master weights and its whole
optax state (both Adam moments and the step counts that place the schedule), as
"<trainer>/params/<path>" and "<trainer>/opt_state/<path>" with <path> the pytree path.

The manifest (format "kdj-drafter-resume", version 1) lists the parts (file, bytes,
sha256), the target's name, the online campaign's stream position (OnlineState) and, per
trainer, its step, the step its data started at, the learning rate of its next step and the
config fields the state only makes sense under: the drafter's shape and the optim fields
that define the schedule and the update (SCHEDULE_FIELDS). Resuming under another value of
any of them is a ValueError naming the field and both values; a missing part is a
FileNotFoundError and a corrupt one a ValueError, each naming the part.

A bundle is replaced with no moment where no valid one exists: the new parts are written
beside the old (their names carry their checksums), then the manifest is swapped in one
rename, then the old parts are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from kdj.train.trainer import shape_fields

FORMAT, VERSION = "kdj-drafter-resume", 1
MANIFEST = "resume.json"
PART_BYTES = 15 * 2**20  # a part plus nothing else fits one 16 MiB result file
# the optim fields a carried optimiser state depends on: the schedule (steps, lr, warmup,
# end), the update (moments, decay, clipping), what a step trains on and the data's seeds
SCHEDULE_FIELDS = (
    "steps", "lr", "warmup_frac", "end_lr_frac", "b1", "b2", "weight_decay", "grad_clip",
    "batch_size", "labels", "gamma", "seed",
)  # fmt: skip


@dataclass
class Bundle:
    """A read, verified bundle: its manifest and its tensors (host arrays)."""

    path: Path
    manifest: dict
    tensors: dict[str, np.ndarray]

    @property
    def online_state(self) -> dict | None:
        return self.manifest.get("online_state")


def _path_name(path) -> str:
    """A pytree path as "a/b/0/c": dict keys, sequence indices and attribute names."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            raise TypeError(f"unexpected pytree path entry {k!r}")
    return "/".join(parts)


def _leaves(trainer) -> list:
    """(name, array) of every leaf of the trainer's params and optimiser state, in tree order."""
    tree = {"params": trainer.params, "opt_state": trainer.opt_state}
    return [(_path_name(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _json(value):
    """value as it reads back from JSON (tuples become lists), to compare like with like."""
    return json.loads(json.dumps(value))


def trainer_fields(trainer) -> dict:
    """What must agree between a bundle's trainer and the trainer it resumes."""
    optim = {k: getattr(trainer.optim, k) for k in SCHEDULE_FIELDS}
    return _json({"drafter": shape_fields(trainer.cfg), "optim": optim})


def _sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bundle(folder, trainers: dict, target: str, online_state: dict | None = None,
                 part_bytes: int = PART_BYTES, replace: bool = False) -> Path:  # fmt: skip
    """Write the state of `trainers` ({name: DrafterTrainer}) to `folder`; returns the
    manifest's path. An existing bundle there is a FileExistsError unless `replace`; a
    resume.json there that is not a bundle's is never replaced (ValueError)."""
    from safetensors.numpy import save

    if part_bytes < 1:
        raise ValueError(f"a resume bundle's part_bytes must be positive, not {part_bytes}")
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    old = None
    if manifest_path.exists():
        old = _read_manifest(manifest_path)  # a ValueError if it is not a bundle's
        if not replace:
            raise FileExistsError(f"{manifest_path} exists: a resume bundle is there already")
    tensors, records = {}, {}
    for name, tr in trainers.items():
        for key, x in _leaves(tr):
            tensors[f"{name}/{key}"] = np.asarray(x)
        records[name] = dict(trainer_fields(tr), step=tr.step, data_start=tr.data_start,
                             learning_rate=tr.learning_rate())  # fmt: skip
    payload = save(tensors, metadata={"format": FORMAT})
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, start in enumerate(range(0, len(payload), part_bytes)):
        chunk = payload[start : start + part_bytes]
        sha = _sha256(chunk)
        file = f"part-{i:03d}-{sha[:12]}.bin"
        (folder / file).write_bytes(chunk)
        parts.append({"file": file, "bytes": len(chunk), "sha256": sha})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "payload": "safetensors",
        "bytes": len(payload),
        "parts": parts,
        "target": target,
        "online_state": online_state,
        "trainers": records,
    }
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, manifest_path)  # the new bundle is complete before it is named
    keep = {p["file"] for p in parts}
    for p in old["parts"] if old else []:
        if p["file"] not in keep:
            (folder / p["file"]).unlink(missing_ok=True)
    return manifest_path


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a resume bundle's manifest (not JSON: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a resume bundle's manifest (format is not {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path}: resume bundle version {manifest.get('version')!r}; this kdj "
                         f"reads version {VERSION}")  # fmt: skip
    return manifest


def read_bundle(path) -> Bundle:
    """Read and verify a bundle: `path` is its manifest (or the folder holding it). Every part
    must be there with the size and SHA-256 the manifest records."""
    from safetensors.numpy import load

    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    manifest = _read_manifest(path)
    chunks = []
    for p in manifest["parts"]:
        file = path.parent / p["file"]
        if not file.exists():
            raise FileNotFoundError(
                f"resume bundle {path}: part {p['file']} is missing (expected in {path.parent})"
            )
        chunk = file.read_bytes()
        if len(chunk) != p["bytes"] or _sha256(chunk) != p["sha256"]:
            raise ValueError(
                f"resume bundle {path}: part {p['file']} is corrupt ({len(chunk)} bytes, "
                f"SHA-256 {_sha256(chunk)[:12]}...; the manifest records {p['bytes']} bytes, "
                f"{p['sha256'][:12]}...)"
            )
        chunks.append(chunk)
    return Bundle(path, manifest, load(b"".join(chunks)))


def check_matches(bundle: Bundle, trainers: dict, target: str) -> None:
    """ValueError naming every field where the bundle's trainers and `trainers` disagree,
    with both values; every trainer to resume must be in the bundle."""
    have = bundle.manifest["trainers"]
    missing = [name for name in trainers if name not in have]
    if missing:
        raise ValueError(
            f"resume bundle {bundle.path} has no state for {missing} (it holds {sorted(have)}): "
            "a drafter added to online.compare cannot resume from it"
        )
    bad = []
    if bundle.manifest["target"] != target:
        bad.append(f"target: {bundle.manifest['target']!r} in the bundle, {target!r} configured")
    for name, tr in trainers.items():
        want = trainer_fields(tr)
        for section, fields in want.items():
            for k, v in fields.items():
                got = have[name][section].get(k)
                if got != v:
                    bad.append(f"{name}: {section}.{k} is {got!r} in the bundle, {v!r} configured")
    if bad:
        raise ValueError(f"resume bundle {bundle.path} does not match the config: {'; '.join(bad)}")


def restore_trainers(bundle: Bundle, trainers: dict, target: str) -> list[str]:
    """Put the bundle's state into `trainers` (freshly built for the same config): weights,
    optimiser state, step and data start. Returns the names of the bundle's trainers that
    `trainers` does not have (a compare drafter dropped from the config)."""
    check_matches(bundle, trainers, target)
    for name, tr in trainers.items():
        template = {"params": tr.params, "opt_state": tr.opt_state}
        paths, treedef = jax.tree_util.tree_flatten_with_path(template)
        expected = {f"{name}/{_path_name(p)}" for p, _ in paths}
        extra = sorted(k for k in bundle.tensors if k.startswith(f"{name}/") and k not in expected)
        if extra:
            raise ValueError(f"resume bundle {bundle.path}: tensors {extra[:4]} are not in the "
                             f"{name!r} trainer's state")  # fmt: skip
        leaves = []
        for p, x in paths:
            key = f"{name}/{_path_name(p)}"
            a = bundle.tensors.get(key)
            if a is None:
                raise ValueError(f"resume bundle {bundle.path} has no tensor {key}")
            if a.shape != x.shape or a.dtype != x.dtype:
                raise ValueError(f"resume bundle {bundle.path}: {key} is {a.dtype}{list(a.shape)}, "
                                 f"the trainer's {x.dtype}{list(x.shape)}")  # fmt: skip
            leaves.append(jax.device_put(a, x.sharding))
        state = jax.tree_util.tree_unflatten(treedef, leaves)
        tr.params, tr.opt_state = state["params"], state["opt_state"]
        record = bundle.manifest["trainers"][name]
        tr.step, tr.data_start = int(record["step"]), int(record["data_start"])
    return sorted(set(bundle.manifest["trainers"]) - set(trainers))
