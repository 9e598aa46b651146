"""`kdj` command line: thin layers over the Python API (kdj/api.py)."""

from __future__ import annotations

import argparse
import json
import sys

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
    },
}


def _dtype(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _run_config(path: str | None) -> dict:
    from kdj.config import load_yaml

    cfg = json.loads(json.dumps(DEFAULTS))  # deep copy
    if path is not None:
        run = load_yaml(path)
        unknown = set(run) - set(DEFAULTS)
        if unknown:
            raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; expected {sorted(DEFAULTS)}")
        cfg.update({k: v for k, v in run.items() if k != "decode"})
        cfg["decode"].update(run.get("decode") or {})
    return cfg


def cmd_generate(args) -> int:
    import kdj

    run = _run_config(args.config)
    for key in ("target", "drafter", "dtype"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    if args.no_chat:
        run["chat"] = False
    dec = run["decode"]
    for key in ("method", "max_new_tokens", "temperature", "top_p", "seed", "block_size"):
        if getattr(args, key) is not None:
            dec[key] = getattr(args, key)
    target = kdj.load_target(run["target"], dtype=_dtype(run["dtype"]))
    drafter = kdj.load_drafter(run["drafter"], target=target) if run["drafter"] else None
    tok = target.tokenizer
    prompts = args.prompt or ["What is the capital of Australia?"]
    if run["chat"]:
        if tok is None:
            raise SystemExit("--chat needs a tokenizer; this target has none (use --no-chat)")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    out = kdj.generate(target, prompts, drafter=drafter, **dec)
    for i, text in enumerate(out.texts or [str(t) for t in out.tokens]):
        print(f"--- [{i}] {args.prompt[i] if args.prompt else 'What is the capital of Australia?'}")
        print(text)
    s = out.stats
    if s["method"] != "ar":
        hist = " ".join(f"{k + 1}:{n}" for k, n in enumerate(s["acceptance_histogram"]) if n)
        print(f"--- tokens per step (tau) histogram: {hist}")
    print(
        f"--- {s['method']}: {s['new_tokens']} tokens in {s['steps']} steps, "
        f"mean acceptance {s['mean_acceptance']:.2f}, {s['tokens_per_s']:.1f} tok/s decode "
        f"(prefill {s['prefill_s'] * 1e3:.1f} ms, decode {s['decode_s'] * 1e3:.1f} ms, "
        f"compile {s['compile_s']:.1f} s)"
    )
    return 0


def cmd_convert(args) -> int:
    import kdj
    from kdj.checkpoints.orbax import save

    target = kdj.load_target(args.source, dtype=args.dtype)
    path = save(target.model, args.dest)
    print(f"saved {target.name} ({target.cfg.model_type}) to {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kdj", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text (default: the embedded SmolLM2 model)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--config", help="run YAML, e.g. configs/runs/smollm2.yaml")
    g.add_argument("--target", help="HF dir, .gguf, kdj convert dir or built-in name")
    g.add_argument("--drafter", help="DFlash drafter checkpoint dir (published format)")
    g.add_argument("--block-size", type=int, help="run the drafter at a smaller block")
    g.add_argument("--dtype", help="float32 | bfloat16 | auto")
    g.add_argument("--method", choices=["ar", "dflash", "ddtree", "auto"])
    g.add_argument("--max-new-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--no-chat", action="store_true", help="feed prompts raw, no chat template")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("convert", help="convert a checkpoint to kdj's Orbax format")
    c.add_argument("source")
    c.add_argument("dest")
    c.add_argument("--dtype", default="bfloat16")
    c.set_defaults(fn=cmd_convert)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
