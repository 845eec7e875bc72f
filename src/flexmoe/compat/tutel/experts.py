"""Tutel's experts on flexmoe's expert protocol (``forward(rows: [N, M], counts: list[int]) -> [N, M]``).

* :class:`FusedExpertsNetwork`: Tutel's ``ffn`` experts with its parameter names and shapes
  (``batched_fc1_w: [E_local, H_local, M]``, ``batched_fc2_w: [E_local, H_local, M]``, ``batched_fc1_bias:
  [E_local, H_local]``, ``batched_fc2_bias: [E_local, ceil(M / sharded_count)]``), computed by
  :func:`flexmoe.experts.expert_ffn`.
* :class:`PaddedExperts`: runs a Tutel-style custom expert module, whose ``forward(x, ctx)`` takes
  ``x: [E_local, capacity, M]``, on flexmoe's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.compat.tutel.net import zero_gather
from flexmoe.experts import expert_ffn
from flexmoe.experts.weights import ExpertWeights

__all__ = ["FusedExpertsNetwork", "PaddedExperts", "GatheredExperts"]


class FusedExpertsNetwork(nn.Module):
    """``num_experts_per_device`` FFNs ``act(x W1^T + b1) W2 + b2``, stored as Tutel stores them.

    Each expert is initialised as Tutel does: ``fc1 = nn.Linear(model_dim, H_local)`` then ``fc2 =
    nn.Linear(H_local, output_dim)``, expert after expert, copied in (fc2's weight transposed, its bias cut to
    this rank's slice). ``activation_fn`` defaults to ReLU; ``activation_fn_with_self(x, module)`` is the
    alternative that also sees this module.
    """

    def __init__(self, model_dim: int, hidden_size_per_expert: int, num_experts_per_device: int,
                 sharded_count: int = 1, activation_fn: Callable[[Tensor], Tensor] | None = None,
                 activation_fn_with_self: Callable[[Tensor, nn.Module], Tensor] | None = None,
                 output_dim: int | None = None, has_fc1_bias: bool = True, has_fc2_bias: bool = True) -> None:
        super().__init__()
        if isinstance(hidden_size_per_expert, bool) or not isinstance(hidden_size_per_expert, int) \
                or hidden_size_per_expert < 1:
            raise ValueError(f"experts option hidden_size_per_expert must be an int >= 1, "
                             f"got {hidden_size_per_expert!r}")
        if hidden_size_per_expert % sharded_count:
            raise ValueError(f"experts option hidden_size_per_expert={hidden_size_per_expert} must divide into "
                             f"{sharded_count} shards (one expert over {sharded_count} ranks)")
        if output_dim is not None and output_dim != model_dim:
            raise ValueError(f"experts option output_dim must equal model_dim={model_dim} (flexmoe combines "
                             f"expert outputs into the model dimension), got {output_dim}")
        if activation_fn is not None and activation_fn_with_self is not None:
            raise ValueError("experts options activation_fn and activation_fn_with_self: give at most one")
        self.model_dim = model_dim
        self.output_dim = model_dim
        self.hidden_size_per_expert = hidden_size_per_expert
        self.local_experts = num_experts_per_device
        self.sharded_count = sharded_count
        self.hidden_size = hidden_size_per_expert // sharded_count
        self.activation_fn = activation_fn
        self.activation_fn_with_self = activation_fn_with_self

        shape = (num_experts_per_device, self.hidden_size)
        self.batched_fc1_w = nn.Parameter(torch.empty(*shape, model_dim))
        self.batched_fc2_w = nn.Parameter(torch.empty(*shape, self.output_dim))
        self.batched_fc1_bias = nn.Parameter(torch.empty(*shape)) if has_fc1_bias else None
        fc2_bias_slice = -(-self.output_dim // sharded_count)
        self.batched_fc2_bias = (nn.Parameter(torch.empty(num_experts_per_device, fc2_bias_slice))
                                 if has_fc2_bias else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for e in range(self.local_experts):
            fc1 = nn.Linear(self.model_dim, self.hidden_size, bias=self.batched_fc1_bias is not None)
            fc2 = nn.Linear(self.hidden_size, self.output_dim, bias=self.batched_fc2_bias is not None)
            self.batched_fc1_w[e] = fc1.weight
            self.batched_fc2_w[e] = fc2.weight.t()
            if self.batched_fc1_bias is not None:
                self.batched_fc1_bias[e] = fc1.bias
            if self.batched_fc2_bias is not None:
                self.batched_fc2_bias[e] = fc2.bias[:self.batched_fc2_bias.shape[1]]

    def activation(self, h: Tensor) -> Tensor:
        if self.activation_fn_with_self is not None:
            return self.activation_fn_with_self(h, self)
        if self.activation_fn is not None:
            return self.activation_fn(h)
        return F.relu(h)

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows: ``[N, M]`` sorted by local expert, counts: ``[E_local]`` -> ``[N, M]``."""
        if len(counts) != self.local_experts:
            raise ValueError(f"counts must have {self.local_experts} entries (one per local expert), "
                             f"got {len(counts)}")
        return expert_ffn(rows, counts, ExpertWeights(self.batched_fc1_w.transpose(1, 2), self.batched_fc1_bias,
                                                      self.batched_fc2_w, self.batched_fc2_bias, None, None,
                                                      self.activation))

    def extra_repr(self) -> str:
        return (f"model_dim={self.model_dim}, hidden_size={self.hidden_size}, "
                f"num_experts_per_device={self.local_experts}, has_fc1_bias={self.batched_fc1_bias is not None}, "
                f"has_fc2_bias={self.batched_fc2_bias is not None}")


class PaddedExperts(nn.Module):
    """Adapts a Tutel custom expert ``module.forward(x: [E_local, C, M], ctx) -> [E_local, C, M]`` to rows.

    Expert e's rows fill ``x[e, :counts[e]]`` and the rest is zero (Tutel's empty capacity slots); the
    outputs of those padding slots are discarded. ``ctx`` is the Tutel layer, as Tutel passes it.
    """

    def __init__(self, module: nn.Module, num_local_experts: int, ctx: Any) -> None:
        super().__init__()
        self.module = module
        self.num_local_experts = num_local_experts
        self._ctx = [ctx]  # a list: the layer owns this adapter's module, not the other way round

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows: ``[N, M]`` sorted by local expert, counts: ``[E_local]`` -> ``[N, M]``."""
        if len(counts) != self.num_local_experts:
            raise ValueError(f"counts must have {self.num_local_experts} entries, got {len(counts)}")
        capacity = max(counts, default=0)
        if capacity == 0:
            return rows.new_zeros(rows.shape)
        slot = torch.cat([torch.arange(c, device=rows.device) for c in counts])
        expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                         torch.tensor(counts, device=rows.device))
        padded = rows.new_zeros(len(counts), capacity, rows.shape[1]).index_put((expert, slot), rows)
        out = self.module(padded, self._ctx[0])
        if out.shape[:2] != padded.shape[:2]:
            raise ValueError(f"custom expert module returned shape {tuple(out.shape)}, expected "
                             f"[{len(counts)}, {capacity}, ...]")
        return out[expert, slot]


class GatheredExperts(nn.Module):
    """Tutel's sharded experts (fewer experts than ranks): every rank gathers every expert whole and computes
    its own rows, as Tutel's ``adaptive_r=0`` does; any r gives the same numbers, this is the one run here.

    ``shards``: this rank's :class:`FusedExpertsNetwork` holding one hidden slice of one expert (ranks
    ``e * s ... e * s + s - 1`` hold the s slices of expert e in order). The gather is
    :func:`flexmoe.compat.tutel.net.zero_gather`, whose backward sums the ranks' gradients and hands each rank
    its slice, so a shard's gradient covers every rank's tokens.
    """

    def __init__(self, shards: FusedExpertsNetwork, num_experts: int, group: Any) -> None:
        super().__init__()
        self.shards = shards
        self.num_experts = num_experts
        self.group = group

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert, counts: ``[E]`` -> ``[N, M]``."""
        s, E = self.shards, self.num_experts
        hidden, model_dim = s.hidden_size_per_expert, s.model_dim
        fc1_w = zero_gather(s.batched_fc1_w, full_shape=[E, hidden, model_dim], group=self.group)
        fc2_w = zero_gather(s.batched_fc2_w, full_shape=[E, hidden, model_dim], group=self.group)
        fc1_b = fc2_b = None
        if s.batched_fc1_bias is not None:
            fc1_b = zero_gather(s.batched_fc1_bias, full_shape=[E, hidden], group=self.group)
        if s.batched_fc2_bias is not None:
            slices = zero_gather(s.batched_fc2_bias, group=self.group)  # [W, ceil(M / shards)]
            fc2_b = slices.reshape(E, -1)[:, :model_dim]
        return expert_ffn(rows, counts, ExpertWeights(fc1_w.transpose(1, 2), fc1_b, fc2_w, fc2_b, None, None,
                                                      s.activation))
