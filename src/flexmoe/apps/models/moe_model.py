"""What the application models (the GPT, the vision transformer) share: their transformer block, how an MLP
becomes an :class:`~flexmoe.MoELayer`, and the losses and statistics training reads from those layers.

A model using :class:`MoEModel` has a ``cfg`` with ``k``, ``num_experts``, ``aux_loss_coef`` and ``z_loss_coef``;
its MoE layers are found among its submodules, in order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.layer import MoELayer
from flexmoe.upcycle import check_upcycle_routing, check_upcycle_shape, expert_scale, slice_experts

__all__ = ["MoEModelConfig", "build_moe_mlp", "SelfAttention", "DenseMLP", "Block", "MoEModel"]


@dataclass
class MoEModelConfig:
    """What the models' configuration dataclasses share: the transformer's size, the MoE layout over blocks,
    the dense twin, and the JSON round trip. A subclass is a dataclass adding its own fields (and overriding
    a default here by declaring the field again).

    Every field is plain data (what a run saves): the expert-parallel process group, a runtime object, is passed
    beside the configuration (the models' and :func:`build_moe_mlp`'s ``group``), never in it.
    """

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # Mixture of experts. dense=True builds the twin: every MLP dense with hidden k * expert_hidden.
    dense: bool = False
    moe_every: int = 2
    num_experts: int = 8
    expert_hidden: int = 256
    k: int = 2
    capacity_factor: float = 1.25
    router: str = "topk"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        self._check_shape()

    def _check_shape(self) -> None:
        """The checks every such model needs (a subclass's own ones go in its ``__post_init__``)."""
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must divide by n_head={self.n_head}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k must be in [1, num_experts={self.num_experts}], got {self.k}")

    @property
    def dense_hidden(self) -> int:
        """Hidden size of every dense MLP: k * expert_hidden, the active width of an MoE layer."""
        return self.k * self.expert_hidden

    def is_moe_layer(self, index: int) -> bool:
        """Blocks moe_every-1, 2*moe_every-1, ... are MoE (GShard: every other block with moe_every=2)."""
        return not self.dense and (index + 1) % self.moe_every == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> Any:
        """Build from :meth:`to_dict` output; unknown keys are an error (a config from another version)."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}")
        return cls(**{**values, **overrides})

    def dense_twin(self) -> Any:
        """The same model with dense MLPs of equal active compute."""
        return type(self).from_dict({**self.to_dict(), "dense": True})


def build_moe_mlp(cfg: Any, group: Any = None) -> MoELayer:
    """The MoE MLP of width ``cfg.n_embd``: ``cfg.num_experts`` GELU experts of hidden ``cfg.expert_hidden``,
    ``cfg.k`` per token, routed by ``cfg.router`` with ``cfg.capacity_factor``; the all-to-all ``cfg.a2a`` and
    the topology gate's ``cfg.cross_node_share`` and ``cfg.redundant_experts`` where the config has them (the
    GPT's does). ``group``: the expert-parallel process group the layer spreads its experts over (None or
    ``"single"``: this process holds every expert)."""
    kwargs: dict[str, Any] = dict(
        k=cfg.k, capacity_factor=cfg.capacity_factor, router=cfg.router, activation="gelu",
        a2a=getattr(cfg, "a2a", "flat"), cross_node_share=getattr(cfg, "cross_node_share", None),
        aux_loss_type=getattr(cfg, "aux_loss_type", "switch"),
    )
    # Expert parallelism: the layer keeps only this rank's experts (see flexmoe.parallel.layout). Without a
    # group, one process holds every expert even under torch.distributed (MoELayer's own default is the world).
    kwargs["group"] = group if group is not None else "single"
    if kwargs["group"] == "single":
        kwargs["ranks_per_node"] = 1  # one process holding every expert is one node, whatever torchrun says
    if getattr(cfg, "redundant_experts", 0) and kwargs["group"] != "single":
        # Replicas copy experts between ranks. The one-process model of the same config (the job's reference
        # and parameter count) holds every expert; the job refuses --redundant-experts in one process.
        kwargs["redundant_experts"] = cfg.redundant_experts
    return MoELayer(cfg.n_embd, cfg.num_experts, cfg.expert_hidden, **kwargs)


class SelfAttention(nn.Module):
    """Multi-head self-attention, causal (a language model) or over all tokens (every patch of an image)."""

    def __init__(self, cfg: Any, causal: bool) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.causal = causal
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, D]`` -> ``[B, L, D]``."""
        b, seq, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # [B, L, D] -> [B, heads, L, D/heads]
        q, k, v = (t.view(b, seq, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, seq, d))


