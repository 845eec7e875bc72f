"""The layer's options: the keyword constructor's routing of each keyword to its dataclass, the options one call
may override, and each option as a read-only layer attribute (docs/architecture.md, "The layer's options").

The options live in three frozen dataclasses, each validated once when it is made:
:class:`~flexmoe.routing.RoutingOptions`, :class:`~flexmoe.experts.ExpertOptions` and
:class:`~flexmoe.parallel.ParallelOptions`. A new option is one field (and its docstring line) in one of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from flexmoe.experts import ExpertOptions
from flexmoe.parallel.options import ParallelOptions
from flexmoe.routing.options import RoutingOptions
from flexmoe.tuning.policies import resolve_shadow

__all__ = ["OPTION_CLASSES", "options_from_keywords", "call_options", "expose_options", "describe_layer"]

_OptionsClass = type[RoutingOptions] | type[ExpertOptions] | type[ParallelOptions]
OPTION_CLASSES: dict[str, _OptionsClass] = {"routing_options": RoutingOptions, "expert_options": ExpertOptions,
                                            "parallel_options": ParallelOptions}
# What one forward call may override: the capacity (routing) and every parallel option but the chooser.
_CALL_ROUTING = ("capacity", "capacity_factor")
# redundant_experts is the layer's own: its placement and load window live in the layer.
_CALL_PARALLEL = tuple(f.name for f in dataclasses.fields(ParallelOptions)
                       if f.name not in ("chooser", "redundant_experts"))


def options_from_keywords(constructor_options: dict[str, Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """The three options objects: the constructor's (``{"routing_options": ..., ...}``, None for the defaults)
    with each keyword replaced in the dataclass that has a field of its name."""
    by_class: dict[str, dict[str, Any]] = {holder: {} for holder in OPTION_CLASSES}
    for name, value in keywords.items():
        holder = next((h for h, c in OPTION_CLASSES.items() if name in _field_names(c)), None)
        if holder is None:
            raise TypeError(f"MoELayer() got an unexpected keyword argument {name!r}")
        by_class[holder][name] = value
    chosen = {}
    for holder, options_cls in OPTION_CLASSES.items():
        base = constructor_options[holder]
        if base is not None and not isinstance(base, options_cls):
            raise TypeError(f"{holder} must be a {options_cls.__name__}, got {type(base).__name__}")
        chosen[holder] = options_cls(**by_class[holder]) if base is None else dataclasses.replace(
            base, **by_class[holder])
    return chosen


def _field_names(options_cls: _OptionsClass) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(options_cls))


def call_options(routing: RoutingOptions, parallel: ParallelOptions, call_options: dict[str, Any],
                 ) -> tuple[RoutingOptions, ParallelOptions, frozenset[str]]:
    """This call's routing and parallel options: the layer's (``routing``, ``parallel``), with the call's non-None
    keywords replaced; and the names of the parallel options the call gave."""
    if not call_options:  # the common call, without keywords: the layer's own options, nothing to merge
        return routing, parallel, frozenset()
    overrides = {name: value for name, value in call_options.items() if value is not None}
    unknown = sorted(set(overrides) - set(_CALL_ROUTING) - set(_CALL_PARALLEL))
    if unknown:
        raise TypeError(f"MoELayer.forward() got unexpected keyword argument(s) {unknown}; a call may override "
                        f"{list(_CALL_ROUTING) + list(_CALL_PARALLEL)}")
    routing_overrides = {n: v for n, v in overrides.items() if n in _CALL_ROUTING}
    if routing_overrides:
        routing = dataclasses.replace(routing, **routing_overrides)
    pinned = {n: v for n, v in overrides.items() if n in _CALL_PARALLEL}
    if pinned:
        if "shadow" in pinned:
            pinned["shadow"] = resolve_shadow(pinned["shadow"]) or False
        parallel = dataclasses.replace(parallel, **pinned)
    return routing, parallel, frozenset(pinned)


def expose_options(cls: type) -> None:
    """Every option readable as a layer attribute (``moe.k``, ``moe.r``, ...), read-only: the options are
    frozen. ``router`` and ``shared_gate`` are modules of the layer; their options are
    ``moe.routing_options.router`` and ``moe.expert_options.shared_gate``."""
    for holder, options_cls in OPTION_CLASSES.items():
        for f in dataclasses.fields(options_cls):
            if f.name in ("router", "shared_gate") or hasattr(cls, f.name):
                continue
            setattr(cls, f.name, option_property(holder, f.name))


def option_property(holder: str, name: str) -> property:
    """A read-only attribute reading ``self.<holder>.<name>``."""
    def read(layer: Any) -> Any:
        return getattr(getattr(layer, holder), name)

    return property(read, doc=f"The layer's ``{name}`` (``{holder}.{name}``).")


def describe_layer(model_dim: int, num_experts: int, hidden_dim: int, experts: object, dtype: torch.dtype | None,
                   options: tuple[RoutingOptions, ExpertOptions, ParallelOptions]) -> dict[str, object]:
    """A layer's sizes and options as comparable values, one entry per field: what the ranks of an expert-parallel
    group check they agree on (``experts``: the custom experts module described, or ``None``'s description)."""
    described: dict[str, object] = {"model_dim": model_dim, "num_experts": num_experts, "hidden_dim": hidden_dim,
                                    "experts": experts, "dtype": str(dtype)}
    for part in options:
        described.update(part.describe())
    return described
