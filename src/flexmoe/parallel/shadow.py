"""Expert shadowing (FasterMoE): replicate this step's hot experts on every rank.

With skewed routing the rank holding a hot expert computes far more rows than the others, and every rank
waits for it (the all-to-all back is as slow as the busiest rank). Shadowing an expert for one step:

1. its owner broadcasts the expert's weights to every rank (one ``dist.broadcast`` per shadowed expert);
2. every rank computes *its own* rows of that expert locally: those rows never enter the all-to-all;
3. in backward, the gradients of the copies are summed back on the owner (one ``dist.reduce`` per expert),
   so the owner's parameter gradient is the same as without shadowing.

Which experts to shadow is a :class:`ShadowPolicy`, asked at every forward with the all-gathered per-expert
counts ``all_counts[src][e]`` (rows that rank ``src`` routes to global expert ``e``). Every rank must get the
same answer, so a policy must be a deterministic function of ``all_counts`` and the :class:`ShadowContext`.
The layer's own policy is part of its configuration check; a policy passed to one ``forward`` call is not
checked, so pass the same one on every rank.

* :class:`flexmoe.tuning.CostModelShadowPolicy` (``shadow=True``, beside the cost model it needs): FasterMoE's
  rule, via :func:`flexmoe.tuning.cost_model.choose_shadowed`: shadow the hottest experts while the straggler time saved
  exceeds the broadcast + reduce it costs.
* :class:`ShadowExperts` (a fixed list) and :class:`ShadowTopExperts` (the n busiest): explicit choices, for
  tests and experiments.

Supported for the built-in :class:`~flexmoe.experts.FeedForwardExperts` with whole experts (E % W == 0); the
layer raises a ValueError at construction otherwise (a custom module has no weights we know how to ship, and
a sharded expert is already spread over ranks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.weights import WEIGHT_NAMES
from flexmoe.parallel.groups import ExpertGroup
from flexmoe.parallel.layout import ExpertLayout

__all__ = [
    "ShadowContext",
    "ShadowPolicy",
    "ShadowExperts",
    "ShadowTopExperts",
    "check_shadow_supported",
    "choose_experts",
    "rows_per_rank",
    "run_shadowed",
]

# ---------------------------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class ShadowContext:
    """What a policy may know besides the counts: the layer's shape and the step's transport settings."""

    layout: ExpertLayout
    model_dim: int
    hidden_dim: int
    k: int
    dtype: torch.dtype
    glu: bool = False
    a2a: str = "flat"
    ranks_per_node: int | None = None
    overlap_degree: int = 1


@runtime_checkable
class ShadowPolicy(Protocol):
    """Chooses the experts to shadow for one step.

    ``choose(all_counts, context)``: all_counts ``[W][E]`` (rows per source rank and global expert, the same on
    every rank) -> global expert ids. Must be deterministic: every rank calls it and must get the same list.
    """

    def choose(self, all_counts: Sequence[Sequence[int]], context: ShadowContext) -> list[int]: ...


def global_counts(all_counts: Sequence[Sequence[int]]) -> list[int]:
    """``[W][E]`` -> ``[E]``: rows each expert receives from all ranks."""
    return [sum(col) for col in zip(*all_counts)]


@dataclass(frozen=True)
class ShadowExperts:
    """Always shadow these global experts (a fixed list)."""

    experts: tuple[int, ...]

    def __init__(self, experts: Sequence[int]) -> None:
        object.__setattr__(self, "experts", tuple(int(e) for e in experts))

    def choose(self, all_counts: Sequence[Sequence[int]], context: ShadowContext) -> list[int]:
        return list(self.experts)


@dataclass(frozen=True)
class ShadowTopExperts:
    """Shadow the ``n`` experts with the most rows this step (ties: the lower expert id first)."""

    n: int

    def choose(self, all_counts: Sequence[Sequence[int]], context: ShadowContext) -> list[int]:
        counts = global_counts(all_counts)
        order = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        return sorted(order[: self.n])


def check_shadow_supported(layout: ExpertLayout, experts: nn.Module) -> None:
    """Shadowing needs the built-in experts, whole (E % W == 0); a clear ValueError otherwise."""
    if not isinstance(experts, FeedForwardExperts):
        raise ValueError("shadow= needs the built-in FeedForwardExperts: a custom experts module's weights "
                         "cannot be broadcast by flexmoe (use shadow=False)")
    if layout.shards_per_expert > 1:
        raise ValueError(
            f"shadow= needs whole experts (num_experts % world size == 0); {layout.num_experts} experts over "
            f"{layout.world_size} ranks are sharded {layout.shards_per_expert} ways (use shadow=False)"
        )


def choose_experts(policy: ShadowPolicy | None, all_counts: Sequence[Sequence[int]],
                   context: ShadowContext) -> list[int]:
    """The policy's choice, checked and normalized (sorted, unique)."""
    if policy is None:
        return []
    num_experts = context.layout.num_experts
    chosen = sorted({int(e) for e in policy.choose(all_counts, context)})
    bad = [e for e in chosen if not 0 <= e < num_experts]
    if bad:
        raise ValueError(f"shadow policy {policy!r} chose experts {bad} outside [0, {num_experts})")
    return chosen


