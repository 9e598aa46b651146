"""Pallas GPU kernels, each beside its XLA reference (the CPU path and the test oracle).

* ``tree_attention``: GQA and MLA-absorbed attention over the cache in kdj's one mask form
  (prefix < start plus a [T, T] tree), flash style with split-K, Triton lowering; chosen
  per shape by ``kdj.models.layers.attend`` / ``attend_latent`` on GPU.

Kernels are chosen by measurement on the H200 (bench/); MoE expert GEMMs are still XLA.
"""
