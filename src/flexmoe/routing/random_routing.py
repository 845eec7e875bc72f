"""GShard's random routing of the 2nd expert (Lepikhin et al., 2020, Algorithm 1).

With top-2 routing a token whose 2nd choice carries little weight costs as much expert compute (and capacity)
as one whose two choices are equal. GShard therefore dispatches the 2nd choice only with a probability that
grows with its weight: with the two probabilities ``p1 >= p2`` of a token normalized to
``g2 = p2 / (p1 + p2)`` (so ``0 <= g2 <= 1/2``), the 2nd pair is kept when ``2 * g2 > u`` for a uniform sample
``u ~ U[0, 1)``, i.e. with probability

    keep = min(1, 2 * g2) = 2 * p2 / (p1 + p2)

(1 when the two are equal, about 0 when the 2nd is negligible). The decision uses the normalized weight
whether or not the layer normalizes its combine weights, as in GShard. A skipped pair is not dispatched: it
claims no slot and is counted in ``RoutingPlan.num_skipped``; the 1st choice keeps its weight (it is not
renormalized to 1, again as in GShard).

Only for k == 2 (the rule is defined on a token's two choices), and only in training: at evaluation every
choice is dispatched. The layer checks both.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["second_expert_keep_probability", "sample_second_expert"]


def second_expert_keep_probability(probs_topk: Tensor) -> Tensor:
    """``[T]`` the probability of dispatching each token's 2nd choice: ``min(1, 2 * p2 / (p1 + p2))``.

    probs_topk: ``[T, 2]`` the router probabilities of the two chosen experts, largest first.
    """
    if probs_topk.dim() != 2 or probs_topk.shape[1] != 2:
        raise ValueError(f"random routing of the 2nd expert needs [tokens, 2] probabilities, got "
                         f"{tuple(probs_topk.shape)}")
    p = probs_topk.detach()
    total = p.sum(dim=1)
    # A token whose two probabilities underflow to 0 has nothing to prefer: keep its 2nd choice.
    g2 = torch.where(total > 0, p[:, 1] / total.clamp_min(torch.finfo(p.dtype).tiny), torch.ones_like(total))
    return (2.0 * g2).clamp(max=1.0)


def sample_second_expert(probs_topk: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``active: [T, 2]`` bool: the 1st choice always, the 2nd with :func:`second_expert_keep_probability`.

    The uniform samples come from ``generator`` (default: torch's global generator, so ``torch.manual_seed``
    makes the decisions reproducible).
    """
    keep = second_expert_keep_probability(probs_topk)
    u = torch.rand(keep.shape, generator=generator, device=keep.device, dtype=keep.dtype)
    active = torch.ones(probs_topk.shape, dtype=torch.bool, device=probs_topk.device)
    active[:, 1] = keep > u
    return active
