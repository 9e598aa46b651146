"""Which kernel each op runs: one frozen policy, part of every jit key.

Every hot op has an XLA implementation (the reference: any backend, the tests' oracle) and
most have a Pallas kernel beside it (kdj/pallas, for the GPU). A `KernelPolicy` says which
one each kernel family runs and holds the thresholds that choose between them per shape.
It is a field of `ModelConfig`, which NNX keeps in the model's graph definition, so every
jitted function that takes the graphdef compiles again when the policy changes.

A loaded target gets `KernelPolicy.default(backend, sharded)` unless the caller passes one
(`kdj.load_target(..., kernels=)`, `Target.with_kernels`); its drafter follows it. The
figures below were measured on an H200 (bench/; BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

XLA, PALLAS = "xla", "pallas"
# XLA's default command buffer kinds (debug_options_flags.cc), then conditionals.
GRAPHED = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION",
           "CONDITIONAL")  # fmt: skip
FAMILIES = ("dense_gemv", "head_gemv", "attention", "latent_attention", "expert_gemv",
            "expert_grouped", "dense_mlp")  # fmt: skip


@dataclass(frozen=True)
class KernelPolicy:
    """Kernel choices and thresholds. The defaults are the XLA reference everywhere, with
    the thresholds the Pallas kernels use when a family is switched to "pallas"."""

    # Implementation per family: "xla" or "pallas".
    dense_gemv: str = XLA  # one-row matmuls of mid-sized weights (layers.matmul)
    head_gemv: str = XLA  # one row per head through MLA's absorbed w_uk / w_uv (head_matmul)
    attention: str = XLA  # GQA attention over T > 1 new tokens (layers.attend)
    latent_attention: str = XLA  # MLA absorbed attention (layers.attend_latent)
    expert_gemv: str = XLA  # gathered expert matvec: MoE at few assignments per expert
    expert_grouped: str = XLA  # grouped expert matmul: MoE at many (else XLA's ragged_dot)
    # a decoder block's norm + SwiGLU MLP + residual as two fused kernels (pallas/dense_mlp.py)
    dense_mlp: str = XLA

    # The dense GEMV takes weights of gemv_min_weights <= size < gemv_max_weights: below,
    # XLA fuses the one-row dot for free; from 16M up XLA's own dot streams at 2.7-4.2 TB/s.
    gemv_min_weights: int = 1 << 17
    gemv_max_weights: int = 1 << 24
    # Programs a GEMV grid should fill (~2 per SM): with fewer, K is split into slices.
    gemv_programs: int = 256
    # The fused dense MLP takes blocks of up to this many rows (B x T): it is built for the
    # launch-bound decode and verify steps; bigger blocks (prefill) keep XLA's GEMMs.
    dense_mlp_max_rows: int = 64
    # The latent kernel runs plain decode from this cache capacity up, and any step with at
    # least latent_min_rows query rows (T x heads), where the reference's [T, H, S] f32
    # scores grow too big; between those XLA's large matmuls are faster.
    latent_min_decode_capacity: int = 0
    latent_min_rows: int = 32768
    # Tree attention splits a row's committed slots over ~attention_programs programs, each
    # split at least split_blocks K blocks with a tree (T > 1) and decode_split_blocks in
    # plain decode, whose only parallelism at batch 1 is the slot split.
    attention_programs: int = 264
    split_blocks: int = 8
    decode_split_blocks: int = 1
    # MoE gathers each assignment's expert up to this many assignments per expert, grouped
    # matmuls beyond: with the expert GEMV the gathered path never reads more matrices than
    # there are experts (1.0); XLA's gather also writes each copy out, so it stops earlier.
    gather_per_expert_kernel: float = 1.0
    gather_per_expert_xla: float = 0.25
    # Deterministic mode (kdj.generate(deterministic=True)): every choice below is made
    # without looking at how many rows are in flight, so a row's result is the same in a
    # 1-token decode, a k-token verify and any batch: no one-row GEMVs (their XLA twin is a
    # different reduction); where Pallas runs (the GPU), matmuls on fixed tiles and the
    # attention kernel for every T with splits fixed from slot 0 (XLA picks its GEMM per
    # shape), each tree node attending over its own path laid out as a plain decode of it
    # lays it out; MoE always per-assignment with a split-K fixed per weight.
    deterministic: bool = False
    # Its matmuls cut K into slices of at least this many inputs (fixed_splits), so that one
    # row's matmul fills more of the GPU; each slice is a partial sum written out in float32.
    fixed_split_inputs: int = 192
    # Its attention may pack up to this many tree nodes into one query tile (as many as the
    # tile's rows hold), the blocks below the verify's start read once for them all rather
    # than once per node; 1: one node a tile.
    attention_nodes_per_tile: int = 1
    # Record conditionals into XLA's command buffers (CUDA graphs with conditional nodes)
    # beside the kernels and GEMMs XLA records by default: outside a graph a conditional
    # copies its branch index to the host and waits for it, mid-step (sampling's top_p and
    # the tree's compaction are conditionals). Programs without one compile as before.
    # Opt-in: the option names every kind it records, so an XLA whose own default list
    # differs would run this one.
    graph_conditionals: bool = False

    def __post_init__(self):
        for name in FAMILIES:
            if getattr(self, name) not in (XLA, PALLAS):
                raise ValueError(f"KernelPolicy.{name} must be {XLA!r} or {PALLAS!r}, "
                                 f"not {getattr(self, name)!r}")  # fmt: skip
        if not 0 <= self.gemv_min_weights <= self.gemv_max_weights:
            raise ValueError("KernelPolicy needs 0 <= gemv_min_weights <= gemv_max_weights")
        if min(self.gemv_programs, self.attention_programs, self.split_blocks,
               self.decode_split_blocks, self.fixed_split_inputs,
               self.attention_nodes_per_tile) < 1:  # fmt: skip
            raise ValueError("KernelPolicy program counts and split blocks must be >= 1")
        if self.dense_mlp_max_rows < 1:
            raise ValueError("KernelPolicy.dense_mlp_max_rows must be >= 1")

    @staticmethod
    def default(backend: str, sharded: bool = False) -> KernelPolicy:
        """The measured choice for a backend ("gpu", "cpu", ...) and for whether the model's
        weights are split over devices: off the GPU the XLA reference everywhere; on it every
        Pallas kernel, except the dense and head GEMVs of a sharded model (a pallas_call has
        no partitioning rule, so split weights stay with XLA) and the fused dense MLP, which
        is opt-in (dense_mlp="pallas"): no GPU measurement has chosen it yet."""
        if backend != "gpu":
            return KernelPolicy()
        gemv = XLA if sharded else PALLAS
        return KernelPolicy(dense_gemv=gemv, head_gemv=gemv, attention=PALLAS,
                            latent_attention=PALLAS, expert_gemv=PALLAS,
                            expert_grouped=PALLAS)  # fmt: skip

    def replace(self, **kw) -> KernelPolicy:
        return dataclasses.replace(self, **kw)

    def as_deterministic(self) -> KernelPolicy:
        """This policy in deterministic mode (see `deterministic`)."""
        return self.replace(deterministic=True)

    # Per-shape decisions (static: taken at trace time). The kernels' own `supported`
    # checks come on top of these.
    def dense_gemv_for(self, rows: int, weights: int) -> bool:
        """Whether a matmul of `rows` rows by a `weights`-element matrix runs the GEMV."""
        return (
            self.dense_gemv == PALLAS
            and not self.deterministic
            and rows == 1
            and self.gemv_min_weights <= weights < self.gemv_max_weights
        )

    def dense_mlp_for(self, rows: int) -> bool:
        """Whether a dense MLP block of `rows` rows (norm, SwiGLU, down, residual) runs the
        fused kernels: up to dense_mlp_max_rows rows; in deterministic mode at every row
        count, on row tiles fixed at 64 (its tiles then do not depend on the row count, so a
        row's bits do not either; dense_mlp.py)."""
        return self.dense_mlp == PALLAS and (self.deterministic or rows <= self.dense_mlp_max_rows)

    def head_gemv_for(self, rows: int) -> bool:
        """Whether per-head matmuls of `rows` rows per head run the GEMV (no size floor: XLA's
        form of this matvec, a reduction over the middle axis of [H, K, F], fuses nothing)."""
        return self.head_gemv == PALLAS and not self.deterministic and rows == 1

    def attention_kernel_for(self, T: int) -> bool:
        """Whether GQA attention of T new tokens runs the kernel: T > 1 (at T = 1 XLA's form
        is as fast up to ~8K of context)."""
        return self.attention == PALLAS and (T > 1 or self.deterministic)

    def latent_kernel_for(self, T: int, heads: int, capacity: int) -> bool:
        """Whether MLA attention of T new tokens x `heads` over a `capacity`-slot cache runs
        the kernel."""
        decode = T == 1 and capacity >= self.latent_min_decode_capacity
        if self.deterministic:
            return self.latent_attention == PALLAS
        return self.latent_attention == PALLAS and (decode or T * heads >= self.latent_min_rows)

    def min_split_blocks(self, T: int) -> int:
        """The fewest K blocks in one tree-attention slot split for T new tokens."""
        return self.decode_split_blocks if T == 1 else self.split_blocks

    def attention_config(self, T: int) -> dict:
        """The attention kernel's split settings for T new tokens: sized to fill the GPU, or
        in deterministic mode one layout for every T and batch (splits of split_blocks
        blocks from slot 0, query tiles of at most 64 rows holding up to
        attention_nodes_per_tile nodes, each over its own path: tree_attention.packed_paths)."""
        if self.deterministic:
            return dict(fixed_split=self.split_blocks, block_q=64, block_k=64,
                        nodes_per_tile=self.attention_nodes_per_tile)  # fmt: skip
        return dict(programs=self.attention_programs, min_split_blocks=self.min_split_blocks(T))

    def gather_limit(self, expert_kernel: bool) -> float:
        """Assignments per expert up to which MoE gathers experts (the GEMV path), with or
        without the expert GEMV kernel."""
        return self.gather_per_expert_kernel if expert_kernel else self.gather_per_expert_xla

    def gathers(self, assignments: int, experts: int, expert_kernel: bool) -> bool:
        """Whether MoE takes the gathered (per-assignment) path for `assignments` over
        `experts` experts, else grouped matmuls: always gathered when deterministic (each
        assignment its own matvec, whatever the batch), else up to the gather limit."""
        return self.deterministic or assignments <= self.gather_limit(expert_kernel) * experts

    # Deterministic mode's matmul tiles (layers.fixed_tile_matmul): one configuration for
    # every row count, so a row's sums run in the same order in a decode and a verify.
    FIXED_TILES = MappingProxyType(dict(block_m=64, block_k=64, block_f=128, num_warps=4))

    def fixed_splits(self, K: int, F: int) -> int:
        """The K slices of a deterministic matmul by a [K, F] weight, from its shape alone (the
        slices' float32 sums added in a fixed order): the fewest that give gemv_programs
        programs at one row, each slice whole FIXED_TILES K tiles and >= fixed_split_inputs
        inputs. Unsplit, one row by a 576-wide weight is 5 programs walking all of K."""
        tk, tf = self.FIXED_TILES["block_k"], self.FIXED_TILES["block_f"]
        best = 1
        for s in range(2, K // tk + 1):
            if best * -(-F // tf) >= self.gemv_programs or K // s < self.fixed_split_inputs:
                break
            if K % (s * tk) == 0:
                best = s
        return best

    def compiler_options(self) -> dict:
        """XLA options for the programs this policy runs. Deterministic: no excess precision,
        so every bf16 op rounds as written; with it XLA may keep an intermediate in float32
        inside a fusion, and which ops fuse depends on the shapes (one token or a verify).
        graph_conditionals: XLA's default command buffer kinds plus CONDITIONAL
        (the option takes the whole list; GPU backends read it, others ignore it)."""
        options = {}
        if self.deterministic:
            options["xla_allow_excess_precision"] = False
        if self.graph_conditionals:
            options["xla_gpu_enable_command_buffer"] = ",".join(GRAPHED)
        return options

    def fixed_tiles(self) -> bool:
        """Whether matmuls run with fixed tiles: deterministic, where dense weights take
        Pallas kernels (dense_gemv "pallas": the GPU, unsharded)."""
        return self.deterministic and self.dense_gemv == PALLAS

    def split_rows(self, rows: int) -> int:
        """The row count a GEMV sizes its split-K for: `rows`, or 1 when deterministic (one
        reduction order per weight, whatever the batch)."""
        return 1 if self.deterministic else rows


DEFAULT = KernelPolicy()  # the reference policy; its thresholds are the kernels' defaults


def choose(kernels: KernelPolicy | None, sharding=None, backend: str | None = None):
    """The policy a model runs: `kernels` if given, else the default for `backend` (default:
    JAX's) and for whether THIS model is sharded, i.e. `sharding` (a kdj.sharding.Sharding or
    None) spans more than one device: how many devices the host has does not matter."""
    import jax

    sharded = sharding is not None and sharding.mesh.size > 1
    if kernels is None:
        return KernelPolicy.default(backend or jax.default_backend(), sharded)
    if not isinstance(kernels, KernelPolicy):
        raise TypeError(f"kernels must be a kdj.kernels.KernelPolicy, not {type(kernels)}")
    if sharded and PALLAS in (kernels.dense_gemv, kernels.head_gemv, kernels.dense_mlp):
        raise ValueError(
            "the Pallas dense and head GEMVs and the fused dense MLP cannot take weights split "
            "over a mesh: give a sharded model dense_gemv='xla', head_gemv='xla' and "
            "dense_mlp='xla'"
        )
    return kernels
