"""DeepSeek-V2/V3 family (Kimi-K2.x, Moonlight): MLA attention in absorbed form, and MoE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kdj import cache as kvc
from kdj.config import ModelConfig
from kdj.models.layers import (
    MLP,
    Linear,
    RMSNorm,
    apply_rope,
    attend,
    param,
    rope_frequencies,
    softmax_scale,
    zeros,
)


class MLAAttention(nnx.Module):
    """Multi-head latent attention over a latent cache, always in the absorbed form.

    The cache holds [kv_a_layernorm(c_kv) ; rope(k_pe)] per token. kv_b_proj is split into
    w_uk [H, nope, C] (folded into the query) and w_uv [H, v, C] (applied after attention),
    so attention is MQA with one shared 576-wide key stream and the latent as the value.
    """

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, H = cfg.hidden_size, cfg.num_heads
        C, R, N, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            Q = cfg.q_lora_rank
            self.q_a = Linear(D, Q, ("embed", "q_lora"), dtype=dtype, rngs=rngs)
            self.q_a_norm = RMSNorm(Q, cfg.rms_norm_eps, dtype=dtype, axes=("q_lora",))
            self.q_b = Linear(Q, H * (N + R), ("q_lora", "q_heads"), dtype=dtype, rngs=rngs)
            self.q_proj = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q_proj = Linear(D, H * (N + R), ("embed", "q_heads"), dtype=dtype, rngs=rngs)
        self.kv_a = Linear(D, C + R, ("embed", "kv_lora"), dtype=dtype, rngs=rngs)
        self.kv_a_norm = RMSNorm(C, cfg.rms_norm_eps, dtype=dtype, axes=("kv_lora",))
        self.w_uk = param(rngs, (H, N, C), ("heads", "head_dim", "kv_lora"), dtype, C**-0.5)
        self.w_uv = param(rngs, (H, V, C), ("heads", "head_dim", "kv_lora"), dtype, C**-0.5)
        self.o = Linear(H * V, D, ("q_heads", "embed"), dtype=dtype, rngs=rngs)
        self.cfg = cfg

    def __call__(self, x, positions, k_cache, v_cache, mask):
        """x [B, T, D] at positions [B, T]; k_cache [B, S, 1, C + R] (v_cache unused, None);
        mask [B, T, S]. Returns (out [B, T, D], k_cache, v_cache)."""
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
        k_cache = kvc.write(k_cache, jnp.concatenate([latent, k_pe], axis=-1), positions)
        q_lat = jnp.einsum("bthn,hnc->bthc", q_nope, self.w_uk[...])
        q_full = jnp.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)  # [B, T, H, C + R]
        o_lat = attend(q_full, k_cache, k_cache[..., :C], mask, softmax_scale(cfg))
        out = jnp.einsum("bthc,hvc->bthv", o_lat, self.w_uv[...]).reshape(B, T, -1)
        return self.o(out), k_cache, v_cache


def route(x, router, bias, cfg: ModelConfig):
    """Choose top-k experts per token, exactly as the HF reference does.

    x [N, D]; router [D, E] float32; bias [E] float32 or None. Returns combine weights
    [N, k] float32 and expert ids [N, k] int32. The correction bias steers selection only;
    the combine weights are the unbiased scores.
    """
    logits = x.astype(jnp.float32) @ router
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
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def expert_swiglu(x, weights, idx, w_gate_up, w_down):
    """Routed expert compute with tokens grouped by expert (jax.lax.ragged_dot).

    x [N, D]; weights/idx [N, k]; w_gate_up [E, D, 2, I]; w_down [E, I, D]. Returns [N, D].
    This is the XLA reference path; only experts with tokens get rows in each group.
    """
    N, k = idx.shape
    E, D, _, I = w_gate_up.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[token]
    h = jax.lax.ragged_dot(xs, w_gate_up.reshape(E, D, 2 * I), group_sizes).reshape(-1, 2, I)
    h = jax.nn.silu(h[:, 0]) * h[:, 1]
    y = jax.lax.ragged_dot(h.astype(x.dtype), w_down, group_sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y.astype(x.dtype))


def expert_swiglu_gathered(x, weights, idx, w_gate_up, w_down):
    """Routed expert compute for a handful of tokens: gather each assignment's expert weights.

    Same contract as `expert_swiglu`. Reads only the N * k selected experts (duplicates
    included), which beats grouped GEMMs when N * k is far below E: decode at small batch.
    """
    N, k = idx.shape
    flat = idx.reshape(-1)
    xs = jnp.repeat(x, k, axis=0)  # [N*k, D], assignment j belongs to token j // k
    h = jnp.einsum("nd,ndci->nci", xs, w_gate_up[flat])
    h = jax.nn.silu(h[:, 0]) * h[:, 1]
    y = jnp.einsum("ni,nid->nd", h.astype(x.dtype), w_down[flat])
    y = y.reshape(N, k, -1) * weights[..., None].astype(y.dtype)
    return y.sum(1).astype(x.dtype)


# Below this many token-expert assignments per expert, gathering beats grouped GEMMs.
# On an H200 a 64-expert grouped matmul sits at a ~0.11 ms floor for few tokens (ANCHORS.md).
GATHER_MAX_ASSIGNMENTS_PER_EXPERT = 0.25


class MoE(nnx.Module):
    """Routed experts (top-k of E) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.router = param(rngs, (D, E), ("embed", None), jnp.float32)
        self.bias = zeros((E,), (None,), jnp.float32) if cfg.topk_method == "noaux_tc" else None
        self.w_gate_up = param(rngs, (E, D, 2, I), ("experts", "embed", None, "moe_mlp"), dtype)
        self.w_down = param(rngs, (E, I, D), ("experts", "moe_mlp", "embed"), dtype)
        n_shared = cfg.n_shared_experts
        self.shared = MLP(D, I * n_shared, dtype=dtype, rngs=rngs) if n_shared else None
        self.cfg = cfg
        self.shard = None  # a kdj.sharding.Sharding when experts are spread over a mesh

    def __call__(self, x):
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        bias = None if self.bias is None else self.bias[...]
        w, idx = route(flat, self.router[...], bias, self.cfg)
        weights = (self.w_gate_up[...], self.w_down[...])
        if self.shard is None:
            out = local_experts(flat, w, idx, *weights, first=0)
        else:
            out = sharded_experts(self.shard, flat, w, idx, *weights)
        out = out.reshape(B, T, D)
        return out if self.shared is None else out + self.shared(x)


