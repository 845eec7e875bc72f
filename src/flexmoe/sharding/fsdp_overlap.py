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
- **Reduce-scatters waited later.** :class:`DeferredReduceScatter` starts each unit's reduce-scatter and returns;
  it is waited for (and the reduced gradients divided) when two newer ones are in flight
  (:class:`PendingReduceScatters`: the unsharded gradient buffers they read stay bounded, as FSDP2 bounds them on
  a GPU), or at the latest by autograd after the last gradient, before ``backward()`` returns. FSDP2 hands a
  unit's reduced gradients out as views of the reduce-scatter's output, so deferring is exact where nothing reads
  them before that: it is not done (the reduce-scatter waits at once, as before) where a gradient is accumulated
  into an existing one (micro-batches), cast to another dtype, offloaded, or read by a post-accumulate hook.

Numbers are unchanged: the same reductions in the same order, summed then divided as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

__all__ = ["overlap_gloo_collectives", "DeferredReduceScatter", "PendingReduceScatters"]

# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single; the same call otherwise.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def overlap_gloo_collectives(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """Overlap the FSDP2 collectives of ``model`` (the root unit, already sharded) and its ``units`` (in forward
    order) with compute: gathers one unit ahead, reduce-scatters waited later (module docstring).
    For process groups without device streams (gloo); NCCL overlaps through streams already."""
    order = [model, *units]
    sharded = [m for m in order if isinstance(m, FSDPModule)]
    if len(sharded) != len(order):
        raise TypeError("model and units must be sharded by fully_shard first")
    sharded[0]._set_unshard_async_op(True)  # every unit below the root too
    for unit, following in zip(sharded, sharded[1:]):
        unit.set_modules_to_forward_prefetch([following])
    # Reduce-scatters in flight beside gathers on one gloo group made a rank abort at exit now and then (about one
    # 4-rank run in 15); on a group of their own they do not (docs/performance.md). A torch without that option
    # keeps its reduce-scatters waited at once.
    if not hasattr(sharded[0], "set_separate_reduce_scatter_group"):
        return
    sharded[0].set_separate_reduce_scatter_group(True)
    pending = PendingReduceScatters()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            # HSDP all-reduces the reduce-scatter's output at once (it would read it before it is filled); a group
            # over one rank does not reduce-scatter.
            if isinstance(info, FSDPMeshInfo) and not isinstance(info, DDPMeshInfo) and info.shard_mesh_size > 1:
                group.force_sum_reduction_for_comms = False  # the division is DeferredReduceScatter's own
                group._reduce_scatter_comm = DeferredReduceScatter(group, pending)


class PendingReduceScatters:
    """The reduce-scatters started and not yet waited for, oldest first, shared by a model's parameter groups: at
    most ``limit`` in flight, so that the unsharded gradient buffers they read stay bounded (as FSDP2 bounds its
    reduce-scatter buffers on a GPU)."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.entries: list[_Pending] = []

    def add(self, entry: _Pending) -> None:
        self.entries.append(entry)
        while len(self.entries) > self.limit:
            self.entries.pop(0).finish()

    def finish_all(self) -> None:
        while self.entries:
            self.entries.pop(0).finish()


class _Pending:
    """One started reduce-scatter: ``finish`` waits for it and divides its output (once)."""

    def __init__(self, work: dist.Work, output: torch.Tensor, source: torch.Tensor, factor: float) -> None:
        self.work: dist.Work | None = work
        self.source: torch.Tensor | None = source
        self.output, self.factor = output, factor

    def finish(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work, self.source = None, None  # the input buffer may go
        if self.factor != 1:
            self.output.div_(self.factor)


class DeferredReduceScatter(DefaultAllocMixin, ReduceScatter):
    """FSDP2's reduce-scatter for one parameter group, summed and then divided by the group's gradient divide
    factor (gloo has no AVG or PREMUL_SUM). Where that is exact (see the module docstring) it is waited for later:
    when more than ``pending.limit`` are in flight, or at the end of the current backward at the latest; at once
    otherwise.

    ``output_tensor: [numel / shards]`` receives this rank's shard of ``input_tensor: [numel]`` (FSDP2's flat
    gradient buffers).
    """

    def __init__(self, param_group: FSDPParamGroup, pending: PendingReduceScatters) -> None:
        self.param_group = param_group
        self.pending = pending

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        # `op` is FSDP2's AVG / PREMUL_SUM(1 / factor) for the group's divide factor: done here as SUM, then divide.
        factor = self.param_group.gradient_divide_factor or float(group.size())
        work = _reduce_scatter(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        # The entry keeps the input alive: FSDP2 may drop its reference before the work ends.
        entry = _Pending(work, output_tensor, input_tensor, factor)
        if not self._deferrable(output_tensor):
            entry.finish()
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.pending.finish_all)
        except RuntimeError:  # called outside a backward pass: nothing to wait at the end of
            entry.finish()
            return
        self.pending.add(entry)

    def _deferrable(self, output_tensor: torch.Tensor) -> bool:
        """Whether FSDP2 hands out ``output_tensor``'s views as the gradients without reading them first."""
        for fsdp_param in self.param_group.fsdp_params:
            sharded = fsdp_param.sharded_param
            if (sharded.grad is not None or sharded.dtype != output_tensor.dtype or fsdp_param.offload_to_cpu
                    or getattr(sharded, "_post_accumulate_grad_hooks", None)):
                return False
        return True
