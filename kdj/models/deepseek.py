"""DeepSeek-V2/V3 family (Kimi-K2.x, Moonlight): MLA attention in absorbed form, and MoE."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.kernels import KernelPolicy
from kdj.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    apply_rope,
    attend_latent,
    fixed_order_sum,
    head_matmul,
    matmul,
    param,
    rope_frequencies,
    softmax_scale,
    zeros,
)
from kdj.pallas import expert_gemv, expert_grouped
from kdj.quant import (
    FP8_BLOCK,
    INT4_GROUP,
    dequant_stacked,
    quant_fp8_stacked,
    quant_int4_stacked,
)


class MLAAttention(nnx.Module):
    """Multi-head latent attention over a latent cache, always in the absorbed form.

    The cache holds [kv_a_layernorm(c_kv) ; rope(k_pe)] per token. kv_b_proj is split into
    w_uk [H, nope, C] (folded into the query) and w_uv [H, C, v] (applied after attention;
    held with the contracted axis first, as head_matmul's GEMV reads it), so attention is MQA
    with one shared 576-wide key stream and the latent as the value.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, H = cfg.hidden_size, cfg.num_heads
        C, R, N, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        lin = dict(dtype=dtype, rngs=rngs, kernels=cfg.kernels)
        if cfg.q_lora_rank:
            Q = cfg.q_lora_rank
            self.q_a = Linear(D, Q, ("embed", "q_lora"), **lin)
            self.q_a_norm = RMSNorm(
                Q, cfg.rms_norm_eps, dtype=dtype, axes=("q_lora",), kernels=cfg.kernels
            )
            self.q_b = Linear(Q, H * (N + R), ("q_lora", "q_heads"), **lin)
            self.q_proj = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q_proj = Linear(D, H * (N + R), ("embed", "q_heads"), **lin)
        self.kv_a = Linear(D, C + R, ("embed", "kv_lora"), **lin)
        self.kv_a_norm = RMSNorm(
            C, cfg.rms_norm_eps, dtype=dtype, axes=("kv_lora",), kernels=cfg.kernels
        )
        self.w_uk = param(rngs, (H, N, C), ("heads", "head_dim", "kv_lora"), dtype, C**-0.5)
        self.w_uv = param(rngs, (H, C, V), ("heads", "kv_lora", "head_dim"), dtype, C**-0.5)
        self.o = Linear(H * V, D, ("q_heads", "embed"), **lin)
        self.cfg = cfg

    def __call__(self, x, positions, start, tree, k_cache, v_cache):
        """x [B, T, D] at RoPE positions [B, T]; writes k_cache [B, 1, S, C + R] at slots
        start .. start + T - 1 (v_cache unused, None); attends under (start, tree).
        Returns (out [B, T, D], k_cache, v_cache)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, C, N = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        inv_freq, amp = rope_frequencies(cfg)
        q = self.q_proj(x) if self.q_proj is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        q = q.reshape(B, T, H, -1)
        q_nope, q_pe = q[..., :N], q[..., N:]
        ckv = self.kv_a(x)
        latent = self.kv_a_norm(ckv[..., :C])[:, :, None, :]  # [B, T, 1, C]
        k_pe = apply_rope(ckv[..., None, C:], positions, inv_freq, amp, interleaved=True)
        q_pe = apply_rope(q_pe, positions, inv_freq, amp, interleaved=True)
        k_cache = kvc.write(k_cache, jnp.concatenate([latent, k_pe], axis=-1), start)
        q_lat = head_matmul(q_nope, self.w_uk[...], cfg.kernels)  # [B, T, H, C]
        q_full = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # [B, T, H, C + R]
        o_lat = attend_latent(q_full, k_cache, start, tree, softmax_scale(cfg), C, cfg.kernels)
        out = head_matmul(o_lat, self.w_uv[...], cfg.kernels).reshape(B, T, -1)  # [B, T, H V]
        return self.o(out), k_cache, v_cache


def route(x, router, bias, cfg: ModelConfig):
    """Choose top-k experts per token, exactly as the HF reference does.

    x [N, D]; router [D, E] float32; bias [E] float32 or None. Returns combine weights
    [N, k] float32 and expert ids [N, k] int32. The correction bias steers selection only;
    the combine weights are the unbiased scores.
    """
    logits = matmul(x.astype(jnp.float32), router, cfg.kernels)
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias
    E, G = cfg.n_routed_experts, cfg.n_group
    if cfg.topk_method != "greedy" and G > 1:
        grouped = choice.reshape(-1, G, E // G)
        if cfg.topk_method == "noaux_tc":
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # sum of the two best per group
        else:  # group_limited_greedy
            group_score = grouped.max(-1)
        keep = jax.lax.top_k(group_score, cfg.topk_group)[1]  # [N, topk_group]
        group_ok = (
            jnp.zeros_like(group_score, bool).at[jnp.arange(len(keep))[:, None], keep].set(True)
        )
        choice = jnp.where(jnp.repeat(group_ok, E // G, axis=-1), choice, -jnp.inf)
    idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)[1]
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (fixed_order_sum(w) + 1e-20)  # fixed order: the same bits in any batch
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["value", "scale"], meta_fields=["fmt"]
)
@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """A stacked expert matrix [E, in, *out] as it sits in HBM (kdj/quant.py):
    fmt "float" (value is the weights, scale None), "int4" (value int32 [E, in/8, *out] + group
    scales) or "fp8" (value float8_e4m3fn + 128 x 128 block scales). A pytree, so it passes
    through jit and shard_map; value and scale split over the same logical axes."""

    value: jax.Array
    scale: jax.Array | None = None
    fmt: str = "float"

    @staticmethod
    def of(w) -> ExpertWeight:
        """An ExpertWeight as is; a plain array is float weights."""
        return w if isinstance(w, ExpertWeight) else ExpertWeight(jnp.asarray(w))

    @property
    def num_experts(self) -> int:
        return self.value.shape[0]

    def take(self, ids, dtype):
        """Dequantised weights of experts ids [n]: [n, in, *out]. Only those experts are read."""
        if self.fmt == "float":
            # no barrier: XLA reads the selected experts straight into the dot, no copy
            return self.value[ids]
        scale = None if self.scale is None else self.scale[ids]
        # The barrier pins the gather before the dequantisation: otherwise XLA hoists the
        # dequantisation above it and converts EVERY expert each step.
        value, scale = jax.lax.optimization_barrier((self.value[ids], scale))
        return dequant_stacked(self.fmt, value, scale, dtype)

    def matvec(self, x, ids, kernels: KernelPolicy):
        """Rows x [n, in] through one expert each, ids [n]: [n, *out] float32. Only the
        selected experts are read. Under the expert GEMV kernel (`gemv_kernel`) they are read
        as stored and dequantised in registers (kdj/pallas/expert_gemv.py); otherwise XLA
        gathers and dequantises them first (`take`), the reference the kernel is tested
        against."""
        if not self.gemv_kernel(kernels):
            w = self.take(ids, x.dtype)
            return jnp.einsum("nd,nd...->n...", x, w, preferred_element_type=jnp.float32)
        rows = kernels.split_rows(len(ids))
        s = expert_gemv.splits(rows, *self.layout(), programs=kernels.gemv_programs)
        y = expert_gemv.expert_gemv(x, ids, *self.matrix(), self.fmt, splits=s)
        return y.reshape(len(ids), *self.value.shape[2:])

    def gemv_kernel(self, kernels: KernelPolicy) -> bool:
        """Whether `matvec` runs the Pallas kernel: the policy's choice, for a layout it takes."""
        return kernels.expert_gemv == "pallas" and expert_gemv.supported(*self.layout())

    def grouped_kernel(self, kernels: KernelPolicy) -> bool:
        """Whether the grouped Pallas kernel may take these weights (`expert_swiglu_grouped`)."""
        return kernels.expert_grouped == "pallas" and expert_grouped.supported(*self.layout())

    def matrix(self):
        """(value [E, in(/8), F], scale [E, in/g, F'] or None): the output axes flattened, as
        the Pallas expert kernels take them (a free reshape of the stored arrays)."""
        value = self.value.reshape(*self.value.shape[:2], -1)
        return value, None if self.scale is None else self.scale.reshape(*self.scale.shape[:2], -1)

    def layout(self):
        """(fmt, inputs K, outputs F, scale shape or None) of `matrix()`: what the Pallas
        kernels' `supported` checks (INT4 packs 8 inputs per stored row)."""
        value, scale = self.matrix()
        K = value.shape[1] * (8 if self.fmt == "int4" else 1)
        return self.fmt, K, value.shape[2], None if scale is None else scale.shape

    def dense(self, dtype):
        """All experts, dequantised: [E, in, *out] (float weights are returned as they are)."""
        if self.fmt == "float":
            return self.value
        return dequant_stacked(self.fmt, self.value, self.scale, dtype)


def touched_experts(flat, size: int):
    """Distinct experts of assignments flat [n] in a static-size list: (ids [size] ascending,
    padded with the largest id; slot [n]: each assignment's index into ids)."""
    ids = jnp.unique(flat, size=size, fill_value=flat.max())
    return ids, jnp.searchsorted(ids, flat, method="compare_all").astype(jnp.int32)


def expert_swiglu(x, weights, idx, w_gate_up, w_down):
    """Routed expert compute with tokens grouped by expert (jax.lax.ragged_dot).

    x [N, D]; weights/idx [N, k]; w_gate_up [E, D, 2, I] and w_down [E, I, D], arrays or
    ExpertWeight. Returns [N, D]. Quantised experts are dequantised only where they can be
    touched: with fewer assignments than experts, the distinct touched experts are gathered
    first (at most N * k of them) and become the groups.
    """
    wgu, wd = ExpertWeight.of(w_gate_up), ExpertWeight.of(w_down)
    N, k = idx.shape
    E, D = wgu.num_experts, x.shape[1]
    flat = idx.reshape(-1)
    if wgu.fmt != "float" and flat.size < E:
        ids, flat = touched_experts(flat, flat.size)
        gu, down = wgu.take(ids, x.dtype), wd.take(ids, x.dtype)
    else:
        gu, down = wgu.dense(x.dtype), wd.dense(x.dtype)
    G, _, _, I = gu.shape
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=G).astype(jnp.int32)
    xs = x[order // k]
    h = jax.lax.ragged_dot(xs, gu.reshape(G, D, 2 * I), group_sizes).reshape(-1, 2, I)
    y = jax.lax.ragged_dot(swiglu(h[:, 0], h[:, 1], x.dtype), down, group_sizes)  # by expert
    y = jnp.zeros_like(y).at[order].set(y)  # back to assignment order (a permutation)
    return combine(y.reshape(N, k, D), weights, x.dtype)


def expert_swiglu_gathered(x, weights, idx, w_gate_up, w_down, kernels: KernelPolicy):
    """Routed expert compute for a handful of tokens: gather each assignment's expert weights.

    Same contract as `expert_swiglu`. Reads only the N * k selected experts (duplicates
    included), dequantising just those, which beats grouped GEMMs when N * k is far below E:
    decode at small batch. `kernels` decides whether the gather is the Pallas GEMV.
    """
    wgu, wd = ExpertWeight.of(w_gate_up), ExpertWeight.of(w_down)
    N, k = idx.shape
    flat = idx.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # [N*k, D], assignment j belongs to token j // k
    h = wgu.matvec(xs, flat, kernels).astype(x.dtype)  # [N*k, 2, I]
    h = swiglu(h[:, 0], h[:, 1], x.dtype)
    y = wd.matvec(h, flat, kernels).astype(x.dtype)  # [N*k, D]
    return combine(y.reshape(N, k, -1), weights, x.dtype)


def swiglu(gate, up, dtype):
    """silu(gate) * up in float32, rounded to dtype: the activations between an expert's two
    matmuls. Every expert path rounds the same way at the same places (each matmul's output
    and these activations in the model's dtype, as HF's bf16 experts do), so a decode step and
    a verify step, which take different kernels, differ only in their float32 sums' order."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (jax.nn.silu(gate) * up).astype(dtype)


def combine(y, weights, dtype):
    """The routed experts' output per token: y [N, k, D] (each expert's output, model dtype)
    weighted by the combine weights [N, k] float32 and summed in float32 in a fixed order (the
    same bits in any batch). -> [N, D] dtype."""
    return fixed_order_sum(y.astype(jnp.float32) * weights[..., None], 1)[:, 0].astype(dtype)


def expert_swiglu_grouped(x, weights, idx, w_gate_up, w_down):
    """Routed expert compute through the Pallas grouped kernel (GPU; interpreted elsewhere).
    Same contract as `expert_swiglu`, and an id of -1 marks an assignment to skip (another
    shard's expert).

    The assignments are sorted by expert into row blocks once (kdj/pallas/expert_grouped.py);
    gate/up reads each block's token rows straight from x, and the down projection takes the
    SwiGLU activations in that same padded order, so nothing is repeated or permuted between
    the two matmuls. Each touched expert is read once per block of its rows."""
    wgu, wd = ExpertWeight.of(w_gate_up), ExpertWeight.of(w_down)
    N, k = idx.shape
    E, I, D = wgu.num_experts, wd.layout()[1], x.shape[1]
    flat = idx.reshape(-1)
    t_gu = expert_grouped.tiles(wgu.fmt, flat.size / E)
    t_d = expert_grouped.tiles(wd.fmt, flat.size / E) | {"block_m": t_gu["block_m"]}
    rows, be = expert_grouped.blocks(flat, E, t_gu["block_m"])  # assignment per padded row
    token = jnp.where(rows >= 0, rows // k, -1)
    gu = (x, token, be, *wgu.matrix(), wgu.fmt)
    h = expert_grouped.grouped_matmul(*gu, out_dtype=x.dtype, **t_gu)  # [P, 2I], gate first
    h = swiglu(h[:, :I], h[:, I:], x.dtype)
    same = jnp.where(rows >= 0, jnp.arange(rows.shape[0]), -1)
    y = expert_grouped.grouped_matmul(h, same, be, *wd.matrix(), wd.fmt, out_dtype=x.dtype, **t_d)
    y = y[expert_grouped.positions(rows, flat.size)].reshape(N, k, D)  # [N, k, D]
    return combine(jnp.where((idx >= 0)[..., None], y, 0), weights, x.dtype)  # -1: no term


class MoE(nnx.Module):
    """Routed experts (top-k of E) plus always-on shared experts.

    The routed experts are float by default; `quantize_experts` switches them to a format
    kept quantised in HBM ("int4" | "fp8"), adding gate_up_scale / down_scale params."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (D, E), ("embed", None), jnp.float32)
        self.bias = zeros((E,), (None,), jnp.float32) if cfg.topk_method == "noaux_tc" else None
        self.w_gate_up = param(rngs, (E, D, 2, I), ("experts", "embed", None, "moe_mlp"), dtype,
                               D**-0.5)  # fmt: skip
        self.w_down = param(rngs, (E, I, D), ("experts", "moe_mlp", "embed"), dtype, I**-0.5)
        # data slots (not static None): MoE.quantize puts the scales here
        self.gate_up_scale = self.down_scale = nnx.data(None)
        self.expert_format = "float"
        shared = I * cfg.n_shared_experts
        self.shared = (
            MLP(D, shared, dtype=dtype, rngs=rngs, kernels=cfg.kernels) if shared else None
        )
        self.cfg = cfg
        self.shard = None  # a kdj.sharding.Sharding when experts are spread over a mesh

    def experts(self) -> tuple[ExpertWeight, ExpertWeight]:
        """(gate_up [E, D, 2, I], down [E, I, D]) as held."""
        return tuple(
            ExpertWeight(w[...], None if s is None else s[...], self.expert_format)
            for w, s in ((self.w_gate_up, self.gate_up_scale), (self.w_down, self.down_scale))
        )

    def __call__(self, x):
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        bias = None if self.bias is None else self.bias[...]
        w, idx = route(flat, self.router[...], bias, self.cfg)
        kernels = self.cfg.kernels
        if self.shard is None:
            out = local_experts(flat, w, idx, *self.experts(), first=0, kernels=kernels)
        else:
            out = sharded_experts(self.shard, flat, w, idx, *self.experts(), kernels)
        out = out.reshape(B, T, D)
        return out if self.shared is None else out + self.shared(x)

    def quantize(self, fmt: str, *, block: int = FP8_BLOCK, group: int = INT4_GROUP,
                 scale_dtype=jnp.bfloat16) -> None:  # fmt: skip
        """Hold the routed experts in `fmt` from now on (in place). Concrete float weights are
        quantised; abstract ones (an nnx.eval_shape skeleton) only change shape and dtype, for
        a checkpoint to fill. block: FP8 block; group, scale_dtype: INT4 scales."""
        if self.expert_format != "float":
            raise ValueError(f"experts are already {self.expert_format}")
        if fmt == "int4":
            fn = functools.partial(quant_int4_stacked, group=group, scale_dtype=scale_dtype)
        elif fmt == "fp8":
            fn = functools.partial(quant_fp8_stacked, block=block)
        else:
            raise ValueError(f"expert format must be 'int4' or 'fp8', not {fmt!r}")
        for name in ("gate_up", "down"):
            var = getattr(self, f"w_{name}")
            w, axes = var.get_value(), var.get_metadata()["axes"]
            if isinstance(w, jax.ShapeDtypeStruct):
                q, s = jax.eval_shape(fn, w)
            else:
                q, s = jax.jit(fn)(w)
                var.set_value(None)  # drop the float copy before the next matrix is quantised
            setattr(self, f"w_{name}", nnx.Param(q, axes=axes))
            setattr(self, f"{name}_scale", nnx.Param(s, axes=axes))
        self.expert_format = fmt


def quantize_experts(model, fmt: str, **kw) -> None:
    """Switch every MoE layer of `model` to routed experts kept quantised (MoE.quantize)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoE):
            module.quantize(fmt, **kw)


def local_experts(x, weights, idx, w_gate_up, w_down, first, kernels: KernelPolicy):
    """Tokens x [N, D] through the experts held here: global ids first .. first + E_local - 1.

    Assignments to other experts get weight 0 (another shard computes them). The path is
    chosen at trace time from static shapes and `kernels`: gathering the selected experts'
    weights up to the policy's gather limit, grouped GEMMs beyond (the Pallas kernel where
    the policy has it, else ragged_dot).
    """
    w_gate_up, w_down = ExpertWeight.of(w_gate_up), ExpertWeight.of(w_down)
    E_local = w_gate_up.num_experts
    local = idx - first
    mine = (local >= 0) & (local < E_local)
    weights = jnp.where(mine, weights, 0.0)
    gemv = w_gate_up.gemv_kernel(kernels) and w_down.gemv_kernel(kernels)
    few = kernels.gathers(idx.size, E_local, gemv)
    if not few and w_gate_up.grouped_kernel(kernels) and w_down.grouped_kernel(kernels):
        # other shards' assignments (-1) get no rows at all
        return expert_swiglu_grouped(x, weights, jnp.where(mine, local, -1), w_gate_up, w_down)
    # the other paths take them through local expert 0 at weight 0
    local = jnp.where(mine, local, 0)
    if few:
        return expert_swiglu_gathered(x, weights, local, w_gate_up, w_down, kernels)
    return expert_swiglu(x, weights, local, w_gate_up, w_down)  # XLA's ragged_dot


def sharded_experts(shard, x, weights, idx, w_gate_up, w_down, kernels: KernelPolicy):
    """Expert parallelism with shard_map: each device computes its own experts (and, under
    tensor-parallel rules, its slice of each expert's FFN) for the tokens it holds, then the
    partial outputs are summed over the expert (and FFN) axes. When the batch is also split
    over the expert axis (data-parallel attention), tokens are first gathered across it and
    the sum is scattered back (psum_scatter). Quantised experts travel as stored (value and
    scales split alike) and are dequantised on the device that holds them."""
    w_gate_up, w_down = ExpertWeight.of(w_gate_up), ExpertWeight.of(w_down)
    r = shard.rules
    e_ax, f_ax, b_ax = r.experts, r.moe_mlp, r.batch
    if x.shape[0] % shard.size("batch"):
        b_ax = None  # a token count the batch axes do not divide: tokens stay replicated
    b_names = (b_ax,) if isinstance(b_ax, str) else tuple(b_ax or ())
    gather = e_ax is not None and e_ax in b_names
    tok = P(b_ax, None)

    def spec(w: ExpertWeight, p: P) -> ExpertWeight:
        return ExpertWeight(p, None if w.scale is None else p, w.fmt)

    def body(x, weights, idx, wgu, wd):
        if gather:
            x, weights, idx = (jax.lax.all_gather(a, e_ax, tiled=True) for a in (x, weights, idx))
        first = 0 if e_ax is None else jax.lax.axis_index(e_ax) * wgu.num_experts
        y = local_experts(x, weights, idx, wgu, wd, first, kernels)
        if f_ax is not None:
            y = jax.lax.psum(y, f_ax)
        if gather:
            return jax.lax.psum_scatter(y, e_ax, scatter_dimension=0, tiled=True)
        return y if e_ax is None else jax.lax.psum(y, e_ax)

    specs = (spec(w_gate_up, P(e_ax, None, None, f_ax)), spec(w_down, P(e_ax, f_ax, None)))
    return jax.shard_map(
        body, mesh=shard.mesh, check_vma=False, in_specs=(tok, tok, tok, *specs), out_specs=tok,
    )(x, weights, idx, w_gate_up, w_down)  # fmt: skip
