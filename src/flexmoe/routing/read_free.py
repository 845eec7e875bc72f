"""The dropless top-k plan without a host read: the plan of the path a GPU takes (docs/architecture.md, "Expert
compute").

On a GPU every value the host reads from the device stalls the stream, and every operation is a kernel launch.
:func:`read_free_plan` builds the dropless :class:`~flexmoe.routing.RoutingPlan` of a top-k call with neither:

* the finiteness of the logits is asserted on the device (``torch._assert_async``), not read;
* the rows are the pairs in slot order by one stable sort (``N = T * k``, known before routing), and the row
  after each expert's last (``expert_ends``, ``[E]`` int32, the offsets ``torch._grouped_mm`` takes) by one
  ``searchsorted`` of the sorted experts: no ``bincount`` (whose output size is a value), no ``tolist``;
* what the call's output does not need is computed when first read (:class:`DeferredPlan`): the rows and their
  ends (a call of few rows on gathered weights runs the pairs in token order and never sorts them), the slots,
  each row's choice, the counts per expert, the balance loss and the z-loss. A training loop that reads
  ``aux_loss`` gets the same differentiable value as the eager plan's (computed under the call's grad mode);
  a call whose losses nobody reads never launches them. ``counts`` and ``capacity`` still read the device, when
  a caller asks for them.

The plan is the same as :func:`~flexmoe.routing.plan.make_plan`'s (dropless): the same choices, weights, rows in
the same order, the same losses. Capacity mode takes the padded plan instead (``make_plan(..., padded=True,
read_free=True)``), every expert ``capacity`` rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmoe.routing.capacity import assign_slots, count_per_expert, sort_pairs_by_expert
from flexmoe.routing.losses import balance_loss, router_z_loss
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan, check_logits
from flexmoe.routing.scores import (
    check_select_by,
    routed_weights,
    router_scores,
    select_experts,
    softmax_dtype,
    softmax_of_chosen,
    top_k,
    topk_weights,
)

__all__ = ["PlanSources", "DeferredPlan", "read_free_plan"]


class _Deferred:
    """A field of :class:`DeferredPlan` computed when first read: the plan's sources give the value, kept in the
    plan's ``__dict__``, where later reads find it without this descriptor (which has no ``__set__``, as
    ``functools.cached_property``: a small call reads each field without a Python frame). ``rows``: one of the
    row fields, which the sources fill together (:meth:`PlanSources.fill_rows`: one sort for all)."""

    def __init__(self, rows: bool = False) -> None:
        self.rows = rows

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, plan: Any, owner: type | None = None) -> Any:
        if plan is None:
            return self
        if self.rows:
            plan.sources.fill_rows(plan.__dict__)
            return plan.__dict__[self.name]
        value = plan.__dict__[self.name] = getattr(plan.sources, self.name)()
        return value


class PlanSources:
    """What a read-free plan's deferred fields are computed from, and how (one method per field): the choices
    ``expert_index`` and weights ``weight`` ``[T, k]``, the logits and their scores ``[T, E]`` (None: computed
    when first needed, for a plan whose pick and weights did without them), under the call's grad mode (a loss
    read after the call is as differentiable as the eager plan's)."""

    def __init__(self, logits: Tensor, scores: Tensor | None, expert_index: Tensor, weight: Tensor,
                 options: RoutingOptions, num_sequences: int | None) -> None:
        self.logits, self._scores, self.expert_index, self.weight = logits, scores, expert_index, weight
        self.options, self.num_sequences = options, num_sequences
        self.grad_mode = torch.is_grad_enabled()
        self._counts: Tensor | None = None
        self._sorted: tuple[Tensor, Tensor] | None = None

    def all_scores(self) -> Tensor:
        """The scores ``[T, E]`` of every expert (the call's, or computed now under the call's grad mode)."""
        if self._scores is None:
            with torch.set_grad_enabled(self.grad_mode):
                self._scores = router_scores(self.logits, self.options.score_func)
        return self._scores

    def _sorted_pairs(self) -> tuple[Tensor, Tensor]:
        """``(sorted_expert, by_expert)``, ``[N]`` each (:func:`~flexmoe.routing.capacity.sort_pairs_by_expert`):
        one sort for every row field."""
        if self._sorted is None:
            self._sorted = sort_pairs_by_expert(self.expert_index)
        return self._sorted

    def fill_rows(self, fields: dict[str, Any]) -> None:
        """Write the plan's row fields into ``fields`` (its ``__dict__``), the ones not set yet: ``row_expert``
        (sorted), ``row_token``, ``row_weight`` ``[N]`` and ``expert_ends`` ``[E]`` int32, the row after expert
        e's last (the offsets ``torch._grouped_mm`` takes, with no count read)."""
        sorted_expert, by_expert = self._sorted_pairs()
        num_tokens = self.expert_index.shape[0]
        fields.setdefault("row_expert", sorted_expert)
        if "row_token" not in fields:
            fields["row_token"] = by_expert % num_tokens
        if "row_weight" not in fields:
            # take reads weight.t() ([k, T]) in its logical order: element p is weight[p % T, p // T], no copy.
            fields["row_weight"] = torch.take(self.weight.t(), by_expert)
        if "expert_ends" not in fields:
            experts = torch.arange(self.logits.shape[1], device=sorted_expert.device)
            fields["expert_ends"] = torch.searchsorted(sorted_expert, experts, right=True, out_int32=True)

    def slot(self) -> Tensor:
        return assign_slots(self.expert_index, self.logits.shape[1], on_device=True)[0]

    def row_choice(self) -> Tensor:
        return torch.div(self._sorted_pairs()[1], self.expert_index.shape[0], rounding_mode="floor")

    def tokens_per_expert(self) -> Tensor:
        if self._counts is None:  # one tensor for tokens_per_expert and load
            self._counts = count_per_expert(self.expert_index, self.logits.shape[1], on_device=True)
        return self._counts

    load = tokens_per_expert

    def aux_loss(self) -> Tensor:
        with torch.set_grad_enabled(self.grad_mode):
            return balance_loss(self.options.aux_loss_type, self.all_scores(), self.expert_index,
                                score_func=self.options.score_func, num_sequences=self.num_sequences)

    def z_loss(self) -> Tensor:
        with torch.set_grad_enabled(self.grad_mode):
            softmax = self.options.score_func == "softmax"
            return router_z_loss(self.logits, self.all_scores() if softmax else None)

    def scores(self) -> Tensor:
        return self.all_scores().detach()

    def probs_topk(self) -> Tensor:
        """The chosen experts' scores ``[T, k]``, in the logits' dtype (as the eager plan's)."""
        with torch.set_grad_enabled(self.grad_mode):
            chosen = self.all_scores().gather(1, self.expert_index)
            return chosen if chosen.dtype == self.logits.dtype else chosen.to(self.logits.dtype)


