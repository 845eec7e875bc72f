"""Moved to :mod:`flexmoe.sharding.fsdp`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.fsdp` instead."""

from flexmoe.sharding.fsdp import default_blocks, parallelize, place_experts

__all__ = ["parallelize", "default_blocks", "place_experts"]
