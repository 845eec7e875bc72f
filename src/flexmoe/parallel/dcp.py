"""Moved to :mod:`flexmoe.sharding.dcp`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.dcp` instead."""

from flexmoe.sharding.dcp import load_sharded, own_tensors, save_sharded

__all__ = ["save_sharded", "load_sharded", "own_tensors"]
