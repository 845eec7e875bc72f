"""One linear layer per expert over rows sorted by expert, the counts a device tensor: the compiled dropless
path of the experts whose unit the fused custom ops cannot take by name (docs/architecture.md, "Compiling the
layer").

:mod:`flexmoe.experts.padded_op` computes the whole expert FFN in one custom op, which receives the activation by
name. A callable activation (GPT-OSS's ``g * sigmoid(alpha * g)``, any user function) or autocast cannot cross
that boundary. Here only the matmuls are custom ops, ``flexmoe::grouped_linear``: rows ``[N, in]`` sorted by
expert, ``tokens_per_expert`` ``[E]`` on the device, weights ``[E, in, out]`` (bias ``[E, out]``) ->
``[N, out]``, expert ``e``'s rows times ``w[e]``. The op is opaque to dynamo and inductor (its fake gives the
shapes, which follow from N alone), reads the counts inside, and loops over the experts with rows (the matmul
helpers of :mod:`flexmoe.experts.segment_ffn`). The elementwise unit between the two matmuls stays in the traced graph,
so any traceable activation works and inductor fuses it. This is also how Hugging Face's ``grouped_mm`` experts
run on the CPU under ``torch.compile``.

Off the CPU (a GPU), bf16 matmuls go to ``torch._grouped_mm`` instead, given the experts' row ends as a device
tensor (:func:`device_offsets_linear`): nothing is read back to the host, so the compiled layer never waits for the
device. On the CPU the custom op stays: there a host read costs nothing, and its loop of matmuls measured faster
than ``torch._grouped_mm`` (the benchmark suite's grouped floor).

The eager read-free path (:meth:`flexmoe.experts.stage.ExpertStage.read_free`) runs :func:`experts_ffn_by_ends`:
``torch._grouped_mm`` on any device, the offsets made once per call by its plan, never read by the host. On the
CPU a call with no more rows than experts runs :func:`experts_ffn_by_row_weights` instead: each row's own expert
weights gathered, then batched matmuls (:func:`gathers_row_weights`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexmoe.autograd_state import autocast_on
from flexmoe.experts.padded_op import register_op_pair
from flexmoe.experts.segment_ffn import contiguous_segments, expert_grad_buffer, linear_into, weight_grad_into
from flexmoe.experts.weights import ExpertWeights

__all__ = ["grouped_linear", "grouped_experts_ffn", "device_offsets_linear", "uses_device_offsets", "grouped_mm_runs",
           "experts_ffn_by_ends", "GATHER_MAX_VALUES", "gathers_row_weights",
           "experts_ffn_by_row_weights"]

# A change to either op's signature needs a new name (inductor's on-disk cache keeps graphs that call it).
_OP = "flexmoe::grouped_linear"
_BACKWARD_OP = "flexmoe::grouped_linear_backward"


def _forward_impl(rows: Tensor, tokens_per_expert: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    counts = tokens_per_expert.tolist()
    rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0], w.shape[-1])
    for e, start, n in contiguous_segments(counts):
        linear_into(out[start:start + n], rows[start:start + n], w[e], b, e)
    out[sum(counts):].zero_()  # rows past the counted ones belong to no expert
    return out


def _forward_fake(rows: Tensor, tokens_per_expert: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return rows.new_empty(rows.shape[0], w.shape[-1])


def _backward_impl(grad_out: Tensor, rows: Tensor, tokens_per_expert: Tensor, w: Tensor,
                   needs: list[bool]) -> list[Tensor]:
    """-> the gradients of ``rows, w, b`` (an empty tensor where ``needs`` is False); experts without rows get
    zero weight gradients, uncounted rows a zero row gradient."""
    need_x, need_w, need_b = needs
    counts = tokens_per_expert.tolist()
    segments = contiguous_segments(counts)
    grad_out, rows = grad_out.contiguous(), rows.contiguous()
    num_experts = w.shape[0]
    active = [e for e, _, _ in segments]
    grad_w = expert_grad_buffer(w.shape, w, active, num_experts) if need_w else None
    grad_b = expert_grad_buffer((num_experts, w.shape[-1]), w, active, num_experts) if need_b else None
    grad_x = rows.new_empty(rows.shape) if need_x else None
    for e, start, n in segments:
        g = grad_out[start:start + n]
        weight_grad_into(grad_w, grad_b, e, rows[start:start + n], g, True)  # packed: one segment per expert
        if grad_x is not None:
            torch.mm(g, w[e].transpose(0, 1), out=grad_x[start:start + n])
    if grad_x is not None:
        grad_x[sum(counts):].zero_()
    return [g if g is not None else rows.new_empty(0) for g in (grad_x, grad_w, grad_b)]


def _backward_fake(grad_out: Tensor, rows: Tensor, tokens_per_expert: Tensor, w: Tensor,
                   needs: list[bool]) -> list[Tensor]:
    shapes = [rows.shape, w.shape, (w.shape[0], w.shape[-1])]
    return [rows.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs)]


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    rows, tokens_per_expert, w, b = inputs
    ctx.save_for_backward(rows, tokens_per_expert, w)
    ctx.has_bias = b is not None


def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    rows, tokens_per_expert, w = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[2]),
             bool(ctx.has_bias and ctx.needs_input_grad[3])]
    grads = torch.ops.flexmoe.grouped_linear_backward(grad_out, rows, tokens_per_expert, w, needs)
    grad_x, grad_w, grad_b = (g if need else None for g, need in zip(grads, needs))
    return grad_x, None, grad_w, grad_b


# Nothing is registered on a torch without the API (before 2.4; flexmoe.experts.padded_op.padded_op_available).
register_op_pair(_OP, _forward_impl, _forward_fake, _BACKWARD_OP, _backward_impl, _backward_fake, _backward,
                 _setup_context)


def uses_device_offsets(device_type: str, dtype: torch.dtype, w_shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether :func:`grouped_linear` runs :func:`device_offsets_linear` for matmuls of ``dtype`` on a device of
    ``device_type`` with weights of shape ``[E, in, out]``: off the CPU, in bf16 (the dtype torch's grouped GEMM
    takes on every device), with ``in`` and ``out`` multiples of 8 (its 16-byte alignment)."""
    return (device_type != "cpu" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and w_shape[-2] % 8 == 0 and w_shape[-1] % 8 == 0)


