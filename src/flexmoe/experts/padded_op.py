"""The built-in experts on a padded plan's rows, computing only the rows that hold tokens (docs/architecture.md,
"Compiling the layer").

Under ``torch.compile`` in capacity mode every (expert, sequence) unit has ``capacity`` rows, its real rows
first and padding after, so that no shape depends on the routing. Batched matmuls over ``[E, B*C, M]`` compute
the padding too. Here the experts' FFN is one ``torch.library`` custom op, ``flexmoe::padded_experts``,
opaque to dynamo and inductor (``fullgraph=True`` still holds): it receives the padded rows and the number of
real rows of each unit as a device tensor, reads that on the host (the op is not traced, only its
``register_fake`` shapes are), and loops over the units' real rows only: each unit's matmuls and its
elementwise unit one after the other, written in place (``out=``, the matmul helpers of
:mod:`flexmoe.experts.segment_ffn`); padding rows output zeros and are never computed, not even elementwise. The
pre-activations and the unit's output, kept for the backward, come out as one piece per unit
(:func:`unit_pieces`). Its
backward is a second custom op, the same loop: the unit's derivative is the aten kernel eager autograd runs for
a named activation (no recomputation; the forward keeps the unit's output), ``torch.func.vjp`` of the gated
unit on that unit's rows.

The same op serves compiled calls whose counts are only known once routed (dropless, adaptive capacity): their
plan is not padded, its rows sorted by expert with ``tokens_per_expert[e]`` rows each, and the op receives that
device tensor with ``capacity = PACKED`` (0), the units back to back. The graph then never reads a count, so a
count that is 0 or 1 (which dynamo would specialize on, one recompilation per pattern) changes nothing.

Needs ``torch.library.custom_op`` (torch >= 2.4): :func:`padded_op_available` says whether it is there; the
layer otherwise keeps :func:`flexmoe.experts.row_kernels.padded_expert_ffn`.
"""

from collections.abc import Callable
from functools import partial
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from flexmoe.autograd_state import autocast_on
from flexmoe.experts import activation_derivative, activation_into, activation_name, resolve_activation
from flexmoe.experts.row_kernels import padded_expert_ffn
from flexmoe.experts.segment_ffn import Segment, expert_grad_buffer, linear_into, weight_grad_into
from flexmoe.experts.weights import ExpertWeights, hidden_unit
from flexmoe.routing.plan import RoutingPlan

__all__ = ["PACKED", "padded_op_available", "layout_op_runs", "padded_unit_rows", "plan_layout", "padded_segments",
           "padded_experts_forward"]

# A change to either op's signature needs a new name: inductor's on-disk cache keeps compiled graphs that call
# the op, and a stale one fails at run time ("expected Tensor()"). (flexmoe::padded_expert_ffn returned its
# saved tensors as [N, H] buffers.)
_OP = "flexmoe::padded_experts"
_BACKWARD_OP = "flexmoe::padded_experts_backward"

# The ``capacity`` of the packed layout: unit u's rows right after unit u - 1's (a padded layout of capacity 0 has
# no rows and never reaches an op).
PACKED = 0


def padded_op_available() -> bool:
    """Whether this torch has the custom-op API the op is built on (``torch.library.custom_op``, torch 2.4)."""
    return hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")


def padded_unit_rows(plan: RoutingPlan) -> Tensor:
    """``[E * B]`` long: the real rows of each (expert, sequence) unit of a padded plan, on its device.

    A kept pair sits at row ``unit * capacity + slot`` (``plan.pair_row``), every other pair at the spare row
    ``N``; counting pairs per ``row // capacity`` is a scatter-add into a static shape (nothing leaves the
    device, so the count traces into the graph)."""
    if not plan.padded or plan.pair_row is None or plan.capacity < 1:
        raise ValueError("padded_unit_rows needs a padded plan with capacity >= 1")
    num_units = sum(plan.counts) // plan.capacity
    unit = plan.pair_row.reshape(-1).div(plan.capacity, rounding_mode="floor")  # the spare row -> num_units
    ones = torch.ones_like(unit)
    return torch.zeros(num_units + 1, dtype=torch.long, device=unit.device).scatter_add_(0, unit, ones)[:num_units]


def plan_layout(plan: RoutingPlan) -> tuple[Tensor, int]:
    """``(unit_rows, capacity)`` of a plan's rows as the ops take them: a padded plan's units of ``capacity`` rows
    (:func:`padded_unit_rows`), else the packed layout, ``tokens_per_expert`` ``[E]`` with :data:`PACKED`. Neither
    reads a count on the host."""
    if plan.padded:
        return padded_unit_rows(plan), plan.capacity
    return plan.tokens_per_expert, PACKED


