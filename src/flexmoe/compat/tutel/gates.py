"""Tutel's two gates, with Tutel's parameter names, shapes and initialisation.

A gate maps tokens ``x: [T, model_dim]`` to logits ``[T, num_global_experts]``; softmax, top-k and capacity
happen in :mod:`flexmoe.compat.tutel.moe` (through :class:`flexmoe.MoELayer`). Each gate carries its routing
options as attributes: ``top_k``, ``capacity_factor`` (default 1.0) and ``gate_noise`` (default 0.0).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LinearTopKGate", "CosineTopKGate", "BUILTIN_GATES", "RoutingGate"]


class RoutingGate(Protocol):
    """What the Tutel layer uses of a gate: logits of tokens and the routing options it carries (the built-in
    gates set them in ``__init__``; the layer checks a custom gate for them when it builds it)."""

    top_k: int
    capacity_factor: float
    gate_noise: float

    def __call__(self, x: Tensor) -> Tensor: ...


class _BuiltinGate(nn.Module):
    """The routing options of the built-in gates (set by :func:`_routing_options`)."""

    top_k: int
    capacity_factor: float
    gate_noise: float


def _routing_options(gate: _BuiltinGate, num_global_experts: int, k: int, capacity_factor: float,
                     gate_noise: float) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"gate option k must be an int >= 1, got {k!r}")
    gate.top_k = min(num_global_experts, int(k))
    gate.capacity_factor = float(capacity_factor)
    gate.gate_noise = float(gate_noise)


class LinearTopKGate(_BuiltinGate):
    """Tutel's ``top`` gate: ``logits = x @ wg.weight.T``. Parameter ``wg.weight: [E, model_dim]``, drawn as
    ``nn.Linear(model_dim, E, bias=False)`` draws it (float32 with ``fp32_gate``, else the default dtype)."""

    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, fp32_gate: bool = False,
                 capacity_factor: float = 1.0, gate_noise: float = 0.0) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_global_experts, bias=False,
                            dtype=torch.float32 if fp32_gate else None)
        self.fp32_gate = bool(fp32_gate)
        _routing_options(self, num_global_experts, k, capacity_factor, gate_noise)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, model_dim]`` -> logits ``[T, E]`` in the gate weight's dtype (float32 with fp32_gate)."""
        weight = self.wg.weight.float() if self.fp32_gate else self.wg.weight
        return F.linear(x.to(weight.dtype), weight)


class CosineTopKGate(_BuiltinGate):
    """Tutel's ``cosine_top`` gate (SwinV2-MoE): ``logits = cos(P x, S_e) * exp(min(temperature, log 100))``.

    Parameters, in Tutel's names: ``cosine_projector`` (``nn.Linear(model_dim, proj_dim)``), ``sim_matrix:
    [proj_dim, E]`` (N(0, 0.01^2)), ``temperature: [1]`` (initially ``log(1 / init_t)``). The initial draws
    follow Tutel's order: projector weight, projector bias, a standard normal ``[proj_dim, E]`` that is then
    redrawn as N(0, 0.01^2), so that seeded runs reproduce Tutel's weights.
    """

    def __init__(self, model_dim: int, num_global_experts: int, k: int = 1, fp32_gate: bool = False,
                 proj_dim: int = 256, init_t: float = 0.5, capacity_factor: float = 1.0,
                 gate_noise: float = 0.0) -> None:
        super().__init__()
        if not init_t > 0:
            raise ValueError(f"cosine_top gate option init_t must be > 0, got {init_t!r}")
        self.fp32_gate = bool(fp32_gate)
        self.temperature = nn.Parameter(torch.log(torch.full([1], 1.0 / init_t)))
        self.cosine_projector = nn.Linear(model_dim, proj_dim)
        self.sim_matrix = nn.Parameter(torch.randn(proj_dim, num_global_experts))
        nn.init.normal_(self.sim_matrix, 0.0, 0.01)
        # The temperature's ceiling: logit scale <= 100 keeps the softmax from saturating (SwinV2).
        self.clamp_max = math.log(1.0 / 0.01)
        _routing_options(self, num_global_experts, k, capacity_factor, gate_noise)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, model_dim]`` -> logits ``[T, E]``."""
        projector_w: Tensor = self.cosine_projector.weight
        projector_b: Tensor = self.cosine_projector.bias
        sim: Tensor = self.sim_matrix
        if self.fp32_gate:
            x, projector_w, projector_b, sim = x.float(), projector_w.float(), projector_b.float(), sim.float()
        projected = F.linear(x.to(projector_w.dtype), projector_w, projector_b)
        cosine = F.normalize(projected, dim=1) @ F.normalize(sim, dim=0)
        return cosine * torch.clamp(self.temperature, max=self.clamp_max).exp()


BUILTIN_GATES: dict[str, type[nn.Module]] = {"top": LinearTopKGate, "cosine_top": CosineTopKGate}
