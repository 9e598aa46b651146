"""`kdj generate`: text from a target (and drafter) on the command line."""

from __future__ import annotations

import argparse
import math

from kdj.cli import values
from kdj.cli.runs import (
    DEFAULTS,
    METHOD_FIELDS,
    check_method,
    check_per_prompt,
    check_sources,
    dtype_name,
    load_run,
    switch_method,
)
from kdj.cli.status import Status
from kdj.decode.logprobs import MAX_TOP

SAMPLE = "What is the capital of Australia?"
# generate's parameters as this command's flags, for messages raised by the Python API
FLAGS = {"kdj.load_drafter": "--drafter", "kdj.load_target": "--target",
         "max_new_tokens": "--max-new-tokens", "top_p": "--top-p", **METHOD_FIELDS}  # fmt: skip


def settle(args) -> dict:
    """The run: the YAML's fields, the flags' over them, every value and their combination
    checked (ValueError) before any model loads."""
    run = load_run(args.config)
    given = {key: getattr(args, key) for key in ("drafter", *METHOD_FIELDS)}
    if args.method is not None:
        switch_method(run, args.method, given)
    for key in ("target", "drafter", "dtype", "chat"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    dec = run["decode"]
    for key in ("max_new_tokens", "temperature", "top_p", "seed", "deterministic", *METHOD_FIELDS):
        if getattr(args, key) is not None:
            dec[key] = getattr(args, key)
    plain = dec["method"] == "ar" or (dec["method"] == "auto" and not run["drafter"])
    if plain and args.drafter is not None:
        raise ValueError(f"--drafter is not used by method {dec['method']!r} without drafting: "
                         "leave it out, or choose --method dflash, ddtree or auto")  # fmt: skip
    if plain:
        run["drafter"] = None  # not loaded: plain decoding never reads it
    flags = {key: flag for key, flag in METHOD_FIELDS.items() if getattr(args, key) is not None}
    check_method(run, args.config, {"drafter": "--drafter", **flags})
    prompts = args.prompt or [SAMPLE]
    check_per_prompt(run, args.config, len(prompts))
    if not run["chat"] and "" in prompts:
        raise ValueError(f"--prompt {prompts.index('')} is empty (with --no-chat nothing is "
                         "added to it): give some text")  # fmt: skip
    if args.config:  # an API message about a value the YAML gave names its field, not a flag
        args.flags = {**FLAGS, **{key: f"{args.config}: decode.{key}" for key in FLAGS
                                  if key in dec and getattr(args, key) is None}}  # fmt: skip
    block = "--block-size" if args.block_size else f"{args.config}: decode.block_size"
    most, asked = check_sources(run, block).max_position_embeddings, dec["max_new_tokens"]
    longest = max(asked) if isinstance(asked, list) else asked
    if longest >= most:  # a prompt takes a position too; the exact check follows the load
        raise ValueError(f"max_new_tokens {longest} leaves no position for a prompt: the "
                         f"model has max_position_embeddings {most}")  # fmt: skip
    return run


def cmd_generate(args) -> int:
    import kdj

    run = settle(args)
    dec = run["decode"]
    target = kdj.load_target(run["target"], dtype=dtype_name(run["dtype"]))
    drafter = kdj.load_drafter(run["drafter"], target=target) if run["drafter"] else None
    tok = target.tokenizer
    prompts = args.prompt or [SAMPLE]
    if tok is None:  # --prompt is text, with or without --chat
        raise ValueError(f"target {run['target']!r} has no tokenizer (tokenizer.json or "
                         "tiktoken.model beside its weights) to read --prompt with: add "
                         "its tokenizer's files there, or call kdj.generate with token "
                         "ids")  # fmt: skip
    if run["chat"]:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    with Status("kdj generate: compiling (first call of a shape: tens of seconds) and decoding"):
        out = kdj.generate(target, prompts, drafter=drafter, logprobs=args.logprobs, **dec)
    for i, text in enumerate(out.texts or [str(t) for t in out.tokens]):
        print(f"--- [{i}] {(args.prompt or [SAMPLE])[i]}")
        print(text)
        if out.logprobs is not None:
            print_logprobs(tok, out.tokens[i], out.logprobs[i], i)
        print(f"--- [{i}] finish: {out.finish_reasons[i]}, {len(out.tokens[i])} tokens")
    print_stats(out.stats)
    return 0


def print_stats(s: dict) -> None:
    """The run's summary lines; a mean over no steps (every token from prefill, or no tree
    verified) reads "none", not nan."""

    def num(x: float, digits: int) -> str:
        return "none" if math.isnan(x) else f"{x:.{digits}f}"

    if s["method"] != "ar":
        hist = " ".join(f"{k + 1}:{n}" for k, n in enumerate(s["acceptance_histogram"]) if n)
        print(f"--- tokens per step (tau) histogram: {hist or 'none (no decode step)'}")
    if s["method"] == "ddtree":
        capped = s["tree_budget"] != s["tree_budget_requested"]
        asked = f" (of {s['tree_budget_requested']} asked: what fits the cache)" if capped else ""
        print(f"--- tree budget {s['tree_budget']}{asked}, mean tree size "
              f"{num(s['mean_tree_size'], 1)}, mean accepted depth "
              f"{num(s['mean_accepted_depth'], 2)}")  # fmt: skip
    print(
        f"--- {s['method']}: {s['new_tokens']} tokens in {s['steps']} "
        f"{'step' if s['steps'] == 1 else 'steps'} of the batch, "
        f"mean acceptance {num(s['mean_acceptance'], 2)}, {num(s['tokens_per_s'], 1)} tok/s "
        f"decode (prefill {s['prefill_s'] * 1e3:.1f} ms, decode {s['decode_s'] * 1e3:.1f} ms, "
        f"compile {s['compile_s']:.1f} s)"
    )


def print_logprobs(tok, tokens: list[int], logprobs, i: int) -> None:
    """One line per emitted token: the text it adds (quoted, so whitespace shows), its
    log-probability, then its alternatives' most likely first. A character split across
    byte tokens counts for the token that completes it, as kdj serve reports it: alone, each
    byte decodes to the same U+FFFD."""
    context: list[int] = []  # the last few ids, decoded before each token's own

    def piece(t: int) -> str:
        head = tok.decode(context).rstrip("\ufffd")
        text = tok.decode([*context, t]).rstrip("\ufffd")
        return repr(text[len(head) :] if text.startswith(head) else tok.decode([t]))

    print(f"--- [{i}] logprobs: token, log-probability | alternatives")
    for t, x in zip(tokens, logprobs, strict=True):
        top = "  ".join(f"{piece(a)} {v:.4f}" for a, v in x.top)
        print(f"{piece(t):<16} {x.logprob:9.4f}" + (f"  | {top}" if top else ""))
        context = [*context, t][-4:]


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
        type=values.integer(2),
        help=f"run the drafter at a smaller block ({run} the drafter's own)",
    )
    g.add_argument(
        "--tree-budget",
        type=values.POSITIVE,
        help=f"DDTree: draft-tree nodes per step ({run} 64 with --method ddtree)",
    )
    g.add_argument(
        "--dtype",
        choices=values.DTYPES,
        help=f"float32 | bfloat16 | auto ({run} auto: float32 on CPU, bfloat16 on GPU/TPU)",
    )
    g.add_argument(
        "--method",
        choices=["ar", "dflash", "ddtree", "auto"],
        help=f"decoding method ({run} auto: per step, with a drafter)",
    )
    g.add_argument(
        "--max-new-tokens", type=values.POSITIVE, help=f"tokens to generate per prompt ({run} 128)"
    )
    g.add_argument(
        "--temperature", type=values.TEMPERATURE, help=f"sampling temperature, 0 = greedy ({run} 0)"
    )
    g.add_argument("--top-p", type=values.TOP_P, help=f"nucleus sampling mass in (0, 1] ({run} 1)")
    g.add_argument("--logprobs", type=values.integer(0, MAX_TOP), metavar="K",
                   help="print each emitted token's log-probability under the target (raw "
                   f"logits), and its K most likely alternatives', K in [0, {MAX_TOP}] "
                   "(default: none)")  # fmt: skip
    g.add_argument("--seed", type=values.SEED, help=f"sampling seed ({run} 0)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                   help="output independent of method, drafter and batch (kernels chosen per "
                        f"row; {run} false)")  # fmt: skip
    g.add_argument("--chat", action=argparse.BooleanOptionalAction,
                   help=f"apply the chat template to each prompt; --no-chat feeds it raw ({run} "
                   "true)")  # fmt: skip
    g.set_defaults(fn=cmd_generate, flags=FLAGS)
