"""Run YAMLs (configs/runs/*.yaml): a target, a drafter and generate's arguments, read and
checked before anything loads."""

from __future__ import annotations

import json

DEFAULTS = {
    "target": "smollm2-135m-instruct",
    "drafter": None,
    "dtype": "auto",
    "chat": True,
    "decode": {
        "method": "auto",
        "max_new_tokens": 128,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "block_size": None,
        "tree_budget": None,
        "deterministic": False,
        "cost": None,  # auto's step costs: a StepCost JSON, "tune", "estimate" (kdj.generate)
    },
}


def dtype_name(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_run(path: str | None) -> dict:
    from kdj.config import load_yaml

    cfg = json.loads(json.dumps(DEFAULTS))  # deep copy
    if path is not None:
        run = load_yaml(path)
        unknown = set(run) - set(DEFAULTS)
        if unknown:
            raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; expected {sorted(DEFAULTS)}")
        decode = run.get("decode") or {}
        if not isinstance(decode, dict):
            raise SystemExit(f"{path}: decode must be a mapping of generate arguments")
        typos = set(decode) - set(DEFAULTS["decode"])
        if typos:  # before any target loads
            raise SystemExit(f"{path}: unknown decode keys {sorted(typos)}; expected "
                             f"{sorted(DEFAULTS['decode'])}")  # fmt: skip
        cfg.update({k: v for k, v in run.items() if k != "decode"})
        cfg["decode"].update(decode)
    return cfg
