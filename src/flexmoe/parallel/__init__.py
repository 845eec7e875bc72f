"""Expert parallelism: the expert layout over ranks, process groups, all-to-all transports and overlap, and the
execution strategies that run a layer's experts (:mod:`flexmoe.parallel.strategy`); and models larger than one
rank: the device mesh (:mod:`~flexmoe.parallel.mesh`), FSDP2 with expert parallelism
(:func:`~flexmoe.parallel.fsdp.parallelize`), meta-device materialisation and DCP checkpoints.

Nothing here imports :mod:`flexmoe.tuning`: the policies that need the cost model
(:class:`flexmoe.tuning.ModelGuidedChooser`, :class:`flexmoe.tuning.CostModelShadowPolicy`) live beside it.
"""

from flexmoe.parallel.auto import AutoContext, Chooser, MeasuringChooser, candidates
from flexmoe.parallel.dcp import load_sharded, save_sharded
from flexmoe.parallel.ddp import expert_parameter_names, wrap_ddp
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.fsdp import default_blocks, parallelize, place_experts
from flexmoe.parallel.groups import (
    SINGLE_PROCESS,
    CollectiveError,
    ConfigMismatchError,
    ExpertGroup,
    resolve_group,
)
from flexmoe.parallel.layout import ExpertLayout, shard_expert_state, unshard_expert_states, valid_r
from flexmoe.parallel.materialize import allocate, materialize, reset_module
from flexmoe.parallel.memory import local_state_bytes
from flexmoe.parallel.mesh import MESH_DIMS, make_mesh
from flexmoe.parallel.optim import split_expert_groups
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
