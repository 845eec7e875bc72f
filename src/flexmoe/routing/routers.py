"""Routers (gates): small modules mapping tokens ``[T, M]`` to logits ``[T, E]``.

The built-in routers compute in the routing dtype whatever the model's dtype (their weight is cast, and
autocast is switched off around them), because top-k on bf16 logits flips choices on near-ties; routing dtype
None leaves the precision to the router and the caller's autocast (:func:`route`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.autograd_state import autocast_on
from flexmoe.module_call import call_module

__all__ = ["LinearRouter", "CosineRouter", "build_router", "route", "check_router_output"]


class LinearRouter(nn.Module):
    """The classic top-k gate: ``logits = x @ weight.T (+ bias)``. weight: ``[E, M]``; with ``bias`` (GPT-OSS,
    Switch's ``router_bias``) also ``bias: [E]``."""

    def __init__(self, model_dim: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, model_dim))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, M]`` -> logits ``[T, E]`` in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class CosineRouter(nn.Module):
    """Cosine router of SwinV2-MoE: ``logits = cos(x, weight_e) / tau`` with a learned temperature.

    weight: ``[E, M]``; the temperature is ``exp(log_temperature)``, clamped below at ``min_temperature``
    so that the logits stay bounded (cosine similarities lie in [-1, 1]).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        init_temperature: float = 0.07,
        min_temperature: float = 0.01,
    ) -> None:
        super().__init__()
        if init_temperature <= 0 or min_temperature <= 0:
            raise ValueError("init_temperature and min_temperature must be > 0")
        self.weight = nn.Parameter(torch.empty(num_experts, model_dim))
        self.log_temperature = nn.Parameter(torch.tensor(math.log(init_temperature)))
        self.min_temperature = min_temperature
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    @property
    def temperature(self) -> Tensor:
        return self.log_temperature.exp().clamp(min=self.min_temperature)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[T, M]`` -> logits ``[T, E]`` in x's dtype."""
        w = F.normalize(self.weight.to(x.dtype), dim=-1)
        cos = F.linear(F.normalize(x, dim=-1), w)
        return cos / self.temperature.to(x.dtype)


def build_router(router: str | nn.Module, model_dim: int, num_experts: int, bias: bool = False) -> nn.Module:
    """The gate module for the layer's ``router=`` argument, or a module used as is.

    "topk", "expert_choice" and "base" share the linear gate (they differ in how experts are picked from its
    logits, see :mod:`flexmoe.routing.build`); "cosine" is SwinV2-MoE's cosine gate. ``bias``: the linear
    gate's ``router_bias``.
    """
    if isinstance(router, nn.Module):
        return router
    if router in ("topk", "expert_choice", "base"):
        return LinearRouter(model_dim, num_experts, bias=bias)
    if router == "cosine":
        return CosineRouter(model_dim, num_experts)
    raise ValueError(f"router must be 'topk', 'cosine', 'expert_choice', 'base' or an nn.Module, got {router!r}")


def route(
    router: nn.Module,
    x: Tensor,
    *,
    dtype: torch.dtype | None = torch.float32,
    training: bool = False,
    jitter: float = 0.0,
    gate_noise: float = 0.0,
    input_dropout: float = 0.0,
    num_experts: int | None = None,
) -> Tensor:
    """Router logits ``[T, E]`` for tokens x: ``[T, M]`` (or ``[B, S, M]``, flattened to ``T = B * S`` tokens),
    with exploration in training.

    dtype: the routing dtype: the built-in routers see x in it, autocast is switched off around the router and the
    logits are cast to it; a custom router module sees x as is. None: the router's own precision: it runs under
    the caller's autocast like any module (Hugging Face's routers do), and its logits keep their dtype.
    Exploration, applied only when ``training``: ``jitter`` multiplies the router input by U(1-eps, 1+eps),
    ``input_dropout`` drops router input features, ``gate_noise`` adds N(0, gate_noise^2) to the logits.
    num_experts: the layer's E, which the router's output must match (``[..., E]`` over x's tokens): a ValueError
    naming both shapes otherwise (None: not checked).
    """
    if dtype is not None and autocast_on(x):
        # The router computes in `dtype` whatever autocast says (entering the context only when autocast is on:
        # it costs a decoding call measurable time).
        with torch.autocast(device_type=x.device.type, enabled=False):
            return route(router, x, dtype=dtype, training=training, jitter=jitter, gate_noise=gate_noise,
                         input_dropout=input_dropout, num_experts=num_experts)
    builtin = isinstance(router, (LinearRouter, CosineRouter))
    h = x.to(dtype) if builtin and dtype is not None else x
    if training and jitter > 0:
        h = h * torch.empty_like(h).uniform_(1.0 - jitter, 1.0 + jitter)
    if training and input_dropout > 0:
        h = F.dropout(h, p=input_dropout, training=True)
    logits = call_module(router, h)
    if num_experts is not None:
        check_router_output(logits, h, num_experts)
    if logits.dim() != 2:
        logits = logits.reshape(-1, logits.shape[-1])  # [T, E]
    if dtype is not None and logits.dtype != dtype:  # .to costs a small call host time even when it returns logits
        logits = logits.to(dtype)
    if training and gate_noise > 0:
        logits = logits + torch.randn_like(logits) * gate_noise
    return logits


def check_router_output(logits: object, x: Tensor, num_experts: int) -> None:
    """A custom router's output must be a tensor ``[..., num_experts]`` over x's tokens (``x: [..., M]``, the
    router's input): else a TypeError / ValueError naming what it returned, before a wrong shape reaches the
    plan or the experts (where it would surface as an unrelated shape error, or compute with too few experts)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"the router must return a tensor of logits [tokens, num_experts={num_experts}], got "
                        f"{type(logits).__name__}")
    if x.dim() == 2 and logits.dim() == 2 and logits.shape[0] == x.shape[0] and logits.shape[1] == num_experts:
        return  # the common case, [T, M] -> [T, E], told without building the shapes below
    expected = (*x.shape[:-1], num_experts)
    tokens = math.prod(x.shape[:-1])
    # Either x's leading shape or its tokens flattened: a router that sees sequences [B, S, M] (HF's Switch
    # router) may return [B * S, E].
    if tuple(logits.shape) not in (expected, (tokens, num_experts)):
        raise ValueError(f"the router must return logits [tokens, num_experts={num_experts}] for its input "
                         f"{tuple(x.shape)}, i.e. shape {expected} or {(tokens, num_experts)}; got shape "
                         f"{tuple(logits.shape)}")
