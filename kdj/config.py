"""Model configuration: one dataclass for every target family, built from HF config.json dicts.

Field names follow Hugging Face where one exists, so `ModelConfig.from_hf(json.load(...))` is a
mostly mechanical mapping. `family` decides which attention/MLP the decoder stack uses:
"llama" (GQA, Llama/Qwen2/Qwen3) or "deepseek" (MLA + MoE, DeepSeek-V2/V3, Kimi-K2.x, Moonlight).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kdj.kernels import KernelPolicy

LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
WRAPPER_TYPES = ("kimi_k25",)  # multimodal wrappers whose text model sits in `text_config`
# a drafter's config.json (DFlash, DFlash2), never a target's
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "deepseek"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen dict items (hashable)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # GQA (llama family)
    num_kv_heads: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    # MLA (deepseek family)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE (deepseek family)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"  # "noaux_tc" | "greedy" | "group_limited_greedy"
    scoring_func: str = "sigmoid"  # "sigmoid" | "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # which kernel each op runs (kdj/kernels.py): part of the jit key, chosen at load, never
    # saved with the weights
    kernels: KernelPolicy = KernelPolicy()

    @property
    def rope(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of q/k: the whole head (GQA) or qk_rope_head_dim (MLA)."""
        return self.qk_rope_head_dim if self.family == "deepseek" else self.head_dim

    @property
    def latent_dim(self) -> int:
        """MLA cache width per token per layer: normalised latent + rotated shared key (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.family == "deepseek"
            and self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def with_kernels(self, kernels: KernelPolicy) -> ModelConfig:
        return self.replace(kernels=kernels)

    # ------------------------------------------------------------------ loading
    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        """Map a Hugging Face config.json dict to a ModelConfig; unknown model types, and
        fields the model type needs that are missing, raise ValueError."""
        if not isinstance(cfg, dict):
            raise ValueError(
                f"config.json is not a JSON object (it holds a {type(cfg).__name__}): give the "
                "model's Hugging Face config.json"
            )
        try:
            return ModelConfig._from_hf(cfg)
        except KeyError as e:
            raise ValueError(
                f"config.json has no {e.args[0]!r}, which a {cfg.get('model_type')} model needs: "
                "is it the model's own Hugging Face config.json?"
            ) from None

    @staticmethod
    def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
        mt = cfg.get("model_type")
        if mt in WRAPPER_TYPES:
            if "text_config" not in cfg:
                raise ValueError(f"model_type {mt!r} config has no text_config")
            return ModelConfig._from_hf(cfg["text_config"])
        if mt not in LLAMA_TYPES + DEEPSEEK_TYPES:
            raise ValueError(
                f"unknown model_type {mt!r}; kdj supports {', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}"
                f" and the wrapper {', '.join(WRAPPER_TYPES)}"
            )
        if cfg.get("mlp_bias"):
            raise NotImplementedError(f"{mt}: mlp_bias is not supported")
        if cfg.get("use_sliding_window"):
            raise NotImplementedError(f"{mt}: sliding-window attention targets are not supported")
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None:
            rope = {k: v for k, v in rope.items() if k != "rope_theta"}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind == "default":
                rope = None
            elif kind not in ("yarn", "llama3", "linear"):
                raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
            else:
                rope = {**rope, "rope_type": kind}
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"):  # fmt: skip
            n = cfg[key]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"config.json {key} must be a positive integer (got {n!r})")
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
            model_type=mt,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=tuple(sorted(rope.items())) if rope else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
        if mt in LLAMA_TYPES:
            heads = cfg["num_attention_heads"]
            bias = bool(cfg.get("attention_bias", False))
            return ModelConfig(
                family="llama",
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                qkv_bias=bias or mt == "qwen2",  # Qwen2 always has q/k/v bias, never o bias
                o_bias=bias and mt != "qwen2",
                qk_norm=mt == "qwen3",
                **common,
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r} is not supported")
        v2 = mt == "deepseek_v2"
        return ModelConfig(
            family="deepseek",
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            n_routed_experts=cfg.get("n_routed_experts") or 0,
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            moe_layer_freq=cfg.get("moe_layer_freq", 1),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            topk_method=cfg.get("topk_method") or ("greedy" if v2 else "noaux_tc"),
            scoring_func=cfg.get("scoring_func") or ("softmax" if v2 else "sigmoid"),
            # HF's DeepSeek-V2 never renormalises the top-k weights, whatever the config says.
            norm_topk_prob=False if v2 else bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            **common,
        )

    @staticmethod
    def from_json(path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"missing model config: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"corrupt config.json {path}: {e}") from None
        archs = (cfg.get("architectures") or []) if isinstance(cfg, dict) else []
        if any(a in DRAFTER_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{path.parent} is a DFlash drafter checkpoint, not a target: pass it as the "
                "drafter (kdj.load_drafter)"
            )
        return ModelConfig.from_hf(cfg)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["kernels"]  # a runtime choice, not part of the model
        d["rope_scaling"] = self.rope
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelConfig:
        """The inverse of to_dict (a `kdj convert` dir's kdj_config.json): a model type or
        family kdj does not run raises ValueError, as from_hf does."""
        d = dict(d)
        mt, family = d.get("model_type"), d.get("family")
        if mt not in LLAMA_TYPES + DEEPSEEK_TYPES:
            raise ValueError(f"unknown model_type {mt!r}; kdj supports "
                             f"{', '.join(LLAMA_TYPES + DEEPSEEK_TYPES)}")  # fmt: skip
        expected = "llama" if mt in LLAMA_TYPES else "deepseek"
        if family != expected:
            raise ValueError(f"family {family!r} does not match model_type {mt!r} (a {mt} model "
                             f"is family {expected!r})")  # fmt: skip
        d.pop("kernels", None)
        if d.get("rope_scaling"):
            d["rope_scaling"] = tuple(sorted(d["rope_scaling"].items()))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return ModelConfig(**d)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run/mesh/model YAML file into a dict, with a clear error when it is missing."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.is_dir():
        names = sorted(p.name for p in path.glob("*.yaml"))
        raise IsADirectoryError(f"{path} is a directory: give a YAML file, e.g. one of "
                                f"{', '.join(names) or 'none here'}")  # fmt: skip
    try:
        with path.open(encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except UnicodeDecodeError as e:
        byte = e.object[e.start : e.start + 1]
        raise ValueError(f"{path}: not a UTF-8 text file (byte {e.start}: {byte!r}); a YAML "
                         "file is text") from None  # fmt: skip
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
