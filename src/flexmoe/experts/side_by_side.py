"""Gated experts' ``w1`` and ``w3`` stored side by side, so that one grouped GEMM reads both without a copy.

A gated expert computes ``x @ w1[e]`` and ``x @ w3[e]`` from the same rows. One grouped GEMM over the joined
weight ``[E, M, 2H]`` does both (Hugging Face stores that weight as one ``gate_up_proj``); with ``w1`` and ``w3``
in separate storage, joining them costs a copy of ``2 * E * M * H`` values on every call. flexmoe keeps ``w1``
and ``w3`` as two parameters (their names are the checkpoints', the sharding's and the adapters'), but allocates
them as the two halves of one ``[E, M, 2H]`` storage, as ``nn.RNN`` flattens its weights: ``w1`` is
``joined[..., :H]``, ``w3`` is ``joined[..., H:]``. :func:`side_by_side` then gives the joined weight as a view of
that storage, and its backward hands each half of the gradient to its parameter.

Whatever replaces a parameter's storage (``module.to``, ``load_state_dict(assign=True)``, sharding) only breaks
the layout: :func:`side_by_side` answers None for halves that do not sit side by side, and the caller joins them
by a copy, as before. :meth:`flexmoe.experts.modules.FeedForwardExperts._apply` lays them side by side again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["side_by_side_halves", "sit_side_by_side", "side_by_side", "still_halves_of"]


def side_by_side_halves(joined: Tensor) -> tuple[Tensor, Tensor]:
    """joined: ``[..., 2H]`` -> its two halves ``[..., H]`` (views: writing them writes ``joined``)."""
    half = joined.shape[-1] // 2
    return joined[..., :half], joined[..., half:]


def sit_side_by_side(first: Tensor, second: Tensor) -> bool:
    """Whether ``first`` and ``second`` (same shape ``[..., H]``) are the halves of one contiguous ``[..., 2H]``
    tensor: same storage, same strides, ``second`` H elements after ``first``, rows ``2H`` apart."""
    if type(first) is not type(second) or first.shape != second.shape or first.dtype != second.dtype:
        return False
    if first.dim() == 0 or first.device != second.device or first.is_sparse or second.is_sparse:
        return False
    if first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr():
        return False
    half = first.shape[-1]
    if first.stride() != second.stride() or second.storage_offset() != first.storage_offset() + half:
        return False
    # Contiguous as [..., 2H]: unit stride on the last dimension, each earlier one the product of the later sizes.
    expected = 2 * half
    for size, stride in zip(reversed(first.shape[:-1]), reversed(first.stride()[:-1]), strict=True):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return first.stride()[-1] == 1 or half == 1


class _SideBySide(torch.autograd.Function):
    """``[..., H]`` halves sitting side by side -> the ``[..., 2H]`` tensor they are the halves of (no copy);
    backward: the gradient's halves."""

    # The ctx-taking forward: the setup_context form measured 4x the host time per call (torch 2.13).
    @staticmethod
    def forward(ctx: Any, first: Tensor, second: Tensor) -> Tensor:
        shape = (*first.shape[:-1], 2 * first.shape[-1])
        stride = (*first.stride()[:-1], 1)
        return first.as_strided(shape, stride, first.storage_offset())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return side_by_side_halves(grad)


def side_by_side(first: Tensor, second: Tensor) -> Tensor | None:
    """``first``, ``second``: ``[..., H]`` -> the ``[..., 2H]`` tensor ``cat([first, second], -1)`` without a copy
    (gradients flow to both), or None where they are not the halves of one contiguous tensor (the caller copies).
    Reads only the tensors' layout, never their values."""
    if not sit_side_by_side(first, second):
        return None
    if not (first.requires_grad or second.requires_grad) or not torch.is_grad_enabled():
        shape = (*first.shape[:-1], 2 * first.shape[-1])
        return first.detach().as_strided(shape, (*first.stride()[:-1], 1), first.storage_offset())
    return _SideBySide.apply(first, second)


def still_halves_of(joined: Tensor | None, first: Tensor, second: Tensor) -> bool:
    """Whether ``first`` and ``second`` (``[..., H]``) are still the two halves of ``joined`` (``[..., 2H]``, the
    tensor their owner laid them out in: None, never): the same addresses and strides, compared without reading a
    value. What their owner cannot see is checked here: a parameter whose ``.data`` was replaced, or another tensor
    in its place (``torch.func.functional_call``, an adapter). A quick check of a few attributes, where
    :func:`sit_side_by_side` works the layout out from nothing. Not while compiling (dynamo does not trace a
    comparison of data pointers): the caller asks ``torch.compiler.is_compiling()`` first, once per call."""
    if joined is None:
        return False
    start, shape, half = joined.data_ptr(), first.shape, first.shape[-1]
    return (first.data_ptr() == start and second.data_ptr() == start + half * joined.itemsize
            and shape == second.shape and shape[:-1] == joined.shape[:-1] and 2 * half == joined.shape[-1]
            and first.stride() == joined.stride() and second.stride() == joined.stride()
            and first.dtype == joined.dtype and second.dtype == joined.dtype)
