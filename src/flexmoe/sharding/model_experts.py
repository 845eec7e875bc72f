"""Which parameters of a model are MoE experts: the one search every model-level module here shares.

Sharding treats an MoE layer's experts apart from the rest of the model: FSDP shards them over other ranks, DDP
leaves them out, DCP writes them in global form, the optimizer groups them apart, materialisation draws them per
expert. Each of those finds them with :func:`expert_parameters` (and the layers with
:func:`~flexmoe.model_routing.named_moe_layers`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from flexmoe.layer import MoELayer
from flexmoe.model_routing import named_moe_layers

__all__ = ["named_moe_layers", "expert_parameters"]


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, MoELayer]]:
    """Yield ``(name, parameter, layer)`` for every parameter of every :class:`~flexmoe.MoELayer`'s routed experts
    (``layer.experts``: not its router, shared expert or gate) in ``model``, layers in ``named_modules()`` order
    and each layer's experts in ``named_parameters()`` order. ``name`` is the parameter's qualified name in
    ``model`` (``"blocks.0.moe.experts.w1"``; ``"experts.w1"`` when ``model`` is the layer), ``parameter`` the
    tensor itself (a DTensor once the model is sharded), ``layer`` the MoE layer that holds it."""
    for prefix, layer in named_moe_layers(model):
        for pname, param in layer.experts.named_parameters():
            yield (f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}"), param, layer