class DeferredPlan(RoutingPlan):
    """A :class:`~flexmoe.routing.RoutingPlan` whose fields below are computed by its ``sources``
    (:class:`PlanSources`) when first read, then kept; ``row_expert`` is the sorted experts (no host read)."""

    sources: PlanSources

    def add_load_to(self, total: Tensor) -> None:
        """``total += load``; while nobody read ``load``, counted straight into ``total`` (one scatter-add, where
        making ``load`` first and adding it takes three operations more). Every pair counts: no skipped pairs."""
        if "load" not in self.__dict__:
            flat = self.expert_index.reshape(-1)
            total.scatter_add_(0, flat, torch.ones_like(flat, dtype=total.dtype))
        else:
            super().add_load_to(total)


# Set on the subclass only: the plain RoutingPlan (the compiled paths trace it) keeps plain attributes.
_DEFERRED_FIELDS = ("slot", "row_choice", "tokens_per_expert", "load", "aux_loss", "z_loss", "scores",
                    "probs_topk")
_ROW_FIELDS = ("row_token", "row_weight", "expert_ends", "row_expert")
for _name in _DEFERRED_FIELDS + _ROW_FIELDS:
    _field = _Deferred(rows=_name in _ROW_FIELDS)
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
    if selection_bias is not None:  # the options allow none with select_by="logits"; a caller may pass one
        check_select_by(options.select_by, True, options.num_expert_groups)
    softmax = options.score_func == "softmax"
    renormalised = softmax and options.normalize_weights and k > 1
    fields: dict[str, Any] = {}  # probs_topk where computed on the way, else deferred
    if options.select_by == "logits" and renormalised:
        # GPT-OSS's router: the top-k of the logits, the weights the softmax of those k (their values, with their
        # gradient). Nothing needs the scores of all E experts: the plan computes them if a loss is read.
        scores = None
        chosen_logits, expert_index = top_k(logits, k, options.ties, read_free=True)  # [T, k] each
        weight = softmax_of_chosen(chosen_logits, softmax_dtype(logits.dtype), options.route_scale, logits.dtype)
    else:
        scores = router_scores(logits, options.score_func)  # [T, E]
        ranked = logits if options.select_by == "logits" else scores
        if selection_bias is None and options.num_expert_groups is None and ranked is scores:
            # The chosen scores are the top-k's values (the same elements, with their gradient): no gather.
            chosen, expert_index = top_k(scores, k, options.ties, read_free=True)  # [T, k] each
            if renormalised:
                # The same weights as make_plan's, by the same operations (routed_weights).
                weight = softmax_of_chosen(logits.gather(1, expert_index), scores.dtype, options.route_scale,
                                           logits.dtype)
                fields["probs_topk"] = chosen if chosen.dtype == logits.dtype else chosen.to(logits.dtype)
            else:
                fields["probs_topk"], weight = topk_weights(
                    chosen, normalize_weights=options.normalize_weights, route_scale=options.route_scale,
                    dtype=logits.dtype, floor=not softmax)
        else:
            expert_index, _ = select_experts(ranked, k, selection_bias=selection_bias,
                                             num_expert_groups=options.num_expert_groups,
                                             num_limited_groups=options.num_limited_groups, ties=options.ties,
                                             read_free=True)  # [T, k]
            fields["probs_topk"], weight = routed_weights(
                scores, expert_index, normalize_weights=options.normalize_weights, route_scale=options.route_scale,
                dtype=logits.dtype, floor=not softmax, softmax_of=logits if softmax else None)
    plan = DeferredPlan.__new__(DeferredPlan)
    # The fields written straight into the instance: the dataclass __init__ and the fields' descriptors cost a
    # small call measurable host time, and every field is set below or deferred (RoutingPlan has no
    # __post_init__).
    plan.__dict__.update(
        expert_index=expert_index, weight=weight, host_counts=None, host_capacity=None,
        num_dropped=0, dropped_fraction=0.0, num_skipped=0, kind="topk", padded=False, pair_row=None,
        sources=PlanSources(logits, scores, expert_index, weight, options, num_sequences), **fields)
    return plan
