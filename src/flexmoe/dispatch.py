"""Dispatch and combine: row gathers, O(T * k * M).

No dense ``[T, E, C]`` tensor is ever formed: the plan already lists, row by row, the token each expert row
carries (``plan.row_token``) and its weight (``plan.row_weight``). Rows are sorted by expert, so the experts
read contiguous blocks of ``plan.counts[e]`` rows and never compute an empty slot.

Both directions are gathers, forward and backward. Each row belongs to exactly one (token, choice) pair, so
"sum the rows of each token" (combine, and dispatch's backward) reads the ``[T, k]`` pair rows and sums over k
in one pass (``embedding_bag``), and "send each row's gradient back" is a gather by the inverse permutation. A plain
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

__all__ = ["dispatch", "combine", "pair_rows", "sum_rows_by_token", "sum_choices_by_token", "weighted_bag_sum",
           "SCATTER_MAX_ELEMENTS"]

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


# Without autograd, up to this many elements in the pairs' ``[T, k, M]`` block, combine scatter-adds the weighted
# rows straight into their tokens (one index_add): at M=512, k=8 that beat the per-choice gathers up to 256 tokens
# (0.3x their time at 16 tokens, 0.5x at 256) and lost at 512 (1.7x), on a quiet 2-core AVX2 CPU.
SCATTER_MAX_ELEMENTS = 1 << 20


def weighted_bag_sum(rows: Tensor, pairs: Tensor, weight: Tensor | None) -> Tensor:
    """``out[t] = sum_j weight[t, j] * rows[pairs[t, j]]`` (``weight`` None: 1), every index a real row: ``[T, M]``.

    rows: ``[N, M]``, pairs: ``[T, k]`` long, weight: ``[T, k]`` in rows' dtype. One pass by ``embedding_bag``,
    which reads each pair's row once and writes only ``[T, M]``: 2-5x faster than per-choice gathers and 2-8x
    faster than a gather to ``[T, k, M]`` and a batched matmul (T=4096, M=512-2048, k=2-8, fp32, forward and
    backward; 2-core AVX-512 EPYC). It is differentiable in ``rows`` and ``weight``."""
    return torch.nn.functional.embedding_bag(pairs, rows, per_sample_weights=weight, mode="sum")


def _sum_pair_rows(rows: Tensor, pairs: Tensor, pair_weight: Tensor | None, every_pair_has_row: bool) -> Tensor:
    """``out[t] = sum_j pair_weight[t, j] * rows[pairs[t, j]]`` (rows past the end count as zeros): ``[T, M]``.

    ``every_pair_has_row`` (:attr:`RoutingPlan.every_pair_has_row`): one :func:`weighted_bag_sum`. Otherwise, in
    eager mode, one ``embedding_bag`` whose bag per token holds only its pairs that have a row (a token with none
    sums to zeros); a zero weight on a stand-in row instead would let an inf or NaN in that row through as NaN.
    Compiling (a padded plan): one choice at a time with the missing pairs masked, every shape static and no
    branch on a routed value.
    """
    num_rows = rows.shape[0]
    if every_pair_has_row:
        return weighted_bag_sum(rows, pairs, pair_weight)
    if not torch.compiler.is_compiling():
        kept = pairs != num_rows  # [T, k]
        per_token = kept.sum(1)
        weight = None if pair_weight is None else pair_weight[kept]
        return torch.nn.functional.embedding_bag(pairs[kept], rows, per_token.cumsum(0) - per_token,
                                                 per_sample_weights=weight, mode="sum")
    out = None
    for j in range(pairs.shape[1]):
        missing = pairs[:, j] == num_rows
        part = rows.index_select(0, pairs[:, j].masked_fill(missing, 0)).masked_fill_(missing.unsqueeze(-1), 0)
        if pair_weight is not None:
            part.mul_(pair_weight[:, j : j + 1])
        out = part if out is None else out.add_(part)
    assert out is not None, "pairs has no column (k >= 1)"
    return out


class _Dispatch(torch.autograd.Function):
    """Forward ``x[row_token]`` ``[N, M]``; backward: each token's row gradients summed (:func:`_sum_pair_rows`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, row_token: Tensor, pairs: Tensor, every_pair_has_row: bool) -> Tensor:
        ctx.save_for_backward(pairs)
        ctx.every_pair_has_row = every_pair_has_row
        return x.index_select(0, row_token)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (pairs,) = ctx.saved_tensors
        return _sum_pair_rows(grad, pairs, None, ctx.every_pair_has_row), None, None, None


