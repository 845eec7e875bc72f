"""Dispatch and combine: row gathers, O(T * k * M).

No dense ``[T, E, C]`` tensor is ever formed: the plan already lists, row by row, the token each expert row
carries (``plan.row_token``) and its weight (``plan.row_weight``). Rows are sorted by expert, so the experts
read contiguous blocks of ``plan.counts[e]`` rows and never compute an empty slot.

Both directions are gathers, forward and backward. Each row belongs to exactly one (token, choice) pair, so
"sum the rows of each token" (combine, and dispatch's backward) is a gather of the ``[T, k]`` pair rows
followed by a sum over k, and "send each row's gradient back" is a gather by the inverse permutation. A plain
``index_add`` (scatter-add) would give the same numbers but runs several times slower than a gather on CPU.
When a plan has many more pairs than rows (expert-choice routing, whose pair grid is ``[T, E]``) the
scatter-add is used instead, since gathering mostly empty pairs would cost more than it saves.

A padded plan (``plan.padded``, made under ``torch.compile``) has empty rows: the pair gathers never read them,
and nothing here branches on a routed value while compiling (docs/architecture.md, "Compiling the layer").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmoe.routing.plan import RoutingPlan

__all__ = ["dispatch", "combine", "pair_rows"]

# Gather by pairs only while the pair grid is at most this many times the number of rows.
_MAX_PAIRS_PER_ROW = 2


def pair_rows(plan: RoutingPlan) -> Tensor:
    """``[T, k]`` the row of each (token, choice) pair; ``N`` (one past the last row) where the pair has no
    row (dropped, skipped, or not chosen)."""
    if plan.pair_row is not None:
        return plan.pair_row
    num_rows = plan.row_token.numel()
    k = plan.k
    rows = torch.full((plan.num_tokens * k,), num_rows, dtype=torch.long, device=plan.row_token.device)
    rows[plan.row_token * k + plan.row_choice] = torch.arange(num_rows, device=rows.device)
    return rows.view(plan.num_tokens, k)


def _gather_pairs(plan: RoutingPlan) -> bool:
    num_rows = plan.row_token.numel()
    # A padded plan always gathers: its pair grid is [T, k], and only the gathers skip its empty rows.
    return num_rows > 0 and (plan.padded or plan.num_tokens * plan.k <= _MAX_PAIRS_PER_ROW * num_rows)


def _sum_pair_rows(rows: Tensor, pairs: Tensor, pair_weight: Tensor | None) -> Tensor:
    """``out[t] = sum_j pair_weight[t, j] * rows[pairs[t, j]]`` (rows past the end count as zeros): ``[T, M]``.

    One choice at a time, so every temporary is ``[T, M]``: a single ``[T * k, M]`` buffer would be large
    enough for the allocator to map fresh pages (and take their page faults) on every call.
    """
    num_rows = rows.shape[0]
    out = None
    for j in range(pairs.shape[1]):
        index = pairs[:, j]
        missing = index == num_rows
        # Compiled: always mask (a branch on the values would end the graph); eager: skip it when nothing is missing.
        has_missing = torch.compiler.is_compiling() or bool(missing.any())
        part = rows.index_select(0, index.masked_fill(missing, 0) if has_missing else index)
        if has_missing:
            part.masked_fill_(missing.unsqueeze(-1), 0)
        if pair_weight is not None:
            part.mul_(pair_weight[:, j : j + 1])
        out = part if out is None else out.add_(part)
    assert out is not None, "pairs has no column (k >= 1)"
    return out


class _Dispatch(torch.autograd.Function):
    """Forward ``x[row_token]`` ``[N, M]``; backward: each token's row gradients summed by gathers."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, row_token: Tensor, pairs: Tensor) -> Tensor:
        ctx.save_for_backward(pairs)
        return x.index_select(0, row_token)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (pairs,) = ctx.saved_tensors
        return _sum_pair_rows(grad, pairs, None), None, None


class _Combine(torch.autograd.Function):
    """Forward ``y[t] = sum over t's rows of row_weight[r] * rows[r]`` ``[T, M]``, by gathers; backward by
    one gather of ``grad_y`` per row (and a batched dot product for the weights' gradient)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, row_weight: Tensor, row_token: Tensor, pairs: Tensor) -> Tensor:
        ctx.save_for_backward(rows, row_weight, row_token)
        weight_of_pair = torch.cat([row_weight, row_weight.new_zeros(1)])[pairs]  # [T, k], 0 where no row
        return _sum_pair_rows(rows, pairs, weight_of_pair)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        rows, row_weight, row_token = ctx.saved_tensors
        grad_of_row = grad.index_select(0, row_token)  # [N, M]
        grad_weight = torch.bmm(grad_of_row.unsqueeze(1), rows.unsqueeze(-1)).view(-1)  # row-wise dot products
        return grad_of_row.mul_(row_weight.unsqueeze(-1)), grad_weight, None, None


def dispatch(x: Tensor, plan: RoutingPlan, *, scale: bool = False) -> Tensor:
    """Gather the expert input.

    x: ``[T, M]`` -> ``[N, M]`` with ``N = sum(plan.counts)``, rows sorted by expert then slot.
    With ``scale`` each row is multiplied by its combine weight (``score_at="dispatch"``).
    """
    if _gather_pairs(plan) and torch.is_grad_enabled() and x.requires_grad:
        rows = _Dispatch.apply(x, plan.row_token, pair_rows(plan))
    else:
        rows = x.index_select(0, plan.row_token)
    if scale:
        rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
    return rows


def combine(expert_output: Tensor, plan: RoutingPlan, *, weighted: bool = True) -> Tensor:
    """Sum the expert rows back into their tokens.

    expert_output: ``[N, M]`` -> ``[T, M]``. With ``weighted`` each row is multiplied by its combine weight
    first (``score_at="combine"``). Tokens whose every choice was dropped come out as zeros.
    """
    weight = plan.row_weight.to(expert_output.dtype) if weighted else None
    if not _gather_pairs(plan):
        rows = expert_output if weight is None else expert_output * weight.unsqueeze(-1)
        return rows.new_zeros(plan.num_tokens, rows.shape[-1]).index_add(0, plan.row_token, rows)
    if weight is None:
        weight = expert_output.new_ones(expert_output.shape[0])
    return _Combine.apply(expert_output, weight, plan.row_token, pair_rows(plan))
