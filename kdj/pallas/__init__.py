"""Pallas GPU kernels (tree attention, MoE expert GEMMs), each beside its XLA reference.

Empty so far: the foundation runs on XLA alone. Kernels land with the DDTree and MoE issues,
chosen by measurement on the H200; the XLA references in kdj/models stay the CPU path and
the test oracle.
"""
