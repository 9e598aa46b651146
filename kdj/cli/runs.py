"""Run YAMLs (configs/runs/*.yaml): a target, a drafter and generate's arguments, read and
checked before anything loads, then merged with the command line's flags."""

from __future__ import annotations

import json
import re
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
        "tree_budget": None,
        "deterministic": False,
        "cost": None,  # auto's step costs: a StepCost JSON, "tune", "estimate" (kdj.generate)
    },
}


def dtype_name(name: str) -> str:
    if name != "auto":
        return name
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def load_run(path: str | None) -> dict:
    """DEFAULTS updated by the run YAML at `path` (None: the defaults), every value checked:
    a bad one raises ValueError naming the file and the field."""
    from kdj.config import load_yaml

    cfg = json.loads(json.dumps(DEFAULTS))  # deep copy
    if path is None:
        return cfg
    run = load_yaml(path)
    unknown = set(run) - set(DEFAULTS)
    if unknown:
        kind = ("; it reads as a training YAML (kdj train-drafter --config)" if "optim" in unknown
                else "; it reads as a mesh YAML (kdj.load_target(mesh=...))" if "mesh" in unknown
                else "")  # fmt: skip
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected {sorted(DEFAULTS)}"
                         f"{kind}")  # fmt: skip
    decode = run.get("decode") or {}
    if not isinstance(decode, dict):
        raise ValueError(f"{path}: decode must be a mapping of generate arguments")
    typos = set(decode) - set(DEFAULTS["decode"])
    if typos:
        raise ValueError(f"{path}: unknown decode keys {sorted(typos)}; expected "
                         f"{sorted(DEFAULTS['decode'])}")  # fmt: skip
    cfg.update({k: v for k, v in run.items() if k != "decode"})
    cfg["decode"].update(decode)
    check_values(cfg, {**run, "decode": decode}, path)
    return cfg


def check_values(cfg: dict, given: dict, path) -> None:
    """Each field the YAML gave (`given`) as generate would take it, named by its place in
    the file. Booleans are YAML's true / false only: "no" is a non-empty string."""
    from kdj import arguments

    def check(name, fn):
        """fn's error with generate's argument names as the file's fields (decode.seed)."""
        try:
            fn()
        except (TypeError, ValueError) as e:
            message = str(e)
            for key in DEFAULTS["decode"]:
                message = re.sub(rf"(?<![\w.]){key}(?!\w)", f"decode.{key}", message)
            where = "" if "decode." in message or name in message else f"{name}: "
            raise ValueError(f"{path}: {where}{message}") from None

    def boolean(name, value):
        if not isinstance(value, bool):
            raise ValueError(f"{path}: {name} must be true or false (a YAML boolean), got "
                             f"{value!r}")  # fmt: skip

    def text(name, value, none=False):
        if not (isinstance(value, str) and value) and not (none and value is None):
            raise ValueError(f"{path}: {name} must be a name or path (got {value!r})")

    dec, given_dec = cfg["decode"], given["decode"]
    for key, default in DEFAULTS.items():
        if key in given and isinstance(default, bool):
            boolean(key, given[key])
    for key, default in DEFAULTS["decode"].items():
        if key in given_dec and isinstance(default, bool):
            boolean(f"decode.{key}", given_dec[key])
    if "target" in given:
        text("target", cfg["target"])
    if "drafter" in given:
        text("drafter", cfg["drafter"], none=True)
    if "dtype" in given and cfg["dtype"] != "auto":
        try:
            arguments.dtype(cfg["dtype"])
        except ValueError:
            raise ValueError(f"{path}: dtype {cfg['dtype']!r} is not supported: use auto "
                             f"(float32 on a CPU, bfloat16 on an accelerator), "
                             f"{', '.join(arguments.DTYPES)}") from None  # fmt: skip
    if dec["method"] not in arguments.METHODS:
        raise ValueError(f"{path}: decode.method {dec['method']!r} is not one of "
                         f"{', '.join(arguments.METHODS)}")  # fmt: skip

    for key in METHOD_YAML:
        if dec[key] is not None and dec["method"] not in arguments.APPLIES_TO[key]:
            uses = " or ".join(arguments.APPLIES_TO[key])
            raise ValueError(f"{path}: decode.{key} applies to method {uses}, not the file's "
                             f"{dec['method']!r}")  # fmt: skip

    def per_prompt(value):
        return value if isinstance(value, list) else [value]

    check("decode.max_new_tokens",
          lambda: [arguments.integer(m, "max_new_tokens", 1)
                   for m in per_prompt(dec["max_new_tokens"])])  # fmt: skip
    check("decode.temperature", lambda: arguments.sampling(dec["temperature"], dec["top_p"]))
    seeds = per_prompt(dec["seed"])
    check("decode.seed", lambda: arguments.seeds(seeds, len(seeds)))
    if dec["block_size"] is not None:
        check("decode.block_size", lambda: arguments.integer(dec["block_size"], "block_size", 2))
    if dec["tree_budget"] is not None:
        check("decode.tree_budget",
              lambda: arguments.integer(dec["tree_budget"], "tree_budget", 1))  # fmt: skip
    check("decode.cost", lambda: arguments.cost(dec["cost"]))


