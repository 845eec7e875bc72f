"""Expert weights under adaptive parallelism: gathering shards (r < s, r = 0) and reducing their gradients.

All collectives here are ``all_to_all_single`` over the whole expert-parallel group with zero-sized splits
for ranks outside the peer set, so no sub-groups are needed and every rank joins every collective. A peer
relation is symmetric (rank a gathers from b iff b gathers from a), which keeps both directions one call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.parallel.groups import ExpertGroup

__all__ = ["gather_from_peers", "replica_grad"]


def _peer_all_to_all(eg: ExpertGroup, x: Tensor, peers: list[int], what: str) -> Tensor:
    """Send ``x`` (laid out as len(peers) equal blocks, peers in rank order) block i to peers[i]; return
    the blocks received from the peers, in rank order."""
    n = x.shape[0] // max(len(peers), 1)
    splits = [n if p in peers else 0 for p in range(eg.world_size)]
    out = x.new_empty(n * len(peers))
    eg.call(what, lambda: dist.all_to_all_single(out, x.contiguous(), splits, splits, group=eg.group))
    return out


class _GatherFromPeers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat: Tensor, eg: ExpertGroup, peers: list[int]) -> Tensor:
        ctx.eg, ctx.peers = eg, peers
        return _peer_all_to_all(eg, flat.detach().repeat(len(peers)), peers, "expert weight gather")

    @staticmethod
    def backward(ctx, grad: Tensor):
        # Block i of grad is peer i's shard as this rank used it: send it home; sum what the peers used of ours.
        got = _peer_all_to_all(ctx.eg, grad, ctx.peers, "expert weight-gradient reduce")
        return got.view(len(ctx.peers), -1).sum(0), None, None


def gather_from_peers(flat: Tensor, eg: ExpertGroup, peers: list[int]) -> list[Tensor]:
    """Every peer's ``flat`` (1-D, the same size on all ranks), peers in rank order. Differentiable: the
    gradient of each gathered copy is sent back to its owner and summed there."""
    out = _GatherFromPeers.apply(flat, eg, peers)
    return list(out.view(len(peers), -1).unbind(0))


class _ReplicaGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eg: ExpertGroup, peers: list[int]) -> Tensor:
        ctx.eg, ctx.peers = eg, peers
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        flat = grad.reshape(-1)
        got = _peer_all_to_all(ctx.eg, flat.repeat(len(ctx.peers)), ctx.peers, "replicated-bias gradient sum")
        return got.view(len(ctx.peers), -1).sum(0).view_as(grad), None, None


def replica_grad(x: Tensor, eg: ExpertGroup, peers: list[int]) -> Tensor:
    """Identity in forward; in backward every peer gets the sum of all peers' gradients.

    For a parameter every shard of an expert holds a copy of (``b2``): each copy then receives the full
    gradient, so the copies stay equal under any optimizer.
    """
    return _ReplicaGrad.apply(x, eg, peers)
