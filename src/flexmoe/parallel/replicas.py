"""Replicated experts: each rank computes its own experts and R replicas of hot ones (``redundant_experts=R``).

Where the replicas sit is a :class:`~flexmoe.parallel.placement.ReplicaPlacement`, kept with the recent load in
a :class:`ReplicaState` (buffers, so the checkpoint carries them). One forward, on every rank:

1. all-gather the per-expert counts (as every expert-parallel call does) and add them to the load window;
2. fetch the replicas' weights from their owners: one differentiable all-to-all of flat weight rows, so the
   copies are the owner's weights of this very step, and its backward sums every copy's gradient into the
   owner's parameter gradient (before the optimizer step, with nothing for the training loop to call);
3. send each (token, expert) row to the holder :func:`~flexmoe.parallel.placement.split_rows` names, compute the
   owned experts with the expert module and the replicas on the fetched weights, send the outputs back.

Replicas hold no parameters and no optimizer state, so a re-placement (:func:`replace_experts`) moves nothing:
the next forward fetches the new slots' weights. The results are what one process holding every expert computes,
to the order of the float additions in each owner's gradient (the copies' parts are summed after the
exchange).
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.weights import WEIGHT_NAMES
from flexmoe.parallel.alltoall import CommStats, Exchange, SplitMatrix, exchange, transpose
from flexmoe.parallel.expert_parallel import ExpertParallel, ParallelSetting, permute_rows
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.placement import (
    EMPTY,
    ReplicaPlacement,
    check_redundant_experts,
    eplb_placement,
    replica_rows_per_rank,
    split_rows,
)

__all__ = ["ReplicaState", "ReplicatedExperts", "check_replicas_supported", "replace_experts", "replica_slots",
           "placement_record"]


class ReplicaState(nn.Module):
    """A layer's replica placement and load window, as buffers (saved with the model, moved with it).

    slots: ``[W, R]`` the expert each rank's replica slots copy; load: ``[E]`` rows routed to each expert
    (all ranks together) since the last re-placement."""

    slots: Tensor
    load: Tensor

    def __init__(self, num_experts: int, world_size: int, redundant: int) -> None:
        super().__init__()
        start = eplb_placement([0] * num_experts, world_size, redundant)
        self.register_buffer("slots", torch.tensor(start.replicas, dtype=torch.long).reshape(world_size, redundant))
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.long))

    @property
    def placement(self) -> ReplicaPlacement:
        return ReplicaPlacement(self.load.numel(), tuple(tuple(row) for row in self.slots.tolist()))

    def replace(self) -> ReplicaPlacement:
        """Re-place the replicas by :func:`~flexmoe.parallel.placement.eplb_placement` of the load window, then
        start a new window. The same on every rank (the window sums the all-gathered counts)."""
        world, redundant = self.slots.shape
        placement = eplb_placement(self.load.tolist(), world, redundant)
        self.slots.copy_(torch.tensor(placement.replicas, dtype=torch.long).reshape(world, redundant))
        self.load.zero_()
        return placement


def check_replicas_supported(options: ParallelOptions, ep: ExpertParallel | None, experts: nn.Module) -> None:
    """``redundant_experts > 0`` runs whole built-in experts over more than one rank, with the static row
    exchange at r = 1, d = 1, no shadowing and no pairwise schedule: a ValueError naming what differs."""
    if ep is None:
        raise ValueError(f"redundant_experts={options.redundant_experts} needs an expert-parallel group of more "
                         f"than one rank (there is nothing to replicate in one process)")
    if not isinstance(experts, FeedForwardExperts):
        raise ValueError("redundant_experts needs the built-in FeedForwardExperts: flexmoe cannot copy a custom "
                         "experts module's weights")
    check_redundant_experts(options.redundant_experts, ep.layout.num_experts, ep.eg.world_size)
    other = {"r": (options.r, 1), "overlap_degree": (options.overlap_degree, 1),
             "parallel": (options.parallel, "static"), "schedule": (options.schedule, "a2a"),
             "shadow": (options.shadow_policy, None)}
    for name, (got, want) in other.items():
        if got != want:
            raise ValueError(f"redundant_experts runs with {name}={want!r} (replicas replace shadowing and "
                             f"adaptive parallelism), got {name}={got!r}")


@dataclass(frozen=True)
class _Route:
    """One forward's row exchange under a placement, seen from this rank."""

    send_index: Tensor        # [N] this rank's rows (sorted by expert) in destination, then slot order
    splits: SplitMatrix       # W x W rows
    to_slot_order: Tensor     # received (source, slot) order -> (slot, source)
    from_slot_order: Tensor   # its inverse
    slot_counts: list[int]    # rows per local slot: owned experts, then replicas


