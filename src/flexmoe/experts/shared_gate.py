"""The shared experts' sigmoid gate (Qwen2-MoE): ``shared_output * sigmoid(x @ weight.T)`` per token.

The shared experts themselves are a :class:`~flexmoe.experts.FeedForwardExperts` of their own hidden size
(``shared_hidden_dim``) that every token passes through; this module is only the learned scalar gate that
scales their summed output per token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SharedExpertGate"]


class SharedExpertGate(nn.Module):
    """A token's share of the shared experts: ``sigmoid(x @ weight.T)``. weight: ``[1, M]`` (no bias)."""

    def __init__(self, model_dim: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, model_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1])  # nn.Linear's default
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, tokens: Tensor, shared_output: Tensor) -> Tensor:
        """tokens: ``[T, M]``, shared_output: ``[T, M]`` -> the gated output ``[T, M]`` in shared_output's dtype."""
        weight = self.weight
        gate = torch.sigmoid(F.linear(tokens, weight if weight.dtype == tokens.dtype else weight.to(tokens.dtype)))
        # [T, 1]; a cast only where the dtypes differ (a call to .to costs a small call host time even when it
        # returns its input)
        return shared_output * (gate if gate.dtype == shared_output.dtype else gate.to(shared_output.dtype))