def rows_per_rank(all_counts: Sequence[Sequence[int]], layout: ExpertLayout, shadowed: Sequence[int] = ()) -> list[int]:
    """Expert rows each rank computes: its experts' rows from every source, except that a shadowed expert's
    rows are computed by their source rank (whole experts). ``[W][E]`` -> ``[W]``."""
    world = len(all_counts)
    shadow = set(shadowed)
    load = [0] * world
    for src, row in enumerate(all_counts):
        for e, n in enumerate(row):
            load[src if e in shadow else layout.owner_of_expert(e)] += n
    return load


# ------------------------------------------------------------------------------------ weights and gradients


class _BroadcastExperts(torch.autograd.Function):
    """Forward: each shadowed expert's weights broadcast from its owner, as one flat row per expert
    ``[S, P]`` (P: the numbers in one expert's parameters). Backward: each row's gradient reduced (summed) onto
    the owner's local parameters. One flat buffer, so no per-parameter copies on either side."""

    @staticmethod
    def forward(ctx, eg: ExpertGroup, layout: ExpertLayout, shadowed: list[int],
                *params: Tensor) -> Tensor:
        ctx.eg, ctx.layout, ctx.shadowed = eg, layout, shadowed
        ctx.local_shapes = [p.shape for p in params]
        sizes = [math.prod(p.shape[1:]) for p in params]
        flat = params[0].new_empty(len(shadowed), sum(sizes))
        works = []
        for s, x in enumerate(shadowed):
            owner = layout.owner_of_expert(x)
            if owner == eg.rank:
                j = x - layout.experts_of_rank(owner).start
                torch.cat([p[j].reshape(-1) for p in params], out=flat[s])
            works.append(eg.call("shadowed-expert broadcast", functools.partial(
                dist.broadcast, flat[s], src=eg.global_ranks[owner], group=eg.group, async_op=True)))
        for work in works:
            eg.call("shadowed-expert broadcast", work.wait)
        return flat

    @staticmethod
    def backward(ctx, grad: Tensor):
        eg, layout = ctx.eg, ctx.layout
        grad = grad.contiguous().clone()  # reduce writes into it; autograd's buffer is not ours to change
        works = []
        for s, x in enumerate(ctx.shadowed):
            dst = eg.global_ranks[layout.owner_of_expert(x)]
            works.append(eg.call("shadowed-expert gradient reduce", functools.partial(
                dist.reduce, grad[s], dst=dst, group=eg.group, async_op=True)))
        for work in works:
            eg.call("shadowed-expert gradient reduce", work.wait)
        param_grads: list[Tensor | None] = [None] * len(ctx.local_shapes)
        sizes = [math.prod(shape[1:]) for shape in ctx.local_shapes]
        for s, x in enumerate(ctx.shadowed):
            if layout.owner_of_expert(x) != eg.rank:
                continue  # only the owner's buffer holds the sum
            j = x - layout.experts_of_rank(eg.rank).start
            for i, piece in enumerate(grad[s].split(sizes)):
                param_grad = param_grads[i]
                if param_grad is None:
                    param_grad = param_grads[i] = grad.new_zeros(ctx.local_shapes[i])
                param_grad[j] = piece.view(ctx.local_shapes[i][1:])
        return (None, None, None, *param_grads)


