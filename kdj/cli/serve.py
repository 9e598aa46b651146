"""`kdj serve` (the OpenAI-compatible server) and `kdj bench-serve` (its concurrency sweep)."""

from __future__ import annotations

import json
from pathlib import Path

from kdj.cli import values
from kdj.cli.extras import needs
from kdj.cli.runs import check_method, check_per_prompt, check_sources, dtype_name, load_run

# the engine's parameters as serve's flags, for messages raised below the command line; the
# pair comes from the run YAML alone (serve has no --target or --drafter)
FLAGS = {"kdj.load_drafter": "the run YAML's drafter:", "kdj.load_target": "the run YAML's target:",
         "max_batch": "--max-batch", "chunk_steps": "--chunk-steps",
         "max_queue": "--max-queue"}  # fmt: skip
# serve --warm: which modes (greedy True, sampled False) to compile before listening
WARM_MODES = {"all": (True, False), "greedy": (True,), "none": ()}


def check_serve(args, run: dict) -> None:
    """The flags and the run YAML as the server takes them (ValueError), before any model
    loads; each number's range is argparse's (kdj.cli.values)."""
    from kdj.decode.widths import ladder

    if args.widths is not None:
        try:
            ladder(args.max_batch, args.widths)
        except ValueError:
            raise ValueError(f"--widths {' '.join(map(str, args.widths))}: the widths must end "
                             f"at --max-batch ({args.max_batch}), e.g. --widths 1 "
                             f"{args.max_batch}") from None  # fmt: skip
    dec = run["decode"]
    if dec["deterministic"]:
        raise ValueError(f"{args.config}: decode.deterministic: kdj serve does not run "
                         "deterministic mode; set it false (kdj generate "
                         "--deterministic does)")  # fmt: skip
    check_method(run, args.config, {})
    check_per_prompt(run, args.config, None)
    positions = check_sources(run, f"{args.config}: decode.block_size").max_position_embeddings
    if args.context > positions:
        raise ValueError(f"--context {args.context} exceeds the model's max_position_embeddings "
                         f"({positions}): positions past it are not ones it was trained "
                         f"on; give --context {positions} or less")  # fmt: skip


