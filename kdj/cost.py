"""A step-cost model: predicted seconds of one target step that verifies n tokens.

Speculation pays when the tokens a step is expected to accept outgrow what the bigger verify
costs. On a dense target a verify of a few tokens costs about one decode step (weights are
read once); on an MoE target each extra token in flight can touch new experts, so the bytes
grow with n until every expert is touched, and at high batch the step turns compute-bound.
The model keeps exactly those terms, from the model config:

    seconds(batch, T, context) = fixed
        + per_byte * (dense + touched(batch * T) * expert + kv(batch, context + T))
        + per_flop * flops(batch * T, context)
    touched(n) = moe_layers * E * (1 - (1 - k / E) ** n)    (expected distinct experts hit)

A speculative step also runs the drafter once (one block of k tokens per sequence, then the
target's lm_head over k - 1 slots); `with_drafter` adds its terms and `draft_seconds` prices
it with the same coefficients. Its fixed part is fixed_s scaled by its share of the layers
(launch overhead grows with the kernels a pass runs).

The three coefficients are fitted to step times measured on the current GPU (`fit`, fed by
`kdj bench`) and saved as JSON next to the model, with the measured / predicted ratio at each
measured target step (`with_residuals`): three coefficients miss single steps by 5-15%, enough
to turn a 7% win into a predicted loss, so predictions are scaled by the measured ratio
(interpolated between measured batch sizes); `for_config` is a conservative default
(half of an H200's 4.3 TB/s and 40% of its ~600 TFLOP/s bf16 rate, 0.3 ms fixed).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from kdj.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepCost:
    dense_bytes: float  # weights every step reads (all but the routed experts)
    expert_bytes: float  # one routed expert of one MoE layer
    moe_layers: int
    num_experts: int
    top_k: int
    kv_bytes_per_token: float  # cache bytes per token of context, all layers
    flops_per_token: float  # matmul FLOPs per verified token (k experts each)
    attn_flops_per_context: float  # attention FLOPs per verified token per context token
    fixed_s: float = 3e-4
    per_byte_s: float = 1 / (0.5 * 4.3e12)
    per_flop_s: float = 1 / (0.4 * 600e12)
    # the drafter's pass, paid by every step that drafts (0 until with_drafter)
    draft_bytes: float = 0.0  # drafter weights + the target lm_head it borrows
    draft_flops_per_seq: float = 0.0  # one block of k tokens + k - 1 lm_head rows
    draft_kv_bytes_per_token: float = 0.0  # drafter context cache per token
    draft_fixed_frac: float = 0.0  # drafter layers / target layers
    draft_fixed_s: float = 0.0  # fitted: a drafting step's own overhead (launches, tree walk)
    per_node_s: float = 0.0  # fitted: building a tree, per sequence per node
    # fitted: building a tree, per node whatever the batch (its top-k passes over the budget
    # x vocabulary candidates do not fill the GPU at small batch: at batch 1 on the H200 a
    # 64-node tree step costs 0.6 ms more than a 16-node one)
    per_tree_node_s: float = 0.0
    # measured / predicted target step time where `kdj bench` measured it: ((batch,
    # tokens_per_seq, ratio), ...). `seconds` scales the prediction by it, so the model is
    # exact at the measured steps (the three coefficients leave 5-15% there); a tuple so the
    # cost stays hashable (a static argument of the jitted loop).
    residuals: tuple = ()

    @classmethod
    def for_config(cls, cfg: ModelConfig, dtype_bytes: int = 2) -> StepCost:
        """Byte and FLOP terms counted from the config's shapes; default coefficients."""
        from flax import nnx

        from kdj.models.transformer import abstract_model

        total = expert = 0
        for path, var in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param)):
            n = int(np.prod(var.get_value().shape))
            total += n
            if path[-1] in ("w_gate_up", "w_down"):
                expert += n
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        E = max(cfg.n_routed_experts, 1)
        per_expert = expert / max(moe_layers * E, 1)
        dense = total - expert - cfg.vocab_size * cfg.hidden_size  # embedding: rows only
        if cfg.tie_word_embeddings:
            dense += cfg.vocab_size * cfg.hidden_size  # ... but the tied lm_head reads it all
        if cfg.family == "deepseek":
            kv = cfg.latent_dim
            attn = 2 * cfg.num_heads * (cfg.latent_dim + cfg.kv_lora_rank)
        else:
            kv = 2 * cfg.num_kv_heads * cfg.head_dim
            attn = 4 * cfg.num_heads * cfg.head_dim
        k = cfg.num_experts_per_tok if moe_layers else 0
        return cls(
            dense_bytes=float(dense * dtype_bytes),
            expert_bytes=float(per_expert * dtype_bytes),
            moe_layers=moe_layers,
            num_experts=E,
            top_k=k,
            kv_bytes_per_token=float(kv * cfg.num_layers * dtype_bytes),
            flops_per_token=float(2 * (dense + moe_layers * k * per_expert)),
            attn_flops_per_context=float(attn * cfg.num_layers),
        )

    def with_drafter(self, dcfg, num_params: int, target_cfg: ModelConfig,
                     dtype_bytes: int = 2) -> StepCost:  # fmt: skip
        """The same model plus the draft pass of a DFlash drafter (dcfg: its DrafterConfig,
        num_params: its own parameter count; it borrows the target's embedding and lm_head)."""
        lc, k = dcfg.layers, dcfg.block_size
        head = target_cfg.vocab_size * target_cfg.hidden_size
        if dcfg.dflash2 is not None:  # the selector's codebooks: a step gathers a few rows
            num_params -= 2 * lc.vocab_size * dcfg.dflash2.selector_rank
        kv = 2 * lc.num_kv_heads * lc.head_dim * lc.num_layers
        return dataclasses.replace(
            self,
            draft_bytes=float((num_params + head) * dtype_bytes),
            draft_flops_per_seq=float(2 * (num_params * k + head * (k - 1))),
            draft_kv_bytes_per_token=float(kv * dtype_bytes),
            draft_fixed_frac=lc.num_layers / max(target_cfg.num_layers, 1),
        )

    # ------------------------------------------------------------------ prediction
    def terms(self, batch, tokens_per_seq, context):
        """(bytes, flops) of one step; works on numpy and jax values alike."""
        n = batch * tokens_per_seq
        xp = jnp if isinstance(n, jnp.ndarray) else np
        touched = 0.0
        if self.moe_layers:
            E = self.num_experts
            touched = self.moe_layers * E * (1 - (1 - self.top_k / E) ** xp.asarray(n, float))
        bytes_ = self.dense_bytes + touched * self.expert_bytes
        bytes_ = bytes_ + batch * (context + tokens_per_seq) * self.kv_bytes_per_token
        flops = n * (
            self.flops_per_token + (context + tokens_per_seq) * self.attn_flops_per_context
        )
        return bytes_, flops

    def seconds(self, batch, tokens_per_seq, context):
        """Predicted step time: batch sequences, tokens_per_seq verified each, at context,
        corrected by the measured residual (`residual`; batch and tokens_per_seq static)."""
        b, f = self.terms(batch, tokens_per_seq, context)
        model = self.fixed_s + b * self.per_byte_s + f * self.per_flop_s
        return model * self.residual(batch, tokens_per_seq) if self.residuals else model

    def residual(self, batch: int, tokens_per_seq: int) -> float:
        """Measured / predicted step time: the measured ratio at this batch, else
        interpolated in log2(batch) between the measured batches around it (the nearest one
        outside them), for this many tokens per sequence, or for the nearest measured one
        (in log2) where this T was never measured; 1.0 without residuals."""
        if batch < 1 or tokens_per_seq < 1:
            raise ValueError(f"a step of batch {batch} x {tokens_per_seq} tokens has no time")
        if not self.residuals:
            return 1.0
        ts = {t for _, t, _ in self.residuals}
        T = min(ts, key=lambda t: (abs(np.log2(t / tokens_per_seq)), t))
        pts = sorted((b, r) for b, t, r in self.residuals if t == T)
        xs, rs = np.log2([float(b) for b, _ in pts]), [r for _, r in pts]
        return float(np.interp(np.log2(float(batch)), xs, rs))

    def measured_at(self, batch: int, tokens_per_seq: int) -> bool:
        """Whether `kdj bench` measured this step (a residual exactly here)."""
        return any(b == batch and t == tokens_per_seq for b, t, _ in self.residuals)

    def with_residuals(self, rows) -> StepCost:
        """This cost, corrected at the measured target steps rows of (batch, tokens_per_seq,
        context, seconds) (see `residual`)."""
        steps = [(int(b), int(t)) for b, t, _, _ in rows]
        if len(set(steps)) != len(steps):
            raise ValueError("residuals need one measurement per (batch, tokens_per_seq)")
        plain = dataclasses.replace(self, residuals=())
        res = tuple((int(b), int(t), float(s / plain.seconds(b, t, c))) for b, t, c, s in rows)
        return dataclasses.replace(self, residuals=res)

    def draft_seconds(self, batch, context, nodes=0):
        """Predicted time of one draft pass for batch sequences at context, building a tree
        of `nodes` nodes per sequence (0 for a chain); 0 without a drafter."""
        bytes_ = self.draft_bytes + batch * context * self.draft_kv_bytes_per_token
        return (
            self.fixed_s * self.draft_fixed_frac
            + self.draft_fixed_s
            + bytes_ * self.per_byte_s
            + batch * self.draft_flops_per_seq * self.per_flop_s
            + batch * nodes * self.per_node_s
            + nodes * self.per_tree_node_s
        )

    # ------------------------------------------------------------------ fitting and files
    def fit(self, rows) -> StepCost:
        """Least-squares coefficients (all >= 0) from measured rows of (batch, tokens_per_seq,
        context, seconds[, drafted, tree_nodes]). Target steps alone (drafted 0 or absent)
        fit fixed, per byte and per FLOP. Rows with drafted = 1 are whole speculative steps
        (draft pass + tree of tree_nodes nodes + verify, as a decode loop times them; needs
        with_drafter first) and also fit the drafting step's own overhead and the per-node
        tree costs (per sequence and per step). Relative error is minimised, so a 1 ms decode
        step counts as much as a 100 ms batch-256 verify."""
        rows = np.asarray(rows, float)
        b, f = self.terms(rows[:, 0], rows[:, 1], rows[:, 2])
        cols = [np.ones_like(b), b, f]
        if rows.shape[1] > 4:
            d, nodes = rows[:, 4], rows[:, 5] if rows.shape[1] > 5 else np.zeros(len(rows))
            cols[0] = cols[0] + d * self.draft_fixed_frac
            cols[1] = b + d * (
                self.draft_bytes + rows[:, 0] * rows[:, 2] * self.draft_kv_bytes_per_token
            )
            cols[2] = f + d * rows[:, 0] * self.draft_flops_per_seq
            cols += [d, d * rows[:, 0] * nodes, d * nodes]
        X = np.stack(cols, axis=1) / rows[:, 3:4]
        y = np.ones(len(rows))
        keep = [i for i in range(X.shape[1]) if X[:, i].any()]
        while True:  # drop coefficients that come out negative, refit (tiny active-set NNLS)
            coef = np.zeros(X.shape[1])
            coef[keep] = np.linalg.lstsq(X[:, keep], y, rcond=None)[0]
            if (coef >= 0).all():
                break
            keep = [i for i in keep if coef[i] > 0]
        names = ("fixed_s", "per_byte_s", "per_flop_s", "draft_fixed_s", "per_node_s",
                 "per_tree_node_s")  # fmt: skip
        fitted = {n: float(c) for n, c in zip(names, coef)}
        # residuals are ratios to the old coefficients: new ones come from with_residuals
        return dataclasses.replace(self, residuals=(), **fitted)

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path) -> StepCost:
        """The StepCost `save` wrote to `path`; any other file is a ValueError naming it (and
        the field at fault), before anything compiles with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a step-cost JSON file ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a step-cost file holds a JSON object of its fields, not "
                             f"a {type(data).__name__}")  # fmt: skip
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"{path}: unknown step-cost fields {sorted(unknown)}")
        missing = [n for n, f in fields.items()
                   if f.default is dataclasses.MISSING and n not in data]  # fmt: skip
        if missing:
            raise ValueError(f"{path}: step-cost fields {missing} are missing")

        def number(value) -> bool:
            return (not isinstance(value, bool) and isinstance(value, (int, float))
                    and math.isfinite(value) and value >= 0)  # fmt: skip

        for name, value in data.items():
            if name != "residuals" and not number(value):
                raise ValueError(f"{path}: step-cost field {name} must be a finite number "
                                 f">= 0, not {value!r}")  # fmt: skip
        residuals = data.get("residuals", [])
        if not isinstance(residuals, list) or not all(
            isinstance(r, list) and len(r) == 3 and all(map(number, r)) for r in residuals
        ):
            raise ValueError(f"{path}: step-cost field residuals must be a list of [batch, "
                             f"tokens, ratio] numbers, not {residuals!r}")  # fmt: skip
        data["residuals"] = tuple(tuple(r) for r in residuals)
        return cls(**data)
