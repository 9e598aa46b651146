"""`kdj` command line: thin layers over the Python API (kdj/api.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def cmd_generate(args) -> int:
    import kdj

    run = _run_config(args.config)
    for key in ("target", "drafter", "dtype"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    if args.no_chat:
        run["chat"] = False
    dec = run["decode"]
    keys = ("method", "max_new_tokens", "temperature", "top_p", "seed", "block_size", "tree_budget")
    for key in keys:
        if getattr(args, key) is not None:
            dec[key] = getattr(args, key)
    if args.deterministic:
        dec["deterministic"] = True
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
    if s["method"] == "ddtree":
        print(
            f"--- tree budget {s['tree_budget']}, mean tree size {s['mean_tree_size']:.1f}, "
            f"mean accepted depth {s['mean_accepted_depth']:.2f}"
        )
    print(
        f"--- {s['method']}: {s['new_tokens']} tokens in {s['steps']} steps, "
        f"mean acceptance {s['mean_acceptance']:.2f}, {s['tokens_per_s']:.1f} tok/s decode "
        f"(prefill {s['prefill_s'] * 1e3:.1f} ms, decode {s['decode_s'] * 1e3:.1f} ms, "
        f"compile {s['compile_s']:.1f} s)"
    )
    return 0


# serve --warm: which modes (greedy True, sampled False) to compile before listening
WARM_MODES = {"all": (True, False), "greedy": (True,), "none": ()}


def cmd_serve(args) -> int:
    import uvicorn

    import kdj
    from kdj.serve.app import make_app

    run = _run_config(args.config)
    dec = run["decode"]
    target = kdj.load_target(run["target"], dtype=_dtype(run["dtype"]))
    drafter = kdj.load_drafter(run["drafter"], target=target) if run["drafter"] else None
    name = args.model_name or str(run["target"])
    app = make_app(target, name, drafter=drafter, method=dec["method"],
                   block_size=dec["block_size"], tree_budget=dec["tree_budget"],
                   max_batch=args.max_batch, context=args.context,
                   max_tokens=dec["max_new_tokens"], max_queue=args.max_queue,
                   chunk_steps=args.chunk_steps, temperature=dec["temperature"],
                   top_p=dec["top_p"], seed=dec["seed"], widths=args.widths,
                   warm=WARM_MODES[args.warm], cost=dec["cost"])  # fmt: skip
    # SIGTERM: uvicorn stops accepting, lets in-flight requests finish for up to
    # --grace seconds, then the app's shutdown cancels the rest
    uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.grace)
    return 0


def cmd_bench_serve(args) -> int:
    from kdj.serve import bench

    if args.prompts:  # eval_prompts.json written by train-drafter
        prompts = json.loads(Path(args.prompts).read_text())["sharegpt"]
    else:
        from kdj.train.data import sharegpt_split

        prompts = [m for _, m in sharegpt_split()[1]]
    lo, hi = (args.max_tokens * 2)[:2] if len(args.max_tokens) == 1 else args.max_tokens
    if not 1 <= lo <= hi:
        raise ValueError(f"--max-tokens: need 1 <= lo <= hi, got {args.max_tokens}")
    report = bench.run(args.url, prompts, args.concurrency, (lo, hi), args.requests,
                       seed=args.seed, model=args.model, warmup=not args.no_warmup,
                       waves=args.waves)  # fmt: skip
    print(bench.table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        bench.plot({report["model"]: report}, args.plot)
        print(f"wrote {args.plot}")
    return 0


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

    path = Path(__file__).resolve().parent.parent / "bench" / "roofline.py"
    if not path.exists():
        raise SystemExit(f"kdj bench needs a kdj source checkout ({path} is missing)")
    if str(path.parent) not in sys.path:  # the script imports bench/harness.py, as when run
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("kdj_bench_roofline", path)
    roofline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roofline)
    roofline.main(args.args)
    return 0


def cmd_train_drafter(args) -> int:
    from kdj.train.config import TrainConfig
    from kdj.train.loop import run_training
    from kdj.train.online import run_online

    cfg = TrainConfig.from_yaml(args.config)
    for key in ("target", "out_dir"):
        if getattr(args, key) is not None:
            setattr(cfg, key, getattr(args, key))
    if args.steps is not None:
        cfg.optim.steps = args.steps
    if args.max_minutes is not None:
        cfg.optim.max_minutes = args.max_minutes
    if args.init_from is not None:
        cfg.drafter.init_from = args.init_from or None  # "" trains from random weights
    if args.num_layers is not None:
        cfg.drafter.num_layers = args.num_layers
    (run_online if cfg.online is not None else run_training)(cfg)
    return 0


def cmd_eval_acceptance(args) -> int:
    import kdj
    from kdj.train import evaluate
    from kdj.train.loop import chat_prompts

    named = drafter_labels(args.drafter)
    target = kdj.load_target(args.target, dtype=_dtype(args.dtype))
    drafters = {label: kdj.load_drafter(src, target=target) for label, src in named.items()}
    if args.prompts:  # eval_prompts.json written by train-drafter: no dataset packages needed
        texts = json.loads(open(args.prompts).read())
    else:
        from kdj.train.data import humaneval_prompts, sharegpt_split

        texts = {"sharegpt": [m for _, m in sharegpt_split()[1]], "humaneval": humaneval_prompts()}
    n, tok = args.num_prompts, target.tokenizer
    datasets = {name: chat_prompts(tok, texts[name][:n], args.max_prompt_tokens)
                for name in args.datasets if texts.get(name)}  # fmt: skip
    if not datasets:
        raise SystemExit(f"no prompts for {args.datasets} in {args.prompts or 'the packages'}")
    ar_runs: dict = {}  # one AR run per (set, temperature), shared by every drafter
    reports = {}
    for label, drafter in drafters.items():
        out = Path(args.out) / label if len(drafters) > 1 else Path(args.out)
        meta = {"target": args.target, "drafter": named[label], "num_prompts": n,
                "max_new_tokens": args.max_new_tokens, "deterministic": args.deterministic,
                "dtype": args.dtype}  # fmt: skip
        reports[label] = evaluate.eval_acceptance(
            target, drafter, datasets, budgets=args.budgets, temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens, out_dir=out, meta=meta,
            deterministic=args.deterministic, ar_runs=ar_runs,
        )  # fmt: skip
        js, png = evaluate.write_report(reports[label], out, meta)
        print(f"{label}: wrote {js} and {png}")
    if len(reports) > 1:
        print(evaluate.compare_table(reports))
    return 0


def drafter_labels(specs: list[str]) -> dict[str, str]:
    """--drafter values ("NAME=SOURCE" or a bare SOURCE, labelled by its last path part) ->
    {label: source}; two drafters may not share a label (their reports share a folder)."""
    named: dict[str, str] = {}
    for spec in specs:
        label, sep, src = spec.partition("=")
        if not sep:
            label, src = Path(spec.rstrip("/")).name, spec
        if not label or not src:
            raise SystemExit(f"--drafter {spec!r}: give NAME=SOURCE or a drafter dir / name")
        if label in named:
            raise SystemExit(f"--drafter: two drafters are labelled {label!r}; name them "
                             "apart with NAME=SOURCE")  # fmt: skip
        named[label] = src
    return named


def cmd_tune(args) -> int:
    """Time auto's steps for each batch bucket, print the table, cache the fitted costs."""
    import kdj
    from kdj.decode import auto, tune

    target = kdj.load_target(args.target, dtype=_dtype(args.dtype))
    drafter = kdj.load_drafter(args.drafter, target=target)
    shapes = auto.parse_menu("auto", args.menu, drafter.cfg.block_size, None)
    for batch in args.batch:
        _, timings, path = tune.tune(target, drafter, shapes, batch, args.context)
        print(tune.table(timings))
        print(f"saved {path}")
    return 0


