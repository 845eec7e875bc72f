"""Expert parallelism: the expert layout over ranks, process groups, all-to-all transports and overlap, and the
execution strategies that run a layer's experts (:mod:`flexmoe.parallel.strategy`).

Whole models larger than one rank (the device mesh, FSDP2, DDP, meta-device materialisation, DCP checkpoints)
moved to :mod:`flexmoe.sharding`, the level above the layer. Their names (``parallelize``, ``make_mesh``,
``wrap_ddp``, ...) and modules (``flexmoe.parallel.fsdp``, ...) are still re-exported here for one release; import
them from :mod:`flexmoe.sharding` instead.

Nothing here imports :mod:`flexmoe.tuning`: the policies that need the cost model
(:class:`flexmoe.tuning.ModelGuidedChooser`, :class:`flexmoe.tuning.CostModelShadowPolicy`) live beside it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flexmoe.parallel.auto import AutoContext, Chooser, MeasuringChooser, candidates
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.groups import (
    SINGLE_PROCESS,
    CollectiveError,
    ConfigMismatchError,
    ExpertGroup,
    resolve_group,
)
from flexmoe.parallel.layout import ExpertLayout, shard_expert_state, unshard_expert_states, valid_r
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.pairwise import pairwise_peers
from flexmoe.parallel.placement import ReplicaPlacement, eplb_placement
from flexmoe.parallel.replicas import ReplicatedExperts, replace_experts
from flexmoe.parallel.shadow import (
    ShadowContext,
    ShadowExperts,
    ShadowPolicy,
    ShadowTopExperts,
    rows_per_rank,
)
from flexmoe.parallel.strategy import (
    AllToAllExperts,
    AutoExperts,
    ExpertStrategy,
    LocalExperts,
    PairwiseExperts,
    ShadowedExperts,
    build_strategy,
)

__all__ = [
    "ParallelOptions",
    "ExpertStrategy",
    "LocalExperts",
    "AllToAllExperts",
    "PairwiseExperts",
    "AutoExperts",
    "ShadowedExperts",
    "ReplicatedExperts",
    "ReplicaPlacement",
    "eplb_placement",
    "replace_experts",
    "build_strategy",
    "ExpertLayout",
    "valid_r",
    "shard_expert_state",
    "unshard_expert_states",
    "SINGLE_PROCESS",
    "CollectiveError",
    "ConfigMismatchError",
    "ExpertGroup",
    "resolve_group",
    "ParallelSetting",
    "AutoContext",
    "Chooser",
    "MeasuringChooser",
    "candidates",
    "expert_parameter_names",
    "wrap_ddp",
    "split_expert_groups",
    "MESH_DIMS",
    "make_mesh",
    "parallelize",
    "place_experts",
    "default_blocks",
    "local_state_bytes",
    "save_sharded",
    "load_sharded",
    "materialize",
    "allocate",
    "reset_module",
    "pairwise_peers",
    "ShadowContext",
    "ShadowExperts",
    "ShadowPolicy",
    "ShadowTopExperts",
    "rows_per_rank",
]

if TYPE_CHECKING:  # what the names below resolve to, for the type checker
    from flexmoe.sharding import (
        MESH_DIMS,
        allocate,
        default_blocks,
        expert_parameter_names,
        load_sharded,
        local_state_bytes,
        make_mesh,
        materialize,
        parallelize,
        place_experts,
        reset_module,
        save_sharded,
        split_expert_groups,
        wrap_ddp,
    )

# The names and modules that moved to flexmoe.sharding, re-exported for one release. Resolved when first asked for
# (PEP 562), never while this package initialises: flexmoe.sharding imports flexmoe.layer, which imports modules
# of this package, so importing it here would be an import cycle.
_MOVED_NAMES = ("MESH_DIMS", "make_mesh", "parallelize", "place_experts", "default_blocks", "expert_parameter_names",
                "wrap_ddp", "materialize", "allocate", "reset_module", "save_sharded", "load_sharded",
                "split_expert_groups", "local_state_bytes")
_MOVED_MODULES = ("fsdp", "fsdp_overlap", "ddp", "dcp", "materialize", "optim", "mesh", "memory")

# `materialize` names both a moved function and a moved module. Python binds a submodule on its package when the
# submodule is first loaded, which would shadow the function from then on (`from flexmoe.parallel import
# materialize` giving the module). So the re-export module is loaded here, first (it imports nothing yet), and
# that binding dropped: the name resolves to the function through __getattr__, as before the move.
importlib.import_module(f"{__name__}.materialize")
del globals()["materialize"]


def __getattr__(name: str) -> Any:
    """A name or module moved to :mod:`flexmoe.sharding`: ``flexmoe.parallel.parallelize`` is
    ``flexmoe.sharding.parallelize``, ``flexmoe.parallel.fsdp`` the re-export module of ``flexmoe.sharding.fsdp``."""
    if name in _MOVED_NAMES:
        import flexmoe.sharding

        return getattr(flexmoe.sharding, name)
    if name in _MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MOVED_NAMES, *_MOVED_MODULES})
