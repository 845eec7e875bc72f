"""Data parallelism beside expert parallelism: DDP must not all-reduce the expert parameters.

An expert parameter lives on one rank (or one hidden shard per rank) and its gradient already sums every
rank's tokens through the all-to-all; all-reducing it across the expert-parallel group as DDP does for
replicated parameters would add other ranks' *different* experts into it. :func:`wrap_ddp` hides the expert
parameters from DDP and scales their gradients by ``1 / W`` so that, like DDP's averaged gradients, they are
the gradient of the mean of the ranks' losses. Shards of one expert receive the gradient of their own
hidden slice; the replicated ``b2`` of a sharded expert already gets the full sum on every shard.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from flexmoe.layer import MoELayer
from flexmoe.sharding.model_experts import expert_parameters, named_moe_layers

__all__ = ["expert_parameter_names", "divide_gradients", "wrap_ddp", "GRAD_DIVISOR"]

GRAD_DIVISOR = "_flexmoe_grad_divisor"  # the attribute divide_gradients marks a parameter with


def _expert_parallel_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """``(name, layer)`` of the MoE layers that spread their experts over ranks."""
    return [(name, layer) for name, layer in named_moe_layers(model) if layer.ep_group.distributed]


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the parameters of expert-parallel MoE layers' experts."""
    return [name for name, _, layer in expert_parameters(model) if layer.ep_group.distributed]


def divide_gradients(params: list[nn.Parameter], world: int) -> None:
    """Divide every gradient ``params`` receive by ``world`` (once per parameter, however often this is called):
    expert gradients that already sum every rank's tokens become the gradient of the mean of the ranks' losses."""
    for p in params:
        if p.requires_grad and getattr(p, GRAD_DIVISOR, None) is None:
            # Scale each incoming gradient (not the accumulated one), so gradient accumulation stays right.
            p.register_hook(lambda g, w=world: g / w)
            setattr(p, GRAD_DIVISOR, world)  # read again where a parameter is replaced (materialize's to_empty)


def wrap_ddp(model: nn.Module, process_group: Any = None, *, expert_replicas: bool = False,
             **ddp_kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(model, ...)`` that leaves expert-parallel experts alone.

    The data-parallel group (``process_group``, default the world) must be the expert-parallel group of every
    MoE layer (the usual "experts over all ranks, the rest data-parallel" set-up).

    expert_replicas: allow MoE layers whose expert-parallel group is a part of the data-parallel group (several
        such groups side by side, each holding every expert: data-parallel replicas of each expert). The experts'
        gradients are then divided by the data-parallel size too, so each replica holds its part of the mean:
        the caller sums each expert's gradient over its replicas before the optimizer step
        (:class:`flexmoe.hf.ExpertParallelTrainer` does).
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    dp_ranks = dist.get_process_group_ranks(group)
    names = set(expert_parameter_names(model))
    for prefix, layer in _expert_parallel_layers(model):
        inside = set(layer.ep_group.global_ranks) <= set(dp_ranks) and world % layer.ep_group.world_size == 0
        if expert_replicas and inside:
            continue
        if layer.ep_group.global_ranks != list(dp_ranks):
            raise NotImplementedError(
                f"MoE layer {prefix or '<root>'} spreads its experts over ranks {layer.ep_group.global_ranks} but "
                f"the data-parallel group is {list(dp_ranks)}; wrap_ddp supports expert-parallel group == "
                f"data-parallel group"
            )
    divide_gradients([p for name, p in model.named_parameters() if name in names], world)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(names))
    return DistributedDataParallel(model, process_group=group, **ddp_kwargs)
