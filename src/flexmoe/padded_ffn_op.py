"""The built-in experts on a padded plan's rows, computing only the rows that hold tokens (docs/architecture.md,
"Compiling the layer").

Under ``torch.compile`` in capacity mode every (expert, sequence) unit has ``capacity`` rows, its real rows
first and padding after, so that no shape depends on the routing. Batched matmuls over ``[E, B*C, M]`` compute
the padding too. Here the experts' FFN is one ``torch.library`` custom op, ``flexmoe::padded_expert_ffn``,
opaque to dynamo and inductor (``fullgraph=True`` still holds): it receives the padded rows and the number of
real rows of each unit as a device tensor, reads that on the host (the op is not traced, only its
``register_fake`` shapes are), and runs :mod:`flexmoe.segment_ffn` over the real rows only; padding rows
output zeros. Its backward is a second custom op on the same functions.

Needs ``torch.library.custom_op`` (torch >= 2.4): :func:`padded_op_available` says whether it is there; the
layer otherwise keeps :meth:`flexmoe.experts.FeedForwardExperts.forward_padded`.
"""

from functools import partial
from typing import Any

import torch
from torch import Tensor

from flexmoe.experts import FeedForwardExperts, activation_name, hidden_unit, resolve_activation
from flexmoe.routing.plan import RoutingPlan
from flexmoe.segment_ffn import Segment, record_unit, segment_ffn_backward, segment_ffn_forward

__all__ = ["padded_op_available", "padded_unit_rows", "padded_segments", "padded_experts_forward"]

_OP = "flexmoe::padded_expert_ffn"
_BACKWARD_OP = "flexmoe::padded_expert_ffn_backward"


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


def padded_segments(unit_rows: list[int], capacity: int, num_experts: int) -> list[Segment]:
    """The segments (:mod:`flexmoe.segment_ffn`) of a padded layout: unit ``u = e * B + b`` starts at row
    ``u * capacity`` and holds ``unit_rows[u]`` real rows (units without rows left out)."""
    units_per_expert = len(unit_rows) // num_experts
    return [(u // units_per_expert, u * capacity, n) for u, n in enumerate(unit_rows) if n]


def _unit(activation: str, glu_limit: float | None) -> partial[Tensor]:
    return partial(hidden_unit, activation=resolve_activation(activation), glu_limit=glu_limit)


def _forward_impl(rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, b1: Tensor | None, w2: Tensor,
                  b2: Tensor | None, w3: Tensor | None, b3: Tensor | None, activation: str,
                  glu_limit: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """-> ``(out [N, M], pre1 [N, H], pre3 [N, H] or [0])``: the output and what the backward needs."""
    segments = padded_segments(unit_rows.tolist(), capacity, w1.shape[0])
    out, pre1, pre3, _ = segment_ffn_forward(rows.contiguous(), segments, w1, b1, w2, b2, w3, b3,
                                             _unit(activation, glu_limit), padded=True, record=False)
    return out, pre1, pre3 if pre3 is not None else rows.new_empty(0)


def _forward_fake(rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, b1: Tensor | None, w2: Tensor,
                  b2: Tensor | None, w3: Tensor | None, b3: Tensor | None, activation: str,
                  glu_limit: float | None) -> tuple[Tensor, Tensor, Tensor]:
    num_rows, hidden = rows.shape[0], w1.shape[-1]
    pre3 = rows.new_empty(num_rows, hidden) if w3 is not None else rows.new_empty(0)
    return rows.new_empty(num_rows, w2.shape[-1]), rows.new_empty(num_rows, hidden), pre3


def _backward_impl(grad_out: Tensor, rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, w2: Tensor,
                   w3: Tensor | None, pre1: Tensor, pre3: Tensor, activation: str, glu_limit: float | None,
                   needs: list[bool]) -> list[Tensor]:
    """-> the gradients of ``rows, w1, b1, w2, b2, w3, b3`` (an empty tensor where ``needs`` is False)."""
    segments = padded_segments(unit_rows.tolist(), capacity, w1.shape[0])
    recorded = record_unit(pre1, pre3 if w3 is not None else None, _unit(activation, glu_limit), functional=True)
    grads = segment_ffn_backward(grad_out.contiguous(), rows.contiguous(), segments, w1, w2, w3, recorded, needs,
                                 padded=True)
    return [g if g is not None else rows.new_empty(0) for g in grads]


def _backward_fake(grad_out: Tensor, rows: Tensor, unit_rows: Tensor, capacity: int, w1: Tensor, w2: Tensor,
                   w3: Tensor | None, pre1: Tensor, pre3: Tensor, activation: str, glu_limit: float | None,
                   needs: list[bool]) -> list[Tensor]:
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    shapes = [rows.shape, w1.shape, (num_experts, hidden), w2.shape, (num_experts, model_dim),
              w3.shape if w3 is not None else (0,), (num_experts, hidden)]
    return [rows.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs)]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    rows, unit_rows, capacity, w1, b1, w2, b2, w3, b3, activation, glu_limit = inputs
    _, pre1, pre3 = output
    ctx.save_for_backward(rows, unit_rows, w1, w2, w3, pre1, pre3)
    ctx.capacity, ctx.activation, ctx.glu_limit = capacity, activation, glu_limit
    ctx.present = (True, True, b1 is not None, True, b2 is not None, w3 is not None, b3 is not None)


def _backward(ctx: Any, grad_out: Tensor, _grad_pre1: Tensor,
              _grad_pre3: Tensor) -> tuple[Tensor | None, ...]:
    rows, unit_rows, w1, w2, w3, pre1, pre3 = ctx.saved_tensors
    wanted = (ctx.needs_input_grad[0], *ctx.needs_input_grad[3:9])
    needs = [bool(want and present) for want, present in zip(wanted, ctx.present)]
    grads = torch.ops.flexmoe.padded_expert_ffn_backward(grad_out, rows, unit_rows, ctx.capacity,
                                                          w1, w2, w3, pre1, pre3, ctx.activation,
                                                          ctx.glu_limit, needs)
    g = [grad if need else None for grad, need in zip(grads, needs)]
    return g[0], None, None, g[1], g[2], g[3], g[4], g[5], g[6], None, None


def _register() -> None:
    forward = torch.library.custom_op(_OP, _forward_impl, mutates_args=())
    forward.register_fake(_forward_fake)
    backward = torch.library.custom_op(_BACKWARD_OP, _backward_impl, mutates_args=())
    backward.register_fake(_backward_fake)
    torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)


if padded_op_available():
    _register()


def padded_experts_forward(experts: FeedForwardExperts, rows: Tensor, plan: RoutingPlan) -> Tensor:
    """rows: ``[N, M]`` laid out by a padded plan -> ``[N, M]``, the built-in experts' FFN on the real rows
    (padding rows: zeros, never combined) by the custom op where it runs: this torch has the API, the activation
    is one of the named ones (the op receives names, not callables), no autocast. Anywhere else the batched
    matmuls over every row, padding included (:meth:`FeedForwardExperts.forward_padded`)."""
    activation = activation_name(experts.activation)
    if (not padded_op_available() or activation is None or plan.capacity < 1
            or torch.is_autocast_enabled(rows.device.type)):
        num_experts = len(plan.counts)
        return experts.forward_padded(rows.view(num_experts, plan.counts[0], rows.shape[-1])).flatten(0, 1)
    out, _, _ = torch.ops.flexmoe.padded_expert_ffn(rows, padded_unit_rows(plan), plan.capacity, experts.w1,
                                                    experts.b1, experts.w2, experts.b2, experts.w3, experts.b3,
                                                    activation, experts.glu_limit)
    return out
