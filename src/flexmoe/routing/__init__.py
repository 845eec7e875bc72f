"""Routing: routers (logits), the routing plan (experts, slots, weights) and the router losses.

:class:`RoutingOptions` holds a layer's routing options; :func:`build_plan` is the entry point the layer uses:
it picks the plan builder for those options (top-k with its variants, expert choice, BASE).
"""

from flexmoe.routing.balanced import balanced_assignment, make_base_plan
from flexmoe.routing.bias_balance import bias_update, load_imbalance
from flexmoe.routing.build import build_plan
from flexmoe.routing.capacity import assign_sequence_slots
from flexmoe.routing.expert_choice import expert_choice_capacity, make_expert_choice_plan
from flexmoe.routing.families import check_family_options
from flexmoe.routing.losses import (
    all_choices_balance_loss,
    balance_loss,
    load_balancing_loss,
    router_z_loss,
    sequence_balance_loss,
)
from flexmoe.routing.options import RoutingOptions, selection_kind
from flexmoe.routing.plan import (
    RoutingPlan,
    assign_slots,
    check_logits,
    make_plan,
    normalize_topk,
    plan_from_pairs,
    resolve_capacity,
    top_k,
)
from flexmoe.routing.random_routing import sample_second_expert, second_expert_keep_probability
from flexmoe.routing.routers import CosineRouter, LinearRouter, build_router, route
from flexmoe.routing.scores import group_limited_mask, routed_weights, router_scores, select_experts
from flexmoe.routing.topology import TopologyGate, expert_nodes, limit_cross_node, remote_pair_budget, topology_gate

__all__ = [
    "RoutingOptions",
    "RoutingPlan",
    "make_plan",
    "resolve_capacity",
    "top_k",
    "assign_slots",
    "check_logits",
    "normalize_topk",
    "plan_from_pairs",
    "build_plan",
    "selection_kind",
    "make_expert_choice_plan",
    "expert_choice_capacity",
    "balanced_assignment",
    "make_base_plan",
    "bias_update",
    "load_imbalance",
    "sample_second_expert",
    "second_expert_keep_probability",
    "TopologyGate",
    "topology_gate",
    "expert_nodes",
    "limit_cross_node",
    "remote_pair_budget",
    "load_balancing_loss",
    "router_z_loss",
    "all_choices_balance_loss",
    "sequence_balance_loss",
    "balance_loss",
    "router_scores",
    "group_limited_mask",
    "select_experts",
    "routed_weights",
    "assign_sequence_slots",
    "check_family_options",
    "LinearRouter",
    "CosineRouter",
    "build_router",
    "route",
]
