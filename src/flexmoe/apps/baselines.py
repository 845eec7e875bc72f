"""What the benchmark measures flexmoe against, computed with the layer's own router and expert weights.

* :func:`expert_floor`: the compute floor, the expert FFNs on exactly the routed rows and nothing else (no
  router, no dispatch, no combine), done the plain way: one ``addmm`` pair per expert over ``w.unbind(0)``
  (on a 2-core CPU this beats a single batched ``baddbmm`` by a few percent, and unlike it needs no padding).
  With many small experts this loop is itself far from the hardware, hence the second floor:
* :func:`grouped_floor`: the same FFNs by the fastest grouped GEMM torch offers for exactly these rows,
  ``torch._grouped_mm`` (one call per weight matrix over all experts) where it runs on the device and dtype;
  elsewhere :func:`padded_bmm_floor`, one ``baddbmm`` over the experts' rows padded to the largest count (the
  benchmark then reports the better of it and the loop).
* :func:`gshard_einsum_forward`: a GShard/fairseq-style layer, kept as a labelled reference: one-hot
  ``[T, E, C]`` dispatch and combine tensors, the einsums ``sec,sm->ecm`` and ``sec,ecm->sm``, and experts that
  compute every one of the ``E * C`` slots, empty or not. Same routing semantics as :func:`flexmoe.make_plan`
  (it reads the plan's experts and slots), so its output equals the layer's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.row_kernels import active_experts_ffn, grouped_expert_ffn, grouped_mm_supported, looped_expert_ffn
from flexmoe.experts.weights import gated_unit
from flexmoe.layer import MoELayer
from flexmoe.routing.plan import make_plan
from flexmoe.routing.routers import route

__all__ = ["expert_floor", "grouped_floor", "grouped_floor_kind", "padded_bmm_floor", "gshard_einsum_forward"]


def expert_floor(experts: FeedForwardExperts, rows: Tensor, counts: list[int]) -> Tensor:
    """rows: ``[N, M]`` sorted by expert, counts: rows per expert -> ``[N, M]``: each expert's FFN on its rows
    by one ``addmm`` pair per expert through autograd (:func:`flexmoe.experts.row_kernels.looped_expert_ffn` on
    the experts' weights, with no routing around it), whichever path the layer itself takes (in training it may be the
    hand-written backward, :func:`flexmoe.experts.row_kernels.segmented_expert_ffn`).

    Without autograd the floor stays that loop, each expert's unit on its own rows, where the layer's experts
    may apply the unit once over all rows (:func:`flexmoe.experts.row_kernels.joined_unit_ffn`):
    :func:`flexmoe.experts.row_kernels.active_experts_ffn`."""
    weights = experts.weights()
    if weights.needs_grad(rows):
        return looped_expert_ffn(rows, counts, weights)
    return active_experts_ffn(rows, counts, weights)


def grouped_floor_kind(experts: FeedForwardExperts, rows: Tensor) -> str:
    """Which grouped GEMM :func:`grouped_floor` runs: ``"torch._grouped_mm"`` or ``"padded bmm"``."""
    return "torch._grouped_mm" if grouped_mm_supported(rows, experts.weights()) else "padded bmm"


def grouped_floor(experts: FeedForwardExperts, rows: Tensor, counts: list[int]) -> Tensor:
    """The same numbers as :func:`expert_floor` (up to float rounding) by a grouped GEMM: ``torch._grouped_mm``
    where it runs (:func:`flexmoe.experts.row_kernels.grouped_expert_ffn`), else :func:`padded_bmm_floor`."""
    if grouped_floor_kind(experts, rows) == "torch._grouped_mm":
        return grouped_expert_ffn(rows, counts, experts.weights())
    return padded_bmm_floor(experts, rows, counts)


def padded_bmm_floor(experts: FeedForwardExperts, rows: Tensor, counts: list[int]) -> Tensor:
    """:func:`expert_floor` by batched matmuls: the rows are laid out ``[E, C, M]`` with C the largest count
    (the padding rows are zeros, computed and thrown away), one ``baddbmm`` per weight matrix, then the real
    rows are read back: ``[N, M]``."""
    e = experts
    num_experts, capacity = len(counts), max(counts, default=0)
    sizes = torch.tensor(counts, device=rows.device)
    starts = sizes.cumsum(0) - sizes
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=rows.device), sizes,
                                            output_size=rows.shape[0])
    slot_of_row = torch.arange(rows.shape[0], device=rows.device) - starts[expert_of_row]
    flat = expert_of_row * capacity + slot_of_row  # each row's place in the padded [E * C] layout
    padded = rows.new_zeros(num_experts * capacity, rows.shape[1]).index_copy(0, flat, rows)
    padded = padded.view(num_experts, capacity, -1)

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return torch.baddbmm(b.unsqueeze(1), x, w) if b is not None else torch.bmm(x, w)

    if e.w3 is not None:
        h = gated_unit(linear(padded, e.w1, e.b1), linear(padded, e.w3, e.b3), e.activation, e.glu_limit)
    else:
        h = e.activation(linear(padded, e.w1, e.b1))
    out = linear(h, e.w2, e.b2)
    return out.view(num_experts * capacity, -1).index_select(0, flat)


def gshard_einsum_forward(layer: MoELayer, x: Tensor) -> Tensor:
    """The GShard/fairseq-style forward of ``layer`` (built-in experts, one process): x ``[..., M]`` -> same.

    The capacity is the layer's (dropless: the largest load, as padded dense layers must do); expert outputs
    are weighted at combine (``score_at="combine"``).
    """
    if layer.score_at != "combine":
        raise ValueError("gshard_einsum_forward weights at combine: build the layer with score_at='combine'")
    if not isinstance(layer.experts, FeedForwardExperts):
        raise TypeError("gshard_einsum_forward needs the built-in FeedForwardExperts")
    tokens = x.reshape(-1, layer.model_dim)
    opts = layer.routing_options
    logits = route(layer.router, tokens, dtype=opts.router_dtype, training=layer.training)
    plan = make_plan(logits, opts.k, capacity_factor=opts.capacity_factor, capacity=opts.capacity,
                     normalize_weights=opts.normalize_weights, batch_prioritized=opts.batch_prioritized)
    num_tokens, num_experts, capacity = tokens.shape[0], layer.num_experts, plan.capacity
    kept = plan.slot >= 0
    token_of_pair = torch.arange(num_tokens, device=x.device).unsqueeze(1).expand_as(plan.slot)[kept]
    where = (token_of_pair, plan.expert_index[kept], plan.slot[kept])
    combine_weights = tokens.new_zeros(num_tokens, num_experts, capacity).index_put(
        where, plan.weight[kept].to(tokens.dtype))
    dispatch_mask = tokens.new_zeros(num_tokens, num_experts, capacity).index_put(
        where, tokens.new_ones(where[0].shape))
    expert_in = torch.einsum("sec,sm->ecm", dispatch_mask, tokens)  # [E, C, M], empty slots included
    e = layer.experts
    h = e.activation(torch.baddbmm(e.b1.unsqueeze(1), expert_in, e.w1) if e.b1 is not None
                     else torch.bmm(expert_in, e.w1))
    if e.w3 is not None:
        h = h * (torch.baddbmm(e.b3.unsqueeze(1), expert_in, e.w3) if e.b3 is not None
                 else torch.bmm(expert_in, e.w3))
    expert_out = torch.baddbmm(e.b2.unsqueeze(1), h, e.w2) if e.b2 is not None else torch.bmm(h, e.w2)
    return torch.einsum("sec,ecm->sm", combine_weights, expert_out).reshape(x.shape)
