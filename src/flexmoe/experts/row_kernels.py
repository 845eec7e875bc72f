"""The experts' FFN over rows sorted by expert, computed several ways (docs/architecture.md, "Expert compute").

Every function here takes rows ``[N, M]`` sorted by expert, ``counts[e]`` rows for expert e (``sum(counts) ==
N``) and the experts' weights (:class:`~flexmoe.experts.weights.ExpertWeights`, ``[E, ...]``; H may be a hidden
shard, the result then a partial sum) and returns ``[N, M]``: the same numbers up to float rounding, at costs
that depend on the machine, the dtype and the shape. :mod:`flexmoe.experts.kernels` wraps each as a kernel
object that says which cases it runs; :class:`~flexmoe.experts.chooser.KernelChooser` picks among them by
measurement.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flexmoe.experts.segment_ffn import addmm_into, segment_expert_ffn
from flexmoe.experts.weights import ExpertWeights

__all__ = ["looped_expert_ffn", "one_expert_ffn", "active_experts_ffn", "joined_unit_ffn", "segmented_expert_ffn",
           "grouped_expert_ffn", "grouped_mm_supported", "embedding_bag_ffn", "embedding_bag_supported",
           "padded_expert_ffn", "joined_outputs", "check_counts", "all_like"]

# The index tensors of embedding_bag_ffn hold rows x max(M, H) entries: above this many it does not run (memory,
# not time).
_EMBEDDING_BAG_MAX_INDICES = 1 << 22


def grouped_mm_supported(rows: Tensor, weights: ExpertWeights) -> bool:
    """Whether :func:`grouped_expert_ffn` can run on these tensors: torch has ``_grouped_mm``, a dtype its kernel
    takes on this device (the CPU: float32, bf16, fp16; other devices: bf16), and strides in multiples of 16
    bytes, also those of the hidden activations it makes itself (``[N, H]``, contiguous)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if rows.device.type == "cpu" else (torch.bfloat16,)
    if rows.dtype not in dtypes or not weights.all_like(rows):
        return False
    matrices = [w for w in (weights.w1, weights.w2, weights.w3) if w is not None]
    return all(_strides_aligned(t) for t in (rows, *matrices)) and (weights.hidden * rows.element_size()) % 16 == 0


def all_like(rows: Tensor, *tensors: Tensor | None) -> bool:
    """Every tensor given (None: absent) has the rows' dtype and device."""
    return all(t.dtype == rows.dtype and t.device == rows.device for t in tensors if t is not None)


def _strides_aligned(t: Tensor) -> bool:
    """Every stride of a dimension longer than 1, other than a unit stride, is a multiple of 16 bytes."""
    return all(stride == 1 or (stride * t.element_size()) % 16 == 0
               for size, stride in zip(t.shape, t.stride()) if size > 1)


def embedding_bag_supported(rows: Tensor, weights: ExpertWeights) -> bool:
    """Whether :func:`embedding_bag_ffn` can run on these tensors: one dtype and device, contiguous weight
    matrices, and index tensors of at most ``_EMBEDDING_BAG_MAX_INDICES`` entries."""
    if not weights.all_like(rows):
        return False
    gated = weights.laid_out_gate_up() if weights.w3 is not None else None
    matrices = (weights.w1, weights.w2, weights.w3) if gated is None else (gated[0], weights.w2)
    if not all(w.is_contiguous() for w in matrices if w is not None):
        return False
    return rows.shape[0] * max(weights.model_dim, weights.hidden) <= _EMBEDDING_BAG_MAX_INDICES


