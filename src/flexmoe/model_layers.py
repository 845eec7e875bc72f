"""Finding a model's flexmoe MoE layers: what the model-wide hooks (routing replay, balance metrics) walk."""

from __future__ import annotations

from torch import nn

from flexmoe.layer import MoELayer

__all__ = ["named_moe_layers"]


def named_moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """``(qualified name, layer)`` of every :class:`~flexmoe.MoELayer` in ``model``, in ``named_modules()`` order
    (the model itself is named ``""`` when it is one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)]