def local_experts(x, weights, idx, w_gate_up, w_down, first):
    """Tokens x [N, D] through the experts held here: global ids first .. first + E_local - 1.

    Assignments to other experts get weight 0 (another shard computes them). The path is
    chosen at trace time from static shapes: gathering the selected experts' weights for a
    handful of tokens, grouped GEMMs otherwise.
    """
    E_local = w_gate_up.shape[0]
    local = idx - first
    mine = (local >= 0) & (local < E_local)
    weights = jnp.where(mine, weights, 0.0)
    local = jnp.where(mine, local, 0)
    few = idx.size <= GATHER_MAX_ASSIGNMENTS_PER_EXPERT * E_local
    experts = expert_swiglu_gathered if few else expert_swiglu
    return experts(x, weights, local, w_gate_up, w_down)


def sharded_experts(shard, x, weights, idx, w_gate_up, w_down):
    """Expert parallelism with shard_map: each device computes its own experts (and, under
    tensor-parallel rules, its slice of each expert's FFN) for the tokens it holds, then the
    partial outputs are summed over the expert (and FFN) axes. When the batch is also split
    over the expert axis (data-parallel attention), tokens are first gathered across it and
    the sum is scattered back (psum_scatter)."""
    r = shard.rules
    e_ax, f_ax, b_ax = r.experts, r.moe_mlp, r.batch
    if x.shape[0] % shard.size("batch"):
        b_ax = None  # a token count the batch axes do not divide: tokens stay replicated
    b_names = (b_ax,) if isinstance(b_ax, str) else tuple(b_ax or ())
    gather = e_ax is not None and e_ax in b_names
    tok = P(b_ax, None)

    def body(x, weights, idx, wgu, wd):
        if gather:
            x, weights, idx = (jax.lax.all_gather(a, e_ax, tiled=True) for a in (x, weights, idx))
        first = 0 if e_ax is None else jax.lax.axis_index(e_ax) * wgu.shape[0]
        y = local_experts(x, weights, idx, wgu, wd, first)
        if f_ax is not None:
            y = jax.lax.psum(y, f_ax)
        if gather:
            return jax.lax.psum_scatter(y, e_ax, scatter_dimension=0, tiled=True)
        return y if e_ax is None else jax.lax.psum(y, e_ax)

    return jax.shard_map(
        body, mesh=shard.mesh, check_vma=False,
        in_specs=(tok, tok, tok, P(e_ax, None, None, f_ax), P(e_ax, f_ax, None)), out_specs=tok,
    )(x, weights, idx, w_gate_up, w_down)  # fmt: skip
