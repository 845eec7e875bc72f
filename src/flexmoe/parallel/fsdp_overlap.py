"""FSDP2's collectives overlapped with compute where there are no device streams (gloo, the CPU).

On a GPU, FSDP2 overlaps its all-gathers and reduce-scatters with compute through CUDA streams. On the CPU it has
none: every gather waits in the block's pre-forward hook and every reduce-scatter in its post-backward hook, so
each block becomes a point where every rank waits for the slowest. With a block a unit, that is a dozen waits a
step where replication (``wrap_ddp``) has one, and what they cost is the ranks' skew, not the bytes moved.
:func:`overlap_gloo_collectives` gives FSDP2 the same overlap the streams give it (docs/architecture.md, "Models
larger than one rank"):

- **Gathers one block ahead.** Each unit's forward starts the gather of the next unit's parameters (root -> first
  block -> second block ...) without waiting for it; FSDP2's backward prefetch does the same in reverse. Gloo runs
  them on its own threads while this rank computes. At most one more block is gathered at a time.
- **Reduce-scatters waited at the end of backward.** :class:`DeferredReduceScatter` starts each unit's
  reduce-scatter and returns; autograd waits for all of them (and divides the reduced gradients) after the last
  gradient, before ``backward()`` returns, as DDP waits for its all-reduces. FSDP2 hands a unit's reduced gradients
  out as views of the reduce-scatter's output, so deferring is exact where nothing reads them before that: it is
  not done (the reduce-scatter waits at once, as before) where a gradient is accumulated into an existing one
  (micro-batches), cast to another dtype, offloaded, or read by a post-accumulate hook.

Numbers are unchanged: the same collectives in the same order, summed then divided as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["overlap_gloo_collectives", "DeferredReduceScatter"]

# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single; the same call otherwise.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def overlap_gloo_collectives(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Overlap the FSDP2 collectives of ``model`` (the root unit, already sharded) and its ``units`` (in forward
    order) with compute: gathers one unit ahead, reduce-scatters waited at the end of backward (module docstring).
    For process groups without device streams (gloo); NCCL overlaps through streams already."""
    order = [model, *units]
    sharded = [m for m in order if isinstance(m, FSDPModule)]
    if len(sharded) != len(order):
        raise TypeError("model and units must be sharded by fully_shard first")
    sharded[0]._set_unshard_async_op(True)  # every unit below the root too
    for unit, following in zip(sharded, sharded[1:]):
        unit.set_modules_to_forward_prefetch([following])
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            # HSDP all-reduces the reduce-scatter's output at once (it would read it before it is filled); a group
            # over one rank does not reduce-scatter.
            if isinstance(info, FSDPMeshInfo) and not isinstance(info, DDPMeshInfo) and info.shard_mesh_size > 1:
                group.force_sum_reduction_for_comms = False  # the division is DeferredReduceScatter's own
                group._reduce_scatter_comm = DeferredReduceScatter(group)


class DeferredReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one parameter group, summed and then divided by the group's gradient divide
    factor (gloo has no AVG or PREMUL_SUM), waited for at the end of the current backward where that is exact (see
    the module docstring), at once otherwise.

    ``output_tensor: [numel / shards]`` receives this rank's shard of ``input_tensor: [numel]`` (FSDP2's flat
    gradient buffers).
    """

    def __init__(self, param_group: FSDPParamGroup) -> None:
        self.param_group = param_group

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        # `op` is FSDP2's AVG / PREMUL_SUM(1 / factor) for the group's divide factor: done here as SUM, then divide.
        factor = self.param_group.gradient_divide_factor or float(group.size())
        work = _reduce_scatter(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

        def finish() -> None:
            work.wait()
            del keep_alive[:]
            if factor != 1:
                output_tensor.div_(factor)

        keep_alive = [input_tensor]  # FSDP2 may drop its reference to the input before the work ends
        if not self._deferrable(output_tensor):
            finish()
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(finish)
        except RuntimeError:  # called outside a backward pass: nothing to wait at the end of
            finish()

    def _deferrable(self, output_tensor: torch.Tensor) -> bool:
        """Whether FSDP2 hands out ``output_tensor``'s views as the gradients without reading them first."""
        for fsdp_param in self.param_group.fsdp_params:
            sharded = fsdp_param.sharded_param
            if (sharded.grad is not None or sharded.dtype != output_tensor.dtype or fsdp_param.offload_to_cpu
                    or getattr(sharded, "_post_accumulate_grad_hooks", None)):
                return False
        return True
