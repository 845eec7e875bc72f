"""Experts: batched feed-forward networks, and the protocol a custom expert follows.

An expert module takes the dispatched rows ``x: [N, M]`` (sorted by local expert) and the per-expert row
counts ``counts: list[int]`` (``sum(counts) == N``) and returns ``[N, M]``. Any module with that forward can be
passed to ``MoELayer(experts=...)``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FeedForwardExperts", "resolve_activation"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def resolve_activation(activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``"gelu"`` (exact), ``"relu"``, ``"silu"`` or any callable applied elementwise."""
    if callable(activation):
        return activation
    if activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)} or a callable, got {activation!r}")


class FeedForwardExperts(nn.Module):
    """``num_experts`` two-layer FFNs stored batched.

    Parameters: ``w1: [E, M, H]``, ``b1: [E, H]``, ``w2: [E, H, M]``, ``b2: [E, M]`` and, with ``glu``,
    ``w3: [E, M, H]``, ``b3: [E, H]``. Expert e computes ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``, or with
    ``glu`` ``(act(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]``.
    """

    def __init__(
        self,
        num_experts: int,
        model_dim: int,
        hidden_dim: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        glu: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.model_dim = model_dim
        self.hidden_dim = hidden_dim
        self.glu = glu
        self.activation = resolve_activation(activation)
        factory = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, model_dim, **factory))
        self.w3 = nn.Parameter(torch.empty(num_experts, model_dim, hidden_dim, **factory)) if glu else None
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim, **factory))
            self.b2 = nn.Parameter(torch.empty(num_experts, model_dim, **factory))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim, **factory)) if glu else None
        else:
            self.b1 = self.b2 = self.b3 = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for w, fan_in in ((self.w1, self.model_dim), (self.w3, self.model_dim), (self.w2, self.hidden_dim)):
            if w is not None:
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        for b, fan_in in ((self.b1, self.model_dim), (self.b3, self.model_dim), (self.b2, self.hidden_dim)):
            if b is not None:
                nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def _per_expert(self, p: Tensor | None) -> list[Tensor | None]:
        # unbind, not p[e]: indexing inside the loop writes each slice's gradient into a full-size zero tensor.
        return list(p.unbind(0)) if p is not None else [None] * self.num_experts

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """x: ``[N, M]`` rows sorted by expert, counts: ``[E]`` rows per expert -> ``[N, M]``."""
        if len(counts) != self.num_experts:
            raise ValueError(f"counts must have {self.num_experts} entries (one per expert), got {len(counts)}")
        outputs = []
        params = zip(
            x.split(counts),
            *(self._per_expert(p) for p in (self.w1, self.b1, self.w2, self.b2, self.w3, self.b3)),
        )
        for rows, w1, b1, w2, b2, w3, b3 in params:
            if rows.shape[0] == 0:
                continue
            h = self.activation(_linear(rows, w1, b1))
            if w3 is not None:
                h = h * _linear(rows, w3, b3)
            outputs.append(_linear(h, w2, b2))
        if not outputs:
            return x.new_zeros(x.shape[0], self.model_dim)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden_dim={self.hidden_dim}, "
            f"glu={self.glu}, bias={self.b1 is not None}"
        )


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x: ``[n, in]``, w: ``[in, out]``, b: ``[out]`` -> ``[n, out]``."""
    return torch.addmm(b, x, w) if b is not None else x @ w
