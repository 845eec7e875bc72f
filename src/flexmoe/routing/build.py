"""Which plan builder runs for a layer's routing options: the one entry point between logits and a RoutingPlan.

The layer's ``router=`` string names both the gate (the module making logits, :mod:`flexmoe.routing.routers`)
and the way experts are picked from the logits:

* ``"topk"`` / ``"cosine"`` (or a custom gate module): every token takes its k best experts
  (:func:`flexmoe.routing.plan.make_plan`), optionally with
    - ``selection_bias``: auxiliary-loss-free balancing (:mod:`flexmoe.routing.bias_balance`),
    - ``second_expert="random"``: GShard's random 2nd expert, in training (:mod:`flexmoe.routing.random_routing`),
    - ``topology``: FasterMoE's cross-node bound (:mod:`flexmoe.routing.topology`);
* ``"expert_choice"``: every expert takes its top-C tokens (:mod:`flexmoe.routing.expert_choice`);
* ``"base"``: BASE layers' balanced assignment in training, the best k experts (dropless unless an explicit
  capacity is given) at evaluation (:mod:`flexmoe.routing.balanced`).

:func:`check_routing_options` rejects the combinations that have no meaning, naming the argument.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flexmoe.routing.balanced import make_base_plan
from flexmoe.routing.expert_choice import make_expert_choice_plan
from flexmoe.routing.families import is_plain_topk
from flexmoe.routing.losses import balance_loss
from flexmoe.routing.pairs import plan_from_pairs
from flexmoe.routing.plan import RoutingPlan, _priority_order, make_plan
from flexmoe.routing.random_routing import sample_second_expert
from flexmoe.routing.scores import routed_weights, router_scores, select_experts
from flexmoe.routing.topology import TopologyGate

__all__ = ["ROUTER_NAMES", "BALANCE_MODES", "SECOND_EXPERT_MODES", "selection_kind", "check_routing_options",
           "build_plan"]

ROUTER_NAMES = ("topk", "cosine", "expert_choice", "base")
BALANCE_MODES = ("aux", "bias")
SECOND_EXPERT_MODES = ("top", "random")


def selection_kind(router: object) -> str:
    """How experts are picked for a ``router=`` value: "expert_choice", "base", or "topk" (anything else)."""
    return router if router in ("expert_choice", "base") else "topk"


def check_routing_options(
    *,
    router: object,
    k: int,
    capacity_factor: float,
    capacity: int | None,
    balance: object,
    bias_update_rate: object,
    second_expert: object,
    cross_node_share: object,
) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the argument for options that do not fit together."""
    if isinstance(router, str) and router not in ROUTER_NAMES:
        raise ValueError(f"router must be one of {list(ROUTER_NAMES)} or an nn.Module, got {router!r}")
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be 'aux' or 'bias', got {balance!r}")
    if isinstance(bias_update_rate, bool) or not isinstance(bias_update_rate, (int, float)):
        raise TypeError(f"bias_update_rate must be a number, got {type(bias_update_rate).__name__}")
    if not (math.isfinite(bias_update_rate) and bias_update_rate >= 0):
        raise ValueError(f"bias_update_rate must be finite and >= 0, got {bias_update_rate}")
    if second_expert not in SECOND_EXPERT_MODES:
        raise ValueError(f"second_expert must be 'top' or 'random', got {second_expert!r}")
    if cross_node_share is not None:
        if isinstance(cross_node_share, bool) or not isinstance(cross_node_share, (int, float)):
            raise TypeError(f"cross_node_share must be a number or None, got {type(cross_node_share).__name__}")
        if not 0.0 <= cross_node_share <= 1.0:
            raise ValueError(f"cross_node_share must be in [0, 1], got {cross_node_share}")

    kind = selection_kind(router)
    if kind == "expert_choice" and capacity is None and not capacity_factor > 0:
        raise ValueError(
            f"router='expert_choice' needs capacity_factor > 0 (each expert takes C = ceil(k * cf * T / E) "
            f"tokens) or an explicit capacity, got capacity_factor={capacity_factor}"
        )
    if kind != "topk":
        # These act on the k choices of each token, which expert choice and BASE do not make.
        if balance == "bias":
            raise ValueError(f"balance='bias' needs a top-k router; router={router!r} is balanced by construction")
        if second_expert == "random":
            raise ValueError(f"second_expert='random' needs a top-k router, got router={router!r}")
        if cross_node_share is not None:
            raise ValueError(f"cross_node_share needs a top-k router, got router={router!r}")
    if second_expert == "random" and k != 2:
        raise ValueError(f"second_expert='random' is GShard's rule for k=2 (a token's two choices), got k={k}")


