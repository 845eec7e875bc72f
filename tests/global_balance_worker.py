"""One rank of the global-batch balance test (tests/test_global_balance.py): micro-batches of a layer with
``aux_loss_type="global"`` over 2 gloo ranks, each rank its own tokens; returns its losses and the router's
gradient averaged over the ranks (what data-parallel training applies)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexmoe import MoELayer, reset_global_balance

MODEL_DIM, NUM_EXPERTS, HIDDEN, K = 8, 4, 8, 2
STEPS, MICRO_BATCHES = 2, 3


def tokens_of(step: int, micro: int, rank: int) -> torch.Tensor:
    """``[T, M]`` float32 tokens of rank ``rank``; T differs by rank and micro-batch (unequal shares)."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5 + 2 * rank + micro, MODEL_DIM, generator=generator)


def build_layer(group: object) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(MODEL_DIM, NUM_EXPERTS, HIDDEN, k=K, capacity_factor=0.0, aux_loss_type="global", group=group)


def run_rank(expert_parallel: bool) -> dict:
    """Both steps on this rank: per step, every micro-batch's ``aux_loss`` and the rank-averaged router gradient
    of ``sum_i aux_loss_i / MICRO_BATCHES``."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = build_layer(dist.group.WORLD if expert_parallel else "single").train()
    out: dict = {"losses": [], "grads": []}
    for step in range(STEPS):
        layer.zero_grad()
        losses = []
        for micro in range(MICRO_BATCHES):
            layer(tokens_of(step, micro, rank))
            assert layer.aux_loss is not None
            (layer.aux_loss / MICRO_BATCHES).backward()
            losses.append(float(layer.aux_loss.detach()))
        grad = layer.router.weight.grad.clone()
        dist.all_reduce(grad)
        out["losses"].append(losses)
        out["grads"].append((grad / world).tolist())
        reset_global_balance(layer)
    dist.destroy_process_group()
    return out
