"""`kdj` command line: thin layers over the Python API (kdj/api.py)."""

from __future__ import annotations

import argparse

from kdj.cli import convert, generate, serve, train


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdj", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for module in (generate, convert, serve, train):
        module.add_parsers(sub)
    return p


# Bad input the commands report in one line (the message names the problem and the fix).
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, NotImplementedError)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        raise SystemExit(f"kdj {args.cmd}: {e}") from e
