"""The experts' weights and hidden unit as one value, the argument every expert kernel takes.

Expert e computes ``unit(x @ w1[e] + b1[e], x @ w3[e] + b3[e]) @ w2[e] + b2[e]`` on its rows ``x: [n, M]``,
with ``w1, w3: [E, M, H]``, ``w2: [E, H, M]``, biases ``[E, H]`` / ``[E, M]`` or None, and ``unit`` the
activation of the first projection, times the second for gated experts (``w3`` given), optionally with
GPT-OSS's clamp (:func:`gated_unit`). H may be a hidden shard (expert parallelism): the output is then a partial
sum. Only torch is needed here, so that the kernel modules import this without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ExpertWeights", "WEIGHT_NAMES", "hidden_unit", "gated_unit", "needs_grad"]

# The experts' tensors by name, in the order of ExpertWeights.tensors(): the names of the built-in experts'
# parameters, and the keys every module that gathers, broadcasts or cuts them by name goes through.
WEIGHT_NAMES: tuple[str, ...] = ("w1", "b1", "w2", "b2", "w3", "b3")


@dataclass(frozen=True)
class ExpertWeights:
    """``w1, w3: [E, M, H]``, ``w2: [E, H, M]``, ``b1, b3: [E, H]``, ``b2: [E, M]`` (None: absent; ``w3``
    present makes the experts gated), ``activation``: elementwise callable, ``glu_limit``: GPT-OSS's clamp of the
    gated unit (None: none). :meth:`for_expert` gives one expert's weights, the same fields without the ``E``
    dimension."""

    w1: Tensor
    b1: Tensor | None
    w2: Tensor
    b2: Tensor | None
    w3: Tensor | None
    b3: Tensor | None
    activation: Callable[[Tensor], Tensor]
    glu_limit: float | None = None
    # Joined experts' [E, M, 2H] and [E, 2H] tensors whose halves w1 | w3 and b1 | b3 are (None: not so); a kernel
    # reads the pair as one weight there, without a copy (:meth:`laid_out_gate_up`).
    gate_up: Tensor | None = None
    gate_up_bias: Tensor | None = None

    @property
    def glu(self) -> bool:
        """Whether the experts are gated (a third matrix ``w3``)."""
        return self.w3 is not None

    @property
    def hidden(self) -> int:
        """H, the hidden size (of this shard)."""
        return self.w1.shape[-1]

    @property
    def model_dim(self) -> int:
        """M, the rows' width."""
        return self.w2.shape[-1]

    @property
    def num_experts(self) -> int:
        """E (for :meth:`for_expert`'s per-expert weights: the model dim, meaningless)."""
        return self.w1.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.w1.dtype

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def tensors(self) -> tuple[Tensor | None, ...]:
        """``(w1, b1, w2, b2, w3, b3)``, None where absent."""
        return self.w1, self.b1, self.w2, self.b2, self.w3, self.b3

    def present(self) -> list[Tensor]:
        """The tensors that exist, in :meth:`tensors`' order."""
        return [t for t in self.tensors() if t is not None]

    def for_expert(self, e: int) -> ExpertWeights:
        """Expert ``e``'s weights: ``w1: [M, H]``, ``b1: [H]``, ... (views)."""
        return ExpertWeights(self.w1[e], _at(self.b1, e), self.w2[e], _at(self.b2, e), _at(self.w3, e),
                             _at(self.b3, e), self.activation, self.glu_limit)

    def per_expert(self) -> list[ExpertWeights]:
        """Every expert's weights, as views made by one ``unbind`` per tensor. Under autograd, unbinding gives
        each slice's gradient back through one node; indexing ``w[e]`` in a loop would write each slice's
        gradient into a full-size zero tensor."""
        def each(t: Tensor | None) -> list[Tensor | None]:
            return list(t.unbind(0)) if t is not None else [None] * self.num_experts

        return [ExpertWeights(w1, b1, w2, b2, w3, b3, self.activation, self.glu_limit)
                for w1, b1, w2, b2, w3, b3 in zip(*(each(t) for t in self.tensors()))]

    def with_tensors(self, **tensors: Tensor | None) -> ExpertWeights:
        """The same unit on other tensors (gathered, cast, a shard): ``with_tensors(w1=..., b1=...)``. Another
        ``w1`` or ``w3`` (``b1`` or ``b3``) drops :attr:`gate_up` (:attr:`gate_up_bias`) unless given too."""
        if "gate_up" not in tensors and ("w1" in tensors or "w3" in tensors):
            tensors["gate_up"] = None
        if "gate_up_bias" not in tensors and ("b1" in tensors or "b3" in tensors):
            tensors["gate_up_bias"] = None
        return dataclasses.replace(self, **tensors)  # type: ignore[arg-type]

    def unit(self, pre1: Tensor, pre3: Tensor | None) -> Tensor:
        """The hidden activations ``[n, H]`` from the pre-activations ``[n, H]`` (:func:`hidden_unit`)."""
        return hidden_unit(pre1, pre3, self.activation, self.glu_limit)

    def ffn(self, x: Tensor, linear: Callable[[Tensor, Tensor, Tensor | None], Tensor],
            join: Callable[[Tensor, Tensor], Tensor | None] | None = None) -> Tensor:
        """The expert FFN once, whatever ``linear(x, w, b)`` does (one expert's addmm, a grouped GEMM over all
        experts, a batched matmul over padded or gathered weights): ``linear(act(x w1 + b1), w2, b2)``, or with
        ``w3`` the gated unit (:func:`gated_unit`) of the ``w1`` and ``w3`` projections, by one product over 2H
        columns where :meth:`laid_out_gate_up` gives ``w1 | w3``, or where ``join(w1, w3)`` makes it (a copy or a
        view; None: the two run apart)."""
        laid_out = self.laid_out_gate_up()
        w3, b1, b3 = self.w3, self.b1, self.b3
        if laid_out is None and join is not None and w3 is not None and (b1 is None) == (b3 is None):
            gate_up = join(self.w1, w3)  # [E, M, 2H]
            if gate_up is not None:
                laid_out = gate_up, None if b1 is None or b3 is None else torch.cat([b1, b3], dim=-1)
        if laid_out is not None:
            hidden = self.w1.shape[-1]
            gate, up = linear(x, *laid_out).split_with_sizes((hidden, hidden), dim=-1)  # [..., H] each
            return linear(gated_unit(gate, up, self.activation, self.glu_limit), self.w2, self.b2)
        pre3 = linear(x, w3, b3) if w3 is not None else None
        return linear(self.unit(linear(x, self.w1, b1), pre3), self.w2, self.b2)

    def laid_out_gate_up(self) -> tuple[Tensor, Tensor | None] | None:
        """``(w1 | w3 [E, M, 2H], b1 | b3 [E, 2H] or None)`` read in place where the gated pair is the halves of
        :attr:`gate_up` (joined experts): one matmul over ``2H`` columns instead of two, no copy of the weights
        (the biases are joined by a copy where :attr:`gate_up_bias` is absent). Autograd records it as any
        parameter: the gradient reaches ``gate_up``. None otherwise (ungated, or not joined)."""
        w3, gate_up = self.w3, self.gate_up
        if w3 is None or gate_up is None:
            return None
        b1, b3 = self.b1, self.b3
        if b1 is None and b3 is None:
            return gate_up, None
        if self.gate_up_bias is not None:
            return gate_up, self.gate_up_bias
        if b1 is None or b3 is None:
            return None
        return gate_up, torch.cat([b1, b3], dim=-1)

    def needs_grad(self, rows: Tensor) -> bool:
        """Whether autograd records an operation on ``rows`` and these weights."""
        return torch.is_grad_enabled() and needs_grad(rows, *self.tensors())

    def all_like(self, rows: Tensor) -> bool:
        """Every tensor has the rows' dtype and device."""
        return all(t.dtype == rows.dtype and t.device == rows.device for t in self.present())


def _at(p: Tensor | None, e: int) -> Tensor | None:
    return p[e] if p is not None else None


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records an operation on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def hidden_unit(pre1: Tensor, pre3: Tensor | None, activation: Callable[[Tensor], Tensor],
                glu_limit: float | None) -> Tensor:
    """The experts' hidden activations ``[n, H]`` from the pre-activations ``[n, H]`` of ``w1`` and (gated
    experts) ``w3``: ``activation(pre1)``, or the gated unit (:func:`gated_unit`). Elementwise."""
    return gated_unit(pre1, pre3, activation, glu_limit) if pre3 is not None else activation(pre1)


def gated_unit(gate: Tensor, up: Tensor, activation: Callable[[Tensor], Tensor], limit: float | None) -> Tensor:
    """The GLU's hidden activations ``[n, H]`` from its two projections ``[n, H]``.

    ``activation(gate) * up`` without a limit; with ``limit = L`` GPT-OSS's clamped form
    ``activation(min(gate, L)) * (clamp(up, -L, L) + 1)`` (clamped values pass no gradient).
    """
    if limit is None:
        return activation(gate) * up
    return activation(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1)
