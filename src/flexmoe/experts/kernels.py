"""The ways of computing the experts over rows sorted by expert, behind one interface (docs/architecture.md,
"Expert compute").

Each kernel is an object with a ``name``, ``supports(case) -> str | None`` (None: it runs this case; else the
reason it does not: dtype, device, autograd, compile, layout) and ``run(rows, counts, weights) -> [N, M]``
(rows ``[N, M]`` sorted by expert, ``counts[e]`` rows each, weights ``[E, ...]``:
:class:`~flexmoe.experts.weights.ExpertWeights`). All compute the same numbers up to float rounding; which one is
fastest depends on the machine, the dtype and the shape, so :class:`~flexmoe.experts.chooser.KernelChooser`
times the supported ones and keeps the fastest per :class:`KernelCase` bucket.

Without a measurement the rule is the plain loop (:data:`RULE_KERNEL`): it runs every case, so it is never
slower than itself, and every other kernel earns its place by being timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from flexmoe.experts.row_kernels import (
    active_experts_ffn,
    embedding_bag_ffn,
    embedding_bag_supported,
    grouped_expert_ffn,
    grouped_mm_supported,
    joined_unit_ffn,
    looped_expert_ffn,
    segmented_expert_ffn,
)
from flexmoe.experts.weights import ExpertWeights

__all__ = ["KernelCase", "ExpertKernel", "KERNELS", "RULE_KERNEL", "ROUTES", "kernel_named", "supported_kernels",
           "power_of_two", "route_bucket"]


@dataclass(frozen=True)
class KernelCase:
    """What a kernel's support and speed depend on, for one call.

    device_type, dtype: the rows'; needs_grad: autograd records the call; compiling: traced by
    ``torch.compile``; autocast: autocast is on for the device; rows: N; experts: E; active: experts with rows;
    model_dim: M; hidden: H; glu: gated experts; uniform: every weight has the rows' dtype and device;
    grouped_layout: the strides ``torch._grouped_mm`` needs (:func:`~flexmoe.experts.row_kernels.grouped_mm_supported`);
    bag_layout: the contiguous weights and index size ``embedding_bag`` needs.
    """

    device_type: str
    dtype: torch.dtype
    needs_grad: bool
    compiling: bool
    autocast: bool
    rows: int
    experts: int
    active: int
    model_dim: int
    hidden: int
    glu: bool
    uniform: bool
    grouped_layout: bool
    bag_layout: bool

    @classmethod
    def of(cls, rows: Tensor, counts: list[int], weights: ExpertWeights) -> KernelCase:
        """The case of ``run(rows, counts, weights)``."""
        device_type = rows.device.type
        return cls(device_type=device_type, dtype=rows.dtype, needs_grad=weights.needs_grad(rows),
                   compiling=torch.compiler.is_compiling(), autocast=torch.is_autocast_enabled(device_type),
                   rows=rows.shape[0], experts=len(counts), active=sum(1 for n in counts if n),
                   model_dim=weights.model_dim, hidden=weights.hidden, glu=weights.glu,
                   uniform=weights.all_like(rows), grouped_layout=grouped_mm_supported(rows, weights),
                   bag_layout=embedding_bag_supported(rows, weights))

    def bucket(self) -> str:
        """The key a measurement is kept under: the device, dtype, autograd, autocast and the experts' shape
        exactly, the rows and the active experts by powers of two (a call of 300 rows is timed once for 257 to
        512). A call under autocast has a bucket of its own (``.../autocast``): only the loop runs it, and its
        decision must neither replace nor take the measured kernel of the same call without autocast."""
        return (f"{self.device_type}/{str(self.dtype).removeprefix('torch.')}/"
                f"{'train' if self.needs_grad else 'infer'}/E{self.experts}/M{self.model_dim}/H{self.hidden}/"
                f"{'glu' if self.glu else 'ffn'}/N{power_of_two(self.rows)}/A{power_of_two(self.active)}"
                f"{'/autocast' if self.autocast else ''}")


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class ExpertKernel(Protocol):
    """One way of computing the experts (module docstring)."""

    name: str

    def supports(self, case: KernelCase) -> str | None:
        """None when this kernel runs ``case``, else why not."""

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        """rows ``[N, M]`` sorted by expert, ``counts[e]`` rows each -> ``[N, M]``."""


class LoopKernel:
    """One ``addmm`` pair per expert: through autograd over ``w.unbind(0)``, or without autograd over the experts
    that have rows only. Runs every case (any dtype, device, autograd, compile)."""

    name = "loop"

    def supports(self, case: KernelCase) -> str | None:
        return None

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        if weights.needs_grad(rows):
            return looped_expert_ffn(rows, counts, weights)
        return active_experts_ffn(rows, counts, weights)


class SegmentedKernel:
    """The per-expert loop with a hand-written backward, one autograd node (:mod:`flexmoe.experts.segment_ffn`)."""

    name = "segmented"

    def supports(self, case: KernelCase) -> str | None:
        if not case.needs_grad:
            return "no autograd: its one gain is the backward"
        if case.compiling:
            return "torch.compile traces the loop instead of an opaque autograd.Function"
        if case.autocast:
            return "autocast: its matmuls write into buffers of the rows' dtype"
        return None if case.uniform else "the weights' dtype or device differs from the rows'"

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        return segmented_expert_ffn(rows, counts, weights)


class GroupedMMKernel:
    """One ``torch._grouped_mm`` per weight matrix over all experts (CPU: float32, bf16, fp16; CUDA: bf16)."""

    name = "grouped_mm"

    def supports(self, case: KernelCase) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return "this torch has no _grouped_mm"
        if case.compiling and case.dtype != torch.bfloat16:
            return "torch.compile takes _grouped_mm in bf16 only"
        if case.autocast:
            return "autocast: the grouped GEMM takes one dtype"
        if not case.grouped_layout:
            return f"_grouped_mm takes no {case.dtype} on {case.device_type}, or these strides (16-byte aligned)"
        return None

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        return grouped_expert_ffn(rows, counts, weights)


class EmbeddingBagKernel:
    """Each row's products as weighted sums of its expert's weight rows (``F.embedding_bag``), no matmul; no
    autograd (decoding: a few rows per expert)."""

    name = "embedding_bag"

    def supports(self, case: KernelCase) -> str | None:
        if case.needs_grad:
            return "autograd: the bags have no hand-written backward"
        if case.compiling:
            return "torch.compile: not traced"
        if case.rows == 0:
            return "no rows"
        if case.autocast:
            return "autocast: the bags take one dtype"
        return None if case.bag_layout else "the weights are not contiguous, or the index tensors would be too large"

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        return embedding_bag_ffn(rows, counts, weights)


class JoinedUnitKernel:
    """Each expert's matmuls into its rows of one buffer, the elementwise unit once over every row; no autograd
    (``out=``)."""

    name = "joined_unit"

    def supports(self, case: KernelCase) -> str | None:
        if case.needs_grad:
            return "autograd: it writes into buffers (out=)"
        if case.autocast:
            return "autocast: it writes into buffers of the rows' dtype"
        return None if case.uniform else "the weights' dtype or device differs from the rows'"

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        return joined_unit_ffn(rows, counts, weights)


KERNELS: dict[str, ExpertKernel] = {k.name: k for k in (LoopKernel(), SegmentedKernel(), GroupedMMKernel(),
                                                        EmbeddingBagKernel(), JoinedUnitKernel())}
# The rule without a measurement: the loop runs every case, and is the floor every other kernel is timed against.
RULE_KERNEL = "loop"


# The expert stage's routes a chooser may also time (flexmoe.experts.stage): dispatch, experts and combine fused
# expert by expert, or one after another over rows; ExpertOptions.expert_route forces one.
ROUTES = ("fused", "rows")


def route_bucket(tokens: Tensor, num_rows: int, weights: ExpertWeights) -> str:
    """The chooser's key for a route of the expert stage (:data:`ROUTES`): tokens ``[T, M]``, ``num_rows`` pairs
    computed; the device, dtype and experts' shape exactly, T and N by powers of two."""
    dtype = str(tokens.dtype).removeprefix("torch.")
    return (f"route/{tokens.device.type}/{dtype}/E{weights.num_experts}/M{weights.model_dim}/H{weights.hidden}/"
            f"{'glu' if weights.glu else 'ffn'}/T{power_of_two(tokens.shape[0])}/N{power_of_two(num_rows)}")


def kernel_named(name: str) -> ExpertKernel:
    """The kernel called ``name``; ValueError naming the known ones otherwise."""
    if name not in KERNELS:
        raise ValueError(f"expert_kernel must be 'auto' or one of {sorted(KERNELS)}, got {name!r}")
    return KERNELS[name]


def supported_kernels(case: KernelCase) -> list[ExpertKernel]:
    """The kernels that run ``case``, the rule's first."""
    return [k for k in KERNELS.values() if k.supports(case) is None]
