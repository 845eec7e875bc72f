"""Expert parallelism: the expert layout over ranks, process groups, all-to-all transports and overlap."""

from flexmoe.parallel.layout import ExpertLayout, shard_expert_state, unshard_expert_states

__all__ = ["ExpertLayout", "shard_expert_state", "unshard_expert_states"]
