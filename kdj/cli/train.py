"""The drafter's commands: `kdj train-drafter`, `eval-acceptance`, `calibrate`, `tune`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kdj.cli import values
from kdj.cli.extras import needs
from kdj.cli.runs import dtype_name

# the loading calls as these commands' flags, for messages raised by the Python API
FLAGS = {"kdj.load_drafter": "--drafter", "kdj.load_target": "--target"}


def cmd_train_drafter(args) -> int:
    with needs("train"):
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
    if args.resume_state is not None:
        if cfg.online is None:
            raise ValueError(f"--resume-state continues an online campaign; {args.config} has "
                             "no online section")  # fmt: skip
        cfg.online.resume_state = args.resume_state
    check_training(cfg, args)
    with needs("train"):  # the dataset packages are looked for only once the target loaded
        (run_online if cfg.online is not None else run_training)(cfg)
    return 0


def check_training(cfg, args) -> None:
    """The target, the drafters to start from and out_dir, checked before the data is made
    (hours on a GPU); each named as the flag or the config's field that gave it."""
    from kdj.loading import check_target, drafter_config

    def named(flag, field):
        given = getattr(args, flag[2:].replace("-", "_")) is not None
        return flag if given else f"{args.config}: {field}"

    checks = [(named("--target", "target"), check_target, cfg.target)]
    if cfg.drafter.init_from:
        checks.append((named("--init-from", "drafter.init_from"), drafter_config,
                       cfg.drafter.init_from))  # fmt: skip
    for key, entry in (cfg.online.compare if cfg.online else {}).items():
        if entry.drafter.init_from:
            checks.append((f"{args.config}: online.compare.{key}.init_from", drafter_config,
                           entry.drafter.init_from))  # fmt: skip
    for name, check, source in checks:
        try:
            check(source)
        except (OSError, ValueError) as e:
            raise ValueError(f"{name}: {e}") from None
    values.output(cfg.out_dir, named("--out-dir", "out_dir"), folder=True)
    check_out_dir(cfg, named("--out-dir", "out_dir"))


# a drafter section's fields that only choose its first weights: a checkpoint restores
# whatever they were
START_FIELDS = ("init_from", "grow", "retap")


def drafter_sections(record: dict) -> dict[str, dict]:
    """A train_config's drafters by name, each with the target it trains against: the run's
    and each online.compare entry's (an entry recorded before it had an optim part is its
    drafter section itself)."""
    compare = (record.get("online") or {}).get("compare") or {}
    sections = {"drafter": record["drafter"]}
    sections.update({f"online.compare.{n}": e.get("drafter", e) for n, e in compare.items()})
    return {k: dict(v, target=record.get("target")) for k, v in sections.items()}


