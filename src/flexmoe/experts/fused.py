"""Dispatch, the experts' FFN and combine, fused expert by expert into one autograd node (docs/architecture.md,
"Fused experts").

The three-stage path (:func:`flexmoe.dispatch.dispatch`, the experts, :func:`flexmoe.dispatch.combine`) writes
the dispatched rows ``[N, M]`` and the experts' output ``[N, M]`` (``N = T * k``) to memory, keeps both for
backward, and in backward writes two more such tensors. With many small experts (E >= 64, k = 8) those passes
over fresh ``[N, M]`` buffers cost as much as a fifth of the step. Here each expert's rows are gathered from the
tokens, pass through its FFN and are added, weighted, into their tokens' output while they are still in cache
(small experts a few at a time, :func:`expert_chunks`); only the pre-activations and ``h`` (``[N, H]`` in
pieces) are kept for backward.

For expert ``e`` with rows ``r`` (tokens ``t_r``, combine weights ``w_r``)::

    forward:   p_r = x[t_r] @ w1[e] + b1[e],   h_r = unit(p_r),   y[t_r] += w_r * (h_r @ w2[e] + b2[e])
    backward:  g_r = grad_y[t_r],   d_r = g_r @ w2[e]^T
               grad w_r = <d_r, h_r> + <g_r, b2[e]>      (the expert's output itself is never stored)
               grad h_r = w_r * d_r,  grad w2[e] = sum_r h_r^T (w_r g_r),  grad b2[e] = sum_r w_r g_r
               grad p_r = unit's vjp,  grad w1[e] = sum_r x[t_r]^T grad p_r,  grad x[t_r] += grad p_r @ w1[e]^T

and likewise ``w3`` for gated experts. The unit's derivative is autograd's own formula for the named activations
and autograd on the elementwise call alone otherwise (:class:`HiddenUnit`), so any activation and GPT-OSS's
clamped unit work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from flexmoe.autograd_state import autocast_on
from flexmoe.experts import activation_derivative, activation_into
from flexmoe.experts.segment_ffn import add_bias_grad, add_weight_grad, addmm_into, expert_grad_buffer, record_unit
from flexmoe.experts.weights import ExpertWeights, hidden_unit

__all__ = ["HiddenUnit", "CHUNK_ROWS", "expert_chunks", "fused_experts", "fused_forward", "fused_backward",
           "fused_size_rule", "fused_supported"]

@dataclass(frozen=True)
class HiddenUnit:
    """The experts' elementwise hidden unit (:func:`flexmoe.experts.hidden_unit`) and its derivative: in closed
    form for the named activations without a clamp, else by autograd on the elementwise call alone."""

    activation: Callable[[Tensor], Tensor]
    glu_limit: float | None = None

    @classmethod
    def of(cls, weights: ExpertWeights) -> HiddenUnit:
        """The unit of these experts' weights."""
        return cls(weights.activation, weights.glu_limit)

    def __call__(self, pre1: Tensor, pre3: Tensor | None) -> Tensor:
        """pre1, pre3: ``[n, H]`` (pre3 None without gating) -> h ``[n, H]``."""
        return hidden_unit(pre1, pre3, self.activation, self.glu_limit)

    def into(self, pre1: Tensor, pre3: Tensor | None, out: Tensor) -> Tensor:
        """h = unit(pre1, pre3) written into ``out`` ``[n, H]``: by the activation's out= kernel where it has one
        (no temporary), else computed and copied."""
        into = activation_into(self.activation) if self.glu_limit is None else None
        if into is None:
            return out.copy_(self(pre1, pre3))
        if pre3 is None:
            return into(pre1, out)
        return into(pre1, out).mul_(pre3)

    def backward(self, grad_h: Tensor, pre1: Tensor, pre3: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """grad_h: ``[n, H]`` (overwritten) -> the gradients of pre1 and pre3 (None without gating)."""
        derivative = activation_derivative(self.activation) if self.glu_limit is None else None
        if derivative is None:
            grads = record_unit(pre1, pre3, self)[1](grad_h)
            return grads[0], (grads[1] if len(grads) > 1 else None)
        if pre3 is None:
            return derivative(grad_h, pre1, grad_h), None
        grad_pre3 = grad_h * self.activation(pre1)
        return derivative(grad_h.mul_(pre3), pre1, grad_h), grad_pre3


# Experts with few rows are taken a few at a time: the gathers, the elementwise work and the scatter-add run once
# per chunk of consecutive experts of at least this many rows (the matmuls stay per expert), so their op count
# stays that of E=64, k=8 at T=4096 (512 rows per expert) when E is 128 or 256. Fused experts over the loop floor,
# E=64/128/256, two runs: chunks of 256 rows 1.06/1.04/1.01 and 1.01/1.12/-, 512 1.05/1.01/0.91 and 0.99/0.99/-,
# 1024 1.04/0.97/0.89 and 1.04/1.01/-, 2048 1.03/0.96/0.93 and 1.05/1.02/-: within the noise but for 256.
CHUNK_ROWS = 512

Chunk = tuple[int, int, list[tuple[int, int, int]]]  # (first row, rows, [(expert, first row in the chunk, rows)])


def expert_chunks(counts: Sequence[int], min_rows: int = CHUNK_ROWS) -> list[Chunk]:
    """The rows, sorted by expert with ``counts[e]`` rows each, cut into chunks of whole consecutive experts,
    each closed once it holds at least ``min_rows`` rows (the last may hold fewer); experts without rows are
    left out."""
    chunks: list[Chunk] = []
    first, rows, members = 0, 0, []
    for e, n in enumerate(counts):
        if n:
            members.append((e, rows, n))
            rows += n
        if rows >= min_rows:
            chunks.append((first, rows, members))
            first, rows, members = first + rows, 0, []
        elif not members:
            first += n
    if members:
        chunks.append((first, rows, members))
    return chunks


def _per_expert(p: Tensor | None, num_experts: int) -> Sequence[Tensor | None]:
    """``p[e]`` for every expert, as views made in one call (indexing in the loop costs a dispatch each)."""
    return p.unbind(0) if p is not None else [None] * num_experts


KeptBuffers = Callable[[int, int], tuple[Tensor, Tensor | None, Tensor]]


def fused_forward(tokens: Tensor, row_token: Tensor, row_weight: Tensor, weights: ExpertWeights,
                  chunks: list[Chunk], kept_buffers: KeptBuffers | None = None) -> tuple[Tensor, list[Tensor]]:
    """The forward of :func:`fused_experts`: ``y [T, M]`` and what the backward needs, per chunk ``pre1,
    (pre3,) h`` (``[n, H]`` each).

    weights: ``[E, ...]`` with their unit; chunks: rows ``start .. start + n`` of ``row_token`` / ``row_weight``
    (:func:`expert_chunks`, or one per unit of a padded plan). ``kept_buffers(start, n)`` gives the places to
    keep a chunk's ``pre1, pre3, h`` in (views of full-size outputs, for the compiled op); by default each chunk
    gets its own pieces."""
    w1, b1, w2, b2, w3, b3 = weights.tensors()
    assert w1 is not None and w2 is not None
    unit = HiddenUnit.of(weights)
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    y = tokens.new_zeros(tokens.shape[0], model_dim)
    kept: list[Tensor] = []
    w1s, b1s, w2s, b2s, w3s, b3s = (_per_expert(p, num_experts) for p in (w1, b1, w2, b2, w3, b3))
    for start, n, members in chunks:
        token = row_token[start:start + n]
        x = tokens.index_select(0, token)  # [n, M]
        if kept_buffers is not None:
            pre1, pre3, h_place = kept_buffers(start, n)
        else:
            pre1, h_place = x.new_empty(n, hidden), None
            pre3 = x.new_empty(n, hidden) if w3 is not None else None
        for e, a, m in members:
            addmm_into(pre1[a:a + m], x[a:a + m], w1s[e], b1s[e])  # type: ignore[arg-type]
            if pre3 is not None:
                addmm_into(pre3[a:a + m], x[a:a + m], w3s[e], b3s[e])  # type: ignore[arg-type]
        h = unit(pre1, pre3) if h_place is None else unit.into(pre1, pre3, h_place)
        out = x.new_empty(n, model_dim)
        for e, a, m in members:
            addmm_into(out[a:a + m], h[a:a + m], w2s[e], b2s[e])  # type: ignore[arg-type]
        y.index_add_(0, token, out.mul_(row_weight[start:start + n].unsqueeze(-1)))
        kept += [pre1, h] if pre3 is None else [pre1, pre3, h]
    return y, kept


def fused_backward(grad_y: Tensor, tokens: Tensor, row_token: Tensor, row_weight: Tensor, weights: ExpertWeights,
                   chunks: list[Chunk], kept: Sequence[Tensor], needs: Sequence[bool]) -> list[Tensor | None]:
    """The gradients of :func:`fused_forward`: ``[tokens, row_weight, w1, b1, w2, b2, w3, b3]``, each None where
    ``needs`` (eight flags) is False; a flag must be False for a bias or ``w3`` that does not exist.
    ``row_weight``'s gradient is written for the chunks' rows only (a padded plan's empty rows: left as they are;
    the caller zeroes them)."""
    w1, _, w2, b2, w3, _ = weights.tensors()
    assert w1 is not None and w2 is not None
    unit = HiddenUnit.of(weights)
    need_x, need_weight, need_w1, need_b1, need_w2, need_b2, need_w3, need_b3 = needs
    grad_y = grad_y.contiguous()
    num_experts, hidden, model_dim = w1.shape[0], w1.shape[-1], w2.shape[-1]
    active = sorted({e for _, _, members in chunks for e, _, _ in members})

    def buffer(shape: Sequence[int], wanted: bool) -> Tensor | None:
        return expert_grad_buffer(shape, grad_y, active, num_experts) if wanted else None

    grad_w1, grad_w2 = buffer(w1.shape, need_w1), buffer(w2.shape, need_w2)
    grad_w3 = buffer(w3.shape, need_w3) if w3 is not None else None
    grad_b1 = buffer((num_experts, hidden), need_b1)
    grad_b2 = buffer((num_experts, model_dim), need_b2)
    grad_b3 = buffer((num_experts, hidden), need_b3)
    gw1, gw2, gw3, gb1, gb2, gb3 = (_per_expert(p, num_experts)
                                    for p in (grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3))
    w1s, w2s, w3s, b2s = (_per_expert(p, num_experts) for p in (w1, w2, w3, b2))
    grad_tokens = torch.zeros_like(tokens) if need_x else None
    grad_weight = row_weight.new_empty(row_weight.shape) if need_weight else None
    pieces = iter(kept)
    seen: set[int] = set()

    for start, n, members in chunks:
        pre1 = next(pieces)
        pre3 = next(pieces) if w3 is not None else None
        h = next(pieces)
        token = row_token[start:start + n]
        weight = row_weight[start:start + n].unsqueeze(-1)  # [n, 1]
        g = grad_y.index_select(0, token)  # [n, M]: the gradient of the weighted output
        d = g.new_empty(n, hidden)  # the gradient of h, before the weight
        for e, a, m in members:
            torch.mm(g[a:a + m], w2s[e].transpose(0, 1), out=d[a:a + m])  # type: ignore[union-attr]
        if grad_weight is not None:  # <g_r, out_r> = <d_r, h_r> + <g_r, b2[e]>
            chunk_grad = grad_weight[start:start + n]
            torch.linalg.vecdot(d, h, out=chunk_grad)
            for e, a, m in members:
                bias = b2s[e]
                if bias is not None:
                    chunk_grad[a:a + m].addmv_(g[a:a + m], bias)
        # An expert's first chunk writes its weight gradients, later ones (a padded plan's other sequences) add.
        first = [e not in seen for e, _, _ in members]
        seen.update(e for e, _, _ in members)
        if grad_w2 is not None or grad_b2 is not None:
            weighted_h = h * weight
            for (e, a, m), writes in zip(members, first):
                add_weight_grad(gw2[e], weighted_h[a:a + m], g[a:a + m], writes)
                add_bias_grad(gb2[e], g[a:a + m], writes, weight[a:a + m, 0])
        grad_pre1, grad_pre3 = unit.backward(d.mul_(weight), pre1, pre3)
        x = tokens.index_select(0, token) if grad_w1 is not None or grad_w3 is not None else None
        grad_x = g.new_empty(n, model_dim) if grad_tokens is not None else None
        for (e, a, m), writes in zip(members, first):
            if x is not None:
                add_weight_grad(gw1[e], x[a:a + m], grad_pre1[a:a + m], writes)
            add_bias_grad(gb1[e], grad_pre1[a:a + m], writes)
            if grad_pre3 is not None:
                if x is not None:
                    add_weight_grad(gw3[e], x[a:a + m], grad_pre3[a:a + m], writes)
                add_bias_grad(gb3[e], grad_pre3[a:a + m], writes)
            if grad_x is not None:
                torch.mm(grad_pre1[a:a + m], w1s[e].transpose(0, 1), out=grad_x[a:a + m])  # type: ignore
                if grad_pre3 is not None:
                    grad_x[a:a + m].addmm_(grad_pre3[a:a + m], w3s[e].transpose(0, 1))  # type: ignore
        if grad_tokens is not None and grad_x is not None:
            grad_tokens.index_add_(0, token, grad_x)
    return [grad_tokens, grad_weight, grad_w1, grad_b1, grad_w2, grad_b2, grad_w3, grad_b3]


class _FusedExperts(torch.autograd.Function):
    """One autograd node: ``tokens [T, M]`` and ``row_weight [N]`` in, ``y [T, M]`` out (module docstring).

    What backward needs is kept per chunk (``pre1``, ``pre3``, ``h``: ``[n, H]`` each), not in full-size
    ``[N, H]`` buffers: a buffer that large is mapped fresh by the allocator on every call, and writing it
    page-faults, while chunk-sized pieces are reused from the heap (measured: ~20% of the forward at E=64)."""

    @staticmethod
    def forward(ctx: Any, tokens: Tensor, row_weight: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor,
                b2: Tensor | None, w3: Tensor | None, b3: Tensor | None, row_token: Tensor, chunks: list[Chunk],
                weights: ExpertWeights) -> Tensor:
        # The tensors come in loose as well, so that autograd sees each as an input (and returns its gradient).
        y, kept = fused_forward(tokens, row_token, row_weight, weights, chunks)
        ctx.save_for_backward(tokens, row_weight, w1, b2, w2, w3, row_token, *kept)
        ctx.chunks, ctx.unit = chunks, HiddenUnit.of(weights)
        ctx.present = (True, True, True, b1 is not None, True, b2 is not None, w3 is not None, b3 is not None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        tokens, row_weight, w1, b2, w2, w3, row_token, *kept = ctx.saved_tensors
        needs = [bool(want and present) for want, present in zip(ctx.needs_input_grad[:8], ctx.present)]
        weights = ExpertWeights(w1, None, w2, b2, w3, None, ctx.unit.activation, ctx.unit.glu_limit)
        grads = fused_backward(grad_y, tokens, row_token, row_weight, weights, ctx.chunks, kept, needs)
        return (*grads, None, None, None)


def fused_experts(tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: Sequence[int],
                  weights: ExpertWeights, *, chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """``y[t] = sum over the rows r of token t of row_weight[r] * expert_e(r)(tokens[t])``: dispatch, the experts'
    FFN and a weighted combine in one pass per expert (module docstring).

    tokens: ``[T, M]``; row_token: ``[N]`` the token of each row, rows sorted by expert, ``counts[e]`` rows each;
    row_weight: ``[N]`` in tokens' dtype; weights: ``[E, ...]`` with their unit; chunk_rows: the experts are
    taken in chunks of at least this many rows (:func:`expert_chunks`) -> ``[T, M]``. Differentiable once in
    tokens, row_weight and every weight.
    """
    if sum(counts) != row_token.shape[0]:
        raise ValueError(f"counts must sum to the number of rows {row_token.shape[0]}, got {sum(counts)}")
    return _FusedExperts.apply(tokens.contiguous(), row_weight, *weights.tensors(), row_token,
                               expert_chunks(counts, chunk_rows), weights)


# The compiled padded path has no first call to time (flexmoe.experts.padded_fused_op): it takes the fused op for
# blocks of rows x model_dim of at least this many elements, where eager's fused experts measured faster on a 2-core CPU
# (T=4096 M=512 k=8 fp32: over the loop floor 1.06 at E=64 H=256, three stages 1.18-1.29; above 32 MiB the three
# stages' blocks are mapped afresh and page-faulted on every call). Eager calls choose by measurement
# (flexmoe.experts.stage.runs_fused).
_FUSED_MIN_ROW_ELEMENTS = 1 << 23  # rows x model_dim: 32 MiB in float32


def fused_supported(tokens: Tensor, weights: ExpertWeights) -> bool:
    """Where :func:`fused_experts` may run in place of the three stages: autograd records (its gain is the
    backward), not traced by ``torch.compile``, no autocast, the tokens and every weight in one dtype and device."""
    if not weights.needs_grad(tokens) or torch.compiler.is_compiling():
        return False
    if autocast_on(tokens):
        return False
    return weights.all_like(tokens)


def fused_size_rule(num_rows: int, model_dim: int) -> bool:
    """At least ``_FUSED_MIN_ROW_ELEMENTS`` in the rows' ``[N, M]`` block (the compiled path's rule, above)."""
    return num_rows * model_dim >= _FUSED_MIN_ROW_ELEMENTS
