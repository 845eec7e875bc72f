"""Decoding without a plan: an evaluation call of a few tokens computes only what its output needs
(docs/architecture.md, "Decoding").

Training and large calls build a :class:`~flexmoe.routing.RoutingPlan` (slots, capacity, losses). A decoding step
routes a few tokens, where the number of small ops, not the FLOPs, is the cost outside the experts: here the
rows are ordered on the host and combined by one gather, and the plan is built only when it is read. Which
calls take this path: :meth:`flexmoe.experts.stage.ExpertStage.serves_without_plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from flexmoe.dispatch import sum_choices_by_token, sum_rows_by_token
from flexmoe.experts.stage import ExpertStage
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.strategy import ExpertStrategy
from flexmoe.routing.build import build_plan
from flexmoe.routing.capacity import HOST_ORDER_MAX_PAIRS, count_per_expert, order_pairs_on_host, sort_pairs_by_expert
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan, check_logits, resolve_capacity
from flexmoe.routing.routers import route
from flexmoe.routing.scores import routed_weights, router_scores, select_experts

__all__ = ["DecodingLayer", "forward_without_plan", "router_input"]


@dataclass(frozen=True)
class DecodingLayer:
    """What a call without a plan reads of its layer, passed in (the layer builds one per call): its router,
    ``expert_bias`` (``[E]``, None unless balance="bias"), number of experts, expert stage, the call's expert
    strategy, and the shared experts and their gate (None without)."""

    router: nn.Module
    expert_bias: Tensor | None
    num_experts: int
    stage: ExpertStage
    strategy: ExpertStrategy
    shared: nn.Module | None = None
    shared_gate: nn.Module | None = None


def forward_without_plan(layer: DecodingLayer, tokens: Tensor, routing: RoutingOptions, parallel: ParallelOptions,
                         pinned: frozenset[str], num_sequences: int | None, replayed: Tensor | None = None,
                         ) -> tuple[Tensor, Callable[[], RoutingPlan], Tensor, Tensor] | None:
    """tokens: ``[T, M]`` -> ``([T, M], the plan's builder, the choices [T, k], their weights [T, k])`` (or None
    when an expert is over its capacity: the full path then drops the pairs), computing only what the output needs
    (the weights are the plan's ``weight``, in the router's dtype; docs/architecture.md,
    "Decoding"). replayed: ``[T, k]`` choices to take instead of the router's (routing replay).

    The same routing functions as :func:`~flexmoe.routing.plan.make_plan` pick the experts and weights, and
    the rows are in the plan's order (by expert, then slot), so the experts compute exactly the full path's
    rows. What only the plan holds (slots, losses) is left to :func:`build_plan`, run on this call's logits
    when ``last_plan``, ``aux_loss`` or ``z_loss`` is first read. Decoding's calls are a few tokens, where the
    number of small ops, not the FLOPs, is the cost outside the experts.
    """
    k = routing.k
    # [T, E]; evaluation: no exploration
    logits = route(layer.router, router_input(tokens, num_sequences), dtype=routing.router_dtype,
                   num_experts=layer.num_experts)
    num_tokens, num_experts = check_logits(logits, k)
    scores = router_scores(logits, routing.score_func)
    ranked = logits if routing.select_by == "logits" else scores
    expert_index = replayed if replayed is not None else select_experts(
        ranked, k, selection_bias=layer.expert_bias, num_expert_groups=routing.num_expert_groups,
        num_limited_groups=routing.num_limited_groups, ties=routing.ties)[0]  # [T, k]
    few_pairs = num_tokens * k <= HOST_ORDER_MAX_PAIRS
    if few_pairs:
        order = order_pairs_on_host(expert_index.tolist(), num_experts)
        counts = order.counts
    else:
        counts = count_per_expert(expert_index, num_experts).tolist()
    max_load = max(counts)
    if max_load > resolve_capacity(num_tokens, num_experts, k, routing.capacity_factor, routing.capacity,
                                   max_load):
        return None
    _, routing_weight = routed_weights(scores, expert_index, normalize_weights=routing.normalize_weights,
                                       route_scale=routing.route_scale, dtype=logits.dtype,
                                       softmax_of=logits if routing.score_func == "softmax" else None)  # [T, k]
    weight = routing_weight.to(tokens.dtype)
    scaled = routing.score_at == "dispatch"
    if few_pairs:
        row_token, pair_row, by_expert = order.index_tensors(tokens.device, with_row_pair=True)
    else:
        _, by_expert = sort_pairs_by_expert(expert_index)  # [T*k] choice-major pairs in row order
        row_token = by_expert % num_tokens
    rows = tokens.index_select(0, row_token)  # [N, M] sorted by expert
    if scaled:
        rows = rows * weight.t().reshape(-1).index_select(0, by_expert).unsqueeze(-1)
    out = layer.stage.run_rows(rows, counts, parallel, pinned, layer.strategy)
    combine_weight = None if scaled else weight.to(out.dtype)
    # In half precision (bf16 experts, autocast) each weighted row is rounded before a sum that rounds at each
    # add, as the full path's combine and HF's blocks do; embedding_bag would add in float32 and round once.
    if few_pairs and out.dtype not in (torch.float16, torch.bfloat16):
        y = sum_choices_by_token(out, pair_row, combine_weight, num_tokens)
    else:
        row_weight = None if combine_weight is None else \
            combine_weight.t().reshape(-1).index_select(0, by_expert)
        y = sum_rows_by_token(out, row_token, row_weight, num_tokens)
    if layer.shared is not None:
        y = y + layer.stage.shared_output(tokens, layer.shared, layer.shared_gate).to(y.dtype)
    # The bias as it was for this call (a later update must not change what this call's plan says).
    bias = None if layer.expert_bias is None else layer.expert_bias.clone()
    return y, partial(build_plan, logits, routing, selection_bias=bias, num_sequences=num_sequences,
                      expert_index=replayed), expert_index, routing_weight


def router_input(tokens: Tensor, num_sequences: int | None) -> Tensor:
    """What the router sees: the tokens ``[T, M]``, or ``[B, S, M]`` when the routing is per sequence (a router
    module that reads the sequences, as Switch's in ``transformers``, gets them; the linear gate is the same)."""
    return tokens if num_sequences is None else tokens.view(num_sequences, -1, tokens.shape[-1])