def device_offsets_linear(rows: Tensor, tokens_per_expert: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """:func:`grouped_linear` by ``torch._grouped_mm``, the experts' row ends a device tensor: rows ``[N, in]``
    sorted by expert with ``N == tokens_per_expert.sum()`` (dropless: every row is counted), w ``[E, in, out]``,
    b ``[E, out]`` or None -> ``[N, out]``. No value reaches the host; autograd and ``torch.compile`` see aten ops
    only. bf16 (the grouped GEMM's dtype)."""
    ends = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
    out = torch._grouped_mm(rows, w, offs=ends)
    if b is not None:
        expert_of_row = torch.repeat_interleave(torch.arange(w.shape[0], device=rows.device), tokens_per_expert,
                                                output_size=rows.shape[0])  # [N]; output_size: no host read
        out = out + b.index_select(0, expert_of_row)
    return out


def grouped_linear(rows: Tensor, tokens_per_expert: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """rows: ``[N, in]`` sorted by expert, ``tokens_per_expert[e]`` rows each (``[E]`` long, on the device);
    w: ``[E, in, out]``, b: ``[E, out]`` or None -> ``[N, out]``. Under autocast the matmuls run in autocast's
    dtype, as ``torch.mm`` would; otherwise rows, w and b must share a dtype."""
    device_type = rows.device.type
    if autocast_on(rows):
        dtype = torch.get_autocast_dtype(device_type)
        rows, w = rows.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
    if uses_device_offsets(device_type, rows.dtype, w.shape) and w.dtype == rows.dtype:
        return device_offsets_linear(rows, tokens_per_expert, w, b)
    out: Tensor = torch.ops.flexmoe.grouped_linear(rows, tokens_per_expert, w, b)
    return out


def grouped_experts_ffn(rows: Tensor, tokens_per_expert: Tensor, weights: ExpertWeights) -> Tensor:
    """rows: ``[N, M]`` sorted by expert, ``tokens_per_expert`` ``[E]`` on the device, weights ``[E, ...]`` ->
    ``[N, M]``: the experts' FFN with any activation, the matmuls by :func:`grouped_linear`, the unit traced in
    between."""
    pre1 = grouped_linear(rows, tokens_per_expert, weights.w1, weights.b1)  # [N, H]
    pre3 = None if weights.w3 is None else grouped_linear(rows, tokens_per_expert, weights.w3, weights.b3)
    return grouped_linear(weights.unit(pre1, pre3), tokens_per_expert, weights.w2, weights.b2)


def grouped_mm_runs(device_type: str, dtype: torch.dtype, w_shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether ``torch._grouped_mm`` takes matmuls of ``dtype`` with weights ``[E, in, out]`` on a device of
    ``device_type``: this torch has it; on the CPU float32, bfloat16 or float16 (float64 it refuses; torch 2.13),
    elsewhere bfloat16 (:func:`uses_device_offsets`: the checks of its CUDA kernel, as torch's meta function
    states them); ``in`` and ``out`` 16 bytes apart (its alignment)."""
    if device_type != "cpu":
        return uses_device_offsets(device_type, dtype, w_shape)
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per_16_bytes = 16 // dtype.itemsize
    return w_shape[-2] % per_16_bytes == 0 and w_shape[-1] % per_16_bytes == 0


# The largest w1 ([E, M, H] elements) whose w1 and w3 are joined by a copy per call (experts_ffn_by_ends): 4 MiB
# in float32.
JOIN_GATED_MAX_ELEMENTS = 1 << 20


def joined(first: Tensor, second: Tensor) -> Tensor | None:
    """``[..., H]`` twice -> ``cat([first, second], -1)`` ``[..., 2H]`` by a copy where small; None for large
    weights (the caller runs them apart rather than copy them). Joined experts' pair is read in place instead
    (:meth:`ExpertWeights.laid_out_gate_up`)."""
    return torch.cat([first, second], dim=-1) if first.numel() <= JOIN_GATED_MAX_ELEMENTS else None


def experts_ffn_by_ends(rows: Tensor, expert_ends: Tensor, row_expert: Tensor, weights: ExpertWeights) -> Tensor:
    """The experts' FFN by ``torch._grouped_mm`` without a host read: rows ``[N, M]`` sorted by expert (every row
    counted), expert_ends ``[E]`` int32 the row after each expert's last (the grouped GEMM's offsets, made once
    per call, not per matmul), row_expert ``[N]`` each row's expert (for the biases) -> ``[N, M]``. Under autocast
    the matmuls run in its dtype, as ``torch.mm`` would (``torch._grouped_mm`` is not recast by autocast)."""
    dtype = torch.get_autocast_dtype(rows.device.type) if autocast_on(rows) else None

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        if dtype is not None:
            x, w = x.to(dtype), w.to(dtype)
            b = None if b is None else b.to(dtype)
        out = torch._grouped_mm(x, w, offs=expert_ends)
        return out if b is None else out.add_(b.index_select(0, row_expert))  # in place: the GEMM keeps no output

    # Gated experts: w1 and w3 side by side in one grouped GEMM ([N, 2H]), as HF's gate_up_proj: one grouped GEMM
    # fewer, forward and backward, where the call's time is host work.
    return weights.ffn(rows, linear, join=joined)


# The most values of one weight the gathered path copies for a call (N * M * H): measured on a 2-core AVX2 CPU
# (gated, forward + backward, against the grouped GEMMs) 2.4-2.5x faster at M=64 H=32 up to E=N=64 (131072), level
# at M=256 H=128 E=N=16 (524288); a converted Qwen3-MoE block at E=64 k=8 M=512 H=256 ran 0.98x HF's time at T=1
# (1M values) and 1.98x at T=8, and 1.5-5.1x without autograd, where the decoding path ran 0.50-0.70x.
GATHER_MAX_VALUES = 1 << 18


def gathers_row_weights(tokens: Tensor, num_rows: int, weights: ExpertWeights) -> bool:
    """Whether the read-free path runs :func:`experts_ffn_by_row_weights` for ``num_rows`` rows N of ``tokens``
    ``[T, M]`` (their device decides): on the CPU, with N <= E (the gathered weights are no larger than the weights
    themselves) and at most :data:`GATHER_MAX_VALUES` values of a weight gathered (N * M * H: the copy must stay
    small beside the host work it saves). Off the CPU the grouped GEMM reads the active experts' weights in place,
    where a gather would copy them."""
    return tokens.is_cpu and num_rows <= weights.num_experts and \
        num_rows * weights.model_dim * weights.hidden <= GATHER_MAX_VALUES


def experts_ffn_by_row_weights(rows: Tensor, row_expert: Tensor, weights: ExpertWeights) -> Tensor:
    """The experts' FFN for few rows without a host read: rows ``[N, M]``, row_expert ``[N]`` each row's expert ->
    ``[N, M]``. Each weight is gathered per row (``[N, M, H]``, one ``index_select``) and each row multiplied by its
    own (``bmm`` over N batches of one row; biases by ``baddbmm``): no counts, no offsets, and the backward
    scatters each row's weight gradient into its expert's. Under autocast the matmuls run in its dtype, as
    :func:`experts_ffn_by_ends`' do."""
    dtype = torch.get_autocast_dtype(rows.device.type) if autocast_on(rows) else None

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # x: [N, 1, in] -> [N, 1, out]
        w = w.index_select(0, row_expert)  # [N, in, out]
        bias = None if b is None else b.index_select(0, row_expert).unsqueeze(1)  # [N, 1, out]
        if dtype is not None:
            x, w = x.to(dtype), w.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias, x, w)

    return weights.ffn(rows.unsqueeze(1), linear).squeeze(1)  # rows as [N, 1, M]
