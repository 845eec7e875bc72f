"""Where each expert's parameters live across the W ranks of an expert-parallel group.

One layout serves every parallel mode (so switching mode moves no parameters):

* ``E % W == 0``: rank i holds the ``E / W`` experts ``i*E/W .. (i+1)*E/W - 1`` whole; ``experts.w1[j]`` on
  rank i is global expert ``i*E/W + j``.
* ``W % E == 0``: each expert is sharded over ``s = W / E`` consecutive ranks along the hidden dimension:
  rank i holds expert ``i // s``, hidden columns ``(i % s) * H/s .. (i % s + 1) * H/s - 1`` (H must divide
  by s). Parameters without a hidden dimension (``b2: [M]``) are held in full by every shard of the expert;
  the global value is shard 0's copy.
* anything else is an error that says which sizes work.

The expert parameters are named as in :class:`flexmoe.experts.FeedForwardExperts`; every one has the expert
as its leading dimension, and :data:`HIDDEN_DIM` says which dimension (if any) is the hidden one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["HIDDEN_DIM", "ExpertLayout", "valid_r", "shard_expert_state", "unshard_expert_states"]

# Dimension of each expert parameter that runs along hidden_dim (None: replicated across shards).
HIDDEN_DIM: dict[str, int | None] = {"w1": 2, "b1": 1, "w3": 2, "b3": 1, "w2": 1, "b2": None}


def valid_r(shards_per_expert: int, world_size: int, builtin_experts: bool = True) -> list[int]:
    """The r values of adaptive parallelism a layout allows: the divisors of the s shards of one expert (just 1
    with whole experts), and r = 0 (gather every expert's weights everywhere) when there is more than one rank
    to gather from and the experts are the built-in ones (flexmoe cannot gather a custom module's weights)."""
    divisors = [r for r in range(1, shards_per_expert + 1) if shards_per_expert % r == 0]
    return ([0] if world_size > 1 and builtin_experts else []) + divisors


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """E_local: how many experts (or expert shards) each of ``world_size`` ranks holds."""
    return max(num_experts // world_size, 1)


def shards_per_expert(num_experts: int, world_size: int) -> int:
    """s: over how many of ``world_size`` ranks one expert is sharded (1 when E >= W)."""
    return max(world_size // num_experts, 1)


@dataclass(frozen=True)
class ExpertLayout:
    """The layout of ``num_experts`` experts of hidden size ``hidden_dim`` over ``world_size`` ranks."""

    num_experts: int
    world_size: int
    hidden_dim: int

    def __post_init__(self) -> None:
        e, w = self.num_experts, self.world_size
        if e < 1 or w < 1:
            raise ValueError(f"num_experts and world_size must be >= 1, got {e} and {w}")
        if e % w != 0 and w % e != 0:
            fitting = {w * m for m in (1, 2, 4)} | {d for d in range(1, w + 1) if w % d == 0}
            raise ValueError(
                f"num_experts={e} and world size {w} do not fit: num_experts must be a multiple of the "
                f"expert-parallel world size (experts spread over ranks) or divide it (experts sharded "
                f"over ranks), e.g. num_experts in {sorted(fitting)}"
            )
        if self.hidden_dim % self.shards_per_expert != 0:
            raise ValueError(
                f"hidden_dim={self.hidden_dim} must divide by the {self.shards_per_expert} shards per expert "
                f"(world size {w} / num_experts {e})"
            )

    @property
    def experts_per_rank(self) -> int:
        """E_local: how many experts (or expert shards) each rank holds."""
        return experts_per_rank(self.num_experts, self.world_size)

    @property
    def shards_per_expert(self) -> int:
        """s: over how many ranks one expert is sharded (1 when E >= W)."""
        return shards_per_expert(self.num_experts, self.world_size)

    @property
    def local_hidden_dim(self) -> int:
        return self.hidden_dim // self.shards_per_expert

    def valid_r(self, builtin_experts: bool = True) -> list[int]:
        """:func:`valid_r` of this layout."""
        return valid_r(self.shards_per_expert, self.world_size, builtin_experts)

    def expert_holders(self) -> list[list[int]]:
        """``[E]`` the ranks holding each expert (one rank for whole experts, its s shards' ranks otherwise)."""
        holders: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank in range(self.world_size):
            for e in self.experts_of_rank(rank):
                holders[e].append(rank)
        return holders

    def experts_of_rank(self, rank: int) -> range:
        """Global indices of the experts rank ``rank`` holds (whole or a shard of)."""
        self._check_rank(rank)
        if self.shards_per_expert == 1:
            return range(rank * self.experts_per_rank, (rank + 1) * self.experts_per_rank)
        first = rank // self.shards_per_expert
        return range(first, first + 1)

    def owner_of_expert(self, expert: int) -> int:
        """The rank holding expert ``expert`` (its shard 0 when sharded)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in [0, {self.num_experts}), got {expert}")
        if self.shards_per_expert == 1:
            return expert // self.experts_per_rank
        return expert * self.shards_per_expert

    def shard_of_rank(self, rank: int) -> int:
        """Which hidden slice of its expert rank ``rank`` holds (0 when experts are whole)."""
        self._check_rank(rank)
        return rank % self.shards_per_expert

    def hidden_slice(self, rank: int) -> slice:
        j = self.shard_of_rank(rank)
        return slice(j * self.local_hidden_dim, (j + 1) * self.local_hidden_dim)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")


def shard_expert_state(global_state: dict[str, Tensor], layout: ExpertLayout, rank: int) -> dict[str, Tensor]:
    """The parameters rank ``rank`` holds, cut from global ones (each ``[E, ...]``)."""
    experts = layout.experts_of_rank(rank)
    hidden = layout.hidden_slice(rank)
    local = {}
    for name, tensor in global_state.items():
        if name not in HIDDEN_DIM:
            raise ValueError(f"unknown expert parameter {name!r}; expected one of {sorted(HIDDEN_DIM)}")
        if tensor.shape[0] != layout.num_experts:
            raise ValueError(
                f"expert parameter {name!r} has {tensor.shape[0]} experts, the layout has {layout.num_experts}"
            )
        part = tensor[experts.start : experts.stop]
        dim = HIDDEN_DIM[name]
        if dim is not None:
            part = part.narrow(dim, hidden.start, hidden.stop - hidden.start)
        local[name] = part.clone()
    return local


def unshard_expert_states(local_states: list[dict[str, Tensor]], layout: ExpertLayout) -> dict[str, Tensor]:
    """The global parameters (each ``[E, ...]``) from every rank's local ones, listed by rank."""
    if len(local_states) != layout.world_size:
        raise ValueError(f"need one state per rank ({layout.world_size}), got {len(local_states)}")
    s = layout.shards_per_expert
    merged = {}
    for name in local_states[0]:
        dim = HIDDEN_DIM[name]
        per_expert = []
        for first in range(0, layout.world_size, s):
            shards = [local_states[r][name] for r in range(first, first + s)]
            per_expert.append(shards[0] if dim is None or s == 1 else torch.cat(shards, dim=dim))
        merged[name] = torch.cat(per_expert, dim=0)
    return merged