def padded_segments(unit_rows: list[int], capacity: int, num_experts: int) -> list[Segment]:
    """The segments (:mod:`flexmoe.experts.segment_ffn`) of a layout: unit ``u = e * B + b`` holds ``unit_rows[u]`` real
    rows starting at row ``u * capacity`` (padded) or right after unit ``u - 1``'s (:data:`PACKED`); units without
    rows left out."""
    units_per_expert = len(unit_rows) // num_experts
    starts = accumulate(unit_rows[:-1], initial=0) if capacity == PACKED else \
        (u * capacity for u in range(len(unit_rows)))
    return [(u // units_per_expert, start, n) for u, (start, n) in enumerate(zip(starts, unit_rows)) if n]


def _unit(activation: str, glu_limit: float | None) -> partial[Tensor]:
    return partial(hidden_unit, activation=resolve_activation(activation), glu_limit=glu_limit)


def padding_ranges(unit_rows: list[int], capacity: int) -> list[tuple[int, int]]:
    """The padding rows of a padded layout as ``(start, stop)`` row ranges, neighbours merged: unit ``u`` holds
    rows ``u * capacity .. (u + 1) * capacity - 1``, its ``unit_rows[u]`` real rows first. None when packed."""
    ranges: list[tuple[int, int]] = []
    if capacity == PACKED:
        return ranges
    for u, n in enumerate(unit_rows):
        start, stop = u * capacity + n, (u + 1) * capacity
        if start == stop:
            continue
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    return ranges


def unit_pieces(num_units: int, capacity: int, num_rows: int, hidden: int, like: Tensor,
                wanted: bool = True) -> list[Tensor]:
    """What a custom op keeps for its backward, ``[rows, H]``: one ``[capacity, H]`` piece per unit of a padded
    layout (none when not ``wanted``); pieces this small are reused by the allocator from call to call, while one
    ``[N, H]`` buffer (40 MiB at E=64, T=4096, k=8, cf=1.25) is mapped afresh and page-faults as it is written
    (measured: ~3% of the compiled step at E=8, H=1024, in the unit and the bias copies that first touch it).
    The packed layout, whose units' sizes the fake shapes cannot know, keeps one ``[num_rows, H]`` piece."""
    if not wanted:
        return []
    if capacity == PACKED:
        return [like.new_empty(num_rows, hidden)]
    return [like.new_empty(capacity, hidden) for _ in range(num_units)]


def unit_piece(pieces: list[Tensor], start: int, n: int, capacity: int) -> Tensor:
    """Rows ``start .. start + n`` (one unit's real rows) of a layout, in its :func:`unit_pieces`."""
    if capacity == PACKED:
        return pieces[0][start:start + n]
    return pieces[start // capacity][:n]


def split_kept(kept: list[Tensor], units: int, gated: bool) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The saved ``*pre1, *pre3, *h`` pieces (``units`` each, pre3 only when ``gated``) as three lists."""
    return kept[:units], (kept[units:2 * units] if gated else []), kept[-units:]


def _zero_rows(t: Tensor, ranges: list[tuple[int, int]]) -> None:
    for start, stop in ranges:
        t[start:stop].zero_()


def _forward_impl(rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, b1: Tensor | None, w2: Tensor,
                  b2: Tensor | None, w3: Tensor | None, b3: Tensor | None, activation: str,
                  glu_limit: float | None) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """-> ``(out [N, M], pre1, pre3, h)``: the output (zeros on padding rows) and what the backward needs, the
    pre-activations and the unit's output in :func:`unit_pieces` (pre3: none without gating), only the real rows
    written.

    Expert by expert over the real rows only, the matmuls and the elementwise unit of a unit's rows one after
    the other while they are in cache, each written into its place (``out=``)."""
    counts = unit_rows.tolist()
    segments = padded_segments(counts, capacity, w1.shape[0])
    rows = rows.contiguous()
    num_rows, hidden = rows.shape[0], w1.shape[-1]
    out = rows.new_empty(num_rows, w2.shape[-1])
    units = len(counts)
    pre1, h = (unit_pieces(units, capacity, num_rows, hidden, rows) for _ in range(2))
    pre3 = unit_pieces(units, capacity, num_rows, hidden, rows, w3 is not None)
    # The plain (not gated) unit written into h (its derivative: the aten kernel eager autograd runs).
    unit_into = activation_into(resolve_activation(activation)) if w3 is None else None
    unit = _unit(activation, glu_limit)
    for e, start, n in segments:
        x, p1, hu = rows[start:start + n], unit_piece(pre1, start, n, capacity), unit_piece(h, start, n, capacity)
        p3 = unit_piece(pre3, start, n, capacity) if w3 is not None else None
        linear_into(p1, x, w1[e], b1, e)
        if p3 is not None and w3 is not None:
            linear_into(p3, x, w3[e], b3, e)
        if unit_into is not None:
            unit_into(p1, hu)
        else:
            hu.copy_(unit(p1, p3))
        linear_into(out[start:start + n], hu, w2[e], b2, e)
    _zero_rows(out, padding_ranges(counts, capacity))
    return out, pre1, pre3, h


def _forward_fake(rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, b1: Tensor | None, w2: Tensor,
                  b2: Tensor | None, w3: Tensor | None, b3: Tensor | None, activation: str,
                  glu_limit: float | None) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    num_units, num_rows, hidden = unit_rows.shape[0], rows.shape[0], w1.shape[-1]
    return (rows.new_empty(num_rows, w2.shape[-1]), unit_pieces(num_units, capacity, num_rows, hidden, rows),
            unit_pieces(num_units, capacity, num_rows, hidden, rows, w3 is not None),
            unit_pieces(num_units, capacity, num_rows, hidden, rows))


def _backward_impl(grad_out: Tensor, rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, w2: Tensor,
                   w3: Tensor | None, pre1: list[Tensor], pre3: list[Tensor], h: list[Tensor], activation: str,
                   glu_limit: float | None, needs: list[bool]) -> list[Tensor]:
    """-> the gradients of ``rows, w1, b1, w2, b2, w3, b3`` (an empty tensor where ``needs`` is False).

    Expert by expert over the real rows, as the forward: ``grad_h`` of a unit's rows goes through the unit's
    derivative in place while in cache (a scratch buffer as large as the largest unit, reused), and every
    gradient is written into its full-size buffer (experts without rows: zeros; padding rows of ``rows``:
    zeros)."""
    need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = needs
    counts = unit_rows.tolist()
    segments = padded_segments(counts, capacity, w1.shape[0])
    grad_out, rows = grad_out.contiguous(), rows.contiguous()
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    active = sorted({e for e, _, _ in segments})

    def weight_buffer(like: Tensor | None, wanted: bool) -> Tensor | None:
        return expert_grad_buffer(like.shape, like, active, num_experts) if wanted and like is not None else None

    def bias_buffer(size: int, wanted: bool) -> Tensor | None:
        return expert_grad_buffer((num_experts, size), w1, active, num_experts) if wanted else None

    grad_w1, grad_b1 = weight_buffer(w1, need_w1), bias_buffer(hidden, need_b1)
    grad_w2, grad_b2 = weight_buffer(w2, need_w2), bias_buffer(model_dim, need_b2)
    grad_w3, grad_b3 = weight_buffer(w3, need_w3), bias_buffer(hidden, need_b3)
    grad_x = rows.new_empty(rows.shape) if need_x else None
    derivative = activation_derivative(resolve_activation(activation)) if w3 is None else None
    unit = _unit(activation, glu_limit)
    scratch = rows.new_empty(max((n for _, _, n in segments), default=0), hidden)
    seen: set[int] = set()
    for e, start, n in segments:
        span, first = slice(start, start + n), e not in seen
        seen.add(e)
        g, x, p1 = grad_out[span], rows[span], unit_piece(pre1, start, n, capacity)
        weight_grad_into(grad_w2, grad_b2, e, unit_piece(h, start, n, capacity), g, first)
        grad_h = torch.mm(g, w2[e].transpose(0, 1), out=scratch[:n])
        grad_pre3: Tensor | None = None
        if derivative is not None:
            grad_pre1 = grad_h
            derivative(grad_h, p1, grad_pre1)
        elif w3 is None:
            (grad_pre1,) = torch.func.vjp(lambda pre: unit(pre, None), p1)[1](grad_h)
        else:
            grad_pre1, grad_pre3 = torch.func.vjp(unit, p1, unit_piece(pre3, start, n, capacity))[1](grad_h)
        weight_grad_into(grad_w1, grad_b1, e, x, grad_pre1, first)
        if grad_pre3 is not None:
            weight_grad_into(grad_w3, grad_b3, e, x, grad_pre3, first)
        if grad_x is not None:
            torch.mm(grad_pre1, w1[e].transpose(0, 1), out=grad_x[span])
            if grad_pre3 is not None and w3 is not None:
                grad_x[span].addmm_(grad_pre3, w3[e].transpose(0, 1))
    if grad_x is not None:
        _zero_rows(grad_x, padding_ranges(counts, capacity))
    grads = [grad_x, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3]
    return [g if g is not None else rows.new_empty(0) for g in grads]


def _backward_fake(grad_out: Tensor, rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, w2: Tensor,
                   w3: Tensor | None, pre1: list[Tensor], pre3: list[Tensor], h: list[Tensor], activation: str,
                   glu_limit: float | None, needs: list[bool]) -> list[Tensor]:
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    shapes = [rows.shape, w1.shape, (num_experts, hidden), w2.shape, (num_experts, model_dim),
              w3.shape if w3 is not None else (0,), (num_experts, hidden)]
    return [rows.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs)]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    rows, unit_rows, capacity, w1, b1, w2, b2, w3, b3, activation, glu_limit = inputs
    _, pre1, pre3, h = output
    ctx.save_for_backward(rows, unit_rows, w1, w2, w3, *pre1, *pre3, *h)
    # What the backward needs rides out as outputs; nothing flows back through them, and left differentiable
    # autograd (and the compiled backward graph) would fill a zero gradient for each. Eager autograd still
    # materializes zeros for non-differentiable outputs unless told not to (measured: 9 ms of zero fills per
    # E=64 backward of the fused op).
    ctx.mark_non_differentiable(*pre1, *pre3, *h)
    ctx.set_materialize_grads(False)
    ctx.capacity, ctx.activation, ctx.glu_limit = capacity, activation, glu_limit
    ctx.units, ctx.gated = len(pre1), bool(pre3)
    ctx.present = (True, True, b1 is not None, True, b2 is not None, w3 is not None, b3 is not None)


def _backward(ctx: Any, grad_out: Tensor, *_grad_kept: Any) -> tuple[Tensor | None, ...]:
    rows, unit_rows, w1, w2, w3, *kept = ctx.saved_tensors
    pre1, pre3, h = split_kept(kept, ctx.units, ctx.gated)
    wanted = (ctx.needs_input_grad[0], *ctx.needs_input_grad[3:9])
    needs = [bool(want and present) for want, present in zip(wanted, ctx.present)]
    grads = torch.ops.flexmoe.padded_experts_backward(grad_out, rows, unit_rows, ctx.capacity, w1, w2, w3, pre1,
                                                       pre3, h, ctx.activation, ctx.glu_limit, needs)
    g = [grad if need else None for grad, need in zip(grads, needs)]
    return g[0], None, None, g[1], g[2], g[3], g[4], g[5], g[6], None, None


def register_op_pair(name: str, impl: Callable[..., Any], fake: Callable[..., Any], backward_name: str,
                     backward_impl: Callable[..., Any], backward_fake: Callable[..., Any],
                     backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
    """Register a custom op and its backward op (each with its fake, for tracing), and ``backward`` (which calls
    the backward op) as the op's autograd formula. Nothing is registered on a torch without the API."""
    if not padded_op_available():
        return
    forward_op = torch.library.custom_op(name, impl, mutates_args=())
    forward_op.register_fake(fake)
    backward_op = torch.library.custom_op(backward_name, backward_impl, mutates_args=())
    backward_op.register_fake(backward_fake)
    torch.library.register_autograd(name, backward, setup_context=setup_context)


register_op_pair(_OP, _forward_impl, _forward_fake, _BACKWARD_OP, _backward_impl, _backward_fake, _backward,
                 _setup_context)


def layout_op_runs(weights: ExpertWeights, rows: Tensor) -> bool:
    """Whether the op can compute experts of these weights on ``rows``: this torch has the API, the activation is
    one of the named ones (the op receives names, not callables), no autocast."""
    return (padded_op_available() and activation_name(weights.activation) is not None
            and not autocast_on(rows))


def padded_experts_forward(rows: Tensor, plan: RoutingPlan, weights: ExpertWeights) -> Tensor:
    """rows: ``[N, M]`` laid out by ``plan`` (:func:`plan_layout`: padded, or packed where
    :func:`layout_op_runs`) -> ``[N, M]``, the built-in experts' FFN on the real rows (padding rows: zeros, never
    combined) by the custom op where it runs. A padded plan anywhere else takes the batched matmuls over every
    row, padding included (:func:`flexmoe.experts.row_kernels.padded_expert_ffn`)."""
    activation = activation_name(weights.activation)
    if not layout_op_runs(weights, rows) or (plan.padded and plan.capacity < 1):
        if not plan.padded:
            raise ValueError("padded_experts_forward: an unpadded plan's rows need the op (layout_op_runs)")
        num_experts = len(plan.counts)
        return padded_expert_ffn(rows.view(num_experts, plan.counts[0], rows.shape[-1]), weights).flatten(0, 1)
    unit_rows, capacity = plan_layout(plan)
    out, _, _, _ = torch.ops.flexmoe.padded_experts(rows, unit_rows, capacity, *weights.tensors(), activation,
                                                    weights.glu_limit)
    return out
