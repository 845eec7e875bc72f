"""The fused experts (:mod:`flexmoe.experts.fused`) on a padded plan, as one ``torch.library`` custom op for
compiled training (docs/architecture.md, "Compiling the layer").

Eager training with many small experts gathers each expert's tokens, runs its FFN and adds the weighted output
into its tokens in one pass (:func:`flexmoe.experts.fused.fused_experts`), without the ``[N, M]`` dispatch and
combine buffers of the three-stage path. A compiled graph in capacity mode pads every expert to the capacity
and cannot read the per-expert counts on the host, so it kept the three stages over the padded rows. Here the
fused pass is ``flexmoe::padded_fused_experts``, opaque to dynamo and inductor (``fullgraph=True`` holds): it
receives the tokens, the padded plan's ``row_token`` / ``row_weight`` ``[N]`` and the real rows of each
(expert, sequence) unit as a device tensor (:func:`flexmoe.experts.padded_op.padded_unit_rows`), reads those on the
host (the op itself is not traced, only its fake shapes), and runs :func:`~flexmoe.experts.fused.fused_forward`
over each unit's real rows. What the backward needs (``pre1``, ``pre3``, ``h``) comes out as non-differentiable
outputs, one ``[capacity, H]`` piece per unit (:func:`flexmoe.experts.padded_op.unit_pieces`), their padding rows
never written nor read; the backward is a second custom op over :func:`~flexmoe.experts.fused.fused_backward`.
A compiled call whose counts are known only once routed (dropless) runs the same op over its plan's rows packed
(:data:`flexmoe.experts.padded_op.PACKED`), the counts again a device tensor the graph never reads.

Named activations with a closed-form derivative only (the op receives names), no clamp (GPT-OSS keeps the
three stages).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmoe.experts import activation_derivative, activation_name, resolve_activation
from flexmoe.experts.fused import Chunk, fused_backward, fused_forward, fused_size_rule
from flexmoe.experts.padded_op import (
    layout_op_runs,
    padded_segments,
    padding_ranges,
    plan_layout,
    register_op_pair,
    split_kept,
    unit_piece,
    unit_pieces,
)
from flexmoe.experts.weights import ExpertWeights
from flexmoe.routing.plan import RoutingPlan

__all__ = ["padded_chunks", "use_padded_fused", "padded_fused_experts"]

# A change to either op's signature needs a new name: inductor's on-disk cache keeps compiled graphs that call
# the op, and a stale one fails at run time ("expected Tensor()").
_OP = "flexmoe::padded_fused_experts"
_BACKWARD_OP = "flexmoe::padded_fused_experts_backward"
FUSED_DTYPES = (torch.float32,)  # where the fused experts were measured faster (eager and compiled)


def padded_chunks(unit_rows: list[int], capacity: int, num_experts: int) -> list[Chunk]:
    """The chunks (:func:`flexmoe.experts.fused.expert_chunks`' format) of a layout
    (:func:`flexmoe.experts.padded_op.padded_segments`, padded or packed): one per unit with rows."""
    return [(start, n, [(e, 0, n)]) for e, start, n in padded_segments(unit_rows, capacity, num_experts)]


def _weights(w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, w3: Tensor | None, b3: Tensor | None,
             activation: str) -> ExpertWeights:
    """The op's loose arguments (its schema takes tensors and names, not objects) as one value."""
    return ExpertWeights(w1, b1, w2, b2, w3, b3, resolve_activation(activation))


def _kept_views(pre1: list[Tensor], pre3: list[Tensor], h: list[Tensor], chunks: list[Chunk],
                capacity: int) -> list[Tensor]:
    """The real rows of each chunk (unit with rows) in the saved pieces: ``pre1, (pre3,) h`` each."""
    views: list[Tensor] = []
    for start, n, _ in chunks:
        views += [unit_piece(t, start, n, capacity) for t in ((pre1, pre3, h) if pre3 else (pre1, h))]
    return views


def _forward_impl(tokens: Tensor, row_token: Tensor, row_weight: Tensor, unit_rows: Tensor, capacity: int,
                  w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, w3: Tensor | None,
                  b3: Tensor | None, activation: str) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """-> ``(y [T, M], pre1, pre3, h)``: the last three in :func:`~flexmoe.experts.padded_op.unit_pieces` (pre3: none
    without gating), only the real rows written."""
    counts = unit_rows.tolist()
    chunks = padded_chunks(counts, capacity, w1.shape[0])
    units, num_rows, hidden = len(counts), row_token.shape[0], w1.shape[-1]
    pre1, h = (unit_pieces(units, capacity, num_rows, hidden, tokens) for _ in range(2))
    pre3 = unit_pieces(units, capacity, num_rows, hidden, tokens, w3 is not None)

    def kept_buffers(start: int, n: int) -> tuple[Tensor, Tensor | None, Tensor]:
        return (unit_piece(pre1, start, n, capacity), unit_piece(pre3, start, n, capacity) if pre3 else None,
                unit_piece(h, start, n, capacity))

    y, _ = fused_forward(tokens.contiguous(), row_token, row_weight, _weights(w1, b1, w2, b2, w3, b3, activation),
                         chunks, kept_buffers)
    return y, pre1, pre3, h


def _forward_fake(tokens: Tensor, row_token: Tensor, row_weight: Tensor, unit_rows: Tensor, capacity: int,
                  w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, w3: Tensor | None,
                  b3: Tensor | None, activation: str) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    units, num_rows, hidden = unit_rows.shape[0], row_token.shape[0], w1.shape[-1]
    return (tokens.new_empty(tokens.shape[0], w2.shape[-1]), unit_pieces(units, capacity, num_rows, hidden, tokens),
            unit_pieces(units, capacity, num_rows, hidden, tokens, w3 is not None),
            unit_pieces(units, capacity, num_rows, hidden, tokens))


def _backward_impl(grad_y: Tensor, tokens: Tensor, row_token: Tensor, row_weight: Tensor, unit_rows: Tensor,
                   capacity: int, w1: Tensor, w2: Tensor, b2: Tensor | None, w3: Tensor | None, pre1: list[Tensor],
                   pre3: list[Tensor], h: list[Tensor], activation: str, needs: list[bool]) -> list[Tensor]:
    """-> the gradients of ``tokens, row_weight, w1, b1, w2, b2, w3, b3`` (an empty tensor where ``needs`` is
    False); the padding rows of ``row_weight``'s gradient are zeros."""
    counts = unit_rows.tolist()
    chunks = padded_chunks(counts, capacity, w1.shape[0])
    grads = fused_backward(grad_y, tokens.contiguous(), row_token, row_weight,
                           _weights(w1, None, w2, b2, w3, None, activation), chunks,
                           _kept_views(pre1, pre3, h, chunks, capacity), needs)
    grad_weight = grads[1]
    if grad_weight is not None:
        for start, stop in padding_ranges(counts, capacity):
            grad_weight[start:stop].zero_()
    return [g if g is not None else tokens.new_empty(0) for g in grads]


def _backward_fake(grad_y: Tensor, tokens: Tensor, row_token: Tensor, row_weight: Tensor, unit_rows: Tensor,
                   capacity: int, w1: Tensor, w2: Tensor, b2: Tensor | None, w3: Tensor | None, pre1: list[Tensor],
                   pre3: list[Tensor], h: list[Tensor], activation: str, needs: list[bool]) -> list[Tensor]:
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    shapes = [tokens.shape, row_weight.shape, w1.shape, (num_experts, hidden), w2.shape, (num_experts, model_dim),
              w3.shape if w3 is not None else (0,), (num_experts, hidden)]
    return [tokens.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs)]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    tokens, row_token, row_weight, unit_rows, capacity, w1, b1, w2, b2, w3, b3, activation = inputs
    _, pre1, pre3, h = output
    ctx.save_for_backward(tokens, row_token, row_weight, unit_rows, w1, w2, b2, w3, *pre1, *pre3, *h)
    ctx.mark_non_differentiable(*pre1, *pre3, *h)  # saved for the backward; nothing flows back through them
    ctx.set_materialize_grads(False)  # else eager autograd zero-fills a gradient for every kept piece, unread
    ctx.capacity, ctx.activation, ctx.units, ctx.gated = capacity, activation, len(pre1), bool(pre3)
    ctx.present = (True, True, True, b1 is not None, True, b2 is not None, w3 is not None, b3 is not None)


