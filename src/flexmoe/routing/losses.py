"""Auxiliary losses of the router (pure functions)."""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.global_balance import local_balance_loss

__all__ = ["load_balancing_loss", "router_z_loss", "AUX_LOSS_TYPES", "all_choices_balance_loss",
           "sequence_balance_loss", "balance_loss"]


def load_balancing_loss(probs: Tensor, first_choice: Tensor) -> Tensor:
    """GShard/Switch balance loss ``E * sum_e f_e * P_e``.

    probs: ``[T, E]`` router probabilities; first_choice: ``[T]`` each token's 1st-choice expert.
    ``f_e`` is the fraction of tokens whose 1st choice is e (not differentiable), ``P_e`` the mean probability
    of e (differentiable). Equals 1 when routing is perfectly uniform. Returns a 0-dim tensor (0 for T = 0).
    """
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    return _counted_mean_prob(probs, first_choice) * (num_experts / num_tokens)


def _counted_mean_prob(probs: Tensor, expert_index: Tensor) -> Tensor:
    """``sum_e count_e * P_e`` with ``count_e`` the entries of ``expert_index`` naming e and ``P_e`` the mean of
    ``probs[:, e]``: summed over the entries (``sum_i P_{expert_index[i]}``), which needs no count per expert."""
    return probs.mean(dim=0).index_select(0, expert_index.reshape(-1)).sum()


def router_z_loss(logits: Tensor, probs: Tensor | None = None) -> Tensor:
    """ST-MoE router z-loss: the mean over tokens of ``logsumexp(logits)^2``. logits: ``[T, E]``.

    probs: ``softmax(logits)`` ``[T, E]`` when the caller has it (the softmax router). Then ``logsumexp(l) =
    l_j - log p_j`` at each token's largest logit ``j`` (so ``p_j >= 1 / E``, no underflow): the same value, and
    the same gradient ``p``, which autograd takes from the softmax's own saved output, so the ``[T, E]`` logits
    are not kept for the backward (4 MiB at T=4096, E=256 in float32)."""
    num_tokens = logits.shape[0]
    if num_tokens == 0:
        return logits.sum() * 0.0
    if probs is None:
        return torch.logsumexp(logits, dim=-1).square().mean()
    # Indexing keeps only the indices for the backward (gather would keep the whole [T, E] input).
    tokens, top = torch.arange(num_tokens, device=logits.device), logits.detach().argmax(dim=-1)
    return (logits[tokens, top] - probs[tokens, top].log()).square().mean()


AUX_LOSS_TYPES = ("switch", "all_choices", "sequence", "global")


def all_choices_balance_loss(probs: Tensor, expert_index: Tensor) -> Tensor:
    """The balance loss counting all k choices (Hugging Face's Mixtral / Qwen / OLMoE loss):
    ``E * sum_e f_e * P_e`` with ``f_e`` the (token, choice) pairs of e over T (the f_e sum to k) and ``P_e``
    the mean probability of e. probs: ``[T, E]``; expert_index: ``[T, k]``. Uniform routing gives k."""
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    return _counted_mean_prob(probs, expert_index) * (num_experts / num_tokens)


def sequence_balance_loss(probs: Tensor, expert_index: Tensor, num_sequences: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without its coefficient alpha), averaged over the sequences.

    probs: ``[B*S, E]`` (sequence-major) scores summing to 1 per token (sigmoid scores divided by their sum),
    expert_index: ``[B*S, k]``. Per sequence of S tokens: ``sum_e f_e * P_e`` with
    ``f_e = E / (k * S) * (pairs of e)`` and ``P_e`` the mean of e's probability over the sequence. Uniform
    routing gives 1; at k=1 it is the Switch loss of each sequence.
    """
    num_tokens, num_experts = probs.shape
    if num_tokens == 0:
        return probs.sum() * 0.0
    seq_len = num_tokens // num_sequences
    k = expert_index.shape[1]
    per_seq = expert_index.reshape(num_sequences, seq_len * k)
    counts = torch.zeros(num_sequences, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, per_seq, torch.ones_like(per_seq, dtype=probs.dtype))
    fraction = counts * (num_experts / (k * seq_len))  # [B, E]
    mean_score = probs.view(num_sequences, seq_len, num_experts).mean(dim=1)  # [B, E]
    return (fraction * mean_score).sum(dim=-1).mean()


def balance_loss(aux_loss_type: str, scores: Tensor, expert_index: Tensor, *, score_func: str = "softmax",
                 num_sequences: int | None = None) -> Tensor:
    """The layer's ``aux_loss`` for ``aux_loss_type`` (:data:`AUX_LOSS_TYPES`).

    scores: ``[T, E]`` the router's scores (sigmoid scores are divided by their sum per token first, so every
    loss sees probabilities), expert_index: ``[T, k]`` the chosen experts (1st column: 1st choice).
    """
    probs = scores / scores.sum(dim=-1, keepdim=True) if score_func == "sigmoid" else scores
    if aux_loss_type == "sequence":
        if num_sequences is None:
            raise ValueError("aux_loss_type='sequence' needs x of shape [batch, seq, model_dim]")
        return sequence_balance_loss(probs, expert_index, num_sequences)
    if aux_loss_type == "all_choices":
        return all_choices_balance_loss(probs, expert_index)
    if aux_loss_type == "switch":
        return load_balancing_loss(probs, expert_index[:, 0])
    if aux_loss_type == "global":
        # This call's tokens alone; a training forward of the layer replaces it by the global-batch loss.
        return local_balance_loss(probs, expert_index)
    raise ValueError(f"aux_loss_type must be one of {list(AUX_LOSS_TYPES)}, got {aux_loss_type!r}")
