"""Logical-axis sharding rules: the one place that maps parameter axis names to mesh axes."""

from kdj.sharding.rules import ShardingRules, named_sharding, single_device_rules

__all__ = ["ShardingRules", "named_sharding", "single_device_rules"]
