"""`kdj convert` (any checkpoint to kdj's Orbax format) and `kdj bench` (bench/roofline.py)."""

from __future__ import annotations

import argparse


def cmd_convert(args) -> int:
    import kdj
    from kdj import arguments
    from kdj.checkpoints import staging
    from kdj.checkpoints.orbax import save

    arguments.dtype(args.dtype)
    staging.check_destination(args.dest)  # before the (long) load of the source
    target = kdj.load_target(args.source, dtype=args.dtype)
    path = save(target.model, args.dest, target.tokenizer, args.source)
    print(f"saved {target.name} ({target.cfg.model_type}) to {path}")
    return 0


def cmd_bench(args) -> int:
    """Forward every argument to bench/roofline.py (it lives in the source checkout)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "roofline.py"
    if not path.exists():
        raise SystemExit(f"kdj bench needs a kdj source checkout ({path} is missing)")
    if str(path.parent) not in sys.path:  # the script imports bench/harness.py, as when run
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("kdj_bench_roofline", path)
    roofline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roofline)
    roofline.main(args.args, prog="kdj bench")
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("convert", help="convert a checkpoint to kdj's Orbax format")
    c.add_argument("source", help="HF checkpoint dir, .gguf file or built-in name")
    c.add_argument("dest", help="new (absent or empty) directory to write")
    c.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="weights dtype, float32 | bfloat16 (default: %(default)s)",
    )
    c.set_defaults(fn=cmd_convert)
    # "+" as its only prefix: every "--option" after `bench` is passed through untouched.
    b = sub.add_parser("bench", help="roofline of one target step (GPU benchmark)",
                       add_help=False, prefix_chars="+")  # fmt: skip
    b.add_argument("args", nargs=argparse.REMAINDER, help="bench/roofline.py arguments")
    b.set_defaults(fn=cmd_bench)