class DenseMLP(nn.Module):
    """The dense twin's MLP: ``n_embd -> dense_hidden -> n_embd`` with GELU."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.dense_hidden)
        self.proj = nn.Linear(cfg.dense_hidden, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, D]`` -> ``[B, L, D]``."""
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; the MLP is MoE (block ``index``
    per ``cfg.is_moe_layer``) or dense, its experts spread over ``group`` (:func:`build_moe_mlp`). Shared by the GPT
    (causal) and the ViT."""

    def __init__(self, cfg: Any, index: int, *, causal: bool, group: Any = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg, causal)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.is_moe = cfg.is_moe_layer(index)
        self.mlp: nn.Module = build_moe_mlp(cfg, group) if self.is_moe else DenseMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, D]`` -> ``[B, L, D]``."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


# The config fields upcycle_mlps sets itself; the others may be given as options.
_UPCYCLE_SETS = frozenset({"dense", "moe_every", "num_experts", "k", "expert_hidden", "n_embd", "n_head", "n_layer"})


class MoEModel(nn.Module):
    """Base of a model with MoE layers: their regularisation losses and last-forward statistics. ``group``: the
    expert-parallel process group its MoE layers were built over (None: this process holds every expert)."""

    cfg: Any
    group: Any = None

    def __init__(self, cfg: Any, group: Any = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group

    def _add_trunk(self, cfg: MoEModelConfig, *, causal: bool) -> None:
        """Register what the GPT and the ViT run between their embeddings and their head (after the embeddings,
        so that parameters keep that order): dropout, ``cfg.n_layer`` blocks (the MoE ones spread over
        ``self.group``), the final layer norm."""
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, causal=causal, group=self.group) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def _run_blocks(self, x: Tensor) -> Tensor:
        """x: ``[B, L, n_embd]`` embedded tokens -> dropout, then every block -> ``[B, L, n_embd]`` (``ln_f`` is the
        caller's: the ViT pools first)."""
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return x

    def _init_gpt_style(self, name: str, module: nn.Module) -> bool:
        """GPT-2 style: N(0, 0.02) for linears and embeddings, residual projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream does not grow with depth; False (untouched) for other modules: the experts and
        the router keep MoELayer's own initialisation, the layer norms theirs."""
        if not isinstance(module, (nn.Linear, nn.Embedding)) or ".experts" in name or "router" in name:
            return False
        std = 0.02
        if name.endswith("proj"):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        nn.init.normal_(module.weight, 0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        return True

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
        return sum(float(p.dropped_fraction) for p in plans) / len(plans) if plans else 0.0

    def expert_load(self) -> list[list[int]]:
        """Per MoE layer, the tokens each expert computed in the last forward (``tokens_per_expert``)."""
        return [m.last_plan.tokens_per_expert.tolist() for m in self.moe_layers if m.last_plan is not None]

    def expert_demand(self) -> list[list[int]]:
        """Per MoE layer, the (token, choice) pairs the router sent each expert in the last forward, before the
        capacity limit dropped any (``load``); above :meth:`expert_load` where an expert overflowed."""
        return [m.last_plan.load.tolist() for m in self.moe_layers if m.last_plan is not None]

    def upcycle_mlps(self, *, num_experts: int, k: int, granularity: int = 1, **options: Any) -> MoEModel:
        """:func:`flexmoe.upcycle` for this model: every block's :class:`DenseMLP` becomes the MoE layer of a config
        with ``moe_every=1``, ``num_experts``, ``k`` and ``expert_hidden = dense_hidden / granularity`` (options:
        other config fields, ``capacity_factor`` default 0, dropless), holding the MLP's slices with the router at
        zero, so the model computes what it did (docs/architecture.md, "Upcycling"); ``self.cfg`` becomes that
        config. Returns the model. ``ValueError`` as :func:`flexmoe.upcycle` says, and for a structure field or a
        name that is no config field among the options."""
        cfg: Any = self.cfg
        given = sorted(set(options) & _UPCYCLE_SETS)
        if given:
            raise ValueError(f"upcycle() sets {given} itself (num_experts, k and granularity decide the layers)")
        if self.group is not None:
            raise ValueError("upcycle() builds one process's model: upcycle it without a group, then load its "
                             "state dict into the expert-parallel model (as flexmoe train --upcycle-from does)")
        mlps: list[tuple[str, Any]] = [(name, m) for name, m in self.named_modules() if isinstance(m, DenseMLP)]
        if not mlps:
            raise ValueError(f"{type(self).__name__} has no dense MLP to upcycle")
        hidden = cfg.dense_hidden
        check_upcycle_shape(num_experts, k, granularity, hidden)
        routing = {"capacity_factor": 0.0, "router": "topk", **options}
        check_upcycle_routing(routing, num_experts, k)
        # from_dict refuses a name that is no field of the config (ValueError naming it).
        new_cfg = type(cfg).from_dict({**cfg.to_dict(), **routing, "dense": False, "moe_every": 1,
                                       "num_experts": num_experts, "k": k, "expert_hidden": hidden // granularity})
        scale = expert_scale(num_experts, k, granularity)  # these layers normalise softmax scores
        for name, mlp in mlps:
            layer = build_moe_mlp(new_cfg).to(device=mlp.fc.weight.device, dtype=mlp.fc.weight.dtype)
            dense = {"w1": mlp.fc.weight.T, "b1": mlp.fc.bias, "w2": mlp.proj.weight.T, "b2": mlp.proj.bias}
            router: Any = layer.router
            with torch.no_grad():
                for part, value in slice_experts(dense, num_experts, granularity, scale).items():
                    getattr(layer.experts, part).copy_(value)
                router.weight.zero_()
            parent_name, _, child = name.rpartition(".")
            block: Any = self.get_submodule(parent_name)
            setattr(block, child, layer)
            block.is_moe = True
        self.cfg = new_cfg
        return self

    def num_params(self, *, active: bool = False) -> int:
        """Parameter count; with ``active`` only those one token uses (k of E experts per MoE layer)."""
        total = 0
        for name, p in self.named_parameters():
            n = p.numel()
            if active and ".experts." in name:
                n = n * self.cfg.k // self.cfg.num_experts
            total += n
        return total
