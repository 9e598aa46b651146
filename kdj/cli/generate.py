"""`kdj generate`: text from a target (and drafter) on the command line."""

from __future__ import annotations

from kdj.cli.runs import DEFAULTS, dtype_name, load_run


def cmd_generate(args) -> int:
    import kdj

    run = load_run(args.config)
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
    target = kdj.load_target(run["target"], dtype=dtype_name(run["dtype"]))
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


def add_parsers(sub) -> None:
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
