"""Tutel's ``net``: collectives over a process group, without and with autograd.

Every function works without torch.distributed (or on a group of one rank), where it is the identity (or the
obvious one-rank result). ``group=None`` is the world.

Without autograd: ``simple_all_reduce``, ``simple_all_to_all``, ``simple_split``, ``simple_reduce_scatter``,
``simple_all_gather``. With autograd: ``all_gather`` (backward: split), ``zero_gather`` (backward:
reduce-scatter, for ZeRO-style sharded parameters), ``zero_scatter``, ``spatial_split``, ``reduce_scatter``,
``allreduce_forward``, ``allreduce_backward``, ``all_to_all``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.compat.tutel.system import create_groups_from_world, create_standalone_group

__all__ = [
    "get_world_size", "get_world_rank", "barrier", "create_groups_from_world", "create_standalone_group",
    "simple_all_reduce", "simple_all_to_all", "simple_split", "simple_reduce_scatter", "simple_all_gather",
    "all_gather", "zero_gather", "zero_scatter", "spatial_split", "reduce_scatter", "allreduce_forward",
    "allreduce_backward", "all_to_all",
]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Any = None) -> int:
    """Ranks in ``group`` (1 without torch.distributed)."""
    return dist.get_world_size(group) if _initialized() else 1


def get_world_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without torch.distributed)."""
    return dist.get_rank(group) if _initialized() else 0


def barrier(group: Any = None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group=group)


def _check_divisible(length: int, world_size: int, what: str) -> None:
    if length % world_size:
        raise ValueError(f"{what}: dim 0 of length {length} does not divide into {world_size} ranks")


# ------------------------------------------------------------------------------------ without autograd
def simple_all_reduce(input: Tensor, group: Any = None, op: Any = dist.ReduceOp.SUM, inplace: bool = False) -> Tensor:
    """``op`` over the ranks of ``input`` (a copy unless ``inplace``)."""
    if get_world_size(group) == 1:
        return input
    output = input if inplace else input.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(output, op=op, group=group)
    return output


def simple_all_to_all(input: Tensor, group: Any = None, background: bool = False) -> Any:
    """Chunk i of dim 0 goes to rank i; returns what every rank sent here (``(output, wait)`` if
    ``background``)."""
    input = input.contiguous()
    if get_world_size(group) == 1:
        return (input, lambda: None) if background else input
    output = torch.empty_like(input)
    work = dist.all_to_all_single(output, input, group=group, async_op=background)
    return (output, work.wait) if background else output


def simple_split(input: Tensor, group: Any = None) -> Tensor:
    """This rank's chunk of dim 0."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    _check_divisible(input.shape[0], world_size, "simple_split")
    return input.contiguous().chunk(world_size, dim=0)[get_world_rank(group)]


def simple_reduce_scatter(input: Tensor, group: Any = None, op: Any = dist.ReduceOp.SUM) -> Tensor:
    """This rank's chunk of dim 0 of the ranks' ``op``."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    _check_divisible(input.shape[0], world_size, "simple_reduce_scatter")
    return simple_split(simple_all_reduce(input, group, op=op), group=group)  # gloo has no reduce_scatter


