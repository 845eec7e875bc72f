"""Which plan builder runs for a layer's routing options: the one entry point between logits and a RoutingPlan.

The ``router`` option names both the gate (the module making logits, :mod:`flexmoe.routing.routers`) and the
way experts are picked from the logits (:attr:`RoutingOptions.selection`):

* ``"topk"`` / ``"cosine"`` (or a custom gate module): every token takes its k best experts
  (:func:`flexmoe.routing.plan.make_plan`), optionally with
    - ``selection_bias``: auxiliary-loss-free balancing (:mod:`flexmoe.routing.bias_balance`),
    - ``second_expert="random"``: GShard's random 2nd expert, in training (:mod:`flexmoe.routing.random_routing`),
    - ``topology``: FasterMoE's cross-node bound (:mod:`flexmoe.routing.topology`);
* ``"expert_choice"``: every expert takes its top-C tokens (:mod:`flexmoe.routing.expert_choice`);
* ``"base"``: BASE layers' balanced assignment in training, the best k experts (dropless unless an explicit
  capacity is given) at evaluation (:mod:`flexmoe.routing.balanced`).

Every builder checks its input with :func:`~flexmoe.routing.plan.check_logits`; the top-k and BASE plans are
laid out by :func:`~flexmoe.routing.plan.plan_from_pairs` (slots, capacity, rows). The options themselves were
validated when the :class:`~flexmoe.routing.RoutingOptions` was made.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.balanced import make_base_plan
from flexmoe.routing.expert_choice import make_expert_choice_plan
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan, make_plan
from flexmoe.routing.read_free import read_free_plan
from flexmoe.routing.topology import TopologyGate

__all__ = ["build_plan"]


def build_plan(
    logits: Tensor,
    options: RoutingOptions,
    *,
    training: bool = False,
    selection_bias: Tensor | None = None,
    topology: TopologyGate | None = None,
    generator: torch.Generator | None = None,
    num_sequences: int | None = None,
    padded: bool = False,
    counts_on_device: bool = False,
    expert_index: Tensor | None = None,
    read_free: bool = False,
) -> RoutingPlan:
    """The :class:`RoutingPlan` for router logits ``[T, E]`` under ``options``.

    selection_bias: ``[E]`` (balance="bias"); topology: the rank's topology gate (cross_node_share);
    generator: feeds the random 2nd-expert decisions (default: torch's global generator); num_sequences: B
    when the T tokens are B sequences (``capacity_per`` / ``aux_loss_type`` "sequence"); padded: the top-k plan
    padded to the capacity (every shape static, for ``torch.compile``; :func:`~flexmoe.routing.plan.plan_from_pairs`).
    counts_on_device: the dropless top-k plan with its counts left on the device (no host sync, for
    ``torch.compile``; :func:`~flexmoe.routing.plan.plan_from_pairs`).
    Expert choice and BASE have no padded layout nor counts left on the device: they ignore both.
    expert_index: ``[T, k]`` replayed choices, taken instead of the router's (routing replay; top-k selection only, see
    :func:`~flexmoe.routing.plan.make_plan`), else ``ValueError``.
    read_free: top-k routing without a host read (:mod:`flexmoe.routing.read_free`): dropless, the plan of
    :func:`~flexmoe.routing.read_free.read_free_plan`; in capacity mode the padded plan (``padded`` must be set).
    """
    kind, k = options.selection, options.k
    if expert_index is not None and kind != "topk":
        raise ValueError(f"replayed choices (routing replay) need top-k selection, got router={options.router!r}")
    if kind == "expert_choice":
        return make_expert_choice_plan(logits, k, capacity_factor=options.static_capacity_factor,
                                       capacity=options.capacity)
    if kind == "base":
        if training:
            return make_base_plan(logits, k, normalize_weights=options.normalize_weights)
        # BASE's test-time rule: each token goes to its best expert(s), without balancing.
        return make_plan(logits, k, capacity_factor=0.0, capacity=options.capacity,
                         normalize_weights=options.normalize_weights, batch_prioritized=options.batch_prioritized)
    if read_free and not padded:
        return read_free_plan(logits, options, selection_bias=selection_bias, num_sequences=num_sequences)
    return make_plan(logits, k, capacity_factor=options.static_capacity_factor, capacity=options.capacity,
                     normalize_weights=options.normalize_weights, batch_prioritized=options.batch_prioritized,
                     selection_bias=selection_bias, topology=topology,
                     random_second=options.second_expert == "random" and training, generator=generator,
                     score_func=options.score_func, num_expert_groups=options.num_expert_groups,
                     num_limited_groups=options.num_limited_groups, route_scale=options.route_scale,
                     aux_loss_type=options.aux_loss_type, capacity_per=options.capacity_per,
                     num_sequences=num_sequences, padded=padded, counts_on_device=counts_on_device,
                     ties=options.ties, select_by=options.select_by, expert_index=expert_index,
                     read_free=read_free)
