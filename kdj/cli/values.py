"""argparse types: each flag's value is checked as it is parsed, so a bad one is refused
before anything loads, in a message that names the flag ("argument --max-batch: ..."); and
the paths a command writes, checked before its work."""

from __future__ import annotations

import argparse
import math
import os


def integer(minimum: int | None = None, maximum: int | None = None):
    """An int in [minimum, maximum] (either bound optional)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if (minimum is not None and n < minimum) or (maximum is not None and n > maximum):
            raise argparse.ArgumentTypeError(f"must be {_range(minimum, maximum)} (got {n})")
        return n

    return parse


def real(minimum: float | None = None, maximum: float | None = None, *, above: bool = False):
    """A finite float >= minimum (> minimum with `above`) and <= maximum."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be finite (got {text!r})")
        low = minimum is not None and (x <= minimum if above else x < minimum)
        if low or (maximum is not None and x > maximum):
            raise argparse.ArgumentTypeError(f"must be {_range(minimum, maximum, above)} "
                                             f"(got {x:g})")  # fmt: skip
        return x

    return parse


def _range(minimum, maximum, above: bool = False) -> str:
    if maximum is None:
        return f"{'>' if above else '>='} {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"in {'(' if above else '['}{minimum}, {maximum}]"


POSITIVE = integer(1)
COUNT = integer(0)
PORT = integer(1, 65535)
SEED = integer(0, 2**32 - 1)
TEMPERATURE = real(0.0)
TOP_P = real(0.0, 1.0, above=True)
DTYPES = ("float32", "bfloat16", "auto")


def output(path: str, flag: str, *, folder: bool = False, inputs: dict | None = None) -> None:
    """`path` can be written as a file (or, `folder`, a directory, made with its parents),
    checked before a long run rather than when it ends (ValueError naming `flag`); `inputs`
    ({flag: path}) are the command's own files, which it must not overwrite."""
    from pathlib import Path

    p = Path(path)
    for other, given in (inputs or {}).items():
        if given and Path(given).resolve() == p.resolve():
            raise ValueError(f"{flag} {path} is the {other} file: writing there would "
                             f"overwrite it; choose another {flag}")  # fmt: skip
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file: give a folder (new or existing)")
    if not folder and p.is_dir():
        raise ValueError(f"{flag} {path} is a directory: give a file name")
    parent = p if folder else p.parent
    while not parent.exists() and parent != parent.parent:  # the folder it would be made in
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write in {parent} (permission denied)")
