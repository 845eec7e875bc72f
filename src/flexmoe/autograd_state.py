"""Where autograd is: whether the code running now runs inside a backward pass."""

from __future__ import annotations

import torch

__all__ = ["in_backward"]


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpointing recomputation).

    Never while compiling: a compiled graph's backward recomputes tensors, it does not re-run the forward's code.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1
