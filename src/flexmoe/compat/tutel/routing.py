"""Tutel's routing rules as pure functions: its capacity and its non-GShard balance loss.

The rest of Tutel's routing (softmax, top-k, choice-major slot order, batch-prioritized order, normalized
gates, the GShard loss) is flexmoe's own (:mod:`flexmoe.routing`), which follows the same rules.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tutel_capacity", "alignment_of", "load_importance_loss"]


def alignment_of(sharded_count: int, overlap_degree: int) -> int:
    """Tutel pads the capacity to a multiple of this, so that the all-to-all splits evenly."""
    alignment = sharded_count * overlap_degree
    if alignment > 256:
        alignment = (alignment + 127) // 128 * 128
    return alignment


def tutel_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                   max_load: int | None, alignment: int = 1) -> int:
    """Slots per expert, as Tutel sets them.

    With ``s = ceil(num_tokens / num_experts)``: ``capacity_factor > 0`` gives ``top_k * int(cf * s)``;
    ``0`` gives ``max_load`` (dropless: the largest number of (token, choice) pairs of one expert, over the
    expert-parallel group); ``< 0`` gives ``min(max_load, top_k * int(-cf * s))``. The result is rounded up to
    a multiple of ``alignment``. ``max_load`` is needed only for ``capacity_factor <= 0``.
    """
    per_expert = -(-num_tokens // num_experts)
    if capacity_factor > 0:
        capacity = top_k * int(capacity_factor * per_expert)
    else:
        if max_load is None:
            raise ValueError("capacity_factor <= 0 needs max_load")
        capacity = int(max_load)
        if capacity_factor < 0:
            capacity = min(capacity, top_k * int(-capacity_factor * per_expert))
    remainder = capacity % alignment
    return capacity + alignment - remainder if remainder else capacity


def load_importance_loss(probs: Tensor, logits_w_noise_topk: Tensor, num_experts: int,
                         gate_noise: float) -> Tensor:
    """Shazeer et al.'s importance + load loss, as Tutel computes it when ``is_gshard_loss=False``.

    probs: ``[T, E]`` softmax of the noiseless logits; logits_w_noise_topk: ``[T, k]`` the noisy logits of the
    chosen experts (the last column is the k-th). Importance ``I_e = sum_t probs``; load ``L_e = sum_t
    Phi((probs[t, e] - kth[t]) / sigma)`` with ``sigma = gate_noise / E``; the loss is the mean of the squared
    coefficients of variation (``var / (mean^2 + 1e-10)``, unbiased variance) of I and L.
    """
    if not gate_noise > 0:
        raise ValueError(f"is_gshard_loss=False needs gate_noise > 0 (the load loss divides by it), "
                         f"got {gate_noise}")

    def cv_squared(v: Tensor) -> Tensor:
        return v.var() / (v.mean() ** 2 + 1e-10)

    probs = probs.float()
    importance = probs.sum(0)
    threshold = logits_w_noise_topk[:, -1:].float()
    normal = torch.distributions.Normal(torch.zeros((), device=probs.device),
                                        torch.full((), gate_noise / num_experts, device=probs.device))
    load = normal.cdf(probs - threshold).sum(0)
    return (cv_squared(importance) + cv_squared(load)) / 2.0
