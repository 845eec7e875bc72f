"""Replicated expert placement: each rank's own experts plus R redundant slots copying hot experts.

The owners never change: rank i owns experts ``i*E/W .. (i+1)*E/W - 1`` as in :class:`ExpertLayout` (whole
experts, ``E % W == 0``), with their parameters and optimizer state. On top of them every rank has R replica
slots, each naming an expert of another rank that it also computes (on copies of the owner's weights, see
:mod:`flexmoe.parallel.replicas`). Everything here is a pure function of integers, the same on every rank:

* :class:`ReplicaPlacement`: which expert each rank's slots copy, and so which ranks hold each expert;
* :func:`split_rows`: how each source rank's rows of an expert are split among the expert's holders;
* :func:`replica_rows_per_rank`: the rows each rank then computes (the busiest rank sets the step's pace);
* :func:`eplb_placement`: DeepSeek's EPLB rule with the owners fixed, from a per-expert load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["EMPTY", "ReplicaPlacement", "split_rows", "replica_rows_per_rank", "eplb_placement",
           "check_redundant_experts"]


EMPTY = -1  # a replica slot that copies no expert (it computes no rows and fetches no weights)


def check_redundant_experts(redundant: int, num_experts: int, world_size: int) -> None:
    """R replica slots per rank fit when each rank can fill them with experts it does not own: a ValueError
    naming the largest R otherwise (E must divide by W: whole experts)."""
    if num_experts % world_size != 0:
        raise ValueError(f"redundant_experts needs whole experts (num_experts % world size == 0), got "
                         f"{num_experts} experts over {world_size} ranks")
    others = num_experts - num_experts // world_size
    if not 0 <= redundant <= others:
        raise ValueError(f"redundant_experts must be in [0, {others}] ({num_experts} experts over {world_size} "
                         f"ranks: a rank may copy each expert it does not own once), got {redundant}")


@dataclass(frozen=True)
class ReplicaPlacement:
    """``replicas[rank]``: the global experts that rank's R slots copy (R the same for every rank; :data:`EMPTY`
    for a slot left empty).

    A rank's slots are its owned experts (local order) then its replicas (slot order); an expert's holders
    are its owner first, then the ranks with a replica of it in rank order."""

    num_experts: int
    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        world = len(self.replicas)
        if world < 1:
            raise ValueError("replicas must list every rank's slots (at least one rank)")
        redundant = len(self.replicas[0])
        check_redundant_experts(redundant, self.num_experts, world)
        for rank, slots in enumerate(self.replicas):
            if len(slots) != redundant:
                raise ValueError(f"every rank needs {redundant} replica slots; rank {rank} has {len(slots)}")
            copies = [e for e in slots if e != EMPTY]
            bad = [e for e in copies if not 0 <= e < self.num_experts or self.owner(e) == rank]
            if bad or len(set(copies)) != len(copies):
                raise ValueError(f"rank {rank}'s replica slots {list(slots)} must be distinct experts in "
                                 f"[0, {self.num_experts}) that rank {rank} does not own, or {EMPTY} (empty)")

    @property
    def world_size(self) -> int:
        return len(self.replicas)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def redundant(self) -> int:
        """R: replica slots per rank."""
        return len(self.replicas[0])

    def owner(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def slot_experts(self, rank: int) -> list[int]:
        """The global expert of each of ``rank``'s ``E/W + R`` slots: owned experts, then replicas."""
        first = rank * self.experts_per_rank
        return list(range(first, first + self.experts_per_rank)) + list(self.replicas[rank])

    def holders(self, expert: int) -> list[int]:
        """The ranks computing ``expert`` (>= 0): its owner, then the ranks with a replica of it (ascending)."""
        return [self.owner(expert)] + [r for r, slots in enumerate(self.replicas) if expert in slots]

    @classmethod
    def unreplicated(cls, num_experts: int, world_size: int) -> ReplicaPlacement:
        """No replica slots (R = 0): the static layout."""
        return cls(num_experts, tuple(() for _ in range(world_size)))


