"""Moved to :mod:`flexmoe.sharding.ddp`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.ddp` instead."""

from flexmoe.sharding.ddp import GRAD_DIVISOR, divide_gradients, expert_parameter_names, wrap_ddp

__all__ = ["expert_parameter_names", "divide_gradients", "wrap_ddp", "GRAD_DIVISOR"]
