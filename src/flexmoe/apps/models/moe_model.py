"""What the application models (the GPT, the vision transformer) share about their MoE layers: how an MLP
becomes an :class:`~flexmoe.MoELayer`, and the losses and statistics training reads from those layers.

A model using :class:`MoEModel` has a ``cfg`` with ``k``, ``num_experts``, ``aux_loss_coef`` and ``z_loss_coef``;
its MoE layers are found among its submodules, in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.layer import MoELayer

__all__ = ["build_moe_mlp", "MoEModel"]


def build_moe_mlp(cfg: Any) -> MoELayer:
    """The MoE MLP of width ``cfg.n_embd``: ``cfg.num_experts`` GELU experts of hidden ``cfg.expert_hidden``,
    ``cfg.k`` per token, routed by ``cfg.router`` with ``cfg.capacity_factor``; the all-to-all ``cfg.a2a`` and
    the topology gate's ``cfg.cross_node_share`` where the config has them (the GPT's does)."""
    kwargs: dict[str, Any] = dict(
        k=cfg.k, capacity_factor=cfg.capacity_factor, router=cfg.router, activation="gelu",
        a2a=getattr(cfg, "a2a", "flat"), cross_node_share=getattr(cfg, "cross_node_share", None),
    )
    # Expert parallelism: the layer keeps only this rank's experts (see flexmoe.parallel.layout). Without a
    # group, one process holds every expert even under torch.distributed (MoELayer's own default is the world).
    kwargs["group"] = cfg.group if cfg.group is not None else "single"
    if kwargs["group"] == "single":
        kwargs["ranks_per_node"] = 1  # one process holding every expert is one node, whatever torchrun says
    return MoELayer(cfg.n_embd, cfg.num_experts, cfg.expert_hidden, **kwargs)


class MoEModel(nn.Module):
    """Base of a model with MoE layers: their regularisation losses and last-forward statistics."""

    cfg: Any

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [m for m in self.modules() if isinstance(m, MoELayer)]

    def aux_loss(self) -> Tensor:
        """Sum over MoE layers of the load-balancing loss of the last forward (differentiable; 0 if dense)."""
        losses = [m.aux_loss.float() for m in self.moe_layers if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def z_loss(self) -> Tensor:
        """Sum over MoE layers of the router z-loss of the last forward (differentiable; 0 if dense)."""
        losses = [m.z_loss.float() for m in self.moe_layers if m.z_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def regularization_loss(self) -> Tensor:
        """What training adds to the task loss: ``aux_loss_coef * aux_loss() + z_loss_coef * z_loss()``."""
        return self.cfg.aux_loss_coef * self.aux_loss() + self.cfg.z_loss_coef * self.z_loss()

    def balance_loss(self) -> float:
        """:meth:`aux_loss` as a float, for logging (1.0 per layer is a perfectly uniform router)."""
        return float(self.aux_loss().detach())

    def drop_rate(self) -> float:
        """Mean fraction of (token, choice) pairs dropped over the MoE layers in the last forward."""
        plans = [m.last_plan for m in self.moe_layers if m.last_plan is not None]
        return sum(p.dropped_fraction for p in plans) / len(plans) if plans else 0.0

    def expert_load(self) -> list[list[int]]:
        """Per MoE layer, the tokens each expert computed in the last forward (``tokens_per_expert``)."""
        return [m.last_plan.tokens_per_expert.tolist() for m in self.moe_layers if m.last_plan is not None]

    def expert_demand(self) -> list[list[int]]:
        """Per MoE layer, the (token, choice) pairs the router sent each expert in the last forward, before the
        capacity limit dropped any (``load``); above :meth:`expert_load` where an expert overflowed."""
        return [m.last_plan.load.tolist() for m in self.moe_layers if m.last_plan is not None]

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count; with ``active`` only those one token uses (k of E experts per MoE layer)."""
        total = 0
        for name, p in self.named_parameters():
            n = p.numel()
            if active and ".experts." in name:
                n = n * self.cfg.k // self.cfg.num_experts
            total += n
        return total