def check_address(host: str, port: int) -> None:
    """`host:port` can be listened on, found before the load and the compiles (minutes on a
    CPU) rather than after them (OSError naming the address)."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]  # fmt: skip
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why += ": another server listens there; stop it or choose another --port"
        raise OSError(f"cannot listen on {host}:{port} ({why})") from None


def free_memory() -> int | None:
    """Bytes the devices can still take (an accelerator's, else the host's available RAM);
    None where it cannot be told."""
    import jax

    devices = jax.local_devices()
    if devices[0].platform == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in s for s in stats):
        return None
    return sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)


def check_pool_fits(target, max_batch: int, context: int) -> None:
    """The pool's target KV cache alone (a lower bound on what serving holds) fits the
    memory left once the model loaded: --max-batch 512 was killed by the OS while warming
    up."""
    import jax

    from kdj.cache import init_cache

    shapes = jax.eval_shape(lambda: init_cache(target.cfg, max_batch, context, target.dtype))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    free = free_memory()
    if free is not None and need > free:
        raise ValueError(f"a pool of {max_batch} slots x {context} tokens needs "
                         f"{need / 2**30:.1f} GiB of KV cache ({need / max_batch / 2**20:.0f} "
                         f"MiB a slot), more than the {free / 2**30:.1f} GiB free: lower "
                         "--max-batch or --context")  # fmt: skip


def check_context_holds_a_chat(target, context: int) -> None:
    """A slot of --context tokens holds a one-word chat message under the target's chat
    template and one token of answer: a smaller one would answer every chat request 400."""
    tok = target.tokenizer
    least = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))) + 1
    if context < least:
        raise ValueError(f"--context {context} holds no chat request: the chat template "
                         f"alone takes {least - 1} tokens of a one-word message, and its "
                         f"answer one more; give --context {least} or more (the default is "
                         "2048)")  # fmt: skip


def cmd_serve(args) -> int:
    import kdj

    run = load_run(args.config)
    check_serve(args, run)
    with needs("serve"):
        import uvicorn

        from kdj.serve.app import make_app
    check_address(args.host, args.port)
    dec = run["decode"]
    target = kdj.load_target(run["target"], dtype=dtype_name(run["dtype"]))
    drafter = kdj.load_drafter(run["drafter"], target=target) if run["drafter"] else None
    check_pool_fits(target, args.max_batch, args.context)
    check_context_holds_a_chat(target, args.context)
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
    with needs("serve"):
        from kdj.serve import bench

    from kdj.serve import prompts as sources

    lo, hi = args.max_tokens[0], args.max_tokens[-1]
    if len(args.max_tokens) > 2 or lo > hi:
        raise ValueError(f"--max-tokens: give N, or LO HI with LO <= HI (got "
                         f"{' '.join(map(str, args.max_tokens))})")  # fmt: skip
    # the sweep can take an hour: what it writes is checked first
    for flag in ("--out", "--plot"):
        if getattr(args, flag[2:]):
            others = {"--prompts": args.prompts, "--out": args.out if flag == "--plot" else None}
            values.output(getattr(args, flag[2:]), flag, inputs=others)
    if args.plot:
        with needs("train"):  # matplotlib
            import matplotlib  # noqa: F401
    if args.prompts:
        prompts = sources.from_file(args.prompts)
    else:
        prompts, origin = sources.default(seed=args.seed)
        print(f"prompts: {origin}")
    url = args.url.rstrip("/")
    url = url.removesuffix("/v1")  # an OpenAI client's base_url names /v1; the sweep adds it
    try:
        report = bench.run(url, prompts, args.concurrency, (lo, hi), args.requests,
                           seed=args.seed, model=args.model, warmup=not args.no_warmup,
                           waves=args.waves, procs=args.procs)  # fmt: skip
    except bench.ServerError as e:
        raise SystemExit(f"kdj bench-serve: {e}") from None
    print(bench.table(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        bench.plot({report["model"]: report}, args.plot)
        print(f"wrote {args.plot}")
    return 0


def add_parsers(sub) -> None:
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs kdj[serve])")
    v.add_argument("--config", help="run YAML, e.g. configs/runs/smollm2.yaml (default: none)")
    v.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    v.add_argument(
        "--port", type=values.PORT, default=8000, help="port to listen on (default: %(default)s)"
    )
    v.add_argument("--model-name", help="the model id clients send (default: the target)")
    v.add_argument(
        "--max-batch", type=values.POSITIVE, default=8, help="slots of the pool (default: 8)"
    )
    v.add_argument(
        "--context", type=values.integer(2), default=2048, help="tokens per slot (default: 2048)"
    )
    v.add_argument(
        "--max-queue", type=values.POSITIVE, default=64, help="waiting requests (default: 64)"
    )
    v.add_argument("--chunk-steps", type=values.POSITIVE,
                   help="device steps between host turns, fixed (default: as few, up to 16, "
                   "as keep the device busy and amortise each chunk's own cost, so tokens "
                   "stream a few steps apart)")  # fmt: skip
    v.add_argument("--widths", type=values.POSITIVE, nargs="+",
                   help="compiled widths the pool runs at, ending at --max-batch (default: "
                   "1 4 16 ... below it; --widths N with N = --max-batch: one width)")  # fmt: skip
    v.add_argument(
        "--grace", type=values.COUNT, default=30, help="SIGTERM grace seconds (default: 30)"
    )
    v.add_argument("--warm", choices=["all", "greedy", "none"], default="all",
                   help="compile the pool's programs before listening: for greedy and sampled "
                   "requests, greedy only, or none (compiled as requests meet them; default: "
                   "%(default)s)")  # fmt: skip
    v.set_defaults(fn=cmd_serve, flags=FLAGS)

    w = sub.add_parser("bench-serve", help="concurrency sweep against an OpenAI-compatible URL")
    w.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL, with or without /v1 (default: %(default)s)",
    )
    w.add_argument("--concurrency", type=values.POSITIVE, nargs="+", default=[1, 4, 16, 64, 256],
                   help="client counts to sweep (default: 1 4 16 64 256)")  # fmt: skip
    w.add_argument("--requests", type=values.POSITIVE, default=64,
                   help="requests per level, at least the concurrency (default: 64)")  # fmt: skip
    w.add_argument("--waves", type=values.POSITIVE, default=1,
                   help="at least this many requests per client per level: the first wave "
                   "arrives at once, later ones show the steady state (default: 1)")  # fmt: skip
    w.add_argument("--max-tokens", type=values.POSITIVE, nargs="+", default=[128],
                   help="output length N, or LO HI drawn uniformly (default: 128)")  # fmt: skip
    w.add_argument("--prompts", help="a JSON list of prompts, or eval_prompts.json (default: "
                   "held-out ShareGPT with kdj[train], else synthetic requests)")  # fmt: skip
    w.add_argument("--procs", type=values.POSITIVE,
                   help="client processes per level (default: one per 64 clients)")  # fmt: skip
    w.add_argument("--model", help="model id (default: the server's first)")
    w.add_argument(
        "--seed", type=values.SEED, default=0, help="seed of prompt and length draws (default: 0)"
    )
    w.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured pass over every level first (the server's "
                   "compiles then land in the measured rows; default: warm up)")  # fmt: skip
    w.add_argument("--out", help="write the report as JSON here (default: print only)")
    w.add_argument("--plot", help="write tok/s and TTFT against concurrency as a PNG here "
                   "(needs matplotlib; default: none)")  # fmt: skip
    w.set_defaults(fn=cmd_bench_serve)
