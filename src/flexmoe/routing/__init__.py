"""Routing: routers (logits), the routing plan (experts, slots, weights) and the router losses."""

from flexmoe.routing.losses import load_balancing_loss, router_z_loss
from flexmoe.routing.plan import RoutingPlan, assign_slots, make_plan, resolve_capacity, top_k
from flexmoe.routing.routers import CosineRouter, LinearRouter, build_router, route

__all__ = [
    "RoutingPlan",
    "make_plan",
    "resolve_capacity",
    "top_k",
    "assign_slots",
    "load_balancing_loss",
    "router_z_loss",
    "LinearRouter",
    "CosineRouter",
    "build_router",
    "route",
]
