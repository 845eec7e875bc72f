"""flexmoe: mixture-of-experts layers for PyTorch.

The layer is :class:`MoELayer`; its stages stand alone for users who build their own layer:
``route`` (tokens -> logits), ``make_plan`` (logits -> :class:`RoutingPlan`), ``dispatch`` (tokens, plan ->
expert input), the experts, and ``combine`` (expert output, plan -> tokens). Its options live in
:class:`RoutingOptions`, :class:`ExpertOptions` and :class:`ParallelOptions`; with ``balance="bias"`` call
:func:`update_expert_biases` once per optimizer step. :func:`record_routing` / :func:`replay_routing` record a
model's expert choices and replay them (reinforcement learning's routing replay); :func:`balance_metrics` gives
every MoE layer's balance numbers for a training loop's logger. docs/architecture.md describes the whole.
"""

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import ExpertOptions, FeedForwardExperts
from flexmoe.layer import MoELayer, update_expert_biases
from flexmoe.model_routing import balance_metrics, record_routing, replay_routing
from flexmoe.parallel import ParallelOptions
from flexmoe.routing import (
    CosineRouter,
    LinearRouter,
    RoutingOptions,
    RoutingPlan,
    load_balancing_loss,
    make_plan,
    resolve_capacity,
    route,
    router_z_loss,
)
from flexmoe.routing.global_balance import reset_global_balance
from flexmoe.routing.replay import RoutingRecord
from flexmoe.upcycle import upcycle
from flexmoe.version import __version__ as __version__

__all__ = [
    "MoELayer",
    "RoutingOptions",
    "ExpertOptions",
    "ParallelOptions",
    "update_expert_biases",
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
    "record_routing",
    "replay_routing",
    "RoutingRecord",
    "balance_metrics",
    "upcycle",
    "reset_global_balance",
]
