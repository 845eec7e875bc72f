"""Global-batch load balancing: ``aux_loss_type="global"`` (docs/architecture.md, "Global-batch balance").

The balance loss of a step's whole data-parallel batch (Megatron's ``global_aux_loss``, Qwen's global-batch
balance loss), ``L = E * sum_e f_e P_e``, where

* ``f_e``: the share of (token, choice) pairs, all k choices, that went to expert e, counted over every rank of
  the data-parallel group and over the step's micro-batches so far (this one included), not differentiable;
* ``P_e``: the mean router probability of e over this micro-batch's tokens of every rank.

Uniform routing gives 1. One all-reduce per call sums ``[pairs per expert, probability sums, tokens]`` over the
group; the layer keeps the running pair counts (:class:`GlobalBalance`) until :func:`reset_global_balance`, which
the training loop calls once per optimizer step.

Gradient: the value is the global one on every rank. Its gradient reaches this rank's tokens only, as
``d L / d p_{t,e} = R * E * f_e / T`` (R ranks, T tokens of the micro-batch over all ranks): data-parallel
training (DDP, FSDP) averages the ranks' gradients, and the average is then exactly the gradient one process
would get from the same loss over every rank's tokens (``E * f_e / T`` per token). No collective runs in the
backward. Outside training (evaluation, decoding) the loss is that of the call's own tokens, without a collective:
ranks may evaluate different batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.routing.scores import router_scores

__all__ = ["GlobalBalance", "global_balance_loss", "local_balance_loss", "reset_global_balance"]


def local_balance_loss(probs: Tensor, expert_index: Tensor) -> Tensor:
    """``E * sum_e f_e P_e`` over this call's tokens alone (one process, one micro-batch): ``f_e`` the share of the
    ``T * k`` pairs that chose e, ``P_e`` the mean of ``probs[:, e]``. probs: ``[T, E]``; expert_index:
    ``[T, k]``."""
    loss, _ = global_balance_loss(probs, expert_index, prior_counts=None, group=None)
    return loss


def global_balance_loss(probs: Tensor, expert_index: Tensor, *, prior_counts: Tensor | None,
                        group: dist.ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """``(loss, counts)``: the global-batch balance loss of this call and its pairs per expert over the group.

    probs: ``[T, E]`` router probabilities of this rank's tokens; expert_index: ``[T, k]`` their chosen experts;
    prior_counts: ``[E]`` float64, pairs per expert of the step's earlier micro-batches over the group (None:
    none); group: the data-parallel ``torch.distributed`` group (None: this process alone). Returns the loss (0-dim,
    probs' dtype; gradient as the module docstring says) and ``counts: [E]`` float64 of this call, all ranks.
    """
    num_tokens, num_experts = probs.shape
    prob_sum = probs.sum(dim=0)  # [E], differentiable
    chosen = expert_index.reshape(-1)
    # scatter_add rather than bincount: a static [E] shape, which compiles without a graph break.
    pairs = torch.zeros(num_experts, dtype=torch.float64, device=probs.device).scatter_add_(
        0, chosen, torch.ones_like(chosen, dtype=torch.float64))
    stats = torch.cat([pairs, prob_sum.detach().to(torch.float64),
                       torch.tensor([float(num_tokens)], dtype=torch.float64, device=probs.device)])
    world = 1
    if group is not None:
        dist.all_reduce(stats, group=group)
        world = dist.get_world_size(group)
    counts, global_prob_sum, tokens = stats[:num_experts], stats[num_experts:-1], stats[-1].clamp_min(1.0)
    running = counts if prior_counts is None else prior_counts + counts
    share = running / running.sum().clamp_min(1.0)  # f_e
    # The value is the mean over every rank's tokens; the gradient flows through this rank's sum, scaled by R / T
    # so that the ranks' averaged gradients equal one process's 1 / T per token.
    local = prob_sum * (world / tokens).to(probs.dtype)
    mean_prob = (global_prob_sum / tokens).to(probs.dtype) + (local - local.detach())
    return num_experts * (share.to(probs.dtype) * mean_prob).sum(), counts


class GlobalBalance:
    """A layer's running pair counts of the current step (``counts: [E]`` float64) and its data-parallel group.

    group: the ranks that see different data (default None: the world when ``torch.distributed`` is initialized,
    else this process alone); set ``layer.global_balance.group`` for another data-parallel group. Every rank of the
    group must run each training forward of the layer (as data-parallel training does anyway)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: Tensor | None = None
        self.group: dist.ProcessGroup | None = None

    def loss(self, logits: Tensor, expert_index: Tensor, score_func: str, *, accumulate: bool) -> Tensor:
        """The training loss of this call (:func:`global_balance_loss`) from the router's ``logits: [T, E]`` and the
        chosen ``expert_index: [T, k]``; with ``accumulate`` this call's pairs join the step's counts (not when the
        call is a recomputation under activation checkpointing)."""
        probs = router_scores(logits, score_func)
        if score_func == "sigmoid":
            probs = probs / probs.sum(dim=-1, keepdim=True)  # probabilities, as every balance loss sees them
        group = self.group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        loss, counts = global_balance_loss(probs, expert_index, prior_counts=self.counts, group=group)
        if accumulate:
            self.counts = counts if self.counts is None else self.counts + counts
        return loss

    def reset(self) -> None:
        """Forget the step's counts: the next call starts a new step."""
        self.counts = None


def reset_global_balance(model: nn.Module) -> int:
    """Start a new step for every layer of ``model`` with ``aux_loss_type="global"`` (forget their accumulated
    pair counts); returns how many there are. Call it once per optimizer step, on every rank, e.g. right after
    ``optimizer.step()``."""
    states = [state for m in model.modules() if isinstance(state := getattr(m, "global_balance", None),
                                                             GlobalBalance)]
    for state in states:
        state.reset()
    return len(states)
