"""flexmoe: mixture-of-experts layers for PyTorch.

The layer is :class:`MoELayer`; its stages stand alone for users who build their own layer:
``route`` (tokens -> logits), ``make_plan`` (logits -> :class:`RoutingPlan`), ``dispatch`` (tokens, plan ->
expert input), the experts, and ``combine`` (expert output, plan -> tokens). Its options live in
:class:`RoutingOptions`, :class:`ExpertOptions` and :class:`ParallelOptions`; with ``balance="bias"`` call
:func:`update_expert_biases` once per optimizer step. :func:`record_routing` / :func:`replay_routing` record a
model's expert choices and replay them (reinforcement learning's routing replay); :func:`balance_metrics` gives
every MoE layer's balance numbers for a training loop's logger. docs/architecture.md describes the whole.
"""

import importlib
import sys

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

# The expert stage's modules moved into the package flexmoe.experts. For one release their old names still import
# (``import flexmoe.kernel_chooser``, ``from flexmoe.expert_kernels import KERNELS``): each old name is registered
# in sys.modules as the moved module itself (not a copy), so a monkeypatch through either name patches the one
# module. Remove the table in the release after next.
_MOVED_MODULES = {
    "flexmoe.expert_kernels": "flexmoe.experts.kernels",
    "flexmoe.expert_stage": "flexmoe.experts.stage",
    "flexmoe.expert_weights": "flexmoe.experts.weights",
    "flexmoe.fused_experts": "flexmoe.experts.fused",
    "flexmoe.grouped_linear_op": "flexmoe.experts.grouped_op",
    "flexmoe.kernel_chooser": "flexmoe.experts.chooser",
    "flexmoe.padded_ffn_op": "flexmoe.experts.padded_op",
    "flexmoe.padded_fused_op": "flexmoe.experts.padded_fused_op",
    "flexmoe.row_kernels": "flexmoe.experts.row_kernels",
    "flexmoe.segment_ffn": "flexmoe.experts.segment_ffn",
    "flexmoe.shared": "flexmoe.experts.shared_gate",
}
for _old, _new in _MOVED_MODULES.items():
    # In sys.modules for `import flexmoe.kernel_chooser`, and as an attribute for `flexmoe.kernel_chooser.X`.
    globals()[_old.rpartition(".")[2]] = sys.modules.setdefault(_old, importlib.import_module(_new))
del _old, _new

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
