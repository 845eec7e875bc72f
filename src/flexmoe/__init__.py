"""flexmoe: mixture-of-experts layers for PyTorch.

The layer is :class:`MoELayer`; its stages stand alone for users who build their own layer:
``route`` (tokens -> logits), ``make_plan`` (logits -> :class:`RoutingPlan`), ``dispatch`` (tokens, plan ->
expert input), the experts, and ``combine`` (expert output, plan -> tokens).
"""

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import FeedForwardExperts
from flexmoe.layer import MoELayer
from flexmoe.routing import (
    CosineRouter,
    LinearRouter,
    RoutingPlan,
    load_balancing_loss,
    make_plan,
    resolve_capacity,
    route,
    router_z_loss,
)

__version__ = "0.1.0"

__all__ = [
    "MoELayer",
    "RoutingPlan",
    "make_plan",
    "resolve_capacity",
    "route",
    "dispatch",
    "combine",
    "FeedForwardExperts",
    "LinearRouter",
    "CosineRouter",
    "load_balancing_loss",
    "router_z_loss",
]
