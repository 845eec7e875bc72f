"""One optimizer step of the training loop (:mod:`flexmoe.apps.train_loop`) and what it is made of: AdamW, the
learning-rate schedule, the gradient clipping over expert-parallel ranks, and the updates of the MoE layers' own
state after each step (the selection biases of ``balance="bias"``, the global balance counts, the replica
placement), which every job makes alike.

Shapes: a step's batch ``x, y`` is this rank's rows, ``[rows, ...]``, cut into ``tcfg.micro_batches`` equal parts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from flexmoe.apps import sharded_job
from flexmoe.apps.models.moe_model import MoEModel
from flexmoe.apps.ranks import all_reduce_host
from flexmoe.apps.train_config import TrainConfig
from flexmoe.checkpoint import expert_param_names, expert_placement
from flexmoe.experts.modules import joined_parameter_halves
from flexmoe.layer import update_expert_biases
from flexmoe.optim import MuonWithAdamW, muon_param_groups
from flexmoe.parallel.optim import split_expert_groups
from flexmoe.parallel.replicas import replace_experts, replica_slots
from flexmoe.routing.global_balance import reset_global_balance

__all__ = ["build_optimizer", "lr_at", "set_lr", "clip_gradients", "mean_over_ranks", "compile_model", "StepStats",
           "forward_backward", "optimizer_step"]


def _spread_experts(model: MoEModel) -> dict[str, str]:
    """The expert parameters spread over ranks (name -> kind); empty when every rank holds all experts."""
    placement = expert_placement(model)
    if placement is None or placement.layout.world_size == 1:
        return {}
    names = expert_param_names(model)
    for joined in joined_parameter_halves(model):  # gate_up: a parameter, by its own name (kind: not b2)
        names[joined] = joined.rsplit(".", 1)[-1]
    return names


def build_optimizer(model: nn.Module, tcfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not biases, norms or expert biases). Multi-tensor (``foreach``), each
    group's experts apart from the rest (:func:`~flexmoe.parallel.split_expert_groups`: under ``--fsdp`` one kind
    of tensor per group). With ``tcfg.optimizer == "muon"``: :class:`~flexmoe.optim.MuonWithAdamW`, Muon on the
    hidden matrices and expert stacks, AdamW on the embeddings, the output ``head``, norms and biases
    (:func:`~flexmoe.optim.muon_param_groups`), both at ``tcfg.lr``: Muon's update is scaled to AdamW's RMS
    (``match_rms_adamw``, Moonlight's rule), so the schedule and weight decay serve both."""
    if tcfg.optimizer == "muon":
        head = getattr(model, "head", None)  # the GPT's and ViT's output projection; HF models': found by the helper
        groups = muon_param_groups(model, head=head if isinstance(head, nn.Module) else None)
        return MuonWithAdamW(split_expert_groups(model, groups), lr=tcfg.lr, weight_decay=tcfg.weight_decay,
                             adjust_lr_fn="match_rms_adamw", betas=(0.9, 0.95), foreach=True)
    if tcfg.optimizer != "adamw":
        raise ValueError(f"tcfg.optimizer must be 'adamw' or 'muon', got {tcfg.optimizer!r}")
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        is_bias = p.dim() < 2 or name.rsplit(".", 1)[-1] in ("b1", "b2", "b3", "gate_up_bias")
        (no_decay if is_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(split_expert_groups(model, groups), lr=tcfg.lr, betas=(0.9, 0.95), foreach=True)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """The learning rate of 0-based step ``step`` (a function of step only): linear warm-up to ``lr`` over the first
    ``warmup`` steps, then cosine decay toward ``min_lr``, which step ``steps`` (one past the last) would reach: the
    last step trains a little above ``min_lr``."""
    if step < tcfg.warmup:
        return tcfg.lr * (step + 1) / tcfg.warmup
    progress = (step - tcfg.warmup) / max(tcfg.steps - tcfg.warmup, 1)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer: torch.optim.Optimizer, step: int, tcfg: TrainConfig) -> float:
    """Give every parameter group the scheduled learning rate of 1-based training step ``step``; returns it."""
    lr = lr_at(step - 1, tcfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_gradients(model: MoEModel, max_norm: float, world: int) -> float:
    """Scale all gradients so that their global L2 norm is at most ``max_norm``; returns the norm.

    Spread expert gradients differ per rank, so their squares are summed over ranks (a ``b2`` that every
    hidden shard of an expert holds a copy of is counted once, from shard 0); other gradients are equal on
    every rank after the all-reduce.
    """
    experts = _spread_experts(model)
    placement = expert_placement(model)
    # On the parameters' device (the job may train on an accelerator); the all-reduce is gloo's, one process there.
    device = next(model.parameters()).device
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.double().square().sum()
        if n in experts:
            assert placement is not None  # a model with spread experts has their placement
            if experts[n] == "b2" and placement.layout.shard_of_rank(placement.rank) != 0:
                continue
            expert_sq += sq
        else:
            dense_sq += sq
    if experts:
        assert placement is not None
        dist.all_reduce(expert_sq, group=placement.group)
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def mean_over_ranks(value: float, world: int) -> float:
    """The mean of ``value`` over the ``world`` ranks (an all-reduce; ``value`` itself in one process)."""
    if world == 1:
        return value
    return float(all_reduce_host(torch.tensor([value], dtype=torch.float64))) / world


def compile_model(model: nn.Module, tcfg: TrainConfig, label: str, rank: int = 0, *,
                  blocks: Sequence[nn.Module] | None = None) -> None:
    """Compile ``model`` in place when ``tcfg.compile`` names a backend: ``nn.Module.compile``, so parameter
    names, and so checkpoints, stay those of the eager model. ``blocks``: compile each of these instead of the whole
    model (a model laid out by ``parallelize``: FSDP2's hooks between the blocks stay eager, as torchtitan does)."""
    if tcfg.compile is None:
        return
    for module in [model] if blocks is None else blocks:
        module.compile(backend=tcfg.compile)
    if rank == 0:
        what = "the model" if blocks is None else f"each of its {len(blocks)} blocks"
        print(f"[{label}] under torch.compile (backend {tcfg.compile}): the first step, and the first evaluation, "
              f"compile {what}", flush=True)


@dataclass
class StepStats:
    """What one step's forward passes saw on this rank, summed over its micro-batches: the task loss, the balance
    loss and the drop rate (floats), and per MoE layer the tokens each expert computed (``load``) and the pairs the
    router sent it (``demand``), both ``[moe_layers, num_experts]`` float64 (``[0]`` for a dense model)."""

    loss: float = 0.0
    balance: float = 0.0
    drop: float = 0.0
    loads: list[Tensor] = field(default_factory=list)
    demands: list[Tensor] = field(default_factory=list)

    @property
    def load(self) -> Tensor:
        return torch.stack(self.loads).sum(0) if self.loads and self.loads[0].numel() else torch.zeros(0)

    @property
    def demand(self) -> Tensor:
        return torch.stack(self.demands).sum(0) if self.demands and self.demands[0].numel() else torch.zeros(0)


def forward_backward(model: MoEModel, ddp: DistributedDataParallel | None, x: Tensor, y: Tensor,
                     micro_batches: int) -> StepStats:
    """Forward and backward of this rank's batch ``x, y: [rows, ...]`` in ``micro_batches`` equal parts, each
    backpropagating ``(task loss + model.regularization_loss()) / micro_batches``; ``ddp`` (the model's DDP wrapper,
    or None) all-reduces in the last part's backward only."""
    stats = StepStats()
    micro = x.shape[0] // micro_batches
    for i in range(micro_batches):
        xs, ys = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
        with ddp.no_sync() if ddp is not None and i < micro_batches - 1 else nullcontext():
            _, loss = (ddp or model)(xs, ys)
            ((loss + model.regularization_loss()) / micro_batches).backward()
        stats.loss += loss.item()
        stats.balance += model.balance_loss()
        stats.drop += model.drop_rate()
        stats.loads.append(torch.tensor(model.expert_load(), dtype=torch.float64))
        stats.demands.append(torch.tensor(model.expert_demand(), dtype=torch.float64))
    return stats


def optimizer_step(model: MoEModel, optimizer: torch.optim.Optimizer, tcfg: TrainConfig, step: int, world: int,
                   sharded: bool) -> list[Any]:
    """Clip the gradients (``sharded``: a model laid on a mesh, ``--fsdp``), update the MoE layers' per-step state
    from all micro-batches' load, step the optimizer and, every ``tcfg.replace_every`` steps, re-place the replica
    experts. Returns the replica placement before that re-placement (empty without replicas). The gradients are
    left for the caller to zero (after it has counted their bytes)."""
    if sharded:
        sharded_job.clip_sharded_gradients(model, tcfg.grad_clip)
    else:
        clip_gradients(model, tcfg.grad_clip, world)
    update_expert_biases(model)  # balance="bias": once per optimizer step, from all micro-batches' load
    reset_global_balance(model)  # aux_loss_type="global": the next step counts its own choices
    optimizer.step()
    placement_before = replica_slots(model)
    if tcfg.replace_every and step % tcfg.replace_every == 0:
        replace_experts(model)  # from the load window since the last one; the same on every rank
    return placement_before
