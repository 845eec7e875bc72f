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

__all__ = ["FeedForwardExperts", "expert_ffn", "gated_unit", "check_glu_limit", "resolve_activation"]

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
    ``glu`` ``(act(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]`` (with ``glu_limit`` the gated unit
    is GPT-OSS's clamped one, :func:`gated_unit`).
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
        glu_limit: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.model_dim = model_dim
        self.hidden_dim = hidden_dim
        self.glu = glu
        self.activation = resolve_activation(activation)
        self.glu_limit = check_glu_limit(glu_limit, glu)
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

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """x: ``[N, M]`` rows sorted by expert, counts: ``[E]`` rows per expert -> ``[N, M]``."""
        if len(counts) != self.num_experts:
            raise ValueError(f"counts must have {self.num_experts} entries (one per expert), got {len(counts)}")
        return expert_ffn(x, counts, self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.activation,
                          glu_limit=self.glu_limit)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden_dim={self.hidden_dim}, "
            f"glu={self.glu}, bias={self.b1 is not None}"
            + (f", glu_limit={self.glu_limit}" if self.glu_limit is not None else "")
        )


def expert_ffn(
    rows: Tensor,
    counts: list[int],
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    w3: Tensor | None,
    b3: Tensor | None,
    activation: Callable[[Tensor], Tensor],
    glu_limit: float | None = None,
) -> Tensor:
    """The experts' FFN on explicit weights: each expert's rows through its own two (or, GLU, three) matmuls.

    rows: ``[N, M]`` sorted by expert, counts: ``[E]``; w1, w3: ``[E, M, H]``, w2: ``[E, H, M]``, biases
    ``[E, H]`` / ``[E, M]`` or None -> ``[N, M]``. H may be a hidden shard (expert parallelism), the result then
    a partial sum. ``glu_limit``: GPT-OSS's clamped gated unit (:func:`gated_unit`). One ``addmm`` pair per
    expert over ``w.unbind(0)``: on CPU this runs at the batched-matmul floor, while indexing ``w[e]`` in the
    loop would write each slice's gradient into a full-size zero tensor.
    """
    num_experts = len(counts)

    def per_expert(p: Tensor | None) -> list[Tensor | None]:
        return list(p.unbind(0)) if p is not None else [None] * num_experts

    outputs = []
    for x, a1, c1, a2, c2, a3, c3 in zip(rows.split(counts), per_expert(w1), per_expert(b1), per_expert(w2),
                                         per_expert(b2), per_expert(w3), per_expert(b3)):
        if x.shape[0] == 0:
            continue
        if a3 is not None:
            h = gated_unit(_linear(x, a1, c1), _linear(x, a3, c3), activation, glu_limit)
        else:
            h = activation(_linear(x, a1, c1))
        outputs.append(_linear(h, a2, c2))
    if not outputs:
        return rows.new_zeros(rows.shape[0], w2.shape[-1])
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def gated_unit(gate: Tensor, up: Tensor, activation: Callable[[Tensor], Tensor], limit: float | None) -> Tensor:
    """The GLU's hidden activations ``[n, H]`` from its two projections ``[n, H]``.

    ``activation(gate) * up`` without a limit; with ``limit = L`` GPT-OSS's clamped form
    ``activation(min(gate, L)) * (clamp(up, -L, L) + 1)`` (clamped values pass no gradient).
    """
    if limit is None:
        return activation(gate) * up
    return activation(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1)


def check_glu_limit(glu_limit: object, glu: bool) -> float | None:
    """``glu_limit`` as a float > 0 (or None); only gated experts have a linear branch to clamp."""
    if glu_limit is None:
        return None
    if isinstance(glu_limit, bool) or not isinstance(glu_limit, (int, float)):
        raise TypeError(f"glu_limit must be a number or None, got {type(glu_limit).__name__}")
    if not (math.isfinite(glu_limit) and glu_limit > 0):
        raise ValueError(f"glu_limit must be finite and > 0, got {glu_limit}")
    if not glu:
        raise ValueError("glu_limit clamps the gated unit: it needs glu=True")
    return float(glu_limit)


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x: ``[n, in]``, w: ``[in, out]``, b: ``[out]`` -> ``[n, out]``."""
    return torch.addmm(b, x, w) if b is not None else x @ w
