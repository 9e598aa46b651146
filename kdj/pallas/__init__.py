"""Pallas GPU kernels, each beside its XLA reference (the CPU path and the test oracle).

* ``tree_attention``: GQA and MLA-absorbed attention over the cache in kdj's one mask form
  (prefix < start plus a [T, T] tree), flash style with split-K; used by
  ``kdj.models.layers.attend`` / ``attend_latent`` (reference: ``layers.reference_attention``).

* ``expert_gemv``: the gathered matvec, one weight matrix per row read as stored (bf16 /
  INT4 / FP8 dequantised in registers); used by MoE decode at few assignments per expert
  (``kdj.models.deepseek.ExpertWeight.matvec``) and by the one-row dense projections
  (``layers.matmul`` / ``head_matmul``). Reference: ``expert_gemv.reference``.

* ``expert_grouped``: the grouped expert matmul for many assignments (rows sorted by expert
  into blocks, tensor-core dots, weights dequantised per tile); used by the MoE layer past the
  gather threshold (``kdj.models.deepseek.expert_swiglu_grouped``; reference: XLA's
  ``ragged_dot`` in ``expert_swiglu``).

* ``dense_mlp``: a dense decoder block's MLP half, RMSNorm + gate/up + SwiGLU in one kernel
  and down + the residual add in another, for decode and verify row counts; used by
  ``kdj.models.layers.MLP.residual`` where the policy's ``dense_mlp`` is "pallas" (reference:
  ``dense_mlp.reference``, the same ops as the XLA path).

Which one runs, and its thresholds, is the model's kernel policy (kdj/kernels.py). All use
the Triton lowering, interpreted off the GPU (tests, CI).
"""