def check_out_dir(cfg, name: str) -> None:
    """out_dir is new, empty, or an earlier run's (its train_config.json, written first);
    where that run left checkpoints, of this config's drafters and target (a later call
    continues them). A folder of other files is not written into (what kdj reads there may
    be: the data cache, a resume bundle), and one whose checkpoints hold another drafter is
    refused before anything in it changes."""
    out = Path(cfg.out_dir)
    if not out.is_dir():
        return
    record = out / "train_config.json"
    if not record.is_file():
        ours = {"resume"} | ({cfg.cache_dir.parts[len(out.parts)]}
                             if cfg.cache_dir.is_relative_to(out) and cfg.cache_dir != out
                             else set())  # fmt: skip
        other = sorted(p.name for p in out.iterdir()
                       if p.name not in ours and not p.name.startswith("."))  # fmt: skip
        if other:
            raise ValueError(f"{name} {out} holds files ({', '.join(other[:4])}) and no "
                             "train_config.json, so it is no kdj training run's folder: "
                             "training writes drafter/, checkpoints/, summary.json and more "
                             "into it; give a new or empty folder")  # fmt: skip
        return
    try:
        shapes = drafter_sections(json.loads(record.read_text()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{record} is not a train_config.json kdj wrote; give a new or empty "
                         f"{name}") from None  # fmt: skip
    wanted = drafter_sections(cfg.to_dict())
    differ = []
    for section in sorted(set(shapes) & set(wanted)):
        folder = out / section.removeprefix("online.compare.") if "." in section else out
        if not (folder / "checkpoints").is_dir():  # nothing there to continue
            continue
        a, b = shapes[section], wanted[section]
        differ += [f"{section}.{k}: {a.get(k)!r} there, {b[k]!r} here" for k in b
                   if k not in START_FIELDS and a.get(k) != b[k]]  # fmt: skip
    if differ:
        raise ValueError(f"{name} {out} holds the checkpoints of another drafter "
                         f"({'; '.join(differ)}), which this run would continue; give "
                         f"another {name}, or delete {out} to start afresh there")  # fmt: skip


def cmd_eval_acceptance(args) -> int:
    import kdj

    with needs("train"):
        import matplotlib  # noqa: F401  (the report's plot, written after the runs)

        from kdj.train import evaluate
        from kdj.train.loop import chat_prompts

    named = drafter_labels(args.drafter)
    check_sources(args.target, *named.values())
    values.output(args.out, "--out", folder=True)  # checked before the runs, not after
    for folder in ([Path(args.out) / label for label in named] if len(named) > 1
                   else [Path(args.out)]):  # fmt: skip
        check_report_files(folder, args.prompts)
    if args.prompts:  # eval_prompts.json written by train-drafter: no dataset packages needed
        texts = eval_prompts(args.prompts, args.datasets)
    else:
        from kdj.train.data import humaneval_prompts, sharegpt_split

        with needs("train"):
            texts = {"sharegpt": [m for _, m in sharegpt_split()[1]],
                     "humaneval": humaneval_prompts()}  # fmt: skip
    target = kdj.load_target(args.target, dtype=dtype_name(args.dtype))
    drafters = {label: kdj.load_drafter(src, target=target) for label, src in named.items()}
    n, tok = args.num_prompts, target.tokenizer
    datasets = {name: chat_prompts(tok, texts[name][:n], args.max_prompt_tokens)
                for name in args.datasets if texts.get(name)}  # fmt: skip
    if not datasets:
        raise SystemExit(f"no prompts for {args.datasets} in {args.prompts or 'the packages'}")
    for name in args.datasets:  # a short set runs what it has, said (and in the report)
        have = len(datasets.get(name, ()))
        if have < n:
            print(f"kdj eval-acceptance: {args.prompts or 'the packages'} has {have} {name} "
                  f"prompts, fewer than --num-prompts {n}: " +
                  (f"running {have}" if have else "skipping the set"), file=sys.stderr)  # fmt: skip
    ar_runs: dict = {}  # one AR run per (set, temperature), shared by every drafter
    reports = {}
    for label, drafter in drafters.items():
        out = Path(args.out) / label if len(drafters) > 1 else Path(args.out)
        meta = {"target": args.target, "drafter": named[label],
                "num_prompts": {name: len(p) for name, p in datasets.items()},
                "max_new_tokens": args.max_new_tokens, "deterministic": args.deterministic,
                "dtype": args.dtype}  # fmt: skip
        reports[label] = evaluate.eval_acceptance(
            target, drafter, datasets, budgets=args.budgets, temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens, out_dir=out, meta=meta,
            deterministic=args.deterministic, ar_runs=ar_runs,
        )  # fmt: skip
        js, png = evaluate.write_report(reports[label], out, meta)
        print(f"{label}: wrote {js} and {png}")
    print(evaluate.compare_table(reports))  # tau (speedup over AR): DFlash, each DDTree budget
    return 0


def check_report_files(folder: Path, prompts: str | None) -> None:
    """eval-acceptance writes acceptance.json and acceptance.png into `folder`: each may
    replace only an earlier report (a JSON of its "meta" and "results", the plot beside
    it), never a user's file or the --prompts file it reads."""
    js, png = folder / "acceptance.json", folder / "acceptance.png"
    values.output(str(js), "--out", inputs={"--prompts": prompts})
    if js.exists():
        try:
            earlier = json.loads(js.read_text())
            ours = isinstance(earlier, dict) and set(earlier) == {"meta", "results"}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            ours = False
        if not ours:
            raise ValueError(f"--out {folder}: {js} exists and is not an earlier "
                             "eval-acceptance report, which it would replace; move it or "
                             "choose another --out")  # fmt: skip
    elif png.exists():
        raise ValueError(f"--out {folder}: {png} exists with no report beside it (not an "
                         "earlier run's), which this run would replace; move it or choose "
                         "another --out")  # fmt: skip


def eval_prompts(path: str, datasets: list[str]) -> dict[str, list[str]]:
    """eval-acceptance --prompts: the sets of `datasets` that eval_prompts.json (train-drafter's
    held-out prompts, {set: [prompt, ...]}) holds, read before any model loads."""
    try:
        texts = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read a JSON file ({e})") from None
    found = {name: texts[name] for name in datasets if isinstance(texts, dict)
             and isinstance(texts.get(name), list) and texts[name]
             and all(isinstance(p, str) for p in texts[name])}  # fmt: skip
    if not found:
        raise ValueError(f"--prompts {path}: expected eval_prompts.json, an object with a "
                         f"non-empty list of prompt strings under "
                         f"{' or '.join(map(repr, datasets))} (--datasets)")  # fmt: skip
    return found


def check_sources(target: str, *drafters: str):
    """The target and drafters are checkpoints kdj reads (their files and configs, no
    weights) before the dataset and the target load. Returns the target's ModelConfig."""
    from kdj.loading import check_target, drafter_config

    cfg = check_target(target)
    for source in drafters:
        drafter_config(source)
    return cfg


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
    from kdj.loading import drafter_config

    most = check_sources(args.target, args.drafter).max_position_embeddings
    if args.context > most:  # a cost timed there would price contexts no run can have
        raise ValueError(f"--context {args.context} exceeds the model's "
                         f"max_position_embeddings ({most})")  # fmt: skip
    shapes = auto.parse_menu("auto", args.menu, drafter_config(args.drafter).block_size, None)
    target = kdj.load_target(args.target, dtype=dtype_name(args.dtype))
    drafter = kdj.load_drafter(args.drafter, target=target)
    for batch in args.batch:
        _, timings, path = tune.tune(target, drafter, shapes, batch, args.context)
        print(tune.table(timings))
        print(f"saved {path}")
    return 0


def cmd_calibrate(args) -> int:
    import kdj
    from kdj.train import calibrate
    from kdj.train.data import sharegpt_split

    if args.tree_budget is not None and args.method != "ddtree":
        raise ValueError(f"--tree-budget applies to --method ddtree, not {args.method}")
    check_sources(args.target, args.drafter)
    if args.save:  # where the fit goes, checked before the runs
        where = kdj.loading.drafter_path(args.drafter)
        shipped = Path(kdj.__file__).resolve().parent / "assets"
        if where.resolve().is_relative_to(shipped):
            raise ValueError(f"--save would replace the calibration shipped with the built-in "
                             f"drafter {args.drafter} ({where / 'calibration.json'}), which "
                             "every later run loads; copy the drafter's folder and calibrate "
                             "the copy, or leave out --save to print the fit")  # fmt: skip
        values.output(str(where / "calibration.json"), "--save")
    with needs("train"):
        from kdj.train.loop import chat_prompts

        held_out = [m for _, m in sharegpt_split()[1]]  # conversations >= 16,000 only
    target = kdj.load_target(args.target, dtype=dtype_name(args.dtype))
    drafter = kdj.load_drafter(args.drafter, target=target)
    prompts = chat_prompts(target.tokenizer, held_out[: args.num_prompts], 512)
    report = calibrate.calibrate(
        target, drafter, prompts, method=args.method, tree_budget=args.tree_budget or 16,
        temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "candidates"}, indent=2))
    if args.save:
        print(f"wrote {calibrate.save(report, kdj.loading.drafter_path(args.drafter))}")
    return 0