def cmd_calibrate(args) -> int:
    import kdj
    from kdj.train import calibrate
    from kdj.train.data import sharegpt_split
    from kdj.train.loop import chat_prompts

    target = kdj.load_target(args.target, dtype=_dtype(args.dtype))
    drafter = kdj.load_drafter(args.drafter, target=target)
    held_out = [m for _, m in sharegpt_split()[1]]  # conversations >= 16,000 only
    prompts = chat_prompts(target.tokenizer, held_out[: args.num_prompts], 512)
    report = calibrate.calibrate(
        target, drafter, prompts, method=args.method, tree_budget=args.tree_budget,
        temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "candidates"}, indent=2))
    if args.save:
        path = Path(args.drafter)
        if not path.exists():  # a built-in name
            path = kdj.loading.ASSETS / args.drafter
        print(f"wrote {calibrate.save(report, path)}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdj", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = "default: the run YAML's, else"
    g = sub.add_parser("generate", help="generate text (default: the embedded SmolLM2 model)")
    g.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for a batch; default: one sample question)",
    )
    g.add_argument("--config", help="run YAML, e.g. configs/runs/smollm2.yaml (default: none)")
    g.add_argument(
        "--target",
        help=f"HF dir, .gguf, kdj convert dir or built-in name ({run} {DEFAULTS['target']})",
    )
    g.add_argument(
        "--drafter",
        help="DFlash drafter checkpoint dir (published format) or "
        f"built-in name ({run} none: plain decoding)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        help=f"run the drafter at a smaller block ({run} the drafter's own)",
    )
    g.add_argument(
        "--tree-budget",
        type=int,
        help=f"DDTree: draft-tree nodes per step ({run} 64 with --method ddtree)",
    )
    g.add_argument(
        "--dtype",
        help=f"float32 | bfloat16 | auto ({run} auto: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    g.add_argument(
        "--method",
        choices=["ar", "dflash", "ddtree", "auto"],
        help=f"decoding method ({run} auto: per step, with a drafter)",
    )
    g.add_argument("--max-new-tokens", type=int, help=f"tokens to generate per prompt ({run} 128)")
    g.add_argument("--temperature", type=float, help=f"sampling temperature, 0 = greedy ({run} 0)")
    g.add_argument("--top-p", type=float, help=f"nucleus sampling mass in (0, 1] ({run} 1)")
    g.add_argument("--seed", type=int, help=f"sampling seed ({run} 0)")
    g.add_argument("--deterministic", action="store_true",
                   help="output independent of method, drafter and batch (kernels chosen per "
                        f"row; {run} false)")  # fmt: skip
    g.add_argument(
        "--no-chat",
        action="store_true",
        help="feed prompts raw, no chat template (default: the chat template)",
    )
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("convert", help="convert a checkpoint to kdj's Orbax format")
    c.add_argument("source", help="HF checkpoint dir, .gguf file or built-in name")
    c.add_argument("dest", help="new (absent or empty) directory to write")
    c.add_argument(
        "--dtype",
        default="bfloat16",
        help="weights dtype, float32 | bfloat16 (default: %(default)s)",
    )
    c.set_defaults(fn=cmd_convert)
    # "+" as its only prefix: every "--option" after `bench` is passed through untouched.
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs kdj[serve])")
    v.add_argument("--config", help="run YAML, e.g. configs/runs/smollm2.yaml (default: none)")
    v.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    v.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    v.add_argument("--model-name", help="the model id clients send (default: the target)")
    v.add_argument("--max-batch", type=int, default=8, help="slots of the pool (default: 8)")
    v.add_argument("--context", type=int, default=2048, help="tokens per slot (default: 2048)")
    v.add_argument("--max-queue", type=int, default=64, help="waiting requests (default: 64)")
    v.add_argument("--chunk-steps", type=int, default=16,
                   help="device steps between host turns (default: 16)")  # fmt: skip
    v.add_argument("--widths", type=int, nargs="+",
                   help="compiled widths the pool runs at, ending at --max-batch (default: "
                   "1 4 16 ... below it; --widths N with N = --max-batch: one width)")  # fmt: skip
    v.add_argument("--grace", type=int, default=30, help="SIGTERM grace seconds (default: 30)")
    v.add_argument("--warm", choices=["all", "greedy", "none"], default="all",
                   help="compile the pool's programs before listening: for greedy and sampled "
                   "requests, greedy only, or none (compiled as requests meet them; default: "
                   "%(default)s)")  # fmt: skip
    v.set_defaults(fn=cmd_serve)

    w = sub.add_parser("bench-serve", help="concurrency sweep against an OpenAI-compatible URL")
    w.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)"
    )
    w.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256],
                   help="client counts to sweep (default: 1 4 16 64 256)")  # fmt: skip
    w.add_argument("--requests", type=int, default=64,
                   help="requests per level, at least the concurrency (default: 64)")  # fmt: skip
    w.add_argument("--waves", type=int, default=1,
                   help="at least this many requests per client per level: the first wave "
                   "arrives at once, later ones show the steady state (default: 1)")  # fmt: skip
    w.add_argument("--max-tokens", type=int, nargs="+", default=[128],
                   help="output length N, or LO HI drawn uniformly (default: 128)")  # fmt: skip
    w.add_argument("--prompts", help="eval_prompts.json (default: held-out ShareGPT)")
    w.add_argument("--model", help="model id (default: the server's first)")
    w.add_argument(
        "--seed", type=int, default=0, help="seed of prompt and length draws (default: 0)"
    )
    w.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured pass over every level first (the server's "
                   "compiles then land in the measured rows; default: warm up)")  # fmt: skip
    w.add_argument("--out", help="write the report as JSON here (default: print only)")
    w.add_argument("--plot", help="write tok/s and TTFT against concurrency as a PNG here "
                   "(needs matplotlib; default: none)")  # fmt: skip
    w.set_defaults(fn=cmd_bench_serve)

    b = sub.add_parser("bench", help="roofline of one target step (bench/roofline.py --help)",
                       add_help=False, prefix_chars="+")  # fmt: skip
    b.add_argument("args", nargs=argparse.REMAINDER, help="bench/roofline.py arguments")
    b.set_defaults(fn=cmd_bench)
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (kdj.train)")
    t.add_argument("--config", required=True, help="training YAML, e.g. configs/train/*.yaml")
    keep = "default: the config's"
    t.add_argument("--target", help=f"override the config's target ({keep})")
    t.add_argument("--out-dir", help=f"override the config's out_dir ({keep})")
    t.add_argument("--steps", type=int, help=f"override optim.steps ({keep})")
    t.add_argument(
        "--max-minutes",
        type=float,
        help="stop (checkpoint + export) after this (default: optim.max_minutes)",
    )
    t.add_argument(
        "--init-from",
        help="override drafter.init_from: a DFlash drafter dir or built-in name to continue "
        f'training from ("" for random init; {keep})',
    )
    t.add_argument(
        "--num-layers", type=int, help=f"override drafter.num_layers (ablations; {keep})"
    )
    t.set_defaults(fn=cmd_train_drafter)
    e = sub.add_parser("eval-acceptance", help="tau and speed of DFlash / DDTree vs AR")
    e.add_argument("--drafter", required=True, nargs="+",
                   help="DFlash drafter dir or built-in name; several (NAME=SOURCE to label "
                   "them) are compared in one process against one AR run, a report each in "
                   "OUT/NAME")  # fmt: skip
    e.add_argument("--deterministic", action="store_true",
                   help="deterministic mode: tau depends only on the weights and prompts "
                   "(bf16 default kernels move it between processes); slower")  # fmt: skip
    d = " (default: %(default)s)"
    e.add_argument("--target", default="smollm2-135m-instruct", help="target to evaluate" + d)
    e.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto" + d)
    e.add_argument("--out", default="out/acceptance", help="folder for the JSON and PNG" + d)
    e.add_argument("--prompts", help="eval_prompts.json (default: read the dataset packages)")
    e.add_argument("--num-prompts", type=int, default=16, help="prompts per dataset" + d)
    e.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="longer prompts are cut to this" + d
    )
    e.add_argument(
        "--max-new-tokens", type=int, default=256, help="tokens generated per prompt" + d
    )
    e.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128, 256],
        help="DDTree budgets to run" + d,
    )
    e.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="sampling temperatures to run" + d,
    )
    e.add_argument("--datasets", nargs="+", choices=["sharegpt", "humaneval"],
                   default=["sharegpt", "humaneval"], help="held-out sets to run" + d)  # fmt: skip
    e.set_defaults(fn=cmd_eval_acceptance)
    k = sub.add_parser("calibrate", help="fit the drafter's forecast temperature (method=auto)")
    k.add_argument("--drafter", required=True, help="DFlash drafter dir or built-in name")
    k.add_argument("--target", default="smollm2-135m-instruct", help="its target" + d)
    k.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto" + d)
    k.add_argument(
        "--method",
        choices=["dflash", "ddtree"],
        default="ddtree",
        help="method whose steps are forecast" + d,
    )
    k.add_argument("--tree-budget", type=int, default=16, help="DDTree budget" + d)
    k.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.5, 0.7, 1.0, 1.5, 2.0],
        help="candidate forecast temperatures" + d,
    )
    k.add_argument("--num-prompts", type=int, default=8, help="held-out ShareGPT prompts" + d)
    k.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt" + d)
    k.add_argument(
        "--save",
        action="store_true",
        help="write calibration.json beside the drafter (default: only print)",
    )
    k.set_defaults(fn=cmd_calibrate)

    u = sub.add_parser("tune", help="time auto's steps on this machine and cache the costs")
    u.add_argument("--drafter", required=True, help="DFlash drafter dir or built-in name")
    u.add_argument("--target", default="smollm2-135m-instruct", help="its target" + d)
    u.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto" + d)
    u.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes" + d)
    u.add_argument("--context", type=int, default=256, help="tokens per sequence" + d)
    u.add_argument("--menu", nargs="+", default=None, help="auto's menu (default: its own)")
    u.set_defaults(fn=cmd_tune)
    return p


# Bad input the commands report in one line (the message names the problem and the fix).
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, NotImplementedError)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        raise SystemExit(f"kdj {args.cmd}: {e}") from e


if __name__ == "__main__":
    sys.exit(main())
