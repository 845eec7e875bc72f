"""Auxiliary losses of the router (pure functions)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["load_balancing_loss", "router_z_loss"]


def load_balancing_loss(probs: Tensor, first_choice: Tensor) -> Tensor:
    """GShard/Switch balance loss ``E * sum_e f_e * P_e``.

    probs: ``[T, E]`` router probabilities; first_choice: ``[T]`` each token's 1st-choice expert.
    ``f_e`` is the fraction of tokens whose 1st choice is e (not differentiable), ``P_e`` the mean probability
    of e (differentiable). Equals 1 when routing is perfectly uniform. Returns a 0-dim tensor (0 for T = 0).
    """
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    counts = torch.bincount(first_choice, minlength=num_experts).to(probs.dtype)
    fraction = counts / num_tokens
    mean_prob = probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: the mean over tokens of ``logsumexp(logits)^2``. logits: ``[T, E]``."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return torch.logsumexp(logits, dim=-1).square().mean()