def build_plan(
    logits: Tensor,
    *,
    kind: str,
    k: int,
    capacity_factor: float,
    capacity: int | None,
    normalize_weights: bool = True,
    batch_prioritized: bool = False,
    training: bool = False,
    selection_bias: Tensor | None = None,
    second_expert: str = "top",
    topology: TopologyGate | None = None,
    generator: torch.Generator | None = None,
    # The open MoE families' options (flexmoe.routing.families):
    score_func: str = "softmax",
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_scale: float = 1.0,
    capacity_per: str = "call",
    aux_loss_type: str = "switch",
    num_sequences: int | None = None,
) -> RoutingPlan:
    """The :class:`RoutingPlan` for router logits ``[T, E]``.

    kind: "topk", "expert_choice" or "base" (:func:`selection_kind`). The other arguments are the layer's
    options (see the module docstring); ``generator`` feeds the random 2nd-expert decisions (default: torch's
    global generator). ``num_sequences``: B when the T tokens are B sequences (for ``capacity_per`` and
    ``aux_loss_type`` "sequence").
    """
    if kind == "expert_choice":
        return make_expert_choice_plan(logits, k, capacity_factor=capacity_factor, capacity=capacity)
    if kind == "base":
        if training:
            return make_base_plan(logits, k, normalize_weights=normalize_weights)
        # BASE's test-time rule: each token goes to its best expert(s), without balancing.
        return make_plan(logits, k, capacity_factor=0.0, capacity=capacity, normalize_weights=normalize_weights,
                         batch_prioritized=batch_prioritized)
    if kind != "topk":
        raise ValueError(f"kind must be 'topk', 'expert_choice' or 'base', got {kind!r}")
    random_second = second_expert == "random" and training
    family = dict(score_func=score_func, num_expert_groups=num_expert_groups, route_scale=route_scale,
                  capacity_per=capacity_per, aux_loss_type=aux_loss_type)
    if not random_second and topology is None and is_plain_topk(**family):
        return make_plan(logits, k, capacity_factor=capacity_factor, capacity=capacity,
                         normalize_weights=normalize_weights, batch_prioritized=batch_prioritized,
                         selection_bias=selection_bias)
    return _topk_pairs_plan(logits, k, capacity_factor=capacity_factor, capacity=capacity,
                            normalize_weights=normalize_weights, batch_prioritized=batch_prioritized,
                            selection_bias=selection_bias, random_second=random_second, topology=topology,
                            generator=generator, num_limited_groups=num_limited_groups,
                            num_sequences=num_sequences, **family)


def _topk_pairs_plan(
    logits: Tensor,
    k: int,
    *,
    capacity_factor: float,
    capacity: int | None,
    normalize_weights: bool,
    batch_prioritized: bool,
    selection_bias: Tensor | None,
    random_second: bool,
    topology: TopologyGate | None,
    generator: torch.Generator | None,
    score_func: str = "softmax",
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_scale: float = 1.0,
    capacity_per: str = "call",
    aux_loss_type: str = "switch",
    num_sequences: int | None = None,
) -> RoutingPlan:
    """Top-k with the families' scores, groups and scaling (:mod:`flexmoe.routing.scores`), whose pairs may
    then be changed (re-routed by the topology gate) or thinned (random 2nd expert)."""
    if not torch.isfinite(logits).all():
        raise ValueError("router logits contain NaN or infinity; check the layer input and the router weights")
    probs = router_scores(logits, score_func)
    expert_index, scores = select_experts(probs, k, selection_bias=selection_bias,
                                          num_expert_groups=num_expert_groups, num_limited_groups=num_limited_groups)
    if topology is not None:
        expert_index = topology.apply(scores, expert_index)
    probs_topk, weight = routed_weights(probs, expert_index, normalize_weights=normalize_weights,
                                        route_scale=route_scale)
    active = sample_second_expert(probs_topk, generator) if random_second else None
    return plan_from_pairs(
        logits, expert_index, probs_topk, weight,
        active=active,
        capacity_factor=capacity_factor,
        capacity=capacity,
        priority=_priority_order(probs_topk.detach(), batch_prioritized),
        aux_loss=balance_loss(aux_loss_type, probs, expert_index, score_func=score_func,
                              num_sequences=num_sequences),
        kind="topk",
        num_sequences=num_sequences if capacity_per == "sequence" else None,
    )
