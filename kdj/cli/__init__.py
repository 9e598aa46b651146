"""`kdj` command line: thin layers over the Python API (kdj/api.py)."""

from __future__ import annotations

import argparse
import re
import sys

from kdj.cli import convert, generate, serve, train

DESCRIPTION = (
    "Speculative decoding (DFlash, DDTree, auto) in JAX. Start with: kdj generate --prompt "
    "'What is the capital of Australia?'. Each command's flags: kdj COMMAND --help."
)


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors carry their message in the SystemExit (callers of
    `main`, tests among them, see why), after the usage line on stderr."""

    def error(self, message):
        self.print_usage(sys.stderr)
        raise SystemExit(f"{self.prog}: error: {message}")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="kdj", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"kdj {version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for module in (generate, convert, serve, train):
        module.add_parsers(sub)
    return p


def version() -> str:
    """The installed kdj's version (its package metadata), or "unknown" when not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version("kdj")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# Bad input the commands report in one line (the message names the problem and the fix).
USER_ERRORS = (ValueError, TypeError, OSError, NotImplementedError)
# what an out-of-memory error asks to shrink, unless the command's `sizes` says
SIZES = "the batch, the context or the tokens asked for"


def as_flags(message: str, flags: dict[str, str]) -> str:
    """A Python API message in the command's words: each API name (a parameter, a call) that
    stands for one of its flags becomes the flag (`flags`: name -> flag). A quoted name is a
    key of a file or a request, named as written there, and stays; so does a call written
    out with its arguments (kdj.load_target(mesh=...)), which no flag spells."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w.'\"-]){re.escape(name)}(?![\w'\"(])", flag, message)
    return message


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # a bare `kdj`: what it does and its commands, not "arguments are required"
        parser().print_help(sys.stderr)
        return 2
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        raise SystemExit(f"kdj {args.cmd}: {as_flags(str(e), getattr(args, 'flags', {}))}") from e
    except KeyboardInterrupt:
        raise SystemExit(f"kdj {args.cmd}: interrupted") from None  # Ctrl-C: no traceback
    except Exception as e:  # XLA's out-of-memory error: one line, not its traceback
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        said = str(e).strip().splitlines()[0][:300]
        raise SystemExit(f"kdj {args.cmd}: the device ran out of memory ({said}): this run "
                         f"is too large for it; make {getattr(args, 'sizes', SIZES)} "
                         "smaller") from None  # fmt: skip
    except SystemExit as e:  # a one-line exit of the command's own says whose it is too
        said = e.code
        if isinstance(said, str) and not said.startswith("kdj "):
            raise SystemExit(f"kdj {args.cmd}: {said}") from None
        raise