def _inverse(order: Tensor) -> Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse


def _cat(pieces: list[Tensor]) -> Tensor:
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _route(all_counts: list[list[int]], placement: ReplicaPlacement, me: int) -> _Route:
    world = placement.world_size
    sends = split_rows(all_counts, placement)
    holder_index = [{rank: h for h, rank in enumerate(placement.holders(e))} for e in range(placement.num_experts)]
    starts = [0]
    for n in all_counts[me]:
        starts.append(starts[-1] + n)

    def rows_to(src: int, dst: int, e: int) -> int:
        return 0 if e == EMPTY else sends[src][e][holder_index[e][dst]]

    index = []
    for dst in range(world):
        for e in placement.slot_experts(dst):
            if e == EMPTY:
                continue
            h = holder_index[e][dst]
            offset = starts[e] + sum(sends[me][e][:h])  # an expert's rows go to its holders in holder order
            index.append(torch.arange(offset, offset + sends[me][e][h]))
    splits = [[sum(rows_to(src, dst, e) for e in placement.slot_experts(dst)) for dst in range(world)]
              for src in range(world)]
    mine = placement.slot_experts(me)
    block = [[rows_to(src, me, e) for e in mine] for src in range(world)]  # received: by source, then slot
    block_start, pos = [[0] * len(mine) for _ in range(world)], 0
    for src in range(world):
        for j in range(len(mine)):
            block_start[src][j] = pos
            pos += block[src][j]
    order = _cat([torch.arange(block_start[src][j], block_start[src][j] + block[src][j])
                  for j in range(len(mine)) for src in range(world)])
    slot_counts = [sum(block[src][j] for src in range(world)) for j in range(len(mine))]
    return _Route(_cat(index), splits, order, _inverse(order), slot_counts)


def fetch_replica_weights(experts: FeedForwardExperts, placement: ReplicaPlacement, me: int, transport: Exchange,
                          stats: CommStats | None = None) -> dict[str, Tensor | None]:
    """The weights of this rank's non-empty replica slots, fetched from their owners: name -> ``[R', ...]``
    (None for absent parameters), in slot order. One all-to-all of flat ``[P]`` rows; differentiable, so each copy's
    gradient is summed into its owner's parameters by the backward exchange."""
    world, per_rank = placement.world_size, placement.experts_per_rank
    names = [n for n in WEIGHT_NAMES if getattr(experts, n, None) is not None]
    params = [getattr(experts, n) for n in names]
    sent = [e - me * per_rank for dst in range(world) for e in placement.replicas[dst] if placement.owner(e) == me]
    index = torch.tensor(sent, dtype=torch.long, device=params[0].device)
    sizes = [math.prod(p.shape[1:]) for p in params]
    flat = torch.cat([p.index_select(0, index).reshape(len(sent), n) for p, n in zip(params, sizes)], dim=1)
    splits = [[sum(placement.owner(e) == src for e in placement.replicas[dst]) for dst in range(world)]
              for src in range(world)]
    received = exchange(flat, transport, splits, stats)  # by owner, then in this rank's slot order
    copies = [e for e in placement.replicas[me] if e != EMPTY]
    by_owner = sorted(range(len(copies)), key=lambda j: (placement.owner(copies[j]), j))
    rows = received.index_select(0, _inverse(torch.tensor(by_owner, dtype=torch.long)).to(received.device))
    pieces = rows.split(sizes, dim=1)
    out: dict[str, Tensor | None] = {n: None for n in WEIGHT_NAMES}
    for n, p, piece in zip(names, params, pieces):
        out[n] = piece.reshape(len(copies), *p.shape[1:])
    return out


