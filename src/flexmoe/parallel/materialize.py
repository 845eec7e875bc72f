"""Moved to :mod:`flexmoe.sharding.materialize`; this path re-exports it for one release.

Import from :mod:`flexmoe.sharding.materialize` instead.

Unlike the other re-export modules, this one looks its names up when they are first asked for (PEP 562) instead of
importing them: :mod:`flexmoe.parallel` loads it while that package initialises (its package attribute
``materialize`` must stay the function, see there), when :mod:`flexmoe.sharding` cannot be imported yet.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names resolve to, for the type checker
    from flexmoe.sharding.materialize import allocate, materialize, reset_module

__all__ = ["materialize", "allocate", "reset_module"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # By import_module, which returns the module: the attribute flexmoe.sharding.materialize (and so
        # `import flexmoe.sharding.materialize as m`) is the function of that name.
        return getattr(importlib.import_module("flexmoe.sharding.materialize"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
