"""Moved to :mod:`flexmoe.sharding.memory`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.memory` instead."""

from flexmoe.sharding.memory import local_state_bytes, tensor_bytes

__all__ = ["local_state_bytes", "tensor_bytes"]
