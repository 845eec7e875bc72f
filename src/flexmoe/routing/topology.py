"""FasterMoE's topology-aware gate: bound the (token, choice) pairs a rank sends across slow inter-node links.

Inter-node links are several times slower than the links inside a node, so a rank may send at most
``max_remote`` of its pairs to experts on other nodes. Pairs claim that budget in the same priority order as
slots (every token's 1st choice before any 2nd choice, tokens in order); a pair past the budget is routed
instead to the best expert on the rank's own node that the token has not chosen yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["remote_pair_budget", "limit_cross_node", "expert_nodes", "TopologyGate", "topology_gate"]


def remote_pair_budget(num_tokens: int, k: int, cross_node_share: float) -> int:
    """How many of ``num_tokens * k`` pairs may cross nodes: ``floor(share * T * k)``."""
    if not 0.0 <= cross_node_share <= 1.0:
        raise ValueError(f"cross_node_share must be in [0, 1], got {cross_node_share}")
    return math.floor(cross_node_share * num_tokens * k)


def limit_cross_node(
    scores: Tensor,
    expert_index: Tensor,
    expert_node: Tensor,
    node: int,
    max_remote: int,
) -> Tensor:
    """Re-route the pairs past the cross-node budget to the best experts on this rank's node.

    scores: ``[T, E]`` selection scores (router probabilities); expert_index: ``[T, k]`` the chosen experts;
    expert_node: ``[E]`` the node of each expert; node: this rank's node; max_remote: the budget.
    Returns the new ``[T, k]`` expert indices: at most ``max_remote`` of them on other nodes, the k experts of
    a token still distinct. Needs at least k experts on this node.
    """
    num_tokens, k = expert_index.shape
    local = expert_node == node
    if int(local.sum()) < k:
        raise ValueError(
            f"the topology-aware gate needs at least k={k} experts on each node, node {node} has {int(local.sum())}"
        )
    remote = ~local[expert_index]  # [T, k]
    # Budget claimed in slot priority order: choice-major, then token order.
    remote_in_order = remote.t().reshape(-1)
    claimed = torch.cumsum(remote_in_order.long(), 0)
    over = (remote_in_order & (claimed > max_remote)).view(k, num_tokens).t()  # [T, k]
    if not bool(over.any()):
        return expert_index
    chosen = expert_index.clone()
    masked = scores.detach().masked_fill(~local, float("-inf"))
    for choice in range(k):  # later choices must avoid experts that earlier re-routings took
        rows = over[:, choice].nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        candidates = masked[rows].scatter(1, chosen[rows], float("-inf"))
        # Stable descending sort: ties go to the lower expert index, as in top-k.
        best = torch.sort(candidates, dim=1, descending=True, stable=True).indices[:, 0]
        chosen[rows, choice] = best
    return chosen


def expert_nodes(expert_ranks: list[list[int]], ranks_per_node: int) -> list[int]:
    """The node of every expert: ``expert_ranks[e]`` lists the ranks holding expert e (or a shard of it), and
    rank i sits on node ``i // ranks_per_node``. Raises ``ValueError`` if an expert's shards span nodes."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    nodes = []
    for e, ranks in enumerate(expert_ranks):
        on = sorted({r // ranks_per_node for r in ranks})
        if len(on) != 1:
            raise ValueError(f"expert {e} is sharded over ranks {ranks}, which span nodes {on}: the topology-aware "
                             f"gate needs every expert inside one node of {ranks_per_node} ranks")
        nodes.append(on[0])
    return nodes


@dataclass(frozen=True)
class TopologyGate:
    """What the gate needs on one rank: ``expert_node[e]`` the node of expert e, ``node`` this rank's node,
    ``cross_node_share`` the share of its ``T * k`` pairs it may send to other nodes."""

    expert_node: tuple[int, ...]
    node: int
    cross_node_share: float

    def __post_init__(self) -> None:
        remote_pair_budget(0, 1, self.cross_node_share)  # validates the share

    def apply(self, scores: Tensor, expert_index: Tensor) -> Tensor:
        """scores: ``[T, E]``, expert_index: ``[T, k]`` -> ``[T, k]`` with the cross-node bound applied."""
        num_tokens, k = expert_index.shape
        expert_node = torch.tensor(self.expert_node, dtype=torch.long, device=expert_index.device)
        budget = remote_pair_budget(num_tokens, k, self.cross_node_share)
        return limit_cross_node(scores, expert_index, expert_node, self.node, budget)


def topology_gate(expert_ranks: list[list[int]], rank: int, world_size: int, ranks_per_node: int | None, k: int,
                  cross_node_share: float) -> TopologyGate:
    """The gate of ``rank`` in a group of ``world_size`` ranks: nodes of ``ranks_per_node`` consecutive ranks,
    ``expert_ranks[e]`` the ranks holding expert e (an expert sits on their node). Raises ``ValueError`` when
    the nodes cannot be formed or a node holds fewer than k experts (its overflow pairs could not stay)."""
    if ranks_per_node is None:
        if world_size > 1:
            raise ValueError("cross_node_share needs ranks_per_node (the ranks of one node) under expert parallelism")
        ranks_per_node = 1
    if ranks_per_node < 1 or world_size % ranks_per_node != 0:
        raise ValueError(f"cross_node_share needs ranks_per_node dividing the world size {world_size}, "
                         f"got {ranks_per_node}")
    nodes = expert_nodes(expert_ranks, ranks_per_node)
    for node in range(world_size // ranks_per_node):
        if nodes.count(node) < k:
            raise ValueError(f"cross_node_share: node {node} holds {nodes.count(node)} experts, fewer than k={k}; "
                             "overflow pairs could not stay on the node")
    return TopologyGate(tuple(nodes), rank // ranks_per_node, cross_node_share)
