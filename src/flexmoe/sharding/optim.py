"""Optimizer parameter groups that stay valid at every layout of a model (docs/architecture.md, "Models larger
than one rank").

Under :func:`~flexmoe.sharding.parallelize` the non-expert parameters are DTensors, while experts that no other
rank holds (``ep`` spanning the data-parallel ranks) are left out of FSDP as plain tensors. torch's multi-tensor
(``foreach``) and fused optimizers refuse a parameter group that mixes the two, and the per-parameter loop they fall
back to pays DTensor's dispatch on every elementwise op of every step. Splitting each group into its expert and its
other parameters makes every group one kind of tensor, and since the split follows the model's own structure (which
parameters belong to an MoE layer's experts), not the layout, it is the same at every mesh, as a DCP checkpoint
loaded at another mesh requires.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from flexmoe.sharding.model_experts import expert_parameters

__all__ = ["split_expert_groups"]


def split_expert_groups(model: nn.Module, groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` (optimizer parameter groups of ``model``'s parameters: dicts with ``"params"`` and their
    hyperparameters), each split in two: its parameters that belong to an MoE layer's experts, then the others,
    each part with the group's hyperparameters; parts without parameters are left out. Pass the result to the
    optimizer: ``torch.optim.AdamW(split_expert_groups(model, groups), foreach=True)``."""
    experts = {id(p) for _, p, _ in expert_parameters(model)}
    split: list[dict[str, Any]] = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"groups[{i}] must be a dict with a 'params' list (an optimizer parameter group), got "
                            f"{type(group).__name__}")
        params = list(group["params"])
        for part in ([p for p in params if id(p) in experts], [p for p in params if id(p) not in experts]):
            if part:
                split.append({**group, "params": part})
    return split
