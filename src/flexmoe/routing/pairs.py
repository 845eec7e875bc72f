"""Build a top-k shaped :class:`RoutingPlan` from chosen (token, choice) pairs.

:func:`flexmoe.routing.plan.make_plan` picks the experts by top-k and lays out every pair. The routers of
:mod:`flexmoe.routing.balanced` (BASE) and :mod:`flexmoe.routing.random_routing` (GShard's random 2nd expert)
choose their ``[T, k]`` experts differently, or dispatch only some pairs; this module turns their choice into a
plan with the same slot rules (DESIGN.md section 3): slots in priority order, every token's 1st choice before
any 2nd choice, a pair whose slot is >= the capacity dropped and counted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.losses import router_z_loss
from flexmoe.routing.capacity import assign_sequence_slots, kept_counts
from flexmoe.routing.plan import RoutingPlan, resolve_capacity

__all__ = ["plan_from_pairs"]


def plan_from_pairs(
    logits: Tensor,
    expert_index: Tensor,
    probs_topk: Tensor,
    weight: Tensor,
    *,
    active: Tensor | None = None,
    capacity_factor: float = 0.0,
    capacity: int | None = None,
    priority: Tensor | None = None,
    aux_loss: Tensor,
    kind: str = "topk",
    num_sequences: int | None = None,
) -> RoutingPlan:
    """The plan for chosen pairs.

    logits: ``[T, E]`` (for the z-loss); expert_index, probs_topk, weight: ``[T, k]`` as in
    :class:`RoutingPlan`; active: ``[T, k]`` bool, the pairs to dispatch (default all). Inactive pairs are
    *skipped*: they claim no slot, get ``slot == -1``, are left out of ``load`` and counted in ``num_skipped``,
    not in ``num_dropped``. Capacity as in :func:`resolve_capacity` over the active pairs' loads.
    priority: ``[T]`` the token order within one choice (default token order).
    num_sequences: B for ``capacity_per="sequence"`` (the T tokens are B sequences, each with its own capacity,
    :mod:`flexmoe.routing.capacity`); None: one capacity over the call.
    """
    num_tokens, num_experts = logits.shape
    k = expert_index.shape[1]
    device = logits.device
    if priority is None:
        priority = torch.arange(num_tokens, device=device)
    if active is None:
        active = torch.ones_like(expert_index, dtype=torch.bool)
    # Skipped pairs go to a virtual expert E that sorts after every real one, so that assign_slots hands out
    # the real slots in priority order among the active pairs only; the virtual expert is then cut off.
    masked_index = torch.where(active, expert_index, torch.full_like(expert_index, num_experts))
    # capacity_per="sequence" (flexmoe.routing.capacity): slots and capacity per (expert, sequence) unit.
    num_units = 1 if num_sequences is None else num_sequences
    slot, unit_load, order = assign_sequence_slots(masked_index, num_experts + 1, priority, num_units)
    unit_load = unit_load[:num_experts]
    load = unit_load.sum(dim=1)
    num_active = int(active.sum())
    order = order[:num_active]

    unit_list = unit_load.tolist()
    cap = resolve_capacity(num_tokens // num_units, num_experts, k, capacity_factor, capacity,
                           max((n for row in unit_list for n in row), default=0))
    counts = kept_counts(unit_list, cap)
    kept_sorted = slot.view(-1)[order] < cap
    rows = order[kept_sorted]
    slot = torch.where(active & (slot < cap), slot, torch.full_like(slot, -1))
    num_kept = sum(counts)
    num_skipped = num_tokens * k - num_active
    num_dropped = num_active - num_kept

    return RoutingPlan(
        expert_index=expert_index,
        slot=slot,
        weight=weight,
        probs_topk=probs_topk,
        row_token=torch.div(rows, k, rounding_mode="floor"),
        row_choice=rows % k,
        row_weight=weight.reshape(-1)[rows],
        tokens_per_expert=torch.tensor(counts, dtype=torch.long, device=device),
        load=load,
        counts=counts,
        capacity=cap,
        num_dropped=num_dropped,
        dropped_fraction=num_dropped / max(num_tokens * k, 1),
        aux_loss=aux_loss,
        z_loss=router_z_loss(logits),
        num_skipped=num_skipped,
        kind=kind,
    )
