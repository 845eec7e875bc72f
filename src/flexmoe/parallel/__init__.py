"""Expert parallelism: the expert layout over ranks, process groups, all-to-all transports and overlap."""

from flexmoe.parallel.layout import ExpertLayout, shard_expert_state, unshard_expert_states
from flexmoe.parallel.groups import (
    SINGLE_PROCESS,
    CollectiveError,
    ConfigMismatchError,
    ExpertGroup,
    resolve_group,
)
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.auto import AutoContext, Chooser, MeasuringChooser, ModelGuidedChooser, candidates
from flexmoe.parallel.ddp import expert_parameter_names, wrap_ddp
from flexmoe.parallel.pairwise import pairwise_peers
from flexmoe.parallel.shadow import (
    CostModelShadowPolicy,
    ShadowContext,
    ShadowExperts,
    ShadowPolicy,
    ShadowTopExperts,
    rows_per_rank,
)

__all__ = [
    "ExpertLayout",
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
    "ModelGuidedChooser",
    "candidates",
    "expert_parameter_names",
    "wrap_ddp",
    "pairwise_peers",
    "CostModelShadowPolicy",
    "ShadowContext",
    "ShadowExperts",
    "ShadowPolicy",
    "ShadowTopExperts",
    "rows_per_rank",
]
