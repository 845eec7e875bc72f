"""Where autograd is: whether the code running now runs inside a backward pass, or inside anything else that
records or replays what a call does (activation checkpointing, a dispatch mode); and whether autocast is on."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _len_torch_dispatch_stack

__all__ = ["in_backward", "saved_tensor_hooks_active", "in_plain_call", "autocast_on"]


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpointing recomputation).

    Never while compiling: a compiled graph's backward recomputes tensors, it does not re-run the forward's code.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def saved_tensor_hooks_active() -> bool:
    """True while saved-tensor hooks are set (``torch.autograd.graph.saved_tensors_hooks``): the forward of a
    non-reentrant ``torch.utils.checkpoint`` region, ``save_on_cpu`` offloading, or any other hook that sees every
    tensor autograd saves."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def in_plain_call() -> bool:
    """True when the code running now is a plain eager call, whose extra work nothing records or replays: not
    compiling, not inside a backward (a reentrant checkpoint's recomputation), no saved-tensor hooks (a
    non-reentrant checkpoint's forward and recomputation, offloading) and no Python dispatch mode (selective
    checkpointing's cache of op outputs, ``FlopCounterMode``, fake tensors)."""
    return (not torch.compiler.is_compiling() and not in_backward() and not saved_tensor_hooks_active()
            and _len_torch_dispatch_stack() == 0)


def autocast_on(t: Tensor) -> bool:
    """``torch.is_autocast_enabled(t.device.type)``, asked only where autocast is on for some device: a call
    without autocast (the common one) is told by one flag, without building ``t``'s device and looking its type
    up by name, which costs a small call measurable host time."""
    return torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(t.device.type)