def check_method(run: dict, path, flags: dict[str, str]) -> None:
    """The run's method, drafter, block_size and tree_budget fit together (ValueError), said
    in the words of where each came from: a flag of the command line (`flags`: field -> flag,
    for the fields it gave) or the run YAML's field."""
    from kdj import arguments

    dec = run["decode"]
    try:
        arguments.method(dec["method"], bool(run["drafter"]), block_size=dec["block_size"],
                         tree_budget=dec["tree_budget"], cost=dec["cost"])  # fmt: skip
    except ValueError as e:
        message = str(e)
        for key in METHOD_YAML:
            if message.startswith(f"{key} "):
                message = (flags.get(key) or f"{path}: decode.{key}") + message[len(key) :]
        drafter = flags.get("drafter") or f"a drafter: field in {path}"
        raise ValueError(message.replace("(kdj.load_drafter)", f"({drafter})")) from None


def check_per_prompt(run: dict, path, prompts: int | None) -> None:
    """The YAML's per-prompt lists (decode.max_new_tokens, decode.seed) have one entry per
    prompt; `prompts` None: the command has no prompts of its own (serve), so none is taken."""
    for key in ("max_new_tokens", "seed"):
        value = run["decode"][key]
        if not isinstance(value, list):
            continue
        if prompts is None:
            raise ValueError(f"{path}: decode.{key} is a list (one per prompt, for kdj generate); "
                             "kdj serve takes one value")  # fmt: skip
        if len(value) != prompts:
            raise ValueError(f"{path}: decode.{key} has {len(value)} entries, one per prompt, "
                             f"for {prompts} prompt(s) (--prompt)")  # fmt: skip


def check_sources(run: dict, block_size: str = "block_size"):
    """The run's target and drafter are checkpoints kdj reads (their files and configs, no
    weights), and its block size fits the drafter's, so a mistyped or wrong drafter is not
    found only after the target has loaded. `block_size`: what to call it in the message.
    Returns the target's ModelConfig."""
    from kdj.loading import check_target, drafter_config

    cfg = check_target(run["target"])
    if run["drafter"]:
        most, k = drafter_config(run["drafter"]).block_size, run["decode"]["block_size"]
        if k is not None and k > most:
            raise ValueError(f"{block_size} must be in [2, {most}] for drafter "
                             f"{run['drafter']!r} (got {k})")  # fmt: skip
    return cfg


# The run's fields that only some methods use (kdj.arguments.APPLIES_TO), and the flags
# that set them.
METHOD_FIELDS = {"block_size": "--block-size", "tree_budget": "--tree-budget"}
METHOD_YAML = (*METHOD_FIELDS, "cost")  # and auto's costs, a field with no flag


def switch_method(run: dict, method: str, flags: dict) -> None:
    """The run with --method `method` in place of the YAML's: the YAML's block_size and
    tree_budget are dropped where `method` does not use them, and its drafter where the run
    decodes plainly (said on stderr). `flags`: the values the command line gave; one of them
    that `method` does not use stays, and generate refuses it."""
    from kdj.arguments import APPLIES_TO

    dec = run["decode"]
    if dec["method"] == method:
        return
    dec["method"] = method
    drafter = run["drafter"] if flags.get("drafter") is None else flags["drafter"]
    plain = method == "ar" or (method == "auto" and not drafter)
    dropped = []
    for key in METHOD_YAML:
        if (
            dec[key] is not None
            and flags.get(key) is None
            and (plain or method not in APPLIES_TO[key])
        ):
            dec[key] = None
            dropped.append(f"decode.{key}")
    if plain and run["drafter"] is not None and flags.get("drafter") is None:
        run["drafter"] = None
        dropped.append("drafter")
    if dropped:
        print(f"kdj: --method {method} leaves out the run YAML's {', '.join(dropped)}",
              file=sys.stderr)  # fmt: skip
