"""Model-wide routing hooks: they walk a model's :class:`~flexmoe.MoELayer` modules by qualified name.

* :func:`record_routing` / :func:`replay_routing`: routing replay (:mod:`flexmoe.routing.replay` holds the record
  and the taps; docs/architecture.md, "Routing replay", the contract);
* :func:`balance_metrics`: every layer's balance numbers of its last forward (:mod:`flexmoe.routing.balance_metrics`
  defines them), as flat keys for a logger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from flexmoe.layer import MoELayer
from flexmoe.routing.balance_metrics import plan_balance_metrics
from flexmoe.routing.replay import RecordingTap, ReplayingTap, RoutingRecord, RoutingTap

__all__ = ["named_moe_layers", "record_routing", "replay_routing", "balance_metrics"]


def named_moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """``(qualified name, layer)`` of every :class:`~flexmoe.MoELayer` in ``model``, in ``named_modules()`` order
    (the model itself is named ``""`` when it is one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a nn.Module, got {type(model).__name__}")
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """``with record_routing(model) as record:`` every MoE layer of ``model`` appends each call's chosen experts
    ``[T, k]`` to ``record`` (a :class:`RoutingRecord`, complete when the block ends).

    Raises ``ValueError`` when ``model`` has no MoE layer, when a layer routes by expert choice or BASE (no
    per-token top-k choice to record), or when a layer is already recording or replaying.
    """
    record = RoutingRecord()
    with _tapped(model, lambda name: RecordingTap(record, name)):
        yield record


@contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord) -> Iterator[None]:
    """``with replay_routing(model, record):`` the n-th call of every MoE layer of ``model`` takes the record's n-th
    choices for that layer instead of its router's top-k; weights, losses and capacity as usual
    (:mod:`flexmoe.routing.replay`; docs/architecture.md, "Routing replay").

    Raises ``ValueError`` when a layer of ``model`` is missing from the record or the record names a layer
    ``model`` lacks, and (at the call) when a recorded call does not fit it (T, k, an expert outside ``[0, E)``) or
    the layer makes more calls than recorded; as :func:`record_routing` for the layers it cannot tap.
    """
    if not isinstance(record, RoutingRecord):
        raise TypeError(f"record must be a RoutingRecord (from record_routing), got {type(record).__name__}")
    names = {name for name, _ in named_moe_layers(model)}
    missing, unknown = sorted(names - set(record.calls)), sorted(set(record.calls) - names)
    if missing:
        raise ValueError(f"the record has no calls of the MoE layers {missing} (it holds {sorted(record.calls)})")
    if unknown:
        raise ValueError(f"the record holds MoE layers {unknown} that the model lacks (its layers: {sorted(names)})")
    with _tapped(model, lambda name: ReplayingTap(record.calls[name], name)):
        yield


@contextmanager
def _tapped(model: nn.Module, make_tap: Callable[[str], RoutingTap]) -> Iterator[None]:
    """Put ``make_tap(name)`` on every MoE layer of ``model`` for the block; take them off after it, whatever
    happens."""
    layers = named_moe_layers(model)
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no flexmoe MoE layer to record or replay")
    for name, layer in layers:
        if layer.routing_options.selection != "topk":
            raise ValueError(f"layer {name!r} routes by {layer.routing_options.selection!r}: routing replay needs "
                             "per-token top-k choices (router 'topk', 'cosine' or a custom gate)")
        if layer.routing_tap is not None:
            raise ValueError(f"layer {name!r} is already recording or replaying its routing")
    try:
        for name, layer in layers:
            layer.routing_tap = make_tap(name)
        yield
    finally:
        for _, layer in layers:
            layer.routing_tap = None


def balance_metrics(model: nn.Module) -> dict[str, float]:
    """Every MoE layer's :func:`plan_balance_metrics` of its last forward, as ``{"<layer name>/<metric>": value}``
    (e.g. ``"blocks.1.mlp/max_over_mean"``; the name is the layer's in ``model.named_modules()``, the bare metric
    for a model that is itself the layer). Layers that have not run yet are left out. Raises ``ValueError`` when
    ``model`` has no MoE layer."""
    layers = named_moe_layers(model)
    if not layers:
        raise ValueError(f"the model ({type(model).__name__}) has no flexmoe MoE layer to measure")
    out: dict[str, float] = {}
    for name, layer in layers:
        plan = layer.last_plan
        if plan is None:
            continue
        for metric, value in plan_balance_metrics(plan).items():
            out[f"{name}/{metric}" if name else metric] = value
    return out
