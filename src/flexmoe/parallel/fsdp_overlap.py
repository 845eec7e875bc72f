"""Moved to :mod:`flexmoe.sharding.fsdp_overlap`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.fsdp_overlap` instead."""

from flexmoe.sharding.fsdp_overlap import DeferredReduceScatter, PendingReduceScatters, overlap_gloo_collectives

__all__ = ["overlap_gloo_collectives", "DeferredReduceScatter", "PendingReduceScatters"]