def simple_all_gather(input: Tensor, group: Any = None) -> Tensor:
    """The ranks' tensors concatenated along dim 0."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    input = input.contiguous()
    pieces = [torch.empty_like(input) for _ in range(world_size)]
    dist.all_gather(pieces, input, group=group)
    return torch.cat(pieces, dim=0)


# ------------------------------------------------------------------------------------ with autograd
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, fused: bool, group: Any) -> Tensor:
        ctx.group, ctx.fused = group, fused
        return simple_all_gather(input, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # fused: the gathered tensor is a parameter used by every rank, so its gradient sums over ranks.
        grad = grad.contiguous()
        piece = simple_reduce_scatter(grad, ctx.group) if ctx.fused else simple_split(grad, ctx.group)
        return piece, None, None


class _Shard(torch.autograd.Function):
    """This rank's piece of ``input`` (split, or reduce-scattered when ``reduce``); the gradient is gathered."""

    @staticmethod
    def forward(ctx, input: Tensor, group: Any, reduce: bool) -> Tensor:
        ctx.group = group
        return simple_reduce_scatter(input, group) if reduce else simple_split(input, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return simple_all_gather(grad, ctx.group), None, None


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, group: Any) -> Tensor:
        return simple_all_reduce(input, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return input

    @staticmethod
    def backward(ctx, grad: Tensor):
        return simple_all_reduce(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return simple_all_to_all(input, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return simple_all_to_all(grad, ctx.group), None


def _along(dim: int, fn: Callable[[Tensor], Tensor], input: Tensor) -> Tensor:
    """``fn`` (which works on dim 0) applied along ``dim``."""
    if dim == 0:
        return fn(input)
    return fn(input.transpose(0, dim).contiguous()).transpose(0, dim).contiguous()


def all_gather(input: Tensor, dim: int = 0, group: Any = None) -> Tensor:
    """Concatenate the ranks' tensors along ``dim``; the gradient of each rank's piece is its slice."""
    return _along(dim, lambda t: _AllGather.apply(t, False, group), input)


def spatial_split(input: Tensor, dim: int = 0, group: Any = None) -> Tensor:
    """This rank's slice along ``dim`` (the inverse of ``all_gather``)."""
    return _along(dim, lambda t: _Shard.apply(t, group, False), input)


def reduce_scatter(input: Tensor, dim: int = 0, group: Any = None) -> Tensor:
    """This rank's slice along ``dim`` of the sum over ranks."""
    return _along(dim, lambda t: _Shard.apply(t, group, True), input)


def allreduce_forward(input: Tensor, group: Any = None) -> Tensor:
    """Sum over ranks in the forward pass; the gradient passes through unchanged."""
    return _AllReduceForward.apply(input, group)


def allreduce_backward(input: Tensor, group: Any = None) -> Tensor:
    """Identity in the forward pass; the gradient is summed over ranks."""
    return _AllReduceBackward.apply(input, group)


def all_to_all(input: Tensor, input_dim: int, output_dim: int, use_2dh: bool = False, group: Any = None) -> Tensor:
    """Split ``input`` along ``output_dim`` into one chunk per rank, exchange, concatenate the received chunks
    along ``input_dim`` (Tutel's convention; ``use_2dh`` changes the algorithm there, not the result)."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input
    _check_divisible(input.shape[output_dim], world_size, "all_to_all")
    chunks = input.movedim(output_dim, 0)
    chunks = chunks.reshape(world_size, -1, *chunks.shape[1:])  # [W, piece of output_dim, ...]
    received = _AllToAll.apply(chunks.contiguous(), group)  # received[j]: rank j's piece for this rank
    # Glue the W received pieces along input_dim: move W next to input_dim and merge.
    received = received.movedim(1, output_dim + 1)  # [W, ...original layout with the piece of output_dim...]
    received = received.movedim(0, input_dim)
    shape = list(received.shape)
    shape[input_dim:input_dim + 2] = [shape[input_dim] * shape[input_dim + 1]]
    return received.reshape(shape)


def zero_gather(input: Tensor, full_shape: list[int] | None = None, group: Any = None) -> Tensor:
    """The full tensor from its ZeRO shards (each rank's ``input`` is one flat piece, dim 0 concatenated),
    cut to ``full_shape`` (default: dim 0 times the world size). The gradient is reduce-scattered."""
    if full_shape is None:
        full_shape = [input.shape[0] * get_world_size(group), *input.shape[1:]]
    numel = 1
    for n in full_shape:
        numel *= int(n)
    gathered = _AllGather.apply(input, True, group)
    return gathered.reshape(-1)[:numel].view(*full_shape)


def zero_scatter(input: Tensor, scatter_fn: Callable[..., Tensor], group: Any = None) -> tuple[Tensor, torch.Size]:
    """``(scatter_fn(flat input zero-padded to a multiple of the world size, group=group), input.shape)``."""
    world_size = get_world_size(group)
    flat = input.reshape(-1)
    if flat.numel() % world_size:
        padded = flat.new_zeros(-(-flat.numel() // world_size) * world_size)
        padded[:flat.numel()] = flat
        flat = padded
    return scatter_fn(flat, group=group), input.shape
