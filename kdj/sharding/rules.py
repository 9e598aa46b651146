"""ShardingRules: logical axis name -> mesh axis (or None = replicated).

Every parameter carries `axes=(...)` logical names (see kdj/models/layers.py). A preset is one
instance of this dataclass; switching tensor parallelism to expert parallelism is a change of
rules, nothing else. With no mesh everything lives on the default device.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    vocab: str | None = None
    embed: str | None = None
    q_heads: str | None = None
    kv_heads: str | None = None
    heads: str | None = None
    head_dim: str | None = None
    mlp: str | None = None
    moe_mlp: str | None = None
    experts: str | None = None
    q_lora: str | None = None
    kv_lora: str | None = None
    norm: str | None = None

    def spec(self, axes: tuple[str | None, ...]) -> PartitionSpec:
        return PartitionSpec(*(None if a is None else getattr(self, a) for a in axes))


def single_device_rules() -> ShardingRules:
    return ShardingRules()


def named_sharding(mesh: Mesh | None, rules: ShardingRules, axes) -> jax.sharding.Sharding | None:
    """The sharding for a parameter with logical `axes`, or None for the default device."""
    if mesh is None:
        return None
    return NamedSharding(mesh, rules.spec(tuple(axes)))
