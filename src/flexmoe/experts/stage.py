"""The expert stage of a :class:`~flexmoe.MoELayer` call: dispatch -> experts -> combine (docs/architecture.md,
"The data path", "Expert compute").

One call takes one of three routes, decided here so that ``MoELayer.forward`` reads as its five stages:

* fused: dispatch, the experts and combine expert by expert in one autograd node (:mod:`flexmoe.experts.fused`;
  compiling, the custom op of :mod:`flexmoe.experts.padded_fused_op`);
* token exchange: expert parallelism sending each token once per rank (:mod:`flexmoe.parallel.token_exchange`);
* rows: dispatch, the experts over rows sorted by expert (the call's strategy, whose built-in experts run the
  kernel their :class:`~flexmoe.experts.chooser.KernelChooser` picks; compiling, the custom ops that read the
  counts on the device), combine.

Functions of the layer, not methods: each reads the layer's modules and options and writes what it reports
after a call (``last_choice``, ``last_shadowed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.chooser import timed_run
from flexmoe.experts.fused import fused_experts, fused_supported
from flexmoe.experts.grouped_op import grouped_experts_ffn, uses_device_offsets
from flexmoe.experts.kernels import route_bucket
from flexmoe.experts.padded_fused_op import padded_fused_experts, use_padded_fused
from flexmoe.experts.padded_op import layout_op_runs, padded_experts_forward, padded_op_available
from flexmoe.parallel.options import ParallelOptions
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan

if TYPE_CHECKING:
    from flexmoe.layer import MoELayer

__all__ = ["run_expert_stage", "run_experts", "in_expert_dtype", "shared_output", "by_layout",
           "counts_on_device", "padded_layout"]


def run_expert_stage(layer: MoELayer, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                     parallel: ParallelOptions, pinned: frozenset[str]) -> Tensor:
    """tokens: ``[T, M]`` -> ``[T, M]``, each token's weighted sum over its experts (or, ``score_at="dispatch"``,
    the plain sum of its experts' outputs on weighted rows), by the route this call takes (module docstring)."""
    if runs_fused(layer, tokens, plan, routing, parallel, pinned):
        return run_fused(layer, tokens, plan)
    sent = exchange_tokens(layer, tokens, plan, routing, parallel, pinned)
    if sent is not None:
        return sent
    return rows_route(layer, tokens, plan, routing, parallel, pinned)


def rows_route(layer: MoELayer, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
               parallel: ParallelOptions, pinned: frozenset[str]) -> Tensor:
    """The three stages one after another: dispatch ``[N, M]``, the experts, combine -> ``[T, M]``."""
    expert_input = dispatch(tokens, plan, scale=routing.score_at == "dispatch")  # [N, M] by expert
    # Counts left on the device (compiling, dropless) are read there by the experts' custom ops only.
    counts = [] if plan.host_counts is None else plan.counts
    expert_output = run_experts(layer, expert_input, counts, parallel, pinned,
                                plan if by_layout(layer, plan, expert_input) else None)  # [N, M]
    return combine(expert_output, plan, weighted=routing.score_at == "combine")


def runs_fused(layer: MoELayer, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
               parallel: ParallelOptions, pinned: frozenset[str]) -> bool:
    """Whether dispatch, the experts and combine run fused, expert by expert (:mod:`flexmoe.experts.fused`):
    the built-in experts, all in this process, weights applied at combine, training
    (:func:`~flexmoe.experts.fused.fused_supported`), and the experts' kernel chooser measured it faster than the
    three stages for this call's bucket (:meth:`~flexmoe.experts.chooser.KernelChooser.choose_route`, forward
    timings). Compiling,
    by the custom op of :mod:`flexmoe.experts.padded_fused_op` (over a padded plan, or any other packed) where
    :func:`~flexmoe.experts.padded_fused_op.use_padded_fused` holds."""
    experts = layer._built_experts
    if not isinstance(experts, FeedForwardExperts) or layer.ep_group.distributed or routing.score_at != "combine":
        return False
    if plan.padded or torch.compiler.is_compiling():
        return not grouped_on_device(layer, plan, tokens) and use_padded_fused(tokens, plan, experts.weights())
    weights = experts.weights()
    if not any(plan.counts) or not fused_supported(tokens, weights):  # no rows: nothing to fuse, nothing to time
        return False
    bucket = route_bucket(tokens, plan.row_token.shape[0], weights)
    # The rows route's kernel first, so that its timing is not timed. Only where timing may happen: elsewhere (a
    # checkpointed forward) the dispatch made for it would be saved, unlike in the recomputation, which knows
    # the bucket by then.
    if experts.kernels.known(bucket) is None and experts.kernels.may_time():
        experts.kernels.prepare(dispatch(tokens, plan), plan.counts, weights)
    # The routes are timed forward only (autograd recording): a whole step each would make a cold cache's first
    # call of a large layer cost three steps; the forward pays the same [N, M] blocks the backward does.
    routes = {"fused": timed_run(lambda t: run_fused(layer, t, plan), tokens, weights, backward=False),
              "rows": timed_run(lambda t: rows_route(layer, t, plan, routing, parallel, pinned), tokens, weights,
                                backward=False)}
    return experts.kernels.choose_route(bucket, routes, rule="rows") == "fused"


