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
    num_rows = plan.row_token.numel()
    k = plan.k
    rows = torch.full((plan.num_tokens * k,), num_rows, dtype=torch.long, device=plan.row_token.device)
    rows[plan.row_token * k + plan.row_choice] = torch.arange(num_rows, device=rows.device)
    return rows.view(plan.num_tokens, k)


def _gather_pairs(plan: RoutingPlan) -> bool:
    return plan.num_tokens * plan.k <= _MAX_PAIRS_PER_ROW * max(plan.row_token.numel(), 1)


def _take(src: Tensor, index: Tensor) -> Tensor:
    """``src`` with a zero row appended (row ``len(src)``), gathered by ``index``: ``[len(index), M]``."""
    if bool((index == src.shape[0]).any()):
        src = torch.cat([src, src.new_zeros(1, src.shape[-1])])
    return src.index_select(0, index)


class _RowsOfTokens(torch.autograd.Function):
    """Forward ``x[row_token]`` ``[N, M]``; backward sums each token's row gradients by a gather over its pairs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, row_token: Tensor, pairs: Tensor) -> Tensor:
        ctx.save_for_backward(pairs)
        return x.index_select(0, row_token)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (pairs,) = ctx.saved_tensors
        num_tokens, k = pairs.shape
        g = _take(grad, pairs.reshape(-1)).view(num_tokens, k, -1)
        return (g[:, 0] if k == 1 else g.sum(1)), None, None


class _PairsOfRows(torch.autograd.Function):
    """Forward ``[T, k, M]``: each pair's row (zeros where it has none); backward: the inverse gather."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, pairs: Tensor, pair_of_row: Tensor) -> Tensor:
        ctx.save_for_backward(pair_of_row)
        return _take(rows, pairs.reshape(-1)).view(*pairs.shape, rows.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (pair_of_row,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[-1]).index_select(0, pair_of_row), None, None


def dispatch(x: Tensor, plan: RoutingPlan, *, scale: bool = False) -> Tensor:
    """Gather the expert input.

    x: ``[T, M]`` -> ``[N, M]`` with ``N = sum(plan.counts)``, rows sorted by expert then slot.
    With ``scale`` each row is multiplied by its combine weight (``score_at="dispatch"``).
    """
    if _gather_pairs(plan) and torch.is_grad_enabled() and x.requires_grad:
        rows = _RowsOfTokens.apply(x, plan.row_token, pair_rows(plan))
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
    if not _gather_pairs(plan):
        rows = expert_output
        if weighted:
            rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
        return rows.new_zeros(plan.num_tokens, rows.shape[-1]).index_add(0, plan.row_token, rows)
    pairs = pair_rows(plan)
    pair_of_row = plan.row_token * plan.k + plan.row_choice
    per_pair = _PairsOfRows.apply(expert_output, pairs, pair_of_row)  # [T, k, M]
    if not weighted:
        return per_pair.sum(1)
    weight = _take(plan.row_weight.to(expert_output.dtype).unsqueeze(-1), pairs.reshape(-1))
    return torch.bmm(weight.view(plan.num_tokens, 1, plan.k), per_pair).squeeze(1)  # [T, 1, k] @ [T, k, M]
