"""What a benchmark times: its configuration, the layer and inputs built from it, and the floor's step.

:class:`BenchConfig` is one configuration; the builders make the :class:`~flexmoe.MoELayer`, the inputs and the
forward + backward steps on ``BenchConfig.device``, drawing every random value on the CPU first so that each
device gets the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.apps.baselines import expert_floor, grouped_floor
from flexmoe.experts import FeedForwardExperts
from flexmoe.layer import MoELayer

__all__ = ["DTYPES", "LayerSizes", "BenchConfig", "build_layer", "random_rows", "make_inputs", "fwd_bwd", "floor_case"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass(frozen=True, kw_only=True)
class LayerSizes:
    """The sizes of one MoE layer call: ``tokens`` rows of width ``model_dim`` routed to ``k`` of ``experts``
    experts of hidden size ``hidden_dim``. What a benchmark configuration and an HF block shape
    (:class:`~flexmoe.apps.bench.hf_blocks.HFShape`) both are; keyword-only, so that a subclass may add a positional
    field before them (the shape's name)."""

    tokens: int = 4096
    model_dim: int = 512
    hidden_dim: int = 1024
    experts: int = 8
    k: int = 2

    def sizes(self) -> dict[str, Any]:
        """The five sizes (ints) by field name: ``BenchConfig(**shape.sizes(), ...)`` times a layer of ``shape``'s
        sizes."""
        return {f.name: getattr(self, f.name) for f in fields(LayerSizes)}


@dataclass(frozen=True, kw_only=True)
class BenchConfig(LayerSizes):
    """One benchmark configuration (keyword arguments only). ``tokens`` is per rank under torchrun."""

    capacity_factor: float = 1.25
    dtype: str = "float32"
    glu: bool = False
    steps: int = 10
    warmup: int = 3
    seed: int = 0
    device: str = "cpu"

    def describe(self) -> str:
        cf = "dropless" if self.capacity_factor == 0 else f"cf={self.capacity_factor:g}"
        on = "" if self.device == "cpu" else f" on {self.device}"
        return (f"T={self.tokens} M={self.model_dim} H={self.hidden_dim} E={self.experts} k={self.k} {cf} "
                f"{self.dtype}{' glu' if self.glu else ''}{on}")


def build_layer(cfg: BenchConfig, **extra: Any) -> MoELayer:
    torch.manual_seed(cfg.seed)
    return MoELayer(cfg.model_dim, cfg.experts, cfg.hidden_dim, k=cfg.k, capacity_factor=cfg.capacity_factor,
                    glu=cfg.glu, dtype=DTYPES[cfg.dtype], **extra).to(cfg.device)


def random_rows(cfg: BenchConfig, rows: int, gen: torch.Generator) -> Tensor:
    """``[rows, model_dim]`` normal values drawn on the CPU (the same on every device), in ``cfg``'s dtype on
    ``cfg``'s device."""
    return torch.randn(rows, cfg.model_dim, generator=gen).to(cfg.device, DTYPES[cfg.dtype])


def make_inputs(cfg: BenchConfig, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = random_rows(cfg, cfg.tokens, gen).requires_grad_()
    grad = random_rows(cfg, cfg.tokens, gen)
    return x, grad


def fwd_bwd(forward: Callable[[], Tensor], grad: Tensor, module: nn.Module | None) -> Callable[[], None]:
    def step() -> None:
        if module is not None:
            module.zero_grad(set_to_none=True)
        forward().backward(grad)
    return step


def floor_case(layer: MoELayer, counts: list[int], cfg: BenchConfig, grouped: bool = False,
                ) -> tuple[Callable[[], None], Callable]:
    """A forward + backward step of the floor (``grouped``: the grouped-GEMM floor) on random rows of the
    routed counts, and its forward alone."""
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    rows = random_rows(cfg, sum(counts), gen).requires_grad_()
    grad = random_rows(cfg, sum(counts), gen)
    experts = layer.experts
    assert isinstance(experts, FeedForwardExperts), "the floor times the built-in FFN experts"
    forward = partial(grouped_floor if grouped else expert_floor, experts, rows, counts)
    return fwd_bwd(forward, grad, layer.experts), forward