def broadcast_experts(experts: FeedForwardExperts, eg: ExpertGroup, layout: ExpertLayout,
                      shadowed: list[int]) -> dict[str, Tensor | None]:
    """The weights of the shadowed experts on every rank: name -> ``[S, ...]`` (None for absent parameters),
    in the order of ``shadowed``. Differentiable: gradients go back to the owners' parameters."""
    names = [n for n in WEIGHT_NAMES if getattr(experts, n, None) is not None]
    params = [getattr(experts, n) for n in names]
    flat = _BroadcastExperts.apply(eg, layout, shadowed, *params)  # [S, P]
    # Views of the flat rows (split along dim 1 keeps each expert's piece contiguous): no copies.
    pieces = flat.split([math.prod(p.shape[1:]) for p in params], dim=1)
    out: dict[str, Tensor | None] = {n: None for n in WEIGHT_NAMES}
    for n, p, piece in zip(names, params, pieces):
        out[n] = piece.view(len(shadowed), *p.shape[1:])
    return out


# --------------------------------------------------------------------------------------------- the forward


def split_rows(counts: Sequence[int], shadowed: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Positions of the rows (sorted by expert, ``counts[e]`` each) of non-shadowed and of shadowed experts."""
    shadow = set(shadowed)
    rest: list[Tensor] = []
    mine: list[Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        (mine if e in shadow else rest).append(torch.arange(start, start + n))
        start += n
    empty = torch.zeros(0, dtype=torch.long)
    return (torch.cat(rest) if rest else empty), (torch.cat(mine) if mine else empty)


def run_shadowed(
    experts: FeedForwardExperts,
    eg: ExpertGroup,
    layout: ExpertLayout,
    rows: Tensor,
    counts: list[int],
    all_counts: list[list[int]],
    shadowed: list[int],
    run_rest: Callable[[Tensor, list[int], list[list[int]]], Tensor],
) -> Tensor:
    """rows ``[N, M]`` sorted by global expert -> ``[N, M]`` expert outputs, with ``shadowed`` experts computed
    here on broadcast weights and the other rows handed to ``run_rest(rows, counts, all_counts)`` (the usual
    expert-parallel path, which sees zero rows for the shadowed experts)."""
    weights = broadcast_experts(experts, eg, layout, shadowed)
    shadow = set(shadowed)
    rest_index, shadow_index = split_rows(counts, shadowed)
    rest_counts = [0 if e in shadow else n for e, n in enumerate(counts)]
    rest_all = [[0 if e in shadow else n for e, n in enumerate(row)] for row in all_counts]
    rest_rows = rows.index_select(0, rest_index)
    w1 = weights["w1"]
    if w1 is not None and w1.requires_grad and torch.is_grad_enabled():
        # Tie the remaining rows to the broadcast weights (adding an empty sum: the values do not change).
        # Then every rank's backward runs the exchange's backward, even a rank whose rows need no gradient,
        # and only after it the reduce of the shadowed gradients: a data dependency, so every rank issues
        # these collectives in the same order.
        rest_rows = rest_rows + w1[:0].sum().to(rest_rows.dtype)
    rest_out = run_rest(rest_rows, rest_counts, rest_all)
    shadow_out = experts.ffn_with(rows.index_select(0, shadow_index), [counts[e] for e in shadowed], weights)
    order = torch.cat([rest_index, shadow_index])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return torch.cat([rest_out.to(rows.dtype), shadow_out.to(rows.dtype)]).index_select(0, inverse)
