"""Laying a model and its caches out on a mesh."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from kdj.cache import KVCache
from kdj.sharding.mesh import MeshConfig, check_fits, make_mesh
from kdj.sharding.rules import Sharding


def as_sharding(mesh) -> Sharding | None:
    """Accept a Sharding, a MeshConfig, a mesh YAML path or its dict; None stays None."""
    if mesh is None or isinstance(mesh, Sharding):
        return mesh
    if isinstance(mesh, MeshConfig):
        return make_mesh(mesh)
    if isinstance(mesh, (str, Path)):
        from kdj.config import load_yaml

        return make_mesh(MeshConfig.from_dict(load_yaml(mesh)))
    if isinstance(mesh, dict):
        return make_mesh(MeshConfig.from_dict(mesh))
    raise TypeError(f"mesh must be a Sharding, MeshConfig, YAML path or dict, not {type(mesh)}")


def mark_experts(model, sharding: Sharding | None) -> None:
    """Tell every MoE layer to run its experts expert-parallel over this mesh (static)."""
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "shard"):
            module.shard = sharding


def shard_model(model, sharding: Sharding):
    """Move every parameter into its sharding (after checking it divides) in place."""
    check_fits(model, sharding.mesh, sharding.rules)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(jax.device_put(var.get_value(), sharding.named(var.get_metadata()["axes"])))
    mark_experts(model, sharding)
    return model


def shard_cache(cache: KVCache, sharding: Sharding | None) -> KVCache:
    """Caches split by batch (and by KV head where the rules split heads)."""
    if sharding is None:
        return cache

    def put(x, axes):
        # A cache dim that does not divide (e.g. 2 KV heads over model=8) stays whole.
        fits = tuple(a if a is None or x.shape[i] % sharding.size(a) == 0 else None
                     for i, a in enumerate(axes))  # fmt: skip
        return jax.device_put(x, sharding.named(fits))

    gqa = ("batch", "kv_heads", None, None)  # [B, KVH, S, D]
    mla = ("batch", None, None, None)
    k = [put(x, gqa if cache.v else mla) for x in cache.k]
    v = [put(x, gqa) for x in cache.v]
    return KVCache(k=k, v=v, lengths=put(cache.lengths, ("batch",)))