def split_rows(all_counts: Sequence[Sequence[int]], placement: ReplicaPlacement) -> list[list[list[int]]]:
    """``all_counts[src][e]`` (rows rank src routes to expert e) -> ``sends[src][e][h]``: how many of them go to
    ``placement.holders(e)[h]``.

    Each expert's total is cut into quotas that differ by at most one, one per holder (the first holders get
    the extra rows). A source holding the expert keeps its rows up to its quota (no exchange for them); then
    the remaining rows fill the remaining quotas, sources in rank order, holders in holder order."""
    world = placement.world_size
    if len(all_counts) != world or any(len(row) != placement.num_experts for row in all_counts):
        raise ValueError(f"all_counts must be [{world}][{placement.num_experts}], got "
                         f"{[len(row) for row in all_counts]}")
    sends: list[list[list[int]]] = [[[] for _ in range(placement.num_experts)] for _ in range(world)]
    for e in range(placement.num_experts):
        holders = placement.holders(e)
        total = sum(row[e] for row in all_counts)
        base, extra = divmod(total, len(holders))
        quota = [base + (1 if h < extra else 0) for h in range(len(holders))]
        left = [row[e] for row in all_counts]
        got = [[0] * len(holders) for _ in range(world)]
        for h, rank in enumerate(holders):  # a holder's own rows stay local first
            take = min(left[rank], quota[h])
            got[rank][h] += take
            left[rank] -= take
            quota[h] -= take
        for src in range(world):
            for h in range(len(holders)):
                take = min(left[src], quota[h])
                got[src][h] += take
                left[src] -= take
                quota[h] -= take
        for src in range(world):
            sends[src][e] = got[src]
    return sends


def replica_rows_per_rank(all_counts: Sequence[Sequence[int]], placement: ReplicaPlacement) -> list[int]:
    """``[W][E]`` -> ``[W]``: the expert rows each rank computes under ``placement`` (:func:`split_rows`)."""
    load = [0] * placement.world_size
    for per_expert in split_rows(all_counts, placement):
        for e, per_holder in enumerate(per_expert):
            for rank, n in zip(placement.holders(e), per_holder):
                load[rank] += n
    return load


def eplb_placement(load: Sequence[float], world_size: int, redundant: int) -> ReplicaPlacement:
    """DeepSeek's EPLB rule (replicate by load per copy, then pack greedily), with the owners fixed.

    load: ``[E]`` rows per expert over the recent window. 1. Each of the ``W * R`` slots in turn goes to the
    expert with the most load per copy (ties: the lower expert id; at most W copies of an expert).
    2. The extra copies, heaviest load per copy first, each go to the rank computing the fewest rows so far
    (rows split evenly among each expert's holders) among those with a free slot and no copy of that expert
    (ties: the lower rank), unless that would raise the busiest rank's rows: then the copy is dropped.
    Slots still free stay :data:`EMPTY`. The check in 2 is ours: owners are fixed, so a copy EPLB would pack
    could otherwise land where it makes the busiest rank busier (and so could any copy filling a slot)."""
    num_experts = len(load)
    check_redundant_experts(redundant, num_experts, world_size)
    per_rank = num_experts // world_size
    copies = [1] * num_experts
    for _ in range(world_size * redundant):
        open_experts = [e for e in range(num_experts) if copies[e] < world_size]
        if not open_experts:
            break
        copies[max(open_experts, key=lambda e: (load[e] / copies[e], -e))] += 1
    holders = [[e // per_rank] for e in range(num_experts)]
    slots: list[list[int]] = [[] for _ in range(world_size)]

    rows = [0.0] * world_size  # rows per rank, each expert's split evenly among its holders
    for e in range(num_experts):
        rows[e // per_rank] += load[e]

    def rows_with(e: int, rank: int) -> list[float]:
        """``rows`` after one more copy of expert ``e`` on ``rank``."""
        n = len(holders[e])
        after = list(rows)
        for held in holders[e]:
            after[held] -= load[e] / n - load[e] / (n + 1)
        after[rank] += load[e] / (n + 1)
        return after

    extra_copies = sorted((e for e in range(num_experts) for _ in range(copies[e] - 1)),
                          key=lambda e: (-load[e] / copies[e], e))
    for e in extra_copies:
        fits = [r for r in range(world_size) if len(slots[r]) < redundant and r not in holders[e]]
        if not fits:
            continue
        rank = min(fits, key=lambda r: (rows[r], r))
        after = rows_with(e, rank)
        if max(after) <= max(rows):
            slots[rank].append(e)
            holders[e].append(rank)
            rows = after
    return ReplicaPlacement(num_experts, tuple(tuple(s + [EMPTY] * (redundant - len(s))) for s in slots))
