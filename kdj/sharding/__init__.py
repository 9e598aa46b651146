"""Logical-axis sharding: rules presets, meshes from config, fit checks (one place)."""

from kdj.sharding.mesh import MeshConfig, check_fits, make_mesh
from kdj.sharding.rules import (
    PRESETS,
    Sharding,
    ShardingRules,
    axis_size,
    named_sharding,
    single_device_rules,
)

__all__ = [
    "PRESETS",
    "MeshConfig",
    "Sharding",
    "ShardingRules",
    "axis_size",
    "check_fits",
    "make_mesh",
    "named_sharding",
    "single_device_rules",
]
