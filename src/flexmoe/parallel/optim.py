"""Moved to :mod:`flexmoe.sharding.optim`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.optim` instead."""

from flexmoe.sharding.optim import split_expert_groups

__all__ = ["split_expert_groups"]