def run_fused(layer: MoELayer, tokens: Tensor, plan: RoutingPlan) -> Tensor:
    """tokens: ``[T, M]`` -> ``[T, M]``, the weighted sum of each token's experts (:func:`fused_experts`)."""
    e = layer._built_experts
    assert isinstance(e, FeedForwardExperts)  # checked by runs_fused
    layer.last_choice, layer.last_shadowed = layer.strategy.last_choice, []

    def fused(x: Tensor) -> Tensor:
        if plan.padded or torch.compiler.is_compiling():
            return padded_fused_experts(x, plan, e.weights())
        return fused_experts(x, plan.row_token, plan.row_weight.to(x.dtype), plan.counts, e.weights())

    if autocast_off_for_experts(layer, tokens):
        with torch.autocast(tokens.device.type, enabled=False):
            return fused(tokens.to(e.w1.dtype)).to(tokens.dtype)
    return fused(tokens)


def exchange_tokens(layer: MoELayer, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                     parallel: ParallelOptions, pinned: frozenset[str]) -> Tensor | None:
    """tokens: ``[T, M]`` -> ``[T, M]`` when this call's strategy sends each token once per rank instead of
    one row per (token, expert) pair (:mod:`flexmoe.parallel.token_exchange`; expert parallelism at r = 1,
    d = 1, weights applied at combine); None: the call dispatches rows."""
    if layer._ep is None or plan.padded or routing.score_at != "combine":
        return None
    strategy = layer.strategy_of(parallel)

    def rows_path(tokens_in: Tensor, run_rows: Callable[[Tensor], Tensor]) -> Tensor:
        out = in_expert_dtype(layer, run_rows, dispatch(tokens_in, plan))  # [N, M] by expert
        return combine(out, plan)

    y = strategy.run_tokens(tokens, plan.row_token, plan.row_weight, plan.counts, parallel, pinned, rows_path)
    if y is not None:
        layer.last_choice, layer.last_shadowed = strategy.last_choice, list(strategy.last_shadowed)
    return y


def by_layout(layer: MoELayer, plan: RoutingPlan, rows: Tensor) -> bool:
    """Whether the built-in experts compute ``rows`` (``[N, M]``, dispatched by ``plan``) by the custom op of
    :mod:`flexmoe.experts.padded_op`, which reads the counts on the device: always for a padded plan, and while
    compiling for any other in one process (dropless, adaptive capacity, expert choice, BASE), whose counts
    then never reach the graph. Traced as Python ints instead, every count that is 0 or 1 is a value dynamo
    specializes on: with many experts nearly every call recompiled, until dynamo's limit sent the rest of
    the forward back to eager (docs/architecture.md, "Compiling the layer")."""
    if plan.padded or plan.host_counts is None:  # host_counts None: the counts are on the device only
        return True
    experts = layer._built_experts
    return (torch.compiler.is_compiling() and isinstance(experts, FeedForwardExperts)
            and not layer.ep_group.distributed and layout_op_runs(experts.weights(), rows))


def counts_on_device(layer: MoELayer, routing: RoutingOptions, tokens: Tensor) -> bool:
    """Whether this call's plan keeps its counts on the device: under ``torch.compile``, dropless top-k routing
    in one process with every pair kept (no random 2nd expert in training) and one capacity over the call
    (``capacity_per="call"``: a per-sequence one is the largest count of a sequence), the built-in experts
    run by the custom op that reads the counts on the device (:func:`by_layout`; the matmuls alone,
    :mod:`flexmoe.experts.grouped_op`, for a callable activation or under autocast). Every shape is then known
    before routing (``N = T * k``) and no routed value reaches the host: the call compiles into one graph
    (docs/architecture.md, "Compiling the layer")."""
    return (torch.compiler.is_compiling() and routing.selection == "topk" and layer.topology is None
            and not layer.ep_group.distributed and routing.capacity is None
            and routing.static_capacity_factor == 0 and routing.capacity_per == "call"
            and not (routing.second_expert == "random" and layer.training)
            and isinstance(layer.experts, FeedForwardExperts) and padded_op_available())


def padded_layout(layer: MoELayer, routing: RoutingOptions, tokens: Tensor) -> bool:
    """Whether this call pads every expert's rows to the capacity: under ``torch.compile``, in capacity mode,
    for top-k routing in one process (docs/architecture.md, "Compiling the layer"). Every shape is then static
    and no routed value reaches the host, so the call compiles into one graph. Eager calls never pad: they
    compute only the rows that hold tokens.

    On the CPU only, for now: on CUDA (an H200, torch 2.11) the compiled padded call's backward gave zero
    gradients (tests/test_compile.py, under make test-gpu; docs/performance.md, "CUDA"), so there a compiled
    capacity-mode call takes the unpadded path, which breaks the graph where the counts reach the host."""
    return (torch.compiler.is_compiling() and tokens.device.type == "cpu" and routing.selection == "topk"
            and layer.topology is None and not layer.ep_group.distributed
            and (routing.capacity is not None or routing.capacity_factor > 0))


