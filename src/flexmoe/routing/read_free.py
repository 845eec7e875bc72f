"""The dropless top-k plan without a host read: the plan of the path a GPU takes (docs/architecture.md, "Expert
compute").

On a GPU every value the host reads from the device stalls the stream, and every operation is a kernel launch.
:func:`read_free_plan` builds the dropless :class:`~flexmoe.routing.RoutingPlan` of a top-k call with neither:

* the finiteness of the logits is asserted on the device (``torch._assert_async``), not read;
* the rows are the pairs in slot order by one stable sort (``N = T * k``, known before routing), and the row
  after each expert's last (``expert_ends``, ``[E]`` int32, the offsets ``torch._grouped_mm`` takes) by one
  ``searchsorted`` of the sorted experts: no ``bincount`` (whose output size is a value), no ``tolist``;
* what the call's output does not need is computed when first read (:class:`DeferredPlan`): the slots, each
  row's choice, the counts per expert, the balance loss and the z-loss. A training loop that reads
  ``aux_loss`` gets the same differentiable value as the eager plan's (computed under the call's grad mode);
  a call whose losses nobody reads never launches them. ``counts`` and ``capacity`` still read the device, when
  a caller asks for them.

The plan is the same as :func:`~flexmoe.routing.plan.make_plan`'s (dropless): the same choices, weights, rows in
the same order, the same losses. Capacity mode takes the padded plan instead (``make_plan(..., padded=True,
read_free=True)``), every expert ``capacity`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from flexmoe.routing.capacity import assign_slots, count_per_expert, sort_pairs_by_expert
from flexmoe.routing.losses import balance_loss, router_z_loss
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan, check_logits
from flexmoe.routing.scores import routed_weights, router_scores, select_experts

__all__ = ["Later", "DeferredPlan", "read_free_plan"]


class Later:
    """A plan field's value computed by ``compute()`` when first read, then kept (one value for every field that
    shares this instance: ``tokens_per_expert`` and ``load``)."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._value: Any = None

    def __call__(self) -> Any:
        if self._compute is not None:
            self._value, self._compute = self._compute(), None
        return self._value


class _Deferred:
    """A field of :class:`DeferredPlan` that may hold a :class:`Later`: reading it computes the value once."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, plan: Any, owner: type | None = None) -> Any:
        if plan is None:
            return self
        value = plan.__dict__[self.name]
        if isinstance(value, Later):
            value = value()
            plan.__dict__[self.name] = value
        return value

    def __set__(self, plan: Any, value: Any) -> None:
        plan.__dict__[self.name] = value


class DeferredPlan(RoutingPlan):
    """A :class:`~flexmoe.routing.RoutingPlan` whose fields below may be given as :class:`Later` values, computed
    when first read; ``row_expert`` is the sorted experts the plan was built from (no host read)."""

    row_experts: Tensor  # [N] the expert of each row, set by read_free_plan

    @property
    def row_expert(self) -> Tensor:
        """``[N]`` the expert of each row (sorted), on the device."""
        return self.row_experts


# Set on the subclass only: the plain RoutingPlan (the compiled paths trace it) keeps plain attributes.
for _name in ("slot", "row_choice", "tokens_per_expert", "load", "aux_loss", "z_loss", "scores"):
    _field = _Deferred()
    _field.__set_name__(DeferredPlan, _name)
    setattr(DeferredPlan, _name, _field)


def read_free_plan(logits: Tensor, options: RoutingOptions, *, selection_bias: Tensor | None = None,
                   num_sequences: int | None = None) -> RoutingPlan:
    """The dropless top-k plan for router logits ``[T, E]`` (T >= 1) under ``options`` (top-k selection, dropless,
    one capacity over the call), without a host read (module docstring). selection_bias: ``[E]``
    (balance="bias"); num_sequences: B for ``aux_loss_type="sequence"``. No random 2nd expert (the layer keeps
    such calls off this path). Non-finite logits: a ``RuntimeError`` with the usual message, raised by the device
    (asynchronously on a GPU)."""
    k = options.k
    num_tokens, num_experts = check_logits(logits, k, read_free=True)
    scores = router_scores(logits, options.score_func)  # [T, E]
    expert_index, _ = select_experts(scores, k, selection_bias=selection_bias,
                                     num_expert_groups=options.num_expert_groups,
                                     num_limited_groups=options.num_limited_groups, ties=options.ties,
                                     read_free=True)  # [T, k]
    probs_topk, weight = routed_weights(scores, expert_index, normalize_weights=options.normalize_weights,
                                        route_scale=options.route_scale, dtype=logits.dtype,
                                        floor=options.score_func != "softmax")
    # [N] choice-major pairs p = choice * T + token in slot order, and their experts (sorted).
    sorted_expert, by_expert = sort_pairs_by_expert(expert_index)
    experts = torch.arange(num_experts, device=logits.device)
    ends = torch.searchsorted(sorted_expert, experts, right=True, out_int32=True)  # [E] row after expert e's last
    row_token = by_expert % num_tokens
    # take reads weight.t() ([k, T]) in its logical order: element p is weight[p % T, p // T], no copy.
    row_weight = torch.take(weight.t(), by_expert)
    grad_mode = torch.is_grad_enabled()

    def with_call_grad_mode(compute: Callable[[], Tensor]) -> Later:
        def run() -> Tensor:
            with torch.set_grad_enabled(grad_mode):
                return compute()
        return Later(run)

    counts = Later(lambda: count_per_expert(expert_index, num_experts, on_device=True))
    fields: dict[str, Any] = dict(
        expert_index=expert_index,
        slot=Later(lambda: assign_slots(expert_index, num_experts, on_device=True)[0]),
        weight=weight,
        probs_topk=probs_topk,
        row_token=row_token,
        row_choice=Later(lambda: torch.div(by_expert, num_tokens, rounding_mode="floor")),
        row_weight=row_weight,
        tokens_per_expert=counts,
        load=counts,
        host_counts=None,
        host_capacity=None,
        num_dropped=0,
        dropped_fraction=0.0,
        aux_loss=with_call_grad_mode(lambda: balance_loss(options.aux_loss_type, scores, expert_index,
                                                          score_func=options.score_func,
                                                          num_sequences=num_sequences)),
        z_loss=with_call_grad_mode(lambda: router_z_loss(logits,
                                                         scores if options.score_func == "softmax" else None)),
        scores=Later(scores.detach),
        expert_ends=ends,
    )
    plan = DeferredPlan(**fields)
    plan.row_experts = sorted_expert
    return plan
