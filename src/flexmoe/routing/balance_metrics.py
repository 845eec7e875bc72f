"""Balance you can see: how evenly a routing plan spreads the tokens over the experts, as plain numbers to log.

Per MoE layer, from its last :class:`~flexmoe.routing.RoutingPlan` (``load``: the (token, choice) pairs routed
to each expert before the capacity dropped any, ``[E]``; ``scores``: the router's scores ``[T, E]``):

* ``max_over_mean``: ``max_e load_e / mean_e load_e``; 1 is perfectly even, E means one expert took everything.
* ``cv``: the coefficient of variation of the load, ``std_e(load) / mean_e(load)`` with the population standard
  deviation (divided by E); 0 is perfectly even.
* ``load_entropy``: the entropy (nats) of the load distribution ``q_e = load_e / sum(load)``,
  ``-sum_e q_e log q_e`` (``0 log 0 = 0``); ``log E`` is perfectly even, 0 one expert.
* ``router_entropy``: the mean over tokens of the entropy (nats) of the router's distribution over experts,
  ``p_t = scores_t / sum_e scores_te`` (the softmax itself for softmax routers; sigmoid scores normalised),
  ``mean_t(-sum_e p_te log p_te)``; low means confident routing. Only for plans that keep their scores (top-k).
* ``dropped_share``: the share of the ``T * k`` pairs the capacity dropped (``plan.dropped_fraction``).

With no token routed (T = 0) the ratios are undefined and come out NaN. Under expert parallelism each rank's
plan covers its own tokens: these are that rank's numbers.

:func:`flexmoe.balance_metrics` (:mod:`flexmoe.model_routing`) gathers them for a whole model as flat
``"<layer name>/<metric>"`` keys, for one-line logging: ``wandb.log(flexmoe.balance_metrics(model))`` or
``writer.add_scalars("balance", flexmoe.balance_metrics(model), step)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.plan import RoutingPlan

__all__ = ["max_over_mean", "load_cv", "load_entropy", "router_entropy", "plan_balance_metrics"]


def max_over_mean(load: Tensor) -> float:
    """load: ``[E]`` pairs per expert -> ``max / mean`` (NaN when nothing was routed)."""
    load = load.double()
    return float(load.max() / load.mean())


def load_cv(load: Tensor) -> float:
    """load: ``[E]`` -> the coefficient of variation ``std / mean`` (population std; NaN when nothing was routed)."""
    load = load.double()
    return float(load.std(correction=0) / load.mean())


def _entropy(p: Tensor) -> Tensor:
    """Entropy (nats) of the distributions along the last dim of ``p`` (each summing to 1), ``0 log 0 = 0``."""
    return -torch.special.xlogy(p, p).sum(dim=-1)


def load_entropy(load: Tensor) -> float:
    """load: ``[E]`` -> the entropy (nats) of ``load / sum(load)`` (NaN when nothing was routed)."""
    load = load.double()
    return float(_entropy(load / load.sum()))


def router_entropy(scores: Tensor) -> float:
    """scores: ``[T, E]`` non-negative router scores -> the mean over tokens of the entropy (nats) of each token's
    scores normalised to sum 1 (NaN for T = 0)."""
    scores = scores.detach().double()
    p = scores / scores.sum(dim=-1, keepdim=True)
    return float(_entropy(p).mean())


def plan_balance_metrics(plan: RoutingPlan) -> dict[str, float]:
    """The module docstring's metrics of one plan: ``max_over_mean``, ``cv``, ``load_entropy``, ``dropped_share``,
    and ``router_entropy`` when the plan kept its scores."""
    metrics = {
        "max_over_mean": max_over_mean(plan.load),
        "cv": load_cv(plan.load),
        "load_entropy": load_entropy(plan.load),
        "dropped_share": float(plan.dropped_fraction),
    }
    if plan.scores is not None:
        metrics["router_entropy"] = router_entropy(plan.scores)
    return metrics