def run_experts(layer: MoELayer, rows: Tensor, counts: list[int], options: ParallelOptions,
                 pinned: frozenset[str], layout_plan: RoutingPlan | None = None) -> Tensor:
    """rows: ``[N, M]`` sorted by global expert -> ``[N, M]`` in rows' dtype, by this call's strategy.

    layout_plan: the rows are this plan's, computed by the built-in experts' custom op
    (:func:`flexmoe.experts.padded_op.padded_experts_forward`, :func:`by_layout`): only the real rows; a plan
    with its counts on the device whose unit the op cannot take, by the grouped matmuls of
    :func:`flexmoe.experts.grouped_op.grouped_experts_ffn`."""
    strategy = layer.strategy_of(options)
    experts = layer._built_experts

    def run(expert_rows: Tensor) -> Tensor:
        if layout_plan is not None and isinstance(experts, FeedForwardExperts):
            weights = experts.weights()
            if layout_plan.host_counts is None and (not layout_op_runs(weights, expert_rows)
                                                    or grouped_on_device(layer, layout_plan, expert_rows)):
                # Counts on the device, and a unit the op cannot take by name (a callable, autocast) or a
                # device where torch's grouped GEMM reads them there (the op would read them on the host).
                return grouped_experts_ffn(expert_rows, layout_plan.tokens_per_expert, weights)
            return padded_experts_forward(expert_rows, layout_plan, weights)
        return strategy.run(expert_rows, counts, options, pinned)

    out = in_expert_dtype(layer, run, rows)
    layer.last_choice, layer.last_shadowed = strategy.last_choice, list(strategy.last_shadowed)
    return out


def grouped_on_device(layer: MoELayer, plan: RoutingPlan, rows: Tensor) -> bool:
    """Whether a plan with its counts on the device runs the experts' matmuls by ``torch._grouped_mm`` with
    device offsets (:func:`flexmoe.experts.grouped_op.uses_device_offsets`: off the CPU, bf16), so that no count
    reaches the host: not by the custom ops, which read them there (docs/architecture.md, "Compiling the
    layer")."""
    experts = layer._built_experts
    if plan.host_counts is not None or not isinstance(experts, FeedForwardExperts):
        return False
    device_type = rows.device.type
    autocast = torch.is_autocast_enabled(device_type) and layer.expert_options.experts_autocast
    dtype = torch.get_autocast_dtype(device_type) if autocast else experts.w1.dtype
    return all(uses_device_offsets(device_type, dtype, w.shape) for w in (experts.w1, experts.w2))


def in_expert_dtype(layer: MoELayer, run: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    """``run(rows)`` in the experts' dtype, returned in rows' dtype: a float32 layer fed bf16 activations (or
    the reverse) computes in its parameters' dtype (under autocast, as autocast says, unless the layer's
    ``experts_autocast`` is False: autocast is then off around the experts, which compute in their parameters'
    dtype as without it)."""
    expert_dtype = parameter_dtype(layer._built_experts)
    if expert_dtype is not None and autocast_off_for_experts(layer, rows):
        with torch.autocast(rows.device.type, enabled=False):
            return run(rows.to(expert_dtype)).to(rows.dtype)
    if expert_dtype is None or torch.is_autocast_enabled(rows.device.type) or expert_dtype == rows.dtype:
        return run(rows)
    return run(rows.to(expert_dtype)).to(rows.dtype)


def autocast_off_for_experts(layer: MoELayer, rows: Tensor) -> bool:
    """Whether autocast is on for ``rows``' device and the layer's ``experts_autocast`` turns it off around its
    routed experts (ExpertOptions)."""
    return torch.is_autocast_enabled(rows.device.type) and not layer.expert_options.experts_autocast


def shared_output(layer: MoELayer, tokens: Tensor) -> Tensor:
    """tokens: ``[T, M]`` -> ``[T, M]``, the sum of the shared experts' outputs (every token through each)."""
    shared = layer.shared
    assert shared is not None  # forward calls this only for a layer with shared experts
    n, num_tokens = layer.expert_options.shared_experts, tokens.shape[0]
    rows = tokens.repeat(n, 1) if n > 1 else tokens  # [n*T, M]: all tokens for shared expert 0, then 1, ...
    dtype = parameter_dtype(shared)
    if not torch.is_autocast_enabled(tokens.device.type) and dtype is not None and dtype != rows.dtype:
        rows = rows.to(dtype)  # as for the routed experts: compute in the parameters' dtype
    out = shared(rows, [num_tokens] * n).view(n, num_tokens, layer.model_dim).sum(0)
    return out if layer.shared_gate is None else layer.shared_gate(tokens, out)


def parameter_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