class _Combine(torch.autograd.Function):
    """Forward ``y[t] = sum over t's rows of row_weight[r] * rows[r]`` ``[T, M]`` (:func:`_sum_pair_rows`);
    backward by one gather of ``grad_y`` per row (and row-wise dot products for the weights' gradient)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, row_weight: Tensor, row_token: Tensor, pairs: Tensor,
                every_pair_has_row: bool) -> Tensor:
        ctx.save_for_backward(rows, row_weight, row_token)
        padded_weight = row_weight if every_pair_has_row else torch.cat([row_weight, row_weight.new_zeros(1)])
        pair_weight = padded_weight[pairs]  # [T, k], 0 where the pair has no row
        return _sum_pair_rows(rows, pairs, pair_weight, every_pair_has_row)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        rows, row_weight, row_token = ctx.saved_tensors
        grad_of_row = grad.index_select(0, row_token)  # [N, M]
        grad_weight = torch.linalg.vecdot(grad_of_row, rows)  # [N] row-wise dot products (2 ms, bmm 3.3 at N=8192)
        return grad_of_row.mul_(row_weight.unsqueeze(-1)), grad_weight, None, None, None


def dispatch(x: Tensor, plan: RoutingPlan, *, scale: bool = False) -> Tensor:
    """Gather the expert input.

    x: ``[T, M]`` -> ``[N, M]`` with ``N = sum(plan.counts)``, rows sorted by expert then slot.
    With ``scale`` each row is multiplied by its combine weight (``score_at="dispatch"``).
    """
    if _gather_pairs(plan) and torch.is_grad_enabled() and x.requires_grad and not _traced_off_cpu(x):
        rows = _Dispatch.apply(x, plan.row_token, pair_rows(plan), plan.every_pair_has_row)
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
    differentiable = torch.is_grad_enabled() and (expert_output.requires_grad
                                                  or (weight is not None and weight.requires_grad))
    small = plan.num_tokens * plan.k * expert_output.shape[-1] <= SCATTER_MAX_ELEMENTS
    if not _gather_pairs(plan) or (small and not differentiable and not torch.compiler.is_compiling()) \
            or _traced_off_cpu(expert_output):
        return sum_rows_by_token(expert_output, plan.row_token, weight, plan.num_tokens)
    complete = plan.every_pair_has_row
    if weight is None:
        weight = expert_output.new_ones(expert_output.shape[0])
    return _Combine.apply(expert_output, weight, plan.row_token, pair_rows(plan), complete)


def _traced_off_cpu(x: Tensor) -> bool:
    """Whether this call is being compiled for a device other than the CPU: there dispatch and combine take
    autograd's own ops (a gather, a scatter-add) instead of the pair-gather functions above. On CUDA (an H200,
    torch 2.11) the traced ``_Dispatch`` / ``_Combine`` gave zero gradients to everything before them while their
    forward was right, with every backend, eager included (tests/test_compile.py's capacity cases under
    ``make test-gpu``); the same graphs on the CPU are right."""
    return torch.compiler.is_compiling() and x.device.type != "cpu"


def sum_rows_by_token(rows: Tensor, row_token: Tensor, row_weight: Tensor | None, num_tokens: int) -> Tensor:
    """``out[t] = sum over the rows r of token t of row_weight[r] * rows[r]`` by one scatter-add.

    rows: ``[N, M]``, row_token: ``[N]``, row_weight: ``[N]`` in rows' dtype or None (unweighted) -> ``[T, M]``.
    """
    weighted = rows if row_weight is None else rows * row_weight.unsqueeze(-1)
    return weighted.new_zeros(num_tokens, rows.shape[-1]).index_add(0, row_token, weighted)


def sum_choices_by_token(rows: Tensor, pair_row: Tensor, weight: Tensor | None, num_tokens: int) -> Tensor:
    """``out[t] = sum over the choices c of weight[t, c] * rows[pair_row[t * k + c]]`` by one
    :func:`weighted_bag_sum`, where every pair has a row (dropless).

    rows: ``[N, M]``, pair_row: ``[T * k]`` the row of each token-major pair, weight: ``[T, k]`` in rows' dtype or
    None -> ``[T, M]``. The weights stay in the router's ``[T, k]`` order: nothing is permuted but the rows.
    """
    return weighted_bag_sum(rows, pair_row.view(num_tokens, -1), weight)
