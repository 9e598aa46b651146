"""Building blocks shared by every model: parameters with logical axes, norms, RoPE, attention.

Every parameter is an `nnx.Param` carrying `axes=(logical names...)`; kdj/sharding maps those
names to mesh axes in one place. Matmuls run in the parameter dtype; norms, softmax and RoPE
angles in float32 (as the Hugging Face reference does).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdj.config import ModelConfig
from kdj.kernels import KernelPolicy
from kdj.pallas import dense_mlp, expert_gemv, expert_grouped, tree_attention

NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax rather than NaN


def param(rngs: nnx.Rngs, shape, axes, dtype, scale: float | None = None) -> nnx.Param:
    """A normal(0, scale) parameter tagged with logical axis names (one per dim). The default
    scale, 1 / sqrt(fan-in), is a [in, out] matrix's; a weight of more dims names its own
    (which of its dims are the fan-in is not in its shape)."""
    assert len(shape) == len(axes), (shape, axes)
    if scale is None:
        assert len(shape) == 2, f"a {len(shape)}-dim weight needs its scale: {shape}"
        scale = 1.0 / math.sqrt(shape[0])
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=tuple(axes))


def ones(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), axes=tuple(axes))


def zeros(shape, axes, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), axes=tuple(axes))


def pad_inputs(x, w, axis: int):
    """x [n, K] and w (K on `axis`) with K zero-padded to a multiple of 16, the shortest
    tensor-core tile (the zeros add nothing to any sum)."""
    pad = -x.shape[-1] % 16
    if not pad:
        return x, w
    widths = [(0, 0)] * w.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, ((0, 0), (0, pad))), jnp.pad(w, widths)


def fixed_tile_matmul(x, w, tiles=KernelPolicy.FIXED_TILES, splits: int = 1):
    """x [n, K] @ w [K, F] -> [n, F] float32 on the grouped Pallas kernel with tiles fixed per
    weight (KernelPolicy.FIXED_TILES; bench/fixed_tiles.py times others): each row's sums run
    in an order that does not depend on n, which XLA's GEMM (its algorithm picked per shape)
    does not promise. splits (KernelPolicy.fixed_splits, fixed per weight too): K cut into
    slices, slice s of every row a row of "expert" s (w's rows s K/splits ...), the slices'
    sums then added in slice order."""
    x, w = pad_inputs(x, w, axis=0)
    n, K = x.shape
    if K % splits:
        raise ValueError(f"a fixed-tile matmul cannot cut K = {K} into {splits} slices")
    t, Ks = tiles, K // splits
    nb = -(-n // t["block_m"])  # row blocks of each slice
    xs = x.reshape(n * splits, Ks)  # row i * splits + s: slice s of row i (no copy)
    rows = np.arange(nb * t["block_m"], dtype=np.int32)
    rows = np.where(rows < n, rows, -1)  # static: one slice's rows in order, then padding
    rows = np.concatenate([np.where(rows >= 0, rows * splits + s, -1) for s in range(splits)])
    be = np.repeat(np.arange(splits, dtype=np.int32), nb)
    y = expert_grouped.grouped_matmul(xs, rows, be, w.reshape(splits, Ks, -1), **t)
    y = y.reshape(splits, nb * t["block_m"], -1)
    acc = y[0]
    for part in y[1:]:  # one order for every n: slice 0 + slice 1 + ...
        acc = acc + part
    return acc[:n]


def matmul(x, w, kernels: KernelPolicy):
    """x [..., K] @ w [K, *out] -> [..., *out] in their result dtype (float32 accumulation).
    One row through a mid-sized matrix runs the Pallas GEMV split over K where `kernels`
    says so: XLA rewrites a one-row dot into a multiply + reduce that streams at ~1 TB/s.
    Deterministic mode on the GPU runs every matmul with tiles fixed per weight."""
    K = w.shape[0]
    if kernels.fixed_tiles():
        w2 = w.reshape(K, -1)
        y = fixed_tile_matmul(x.reshape(-1, K), w2, splits=kernels.fixed_splits(*w2.shape))
        return y.astype(jnp.result_type(x, w)).reshape(*x.shape[:-1], *w.shape[1:])
    if not kernels.dense_gemv_for(math.prod(x.shape[:-1]), w.size):
        return jnp.tensordot(x, w, axes=1)  # w keeps its shape: a flattening could reshard it
    K, out = w.shape[0], w.shape[1:]
    w2 = w.reshape(1, K, -1)  # one "expert"; its id a numpy constant (a traced one: a kernel)
    s = expert_gemv.splits(1, "float", K, w2.shape[2], programs=kernels.gemv_programs)
    y = expert_gemv.expert_gemv(x.reshape(1, K), np.zeros(1, np.int32), w2, splits=s)
    return y.astype(jnp.result_type(x, w)).reshape(*x.shape[:-1], *out)


def head_matmul(x, w, kernels: KernelPolicy):
    """Each head's own matmul: x [..., H, K] @ w [H, K, F] -> [..., H, F] in their result
    dtype (float32 accumulation). MLA's absorbed projections (w_uk, w_uv) at one row per head
    run the Pallas GEMV with the heads as its "experts" where `kernels` says so; anything
    else XLA's batched dot."""
    H, K, F = w.shape
    if kernels.fixed_tiles():  # deterministic: the heads as experts, tiles fixed
        rows, w = pad_inputs(x.reshape(-1, K), w, axis=1)
        ids = jnp.tile(jnp.arange(H, dtype=jnp.int32), rows.shape[0] // H)
        y = expert_grouped.expert_grouped(rows, ids, w, cols_first=False,
                                          **KernelPolicy.FIXED_TILES)  # fmt: skip
        return y.astype(jnp.result_type(x, w)).reshape(*x.shape[:-1], F)
    if not kernels.head_gemv_for(math.prod(x.shape[:-2])):
        return jnp.einsum("...hk,hkf->...hf", x, w)
    y = expert_gemv.expert_gemv(x.reshape(H, K), np.arange(H, dtype=np.int32), w)  # [H, F]
    return y.astype(jnp.result_type(x, w)).reshape(*x.shape[:-1], F)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel is [in, out] (the transpose of torch's weight)."""

    def __init__(self, d_in, d_out, axes, *, bias=False, dtype, rngs, kernels: KernelPolicy):
        self.kernel = param(rngs, (d_in, d_out), axes, dtype)
        self.bias = zeros((d_out,), axes[1:], dtype) if bias else None
        self.kernels = kernels

    def __call__(self, x):
        y = matmul(x, self.kernel[...], self.kernels)
        return y if self.bias is None else y + self.bias[...]


def fixed_order_sum(x, axis=-1):
    """The sum over `axis` (kept, size 1) as a fixed pairwise tree: zero-padded to a power of
    two, halves added elementwise. A row gets the same bits however many rows there are,
    where XLA's reduction picks its summation order from the shape."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (n - 1).bit_length()) - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return jnp.moveaxis(x, -1, axis)


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps, *, dtype, axes=("norm",), kernels: KernelPolicy | None = None):
        self.weight = ones((dim,), axes, dtype)
        self.eps = eps
        self.kernels = kernels  # set_kernels keeps it the model's policy

    def __call__(self, x):
        dtype = x.dtype
        x = x.astype(jnp.float32)
        deterministic = self.kernels is not None and self.kernels.deterministic
        sq = x * x
        mean = fixed_order_sum(sq) / x.shape[-1] if deterministic else sq.mean(-1, keepdims=True)
        x = x * jax.lax.rsqrt(mean + self.eps)
        return self.weight[...] * x.astype(dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)).

    gate and up share one [D, 2, I] kernel so they are one matmul: at decode sizes the step
    is launch-bound, and one wide GEMM also streams the weights faster than two narrow ones.
    """

    def __init__(self, dim, hidden, *, dtype, rngs, kernels: KernelPolicy):
        self.gate_up = param(rngs, (dim, 2, hidden), ("embed", None, "mlp"), dtype, dim**-0.5)
        self.down = Linear(hidden, dim, ("mlp", "embed"), dtype=dtype, rngs=rngs, kernels=kernels)
        self.kernels = kernels

    def __call__(self, x):
        h = matmul(x, self.gate_up[...], self.kernels)  # [..., 2, I]
        return self.down(jax.nn.silu(h[..., 0, :]) * h[..., 1, :])

    def residual(self, x, norm: RMSNorm):
        """x + self(norm(x)): a decoder block's MLP half. Where the kernel policy takes it
        for this many rows (dense_mlp_for), the two fused Pallas kernels of
        kdj/pallas/dense_mlp.py, which fold the norm and the residual add in; else XLA."""
        rows = math.prod(x.shape[:-1])
        w, gate_up, down = norm.weight[...], self.gate_up[...], self.down.kernel[...]
        if not (self.kernels.dense_mlp_for(rows) and dense_mlp.supported(x, w, gate_up, down)):
            return x + self(norm(x))
        y = dense_mlp.dense_mlp(x.reshape(rows, x.shape[-1]), w, norm.eps, gate_up, down,
                                programs=self.kernels.gemv_programs,
                                fixed_rows=self.kernels.deterministic)  # fmt: skip
        return y.reshape(x.shape)


# ---------------------------------------------------------------------------------- RoPE
def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rope_dim // 2] and the cos/sin amplitude, as HF computes them.

    Handles plain RoPE, "linear", "llama3" and "yarn" (with mscale / mscale_all_dim).
    """
    dim, base = cfg.rope_dim, cfg.rope_theta
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    rope = cfg.rope
    if rope is None:
        return inv.astype(np.float32), 1.0
    kind = rope["rope_type"]
    factor = float(rope.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (wavelen >= old / high) & (wavelen <= old / low)
        scaled = np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        return scaled.astype(np.float32), 1.0
    # YaRN: interpolate low frequencies, keep high ones, linear ramp in between.
    orig = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
    extrapolate = 1 - ramp
    inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    amp = rope.get("attention_factor")
    if amp is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        amp = (
            get_mscale(factor, m) / get_mscale(factor, m_all) if m and m_all else get_mscale(factor)
        )
    return inv.astype(np.float32), float(amp)


def softmax_scale(cfg: ModelConfig) -> float:
    """Attention logit scale; MLA with YaRN multiplies by mscale(factor, mscale_all_dim)^2."""
    if cfg.family != "deepseek":
        return cfg.head_dim**-0.5
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope and rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        m = 1.0 if factor <= 1 else 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= m * m
    return scale


def apply_rope(x, positions, inv_freq, amplitude: float, interleaved: bool):
    """Rotate x [B, T, H, D] by angles positions[B, T] * inv_freq[D/2].

    Half-split layout (HF Llama/Qwen) pairs dim i with i + D/2. Interleaved layout (DeepSeek MLA)
    pairs 2i with 2i+1 and returns the result de-interleaved ([evens ; odds]) as HF does; q and k
    are rotated the same way, so dot products are unchanged.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = (jnp.cos(angles) * amplitude)[:, :, None, :]
    sin = (jnp.sin(angles) * amplitude)[:, :, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- attention
# One mask form serves prefill, decode, DFlash verify and DDTree verify: the T new tokens of
# sequence b are written to cache slots start[b] .. start[b] + T - 1, every query sees all
# committed slots < start[b], and among the new slots query i sees slot start[b] + j iff
# tree[b, i, j] (causal = lower triangle; a draft tree = ancestors and self). The kernels in
# kdj/pallas consume exactly this form and so read only slots < start + T.


def causal_tree(batch: int, T: int) -> jax.Array:
    """[B, T, T] lower-triangular visibility: the tree of a chain."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (batch, T, T))


def dense_mask(start, tree, capacity: int) -> jax.Array:
    """(start [B], tree [B, T, T]) -> [B, T, S] bool over all cache slots (True = visible)."""
    B, T, _ = tree.shape
    rel = jnp.arange(capacity)[None, :] - start[:, None]  # [B, S] slot relative to start
    idx = jnp.broadcast_to(jnp.clip(rel, 0, T - 1)[:, None, :], (B, T, capacity))
    in_tree = jnp.take_along_axis(tree, idx, axis=2) & ((rel >= 0) & (rel < T))[:, None, :]
    return (rel < 0)[:, None, :] | in_tree


def reference_attention(q, k, v, start, tree, scale: float):
    """Masked attention in plain XLA: the CPU path and the kernels' test oracle.

    q [B, T, H, Dk]; k [B, KVH, S, Dk]; v [B, KVH, S, Dv]; start [B] int32; tree [B, T, T]
    bool. H is a multiple of KVH (GQA; MLA's absorbed form is KVH = 1). Returns [B, T, H, Dv].
    """
    B, T, H, Dk = q.shape
    KVH = k.shape[1]
    mask = dense_mask(start, tree, k.shape[2])
    q = q.reshape(B, T, KVH, H // KVH, Dk)
    s = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bksd->btkgd", p, v)
    return o.reshape(B, T, H, v.shape[-1])


def packed_reference_attention(q, k, v, start, tree, scale: float):
    """reference_attention over deterministic mode's key layout (tree_attention.packed_view):
    each query attends over its own view of the cache, laid out as a plain decode of its
    path would hold it, in one batched dot per query. The CPU path of deterministic mode; it
    gathers T copies of the cache ([B, KVH, T, S, D] for K and for V)."""
    B, T, H, Dk = q.shape
    KVH = k.shape[1]
    paths = tree_attention.packed_paths(tree)
    (kv, seen), (vv, _) = (tree_attention.packed_view(x, start, paths) for x in (k, v))
    q = q.reshape(B, T, KVH, H // KVH, Dk)
    s = jnp.einsum("btkgd,bktsd->bkgts", q, kv, preferred_element_type=jnp.float32) * scale
    s = jnp.where(seen[:, None, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bktsd->btkgd", p, vv)
    return o.reshape(B, T, H, v.shape[-1])


def attend(q, k, v, start, tree, scale: float, kernels: KernelPolicy):
    """GQA attention of T new queries over the cache (see the mask form above): the Pallas
    kernel where `kernels` takes it for this T and shape, else the XLA reference (in
    deterministic mode over the kernel's packed key layout)."""
    T = q.shape[1]
    if kernels.attention_kernel_for(T) and tree_attention.supported(
        q.shape, k.shape, v.shape[-1], latent=False
    ):
        return tree_attention.tree_attention(q, k, v, start, tree, scale,
                                             **kernels.attention_config(T))  # fmt: skip
    reference = packed_reference_attention if kernels.deterministic else reference_attention
    return reference(q, k, v, start, tree, scale)


def attend_latent(q, kv, start, tree, scale: float, v_dim: int, kernels: KernelPolicy):
    """MLA absorbed attention: q [B, T, H, C + R] over one shared stream kv [B, 1, S, C + R]
    whose first v_dim = C columns are also the values. Returns [B, T, H, C]. The Pallas
    kernel where `kernels` takes it (plain decode, or very many query rows), else the XLA
    reference."""
    T, H, S = q.shape[1], q.shape[2], kv.shape[2]
    if kernels.latent_kernel_for(T, H, S) and tree_attention.supported(
        q.shape, kv.shape, v_dim, latent=True
    ):
        return tree_attention.latent_tree_attention(q, kv, start, tree, scale, v_dim,
                                                    **kernels.attention_config(T))  # fmt: skip
    reference = packed_reference_attention if kernels.deterministic else reference_attention
    return reference(q, kv, kv[..., :v_dim], start, tree, scale)


def set_kernels(model: nnx.Module, kernels: KernelPolicy) -> None:
    """Switch every module of `model` (target or drafter) to kernel policy `kernels`, in
    place: the modules that hold one and the configs (`with_kernels`). Params untouched."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "kernels"):
            module.kernels = kernels
        if hasattr(getattr(module, "cfg", None), "with_kernels"):
            module.cfg = module.cfg.with_kernels(kernels)
