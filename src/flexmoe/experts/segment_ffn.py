"""The experts' FFN over row segments, with a hand-written backward (docs/architecture.md, "Expert compute").

Each expert computes ``unit(x w1 + b1, x w3 + b3) w2 + b2`` on its rows. The rows of one call are laid out as
*segments*, ``(expert, first row, rows)``, back to back, one per expert that has rows. (The compiled padded
layout, with padding rows between segments, has its own loop in :mod:`flexmoe.experts.padded_op`, which calls the
matmul helpers here.)

Autograd through the plain per-expert loop records a dozen nodes per expert (split and unbind views, two
``addmm`` and their bias sums, the activation, the ``cat``) and its backward stacks all E weight gradients and
concatenates the row gradients. Here forward and backward are one node: every matmul writes straight into a
full-size buffer (``out=``), the elementwise unit runs once over all rows, and its derivative comes from
autograd on that elementwise call only, so any activation callable works (the gated unit, GPT-OSS's clamp).

This module needs only torch and :class:`~flexmoe.experts.weights.ExpertWeights`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from flexmoe.experts.weights import ExpertWeights

__all__ = ["Unit", "Segment", "RecordedUnit", "contiguous_segments", "segment_ffn_forward", "record_unit",
           "segment_ffn_backward", "segment_expert_ffn", "addmm_into", "linear_into", "add_weight_grad",
           "add_bias_grad", "weight_grad_into", "expert_grad_buffer"]

Unit = Callable[[Tensor, "Tensor | None"], Tensor]  # (pre1 [n, H], pre3 [n, H] or None) -> h [n, H], elementwise
Segment = tuple[int, int, int]  # (expert, first row, number of rows), rows > 0
RecordedUnit = tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]]  # (h, its vjp): see record_unit


def contiguous_segments(counts: Sequence[int]) -> list[Segment]:
    """The segments of rows sorted by expert, ``counts[e]`` rows each, back to back (empty experts left out)."""
    segments, start = [], 0
    for e, n in enumerate(counts):
        if n:
            segments.append((e, start, n))
        start += n
    return segments


def segment_ffn_forward(rows: Tensor, segments: Sequence[Segment],
                        weights: ExpertWeights) -> tuple[Tensor, Tensor, Tensor | None, RecordedUnit]:
    """rows: ``[N, M]``; weights: ``[E, ...]`` (:class:`~flexmoe.experts.weights.ExpertWeights`).

    Returns ``(out [N, M], pre1 [N, H], pre3 [N, H] or None, recorded)``: the pre-activations and the unit's
    output and derivative (:func:`record_unit`), what the backward needs. The segments cover every row.
    """
    w1, b1, w2, b2, w3, b3 = weights.tensors()
    assert w1 is not None and w2 is not None
    num_rows, hidden = rows.shape[0], w1.shape[-1]
    pre1 = torch.empty(num_rows, hidden, dtype=rows.dtype, device=rows.device)
    pre3 = torch.empty(num_rows, hidden, dtype=rows.dtype, device=rows.device) if w3 is not None else None
    for e, start, n in segments:
        x = rows[start:start + n]
        linear_into(pre1[start:start + n], x, w1[e], b1, e)
        if w3 is not None and pre3 is not None:
            linear_into(pre3[start:start + n], x, w3[e], b3, e)
    recorded = record_unit(pre1, pre3, weights.unit)
    h = recorded[0]
    out = torch.empty(num_rows, w2.shape[-1], dtype=rows.dtype, device=rows.device)
    for e, start, n in segments:
        linear_into(out[start:start + n], h[start:start + n], w2[e], b2, e)
    return out, pre1, pre3, recorded


def record_unit(pre1: Tensor, pre3: Tensor | None, unit: Unit) -> RecordedUnit:
    """``(h, vjp)``: ``h = unit(pre1, pre3)`` and its vector-Jacobian product, ``vjp(grad_h)`` giving the
    gradients of ``pre1`` (and ``pre3``), by autograd on the elementwise call alone, so that any unit works
    (``torch.autograd`` rather than ``torch.func.vjp``, which refuses the saved-tensor hooks of activation
    checkpointing)."""
    with torch.enable_grad():
        inputs = tuple(p.detach().requires_grad_() for p in ((pre1,) if pre3 is None else (pre1, pre3)))
        h = unit(inputs[0], inputs[1] if pre3 is not None else None)

    def vjp(grad_h: Tensor) -> tuple[Tensor, ...]:
        # retain_graph: a second backward through the outer graph (retain_graph there) needs it again.
        return torch.autograd.grad(h, inputs, grad_h, retain_graph=True)

    return h.detach(), vjp


def segment_ffn_backward(grad_out: Tensor, rows: Tensor, segments: Sequence[Segment], w1: Tensor, w2: Tensor,
                         w3: Tensor | None, recorded: RecordedUnit, needs: Sequence[bool]) -> list[Tensor | None]:
    """The gradients of :func:`segment_ffn_forward`: ``[rows, w1, b1, w2, b2, w3, b3]``, each None where
    ``needs`` (the same seven flags) is False; a flag must be False for a bias or ``w3`` that does not exist.

    grad_out: ``[N, M]``; recorded: :func:`record_unit` of the forward's pre-activations. Every gradient is
    written into a full-size buffer (experts without rows get zeros): no stack, no cat.
    """
    need_x, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = needs
    h, unit_vjp = recorded
    num_experts = w1.shape[0]
    active = sorted({e for e, _, _ in segments})

    def weight_buffer(like: Tensor | None, wanted: bool) -> Tensor | None:
        return expert_grad_buffer(like.shape, like, active, num_experts) if wanted and like is not None else None

    def bias_buffer(size: int, wanted: bool) -> Tensor | None:
        return expert_grad_buffer((num_experts, size), w1, active, num_experts) if wanted else None

    hidden, model_dim = w1.shape[-1], w2.shape[-1]
    grad_w2, grad_b2 = weight_buffer(w2, need_w2), bias_buffer(model_dim, need_b2)
    grad_w1, grad_b1 = weight_buffer(w1, need_w1), bias_buffer(hidden, need_b1)
    grad_w3, grad_b3 = weight_buffer(w3, need_w3), bias_buffer(hidden, need_b3)

    grad_h = torch.empty_like(h)
    seen: set[int] = set()
    for e, start, n in segments:
        g, first = grad_out[start:start + n], e not in seen
        seen.add(e)
        torch.mm(g, w2[e].transpose(0, 1), out=grad_h[start:start + n])
        weight_grad_into(grad_w2, grad_b2, e, h[start:start + n], g, first)
    grad_pre = unit_vjp(grad_h)
    grad_pre1, grad_pre3 = grad_pre[0], (grad_pre[1] if len(grad_pre) > 1 else None)

    grad_x = torch.empty_like(rows) if need_x else None
    seen.clear()
    for e, start, n in segments:
        x, first = rows[start:start + n], e not in seen
        seen.add(e)
        g1 = grad_pre1[start:start + n]
        weight_grad_into(grad_w1, grad_b1, e, x, g1, first)
        g3 = grad_pre3[start:start + n] if grad_pre3 is not None else None
        if g3 is not None:
            weight_grad_into(grad_w3, grad_b3, e, x, g3, first)
        if grad_x is not None:
            gx = grad_x[start:start + n]
            torch.mm(g1, w1[e].transpose(0, 1), out=gx)
            if g3 is not None and w3 is not None:
                gx.addmm_(g3, w3[e].transpose(0, 1))
    return [grad_x, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3]


def addmm_into(out: Tensor, x: Tensor, w: Tensor, b: Tensor | None) -> None:
    """out = x @ w (+ b), written into ``out`` (rows of a larger buffer): x ``[n, in]``, w ``[in, out]``."""
    if b is not None:
        torch.addmm(b, x, w, out=out)
    else:
        torch.mm(x, w, out=out)


def linear_into(out: Tensor, x: Tensor, w: Tensor, b: Tensor | None, e: int) -> None:
    """out = x @ w (+ b[e]); out: a contiguous block of rows of a full-size buffer."""
    addmm_into(out, x, w, b[e] if b is not None else None)


def add_weight_grad(grad: Tensor | None, x: Tensor, g: Tensor, writes: bool) -> None:
    """grad (+)= x^T g, ``[in, out]`` from ``x [n, in]`` and ``g [n, out]``: written when ``writes`` (an expert's
    first rows), else added to (its later rows: more sequences, or chunks, of one expert)."""
    if grad is None:
        return
    if writes:
        torch.mm(x.transpose(0, 1), g, out=grad)
    else:
        grad.addmm_(x.transpose(0, 1), g)


def add_bias_grad(grad: Tensor | None, g: Tensor, writes: bool, weight: Tensor | None = None) -> None:
    """grad (+)= the rows of ``g [n, out]`` summed, weighted by ``weight [n]`` if given (as :func:`add_weight_grad`)."""
    if grad is None:
        return
    if weight is not None:
        if writes:
            torch.mv(g.transpose(0, 1), weight, out=grad)
        else:
            grad.addmv_(g.transpose(0, 1), weight)
    elif writes:
        torch.sum(g, 0, out=grad)
    else:
        grad.add_(g.sum(0))


def weight_grad_into(grad_w: Tensor | None, grad_b: Tensor | None, e: int, x: Tensor, g: Tensor,
                      first: bool) -> None:
    """grad_w[e] (+)= x.T @ g and grad_b[e] (+)= g summed over rows: written by the expert's first segment,
    added to by the others (several sequences of one expert in a padded plan)."""
    add_weight_grad(grad_w[e] if grad_w is not None else None, x, g, first)
    add_bias_grad(grad_b[e] if grad_b is not None else None, g, first)


def expert_grad_buffer(shape: Sequence[int], like: Tensor, active: list[int], num_experts: int) -> Tensor:
    """A contiguous ``[E, ...]`` gradient buffer; the experts without rows (nothing writes them) are zeroed."""
    buffer = torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
    for e in sorted(set(range(num_experts)) - set(active)):
        buffer[e].zero_()
    return buffer


class _SegmentExpertFFN(torch.autograd.Function):
    """One autograd node for the whole expert FFN of a call (the functions above)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
                w3: Tensor | None, b3: Tensor | None, segments: list[Segment], weights: ExpertWeights) -> Tensor:
        # The tensors come in loose as well, so that autograd sees each as an input (and returns its gradient).
        out, _, _, recorded = segment_ffn_forward(rows, segments, weights)
        ctx.save_for_backward(rows, w1, w2, w3)
        # The unit's derivative (it holds what it needs, the pre-activations) rides along outside
        # save_for_backward.
        ctx.recorded, ctx.segments = recorded, segments
        ctx.bias_present = (b1 is not None, b2 is not None, b3 is not None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        rows, w1, w2, w3 = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[:7])
        for i, present in zip((2, 4, 6), ctx.bias_present):
            needs[i] = needs[i] and present
        needs[5] = needs[5] and w3 is not None
        grads = segment_ffn_backward(grad_out.contiguous(), rows, ctx.segments, w1, w2, w3, ctx.recorded, needs)
        return (*grads, None, None)


def segment_expert_ffn(rows: Tensor, counts: Sequence[int], weights: ExpertWeights) -> Tensor:
    """The expert FFN as one autograd node: rows ``[N, M]`` sorted by expert, ``counts[e]`` rows each
    (``sum(counts) == N``); weights as in :func:`segment_ffn_forward` (views are fine: the gradients come back
    contiguous) -> ``[N, M]``. Differentiable once (no double backward)."""
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"counts must sum to the number of rows {rows.shape[0]}, got {sum(counts)}")
    return _SegmentExpertFFN.apply(rows.contiguous(), *weights.tensors(), contiguous_segments(counts), weights)
