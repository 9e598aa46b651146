"""Pallas GPU kernels, each beside its XLA reference (the CPU path and the test oracle).

* ``tree_attention``: GQA and MLA-absorbed attention over the cache in kdj's one mask form
  (prefix < start plus a [T, T] tree), flash style with split-K, Triton lowering; chosen
  per shape by ``kdj.models.layers.attend`` / ``attend_latent`` on GPU.

* ``expert_gemv``: the gathered expert matvec of MoE decode at small batch (one assignment
  = one expert's weights read as stored, bf16 / INT4 / FP8 dequantised in registers); used by
  ``kdj.models.deepseek.ExpertWeight.matvec`` on GPU.

* ``expert_grouped``: the grouped expert matmul for many tokens (rows sorted by expert into
  blocks, tensor-core dots, weights dequantised per tile); benchmarked against ragged_dot by
  bench/expert_gather.py, not yet used by the MoE layer.

Kernels are chosen by measurement on the H200 (bench/); grouped expert GEMMs for many tokens
are still XLA's ``ragged_dot``.
"""
