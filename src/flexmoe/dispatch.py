"""Dispatch and combine: index gather and scatter-add, O(T * k * M).

No dense ``[T, E, C]`` tensor is ever formed: the plan already lists, row by row, the token each expert row
carries (``plan.row_token``) and its weight (``plan.row_weight``). Rows are sorted by expert, so the experts
read contiguous blocks of ``plan.counts[e]`` rows and never compute an empty slot.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.plan import RoutingPlan

__all__ = ["dispatch", "combine"]


def dispatch(x: Tensor, plan: RoutingPlan, *, scale: bool = False) -> Tensor:
    """Gather the expert input.

    x: ``[T, M]`` -> ``[N, M]`` with ``N = sum(plan.counts)``, rows sorted by expert then slot.
    With ``scale`` each row is multiplied by its combine weight (``score_at="dispatch"``).
    """
    rows = x.index_select(0, plan.row_token)
    if scale:
        rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
    return rows


def combine(expert_output: Tensor, plan: RoutingPlan, *, weighted: bool = True) -> Tensor:
    """Scatter-add the expert rows back to their tokens.

    expert_output: ``[N, M]`` -> ``[T, M]``. With ``weighted`` each row is multiplied by its combine weight
    first (``score_at="combine"``). Tokens whose every choice was dropped come out as zeros.
    """
    rows = expert_output
    if weighted:
        rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(plan.num_tokens, rows.shape[-1])
    return out.index_add(0, plan.row_token, rows)
