"""MoELayer: validates its configuration and composes router -> plan -> dispatch -> experts -> combine."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import FeedForwardExperts
from flexmoe.routing.plan import RoutingPlan, make_plan
from flexmoe.routing.routers import build_router, route

__all__ = ["MoELayer"]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _check_capacity(capacity: object) -> int | None:
    if capacity is None:
        return None
    return _check_int("capacity", capacity, 0)


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer.

    ``y = moe(x)`` with ``x: [..., model_dim]`` returns ``[..., model_dim]`` in x's dtype. Each token goes to
    ``k`` of ``num_experts`` expert FFNs (``model_dim -> hidden_dim -> model_dim``), weighted by the router.

    Routing (DESIGN.md section 3):
        k: choices per token, 1 <= k <= num_experts.
        capacity_factor: > 0 fixed capacity ``ceil(k * cf * T / E)``; 0 dropless; < 0 adaptive, at most
            ``ceil(k * |cf| * T / E)`` and never more than the largest load.
        capacity: an explicit per-expert capacity (int >= 0) that overrides ``capacity_factor``.
        router: "topk" (linear, no bias), "cosine" (SwinV2-MoE), or a module ``[T, M] -> [T, E]``.
        router_dtype: dtype of the routing math (default float32, whatever the model's dtype).
        normalize_weights: divide the k weights of a token by their sum (k > 1).
        batch_prioritized: hand out slots by descending top-1 probability instead of token order.
        score_at: "combine" weights expert outputs when combining; "dispatch" scales expert inputs.
        jitter, gate_noise, router_input_dropout: exploration, active only in training.

    Experts:
        activation ("gelu", "relu", "silu" or a callable), glu (gated expert with ``w3``), bias; or
        ``experts=`` a module ``forward(x: [N, M], counts: list[int]) -> [N, M]`` used instead.

    After each forward: ``aux_loss`` (balance loss, differentiable), ``z_loss`` and ``last_plan`` (the
    :class:`~flexmoe.routing.RoutingPlan`: ``tokens_per_expert``, ``capacity``, ``dropped_fraction``, ...).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        hidden_dim: int,
        *,
        k: int = 2,
        capacity_factor: float = 1.25,
        capacity: int | None = None,
        router: str | nn.Module = "topk",
        router_dtype: torch.dtype = torch.float32,
        normalize_weights: bool = True,
        batch_prioritized: bool = False,
        score_at: str = "combine",
        jitter: float = 0.0,
        gate_noise: float = 0.0,
        router_input_dropout: float = 0.0,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        glu: bool = False,
        bias: bool = True,
        experts: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.model_dim = _check_int("model_dim", model_dim, 1)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        self.hidden_dim = _check_int("hidden_dim", hidden_dim, 1)
        self.k = _check_int("k", k, 1)
        if k > num_experts:
            raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
        self.capacity_factor = _check_float("capacity_factor", capacity_factor)
        self.capacity = _check_capacity(capacity)
        if router_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"router_dtype must be a floating dtype, got {router_dtype}")
        self.router_dtype = router_dtype
        self.normalize_weights = bool(normalize_weights)
        self.batch_prioritized = bool(batch_prioritized)
        if score_at not in ("combine", "dispatch"):
            raise ValueError(f"score_at must be 'combine' or 'dispatch', got {score_at!r}")
        self.score_at = score_at
        self.jitter = _check_float("jitter", jitter, 0.0, 1.0)
        self.gate_noise = _check_float("gate_noise", gate_noise, 0.0)
        self.router_input_dropout = _check_float("router_input_dropout", router_input_dropout, 0.0, 1.0)

        self.router = build_router(router, model_dim, num_experts)
        if isinstance(router, str):
            self.router.to(device=device, dtype=dtype)
        if experts is not None:
            if not isinstance(experts, nn.Module):
                raise TypeError(f"experts must be an nn.Module, got {type(experts).__name__}")
            self.experts = experts
        else:
            self.experts = FeedForwardExperts(
                num_experts, model_dim, hidden_dim, activation=activation, glu=glu, bias=bias,
                device=device, dtype=dtype,
            )

        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.last_plan: RoutingPlan | None = None

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"x must be float64, float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"x must have shape [..., model_dim={self.model_dim}], got {tuple(x.shape)}")

    def forward(
        self,
        x: Tensor,
        *,
        capacity: int | None = None,
        capacity_factor: float | None = None,
    ) -> Tensor:
        """x: ``[..., model_dim]`` -> ``[..., model_dim]``, same dtype.

        ``capacity`` and ``capacity_factor`` override the layer's for this call only (``capacity=0`` drops
        every token, and ``last_plan`` says so).
        """
        self._check_input(x)
        capacity = self.capacity if capacity is None else _check_capacity(capacity)
        if capacity_factor is None:
            capacity_factor = self.capacity_factor
        else:
            capacity_factor = _check_float("capacity_factor", capacity_factor)

        tokens = x.reshape(-1, self.model_dim)
        logits = route(
            self.router,
            tokens,
            dtype=self.router_dtype,
            training=self.training,
            jitter=self.jitter,
            gate_noise=self.gate_noise,
            input_dropout=self.router_input_dropout,
        )
        plan = make_plan(
            logits,
            self.k,
            capacity_factor=capacity_factor,
            capacity=capacity,
            normalize_weights=self.normalize_weights,
            batch_prioritized=self.batch_prioritized,
        )
        expert_input = dispatch(tokens, plan, scale=self.score_at == "dispatch")
        expert_output = self._run_experts(expert_input, plan.counts)
        y = combine(expert_output, plan, weighted=self.score_at == "combine")

        self.aux_loss = plan.aux_loss
        self.z_loss = plan.z_loss
        self.last_plan = plan
        return y.to(x.dtype).reshape(x.shape)

    def _run_experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows: ``[N, M]`` sorted by expert -> ``[N, M]`` in rows' dtype."""
        expert_dtype = _parameter_dtype(self.experts)
        autocast_on = torch.is_autocast_enabled(rows.device.type)
        if expert_dtype is None or autocast_on or expert_dtype == rows.dtype:
            return self.experts(rows, counts)
        # A float32 layer fed bf16 activations (or the reverse) computes in its parameters' dtype.
        return self.experts(rows.to(expert_dtype), counts).to(rows.dtype)

    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"k={self.k}, capacity_factor={self.capacity_factor}, capacity={self.capacity}, "
            f"score_at={self.score_at!r}"
        )


def _parameter_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
