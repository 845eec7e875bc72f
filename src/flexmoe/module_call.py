"""Calling a submodule for less host time: by its ``forward`` where ``nn.Module.__call__`` would do nothing else.

``Module.__call__`` looks up hooks in eight dictionaries, asks whether TorchScript is tracing and whether the
module was compiled, then calls ``forward``. On a small call (a decoding step, a few tokens) each such call costs
several microseconds of host time, as much as a small kernel; a layer call runs three or four of them. Where
nothing observes the module (:func:`runs_unobserved`), calling ``forward`` directly computes the same thing. A
module with a hook (a user's, FSDP2's all-gather, transformers' output recorders), a compiled module and a call
traced by TorchScript go through ``__call__`` as always.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

__all__ = ["call_module", "runs_unobserved"]


def runs_unobserved(module: nn.Module) -> bool:
    """Whether calling ``module`` would run its forward and nothing else: no forward or backward hook on it, no
    global module hook (``torch.nn.modules.module.register_module_forward_hook``, ...), not compiled by
    ``module.compile()``; torch's own condition for ``Module.__call__``'s plain path. transformers' output
    recorders (``output_router_logits=True``, kept once installed) are forward hooks: a hooked module runs."""
    hooked = (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
              or module._backward_pre_hooks or _torch_module._global_forward_hooks
              or _torch_module._global_forward_pre_hooks or _torch_module._global_backward_hooks
              or _torch_module._global_backward_pre_hooks)
    return not hooked and getattr(module, "_compiled_call_impl", None) is None


def call_module(module: nn.Module, *args: Any) -> Any:
    """``module(*args)``: its ``forward`` called directly where :func:`runs_unobserved` (and TorchScript is not
    tracing, whose ``__call__`` records the module's scope), else through ``Module.__call__``."""
    if runs_unobserved(module) and not torch._C._get_tracing_state():
        return module.forward(*args)
    return module(*args)