def _backward(ctx: Any, grad_y: Tensor, *_grad_kept: Any) -> tuple[Tensor | None, ...]:
    tokens, row_token, row_weight, unit_rows, w1, w2, b2, w3, *kept = ctx.saved_tensors
    pre1, pre3, h = split_kept(kept, ctx.units, ctx.gated)
    wanted = [ctx.needs_input_grad[i] for i in (0, 2, 5, 6, 7, 8, 9, 10)]
    needs = [bool(want and present) for want, present in zip(wanted, ctx.present)]
    grads = torch.ops.flexmoe.padded_fused_experts_backward(grad_y, tokens, row_token, row_weight, unit_rows,
                                                             ctx.capacity, w1, w2, b2, w3, pre1, pre3, h,
                                                             ctx.activation, needs)
    g = [grad if need else None for grad, need in zip(grads, needs)]
    return g[0], None, g[1], None, None, g[2], g[3], g[4], g[5], g[6], g[7], None


register_op_pair(_OP, _forward_impl, _forward_fake, _BACKWARD_OP, _backward_impl, _backward_fake, _backward,
                 _setup_context)


def use_padded_fused(tokens: Tensor, plan: RoutingPlan, weights: ExpertWeights, size_rule: bool = True) -> bool:
    """Whether a compiled call's plan (padded, or any other laid out packed: :func:`~flexmoe.experts.padded_op.
    plan_layout`) runs :func:`padded_fused_experts`: the op is there, a named activation with a closed-form
    derivative and no clamp, autograd records, ``FUSED_DTYPES`` on the CPU, no autocast, and the sizes where
    eager's fused experts measured faster (:func:`~flexmoe.experts.fused.fused_size_rule` on the routed rows: at
    most ``T * k`` in a padded plan, whose padding is never computed, and the plan's ``N`` rows in a packed
    one, read from the shape so that no count reaches the host; ``size_rule`` False: at any size, the fused
    route forced)."""
    if not layout_op_runs(weights, tokens) or (plan.padded and plan.capacity < 1):
        return False  # layout_op_runs: the op is there, a named activation, no autocast
    if activation_derivative(weights.activation) is None or weights.glu_limit is not None:
        return False
    if not weights.needs_grad(tokens):
        return False
    if tokens.dtype not in FUSED_DTYPES or tokens.device.type != "cpu":
        return False
    if not weights.all_like(tokens):
        return False
    if not size_rule:
        return True
    routed_rows = min(sum(plan.counts), plan.num_tokens * plan.k) if plan.padded else plan.row_token.shape[0]
    return fused_size_rule(routed_rows, tokens.shape[-1])


def padded_fused_experts(tokens: Tensor, plan: RoutingPlan, weights: ExpertWeights) -> Tensor:
    """tokens: ``[T, M]`` -> ``[T, M]``, the weighted sum of each token's experts over a plan's layout (module
    docstring); where :func:`use_padded_fused` holds."""
    name = activation_name(weights.activation)
    assert name is not None  # checked by use_padded_fused
    unit_rows, capacity = plan_layout(plan)
    y, _, _, _ = torch.ops.flexmoe.padded_fused_experts(
        tokens, plan.row_token, plan.row_weight.to(tokens.dtype), unit_rows, capacity,
        *weights.tensors(), name)
    return y
