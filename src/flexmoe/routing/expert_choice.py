"""Expert-choice routing (Zhou et al., 2022): each expert takes its top-C tokens.

Router probabilities ``p = softmax(logits)`` over experts, as for top-k. Then, instead of every token picking
k experts, every expert e picks the C tokens with the largest ``p[:, e]`` (ties: the lower token index first).
Loads are exactly ``min(C, T)``: perfectly balanced by construction, so no balance loss is needed. A token may
be taken by 0..E experts; one taken by none gets a zero output (the model's residual path carries it).

Capacity: an explicit ``capacity`` C, else ``C = ceil(k * cf * T / E)`` with ``cf > 0`` (k is then the
average number of experts per token). ``cf == 0`` (dropless) and ``cf < 0`` (adaptive) of the top-k plan have no
meaning here, because the expert, not the token, decides: they are rejected with a ``ValueError``.

Note that an expert's choice depends on the whole batch, so in a causal language model a token's routing can
depend on later tokens of the batch; this is a property of expert-choice routing itself.

The plan's fields (a :class:`~flexmoe.routing.RoutingPlan` with ``kind == "expert_choice"``):

* rows (what dispatch, the experts, combine and the transport read): sorted by expert, then by the expert's
  preference; ``row_token`` the token, ``row_weight = p[token, expert]`` (differentiable, not renormalized over
  the experts that took the token), ``row_choice`` the expert index (the row's column in the per-pair fields);
* per pair, shape ``[T, E]`` (one column per expert, so ``plan.k == E``): ``expert_index[t, j] = j``,
  ``slot[t, e]`` the rank of t in e's choice or -1 where e did not take t, ``weight = probs_topk = p``;
* ``tokens_per_expert = load = min(C, T)`` for every expert; ``capacity = C``;
* ``num_dropped``: tokens that no expert took, ``dropped_fraction = num_dropped / T`` (per *token*, since no
  (token, choice) pair exists here); ``aux_loss`` a differentiable zero; ``z_loss`` as usual.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flexmoe.routing.losses import router_z_loss
from flexmoe.routing.plan import RoutingPlan, check_logits

__all__ = ["expert_choice_capacity", "make_expert_choice_plan"]


def expert_choice_capacity(
    num_tokens: int, num_experts: int, k: int, capacity_factor: float, capacity: int | None
) -> int:
    """C: ``capacity`` if given, else ``ceil(k * cf * T / E)``. Raises ``ValueError`` for ``cf <= 0``."""
    if capacity is not None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        return int(capacity)
    if not capacity_factor > 0:
        raise ValueError(
            f"router='expert_choice' needs capacity_factor > 0 or an explicit capacity, got capacity_factor="
            f"{capacity_factor}: each expert takes a fixed C = ceil(k * cf * T / E) tokens, so the dropless "
            "(cf == 0) and adaptive (cf < 0) capacities of top-k routing do not apply"
        )
    return math.ceil(k * capacity_factor * num_tokens / num_experts)


def make_expert_choice_plan(
    logits: Tensor,
    k: int,
    *,
    capacity_factor: float = 1.0,
    capacity: int | None = None,
) -> RoutingPlan:
    """The expert-choice plan for router logits ``[T, E]`` (see the module docstring for its fields)."""
    num_tokens, num_experts = check_logits(logits, k)
    cap = expert_choice_capacity(num_tokens, num_experts, k, capacity_factor, capacity)
    taken = min(cap, num_tokens)
    device = logits.device

    probs = torch.softmax(logits, dim=-1)  # [T, E]
    # Each expert ranks all tokens; the stable descending sort puts equal scores in token order.
    ranked = torch.sort(probs.detach().t(), dim=1, descending=True, stable=True).indices  # [E, T]
    chosen = ranked[:, :taken]  # [E, C'] tokens per expert, best first
    row_token = chosen.reshape(-1)  # rows sorted by expert, then by the expert's preference
    row_expert = torch.arange(num_experts, device=device).repeat_interleave(taken)
    row_weight = probs[row_token, row_expert]

    slot = torch.full((num_tokens, num_experts), -1, dtype=torch.long, device=device)
    slot[row_token, row_expert] = torch.arange(taken, device=device).repeat(num_experts)
    taken_by_any = (slot >= 0).any(dim=1)
    num_dropped = num_tokens - int(taken_by_any.sum())
    counts = [taken] * num_experts
    tokens_per_expert = torch.full((num_experts,), taken, dtype=torch.long, device=device)

    return RoutingPlan(
        expert_index=torch.arange(num_experts, device=device).expand(num_tokens, num_experts).contiguous(),
        slot=slot,
        weight=probs,
        probs_topk=probs,
        row_token=row_token,
        row_choice=row_expert,
        row_weight=row_weight,
        tokens_per_expert=tokens_per_expert,
        load=tokens_per_expert.clone(),
        host_counts=counts,
        host_capacity=cap,
        num_dropped=num_dropped,
        dropped_fraction=num_dropped / max(num_tokens, 1),
        # Balanced by construction: no balance loss. probs.sum() * 0 keeps the zero in the graph and dtype.
        aux_loss=probs.sum() * 0.0,
        z_loss=router_z_loss(logits),
        kind="expert_choice",
    )