def embedding_bag_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN with every row's products taken as weighted sums of its expert's
    weight rows, no matmul: ``x @ w[e] = sum_i x[i] * w[e][i, :]`` is ``F.embedding_bag`` over ``w`` viewed
    as ``[E * in, out]``, one bag per row (indices ``e * in + i``, ``per_sample_weights`` the row). One call per
    weight matrix covers all rows of all experts. No autograd; needs contiguous ``w1``, ``w2``, ``w3`` (or
    ``w1 | w3`` laid out side by side, one bag over 2H columns).

    Decoding routes a row or a few to each expert: per expert the matmuls then cost far more than the bytes
    they read (measured, see ``the bench's decode group), where the bags stream each row's weights
    once, spread over the threads."""
    num_experts = len(counts)
    check_counts(rows, counts)
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=rows.device),
                                         torch.tensor(counts, device=rows.device), output_size=rows.shape[0])
    # embedding_bag takes int32 indices: half the memory, while the flattened weight has fewer than 2^31 rows.
    index_dtype = torch.int32 if num_experts * max(weights.model_dim, weights.hidden) < 2**31 else torch.int64
    bags: dict[int, Tensor] = {}

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        fan_in, fan_out = w.shape[1], w.shape[2]
        if fan_in not in bags:  # [N, in]: row r's bag is its expert's in rows of the flattened weight
            bags[fan_in] = ((row_expert * fan_in).unsqueeze(1)
                            + torch.arange(fan_in, device=rows.device)).to(index_dtype)
        out = F.embedding_bag(bags[fan_in], w.view(num_experts * fan_in, fan_out), per_sample_weights=x,
                              mode="sum")
        return out if b is None else out.add_(b.index_select(0, row_expert))

    return weights.ffn(rows, linear)


def one_expert_ffn(rows: Tensor, weights: ExpertWeights) -> Tensor:
    """rows ``[N, M]`` through the one expert of ``weights`` (``[1, ...]``) -> ``[N, M]``: a plain matmul per
    weight, what every kernel computes for one expert (shared experts, usually), and the same products as the
    grouped GEMM's one group (bitwise, on the CPU) for less host work per call and no offsets to make."""
    def matmul(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out = x @ w.squeeze(0)
        return out if b is None else out + b  # b: [1, out]
    return weights.ffn(rows, matmul)


def grouped_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN as one ``torch._grouped_mm`` per weight matrix over all experts at once. Each expert's
    rows are one group (``offs``: where each group ends); the biases are gathered per row. Needs a dtype the
    device's grouped GEMM supports (:func:`grouped_mm_supported`)."""
    num_rows = rows.shape[0]
    check_counts(rows, counts)
    if num_rows == 0:
        return rows.new_zeros(0, weights.model_dim)
    if len(counts) == 1:
        return one_expert_ffn(rows, weights)
    sizes = torch.tensor(counts, device=rows.device)
    ends = sizes.cumsum(0).to(torch.int32)
    has_bias = any(b is not None for b in (weights.b1, weights.b2, weights.b3))
    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes,
                                         output_size=num_rows) if has_bias else None

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out = torch._grouped_mm(x, w, offs=ends)
        if b is None:
            return out
        assert row_expert is not None  # made above whenever the experts have biases
        return out + b.index_select(0, row_expert)

    return weights.ffn(rows, linear)


def segmented_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN as the per-expert loop with a hand-written backward, one autograd node for all experts
    (:func:`flexmoe.experts.segment_ffn.segment_expert_ffn`; shapes as there). The same matmuls as
    :func:`looped_expert_ffn`, written into full-size buffers; the elementwise unit runs once over all rows."""
    return segment_expert_ffn(rows, counts, weights)


def looped_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN as one ``addmm`` pair per expert over ``w.unbind(0)``, through autograd; any dtype and
    device. Indexing ``w[e]`` in the loop instead would write each slice's gradient into a full-size zero
    tensor (without autograd that costs nothing: :func:`active_experts_ffn`)."""
    check_counts(rows, counts)
    outputs = [expert.ffn(x, _linear) for x, expert in zip(rows.split(counts), weights.per_expert())
               if x.shape[0]]
    return joined_outputs(outputs, rows, weights.model_dim, weights)


def active_experts_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN as the plain loop over the experts that have rows, each expert's
    matmuls and unit on its own rows (the bench's floor without autograd)."""
    check_counts(rows, counts)
    outputs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outputs.append(weights.for_expert(e).ffn(rows[start : start + n], _linear))
        start += n
    return joined_outputs(outputs, rows, weights.model_dim, weights)


def joined_unit_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN with each expert's matmuls written into its rows of one buffer and
    the elementwise unit applied once over every row, between the two loops; no autograd (``out=``).

    Decoding routes a row or two to each of k experts: a unit call per expert then costs more than its matmuls
    (each elementwise call dispatches, and may wake the thread pool, for a few hundred elements)."""
    check_counts(rows, counts)
    w1, b1, w2, b2, w3, b3 = weights.tensors()
    assert w1 is not None and w2 is not None
    experts = [e for e, n in enumerate(counts) if n]
    sizes = [counts[e] for e in experts]
    # One split per buffer gives every expert's rows as views in a single call: slicing each buffer per expert
    # costs a dispatch per slice, and mm into a fresh slice measured ~3 us more than into a split view.
    xs = rows.split(sizes)
    pre1 = rows.new_empty(rows.shape[0], weights.hidden)
    pre3 = rows.new_empty(rows.shape[0], weights.hidden) if w3 is not None else None
    for e, x, p1 in zip(experts, xs, pre1.split(sizes)):
        addmm_into(p1, x, w1[e], _at(b1, e))
    if pre3 is not None and w3 is not None:
        for e, x, p3 in zip(experts, xs, pre3.split(sizes)):
            addmm_into(p3, x, w3[e], _at(b3, e))
    h = weights.unit(pre1, pre3)
    out = rows.new_empty(rows.shape[0], weights.model_dim)
    for e, hx, o in zip(experts, h.split(sizes), out.split(sizes)):
        addmm_into(o, hx, w2[e], _at(b2, e))
    return out


def _at(p: Tensor | None, e: int) -> Tensor | None:
    return p[e] if p is not None else None


def check_counts(rows: Tensor, counts: list[int]) -> None:
    """counts must cover the rows: ``sum(counts) == rows.shape[0]``."""
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"counts must sum to the number of rows {rows.shape[0]}, got {sum(counts)}")


def joined_outputs(outputs: list[Tensor], rows: Tensor, model_dim: int, weights: ExpertWeights | None = None,
                   ) -> Tensor:
    """The experts' outputs, in order, as ``[N, model_dim]`` (zeros when no expert had rows).

    The zeros stay on the graph of the rows and of ``weights``: a backward must still reach what made the rows
    (under expert parallelism, the exchange every rank's backward runs, or the ranks wait on each other), and the
    weights get zero gradients, as when some expert has rows (an optimizer skips a parameter without one)."""
    if not outputs:
        anchor = rows.sum() * 0
        for t in () if weights is None else weights.tensors():
            if t is not None:
                anchor = anchor + t.sum() * 0
        return rows.new_zeros(rows.shape[0], model_dim) + anchor
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def padded_expert_ffn(rows: Tensor, weights: ExpertWeights) -> Tensor:
    """The experts' FFN when every expert has the same number of rows: batched matmuls, no loop over experts.

    rows: ``[E, R, M]`` (expert e's R rows, padding included); weights ``[E, ...]`` -> ``[E, R, M]``.
    Row for row the same function as the other kernels; padding rows cost their FLOPs like any other row.
    """
    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # [E, R, in] @ [E, in, out] (+ [E, out])
        return torch.baddbmm(b.unsqueeze(1), x, w) if b is not None else torch.bmm(x, w)

    return weights.ffn(rows, linear)


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x: ``[n, in]``, w: ``[in, out]``, b: ``[out]`` -> ``[n, out]``."""
    return torch.addmm(b, x, w) if b is not None else x @ w