class ReplicatedExperts:
    """The strategy of ``redundant_experts=R`` (see the module docstring): rows to the holders the placement
    splits them among, owned experts and fetched replicas computed on each rank."""

    def __init__(self, ep: ExpertParallel, redundant: int) -> None:
        self.ep = ep
        self.state = ReplicaState(ep.layout.num_experts, ep.eg.world_size, redundant)
        self.last_choice: ParallelSetting | None = None
        self.last_shadowed: list[int] = []
        self.last_rows: list[int] = []  # the rows each rank computed in the last call

    def run(self, rows: Tensor, counts: list[int], options: ParallelOptions,
            pinned: AbstractSet[str] = frozenset()) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert, counts ``[E]`` -> ``[N, M]`` each row's expert output."""
        ep, setting = self.ep, options.setting
        experts = ep.experts
        assert isinstance(experts, FeedForwardExperts)  # check_replicas_supported at construction
        all_counts = ep.gather_counts(counts, rows.device)
        if torch.is_grad_enabled():
            self.state.load += torch.tensor(all_counts, dtype=torch.long).sum(0).to(self.state.load.device)
        placement = self.state.placement
        route = _route(all_counts, placement, ep.eg.rank)
        self.last_rows = [sum(row) for row in transpose(route.splits)]
        self.last_choice = setting
        transport = ep.transport(setting)
        replicas = fetch_replica_weights(experts, placement, ep.eg.rank, transport, ep.stats)
        send = rows.index_select(0, route.send_index.to(rows.device))
        w1 = replicas["w1"]
        if w1 is not None and w1.requires_grad and torch.is_grad_enabled():
            # The rows depend on the fetched weights (adding an empty sum changes no value): every rank's
            # backward then runs the row exchanges' backwards before the weight exchange's, in one order.
            send = send + w1[:0].sum().to(send.dtype)
        received = exchange(send, transport, route.splits, ep.stats)
        local = permute_rows(received, route.to_slot_order.to(rows.device), route.from_slot_order.to(rows.device))
        owned = placement.experts_per_rank
        n_owned = sum(route.slot_counts[:owned])
        copy_counts = [n for n, e in zip(route.slot_counts[owned:], placement.replicas[ep.eg.rank]) if e != EMPTY]
        out = torch.cat([experts(local[:n_owned], route.slot_counts[:owned]).to(rows.dtype),
                         experts.ffn_with(local[n_owned:], copy_counts, replicas).to(rows.dtype)])
        if not out.requires_grad and received.requires_grad:
            out = out + received[:0].sum()  # no rows here: still join the gradient exchange
        out = permute_rows(out, route.from_slot_order.to(rows.device), route.to_slot_order.to(rows.device))
        back = exchange(out, transport, transpose(route.splits), ep.stats)
        return permute_rows(back, _inverse(route.send_index).to(rows.device), route.send_index.to(rows.device))

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: object) -> Tensor | None:
        return None  # rows: each (token, expert) pair may go to a different holder of the expert

    def replace(self) -> ReplicaPlacement:
        """Re-place the replicas from the load window (:meth:`ReplicaState.replace`)."""
        return self.state.replace()


def replace_experts(model: nn.Module) -> list[ReplicaPlacement]:
    """Re-place the replicas of every layer of ``model`` with ``redundant_experts`` from its recent load
    (:func:`~flexmoe.parallel.placement.eplb_placement`, DeepSeek's EPLB rule with the owners fixed) and start
    new load windows; the new placements, by layer. Call it on every rank at the same step, between steps
    (nothing moves: the next forward fetches the new replicas' weights)."""
    strategies = [getattr(m, "strategy", None) for m in model.modules()]
    return [s.replace() for s in strategies if isinstance(s, ReplicatedExperts)]


def replica_slots(model: nn.Module) -> list[list[list[int]]]:
    """Per layer with ``redundant_experts`` (model order), the experts each rank's replica slots copy."""
    strategies = [getattr(m, "strategy", None) for m in model.modules()]
    return [s.state.slots.tolist() for s in strategies if isinstance(s, ReplicatedExperts)]


def busiest_share(load: list[int], placement: ReplicaPlacement) -> float:
    """The busiest rank's share of ``load``'s rows (``[E]``, all ranks') under ``placement``: each holder's
    rows depend on the totals only, so they are put on rank 0 as their one source."""
    rows = [list(load)] + [[0] * len(load)] * (placement.world_size - 1)
    per_rank = replica_rows_per_rank(rows, placement)
    return max(per_rank) / max(sum(per_rank), 1)


def placement_record(before: list[list[list[int]]], after: list[list[list[int]]],
                     load: list[list[int]]) -> dict[str, list]:
    """What a training job logs of its replicated layers at one step: ``load`` ``[layers][E]`` its rows per
    expert, ``before``/``after`` each layer's slots (:func:`replica_slots`) before and after a re-placement.
    The busiest rank's share of the rows: without replicas (the static layout), with the placement that ran,
    and with the new one (the same when nothing was re-placed)."""
    num_experts = len(load[0])
    placements = [[ReplicaPlacement(num_experts, tuple(tuple(s) for s in slots)) for slots in layers]
                  for layers in (before, after)]
    static = ReplicaPlacement.unreplicated(num_experts, len(before[0]))
    return {"replicas": after,
            "busiest_share_static": [busiest_share(layer, static) for layer in load],
            "busiest_share": [busiest_share(layer, p) for layer, p in zip(load, placements[0])],
            "busiest_share_replaced": [busiest_share(layer, p) for layer, p in zip(load, placements[1])]}
