"""What one rank holds of a model's training state: parameters, gradients and optimizer states, in bytes.

Counted from the local tensors (a DTensor's shard, not its global size), so the same count serves a replicated
model (``wrap_ddp``), a sharded one (:func:`flexmoe.sharding.parallelize`) and one process.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["local_state_bytes", "tensor_bytes"]


def tensor_bytes(t: Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds of ``model``'s parameters, their gradients and ``optimizer``'s states for them
    (e.g. AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``). A parameter shared by two modules counts once."""
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(tensor_bytes(p) + (tensor_bytes(p.grad) if p.grad is not None else 0) for p in params)
    if optimizer is not None:
        for p in params:
            total += sum(tensor_bytes(v) for v in optimizer.state.get(p, {}).values() if isinstance(v, Tensor))
    return total
