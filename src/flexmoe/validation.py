"""Argument checks shared by every options dataclass: a clear TypeError / ValueError naming the argument.

The bottom of the package: it imports nothing from flexmoe, so every room (routing, parallel, tuning, the layer)
may use it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["FLOAT_DTYPES", "check_int", "check_float", "constant_float", "check_optional_int", "check_choice",
           "check_float_dtype", "describe_value"]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_optional_int(name: str, value: object, minimum: int) -> int | None:
    """None, or an int >= ``minimum``."""
    return None if value is None else check_int(name, value, minimum)


def constant_float(value: int | float) -> float:
    """``value`` as a float, a constant of the graph when ``torch.compile`` traces it symbolically.

    Dynamo makes a float dynamic once it changes between calls (a per-call ``capacity_factor``), and every float
    of a module under ``dynamic=True``; the options dataclasses, rebuilt inside the traced forward for a call's
    overrides, would then fail at their first check (``math.isfinite``). Taking the exact integer ratio makes
    dynamo guard on the value instead (one graph per distinct value), and dividing the two ints gives back
    the same float (-0.0 comes back as 0.0). inf and nan have no ratio and come back as they are, for the
    caller's check."""
    value = float(value)
    try:
        numerator, denominator = value.as_integer_ratio()
    except (OverflowError, ValueError):
        return value
    return numerator / denominator


def check_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None) -> float:
    """``value`` as a finite float in ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = constant_float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_float_dtype(name: str, value: object) -> torch.dtype | None:
    """``value`` if it is None or one of :data:`FLOAT_DTYPES`; a string such as ``"bfloat16"`` would otherwise fail
    inside torch without naming the argument."""
    if value is None or (isinstance(value, torch.dtype) and value in FLOAT_DTYPES):
        return value
    named = isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
    hint = f"; pass torch.{value}" if named else ""
    raise TypeError(f"{name} must be a floating dtype or None, got {value!r}{hint}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        listed = " or ".join(repr(c) for c in choices) if len(choices) <= 2 else str(choices)
        raise ValueError(f"{name} must be {listed}, got {value!r}")
    return str(value)


def describe_value(value: object) -> object:
    """A stand-in for ``value`` that compares equal across processes: plain values as they are, dtypes by
    name, objects with ``describe()`` by its result, dataclass instances by their repr, modules by class name,
    callables by name."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    describe = getattr(value, "describe", None)
    if callable(describe) and not isinstance(value, type):
        return describe()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    if isinstance(value, nn.Module):
        return type(value).__name__
    return getattr(value, "__name__", type(value).__name__)