def pair_arguments(p, d: str) -> None:
    """--drafter, --target and --dtype: the pair a drafter command loads."""
    p.add_argument("--drafter", required=True, help="DFlash drafter dir or built-in name")
    p.add_argument("--target", default="smollm2-135m-instruct", help="its target" + d)
    p.add_argument(
        "--dtype", default="auto", choices=values.DTYPES, help="float32 | bfloat16 | auto" + d
    )


def add_parsers(sub) -> None:
    t = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (kdj.train)")
    t.add_argument("--config", required=True, help="training YAML, e.g. configs/train/*.yaml")
    keep = "default: the config's"
    t.add_argument("--target", help=f"override the config's target ({keep})")
    t.add_argument("--out-dir", help=f"override the config's out_dir ({keep})")
    t.add_argument("--steps", type=values.POSITIVE, help=f"override optim.steps ({keep})")
    t.add_argument(
        "--max-minutes",
        type=values.real(0.0, above=True),
        help="stop (checkpoint + export) after this (default: optim.max_minutes)",
    )
    t.add_argument(
        "--init-from",
        help="override drafter.init_from: a DFlash drafter dir or built-in name to continue "
        f'training from ("" for random init; {keep})',
    )
    t.add_argument(
        "--num-layers",
        type=values.POSITIVE,
        help=f"override drafter.num_layers (ablations; {keep})",
    )
    t.add_argument(
        "--resume-state",
        help="override online.resume_state: the last window's resume bundle (its "
        "<out_dir>/resume/resume.json) to continue its weights, optimiser and schedule "
        "(default: the config's, none starts fresh)",
    )
    t.set_defaults(fn=cmd_train_drafter, sizes="optim.batch_size, optim.anchors_per_seq, "
                   "optim.max_len, optim.head_chunk or data.gen_batch_size")  # fmt: skip
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
    e.add_argument(
        "--dtype", default="auto", choices=values.DTYPES, help="float32 | bfloat16 | auto" + d
    )
    e.add_argument("--out", default="out/acceptance", help="folder for the JSON and PNG" + d)
    e.add_argument("--prompts", help="eval_prompts.json (default: read the dataset packages)")
    e.add_argument(
        "--num-prompts", type=values.POSITIVE, default=16, help="prompts per dataset" + d
    )
    e.add_argument(
        "--max-prompt-tokens",
        type=values.POSITIVE,
        default=512,
        help="longer prompts are cut to this" + d,
    )
    e.add_argument(
        "--max-new-tokens",
        type=values.POSITIVE,
        default=256,
        help="tokens generated per prompt" + d,
    )
    e.add_argument(
        "--budgets",
        type=values.POSITIVE,
        nargs="+",
        default=[16, 32, 64, 128, 256],
        help="DDTree budgets to run" + d,
    )
    e.add_argument(
        "--temperatures",
        type=values.TEMPERATURE,
        nargs="+",
        default=[0.0, 1.0],
        help="sampling temperatures to run" + d,
    )
    e.add_argument("--datasets", nargs="+", choices=["sharegpt", "humaneval"],
                   default=["sharegpt", "humaneval"], help="held-out sets to run" + d)  # fmt: skip
    e.set_defaults(fn=cmd_eval_acceptance, flags=FLAGS)
    k = sub.add_parser("calibrate", help="fit the drafter's forecast temperature (method=auto)")
    pair_arguments(k, d)
    k.add_argument(
        "--method",
        choices=["dflash", "ddtree"],
        default="ddtree",
        help="method whose steps are forecast" + d,
    )
    k.add_argument("--tree-budget", type=values.POSITIVE,
                   help="DDTree budget, with --method ddtree (default: 16)")  # fmt: skip
    k.add_argument(
        "--temperatures",
        type=values.real(0.0, above=True),
        nargs="+",
        default=[0.5, 0.7, 1.0, 1.5, 2.0],
        help="candidate forecast temperatures" + d,
    )
    k.add_argument(
        "--num-prompts", type=values.POSITIVE, default=8, help="held-out ShareGPT prompts" + d
    )
    k.add_argument(
        "--max-new-tokens", type=values.POSITIVE, default=64, help="tokens generated per prompt" + d
    )
    k.add_argument(
        "--save",
        action="store_true",
        help="write calibration.json beside the drafter (default: only print)",
    )
    k.set_defaults(fn=cmd_calibrate, flags=FLAGS)

    u = sub.add_parser("tune", help="time auto's steps on this machine and cache the costs")
    pair_arguments(u, d)
    u.add_argument("--batch", type=values.POSITIVE, nargs="+", default=[1], help="batch sizes" + d)
    u.add_argument("--context", type=values.integer(2), default=256, help="tokens per sequence" + d)
    u.add_argument("--menu", nargs="+", default=None, help="auto's menu (default: its own)")
    u.set_defaults(fn=cmd_tune, flags={**FLAGS, "menu": "--menu"}, sizes="--context or --batch")
