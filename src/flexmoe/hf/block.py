"""The flexmoe block that stands in for a Hugging Face sparse-MoE block (docs/architecture.md, "Hugging Face
models (flexmoe.hf)").

:class:`ConvertedMoeBlock` is a thin module around a :class:`~flexmoe.MoELayer`: ``forward`` is the layer's, on
the block's input ``[batch, seq, M]``. The router is HF's own router module, run through :class:`HFRouterLogits`:
its weight stays the one parameter of the gate, and because the module keeps its class, transformers' output
recorders (hooked on that class) still collect ``router_logits``, so ``output_router_logits=True`` gives HF's
auxiliary loss. The experts (and shared experts) are copied into the layer; only this rank's experts under
expert parallelism. The HF block itself is kept, emptied (its expert tensors on the ``meta`` device), as the
skeleton :meth:`ConvertedMoeBlock.to_hf` fills again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from flexmoe.checkpoint import gather_experts
from flexmoe.hf.families import Family, expert_weights, shared_mlp_weights
from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import HIDDEN_DIM, shard_expert_state

__all__ = ["HFRouterLogits", "ConvertedMoeBlock", "build_converted_block", "adapted_modules"]


class HFRouterLogits(nn.Module):
    """HF's router module as flexmoe's gate: tokens ``[T, M]`` -> its logits ``[T, E]`` (the first of the
    ``(logits, weights, indices)`` it returns; its own choices are not used, flexmoe makes the plan)."""

    def __init__(self, hf_router: nn.Module) -> None:
        super().__init__()
        self.hf_router = hf_router

    def forward(self, x: Tensor) -> Tensor:
        return self.hf_router(x)[0]


class ConvertedMoeBlock(nn.Module):
    """An HF sparse-MoE block computed by flexmoe: ``forward(hidden_states [B, S, M]) -> [B, S, M]`` (GPT-OSS:
    ``(hidden_states, router_weights [B*S, k])`` as its block returns).

    ``moe`` is the :class:`~flexmoe.MoELayer` (its ``router.hf_router`` is HF's router module); ``family`` the
    family name; :meth:`to_hf` gives the HF block back with the current weights. Made by
    :func:`flexmoe.hf.convert`.
    """

    def __init__(self, family: Family, moe: MoELayer, hf_skeleton: nn.Module) -> None:
        super().__init__()
        self.family = family.name
        self.returns_router_scores = family.returns_router_scores
        self.moe = moe
        # The emptied HF block, kept outside the module tree: its tensors are on "meta" (no memory, not
        # parameters of the model) until to_hf fills them; its router is the live one inside self.moe.
        self.__dict__["_hf_skeleton"] = hf_skeleton
        self.__dict__["_family"] = family

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = self.moe(hidden_states)
        if self.returns_router_scores:
            plan = self.moe.last_plan
            assert plan is not None  # set by the forward just run
            return out, plan.weight
        return out

    def extra_repr(self) -> str:
        return f"family={self.family!r}"

    def refuse_unmerged_adapters(self) -> None:
        """``ValueError`` naming the modules of this block an adapter still wraps or parametrizes (PEFT's LoRA
        before ``merge_and_unload()``): :meth:`to_hf` copies tensors, so the HF block would drop the adapter."""
        adapted = adapted_modules(self)
        if adapted:
            raise ValueError(f"{self.family} block: {adapted} carry an unmerged adapter, which the HF block would "
                             f"drop; merge it first (peft_model.merge_and_unload()), then to_hf")

    @torch.no_grad()
    def to_hf(self) -> nn.Module:
        """The HF block with this block's current weights (its own class, so ``save_pretrained`` writes HF's
        format). Under expert parallelism every rank of the group must call it (the experts are gathered)."""
        self.refuse_unmerged_adapters()
        family: Family = self.__dict__["_family"]
        block: Any = self.__dict__["_hf_skeleton"]
        moe = self.moe
        local = {name: p.detach() for name, p in moe.experts.named_parameters(recurse=False) if name in HIDDEN_DIM}
        full = gather_experts(local, moe.layout, moe.ep_group.group) if moe.ep_group.distributed else local
        like = local["w1"]
        _materialize(block.experts, like)
        for name, view in expert_weights(block.experts).items():
            view.copy_(full[name])
        if family.shared is not None:
            assert moe.shared is not None  # built from the same family
            mlp = getattr(block, family.shared)
            _materialize(mlp, like)
            for name, view in shared_mlp_weights(mlp).items():
                view.copy_(getattr(moe.shared, name))
        if family.shared_gate is not None:
            assert moe.shared_gate is not None
            gate = getattr(block, family.shared_gate)
            _materialize(gate, like)
            gate.weight.copy_(moe.shared_gate.weight)
        router = getattr(block, family.router)
        if moe.expert_bias is not None and hasattr(router, "e_score_correction_bias"):
            # DeepSeek-V3's e_score_correction_bias, carried by flexmoe's expert_bias while converted.
            router.e_score_correction_bias.copy_(moe.expert_bias)
        return block


def build_converted_block(block: Any, family: Family, *, group: object | None,
                          options: dict[str, object]) -> ConvertedMoeBlock:
    """The :class:`ConvertedMoeBlock` for HF block ``block`` of ``family``, with ``options`` applied on top of the
    family's; ``block`` is emptied into the skeleton only once the layer is built (a bad option leaves it whole)."""
    model_dim, num_experts, hidden_dim = family.sizes(block)
    like = expert_weights(block.experts)["w1"]
    router = getattr(block, family.router)
    moe = MoELayer(model_dim, num_experts, hidden_dim, router=HFRouterLogits(router), group=group,
                   device=like.device, dtype=like.dtype, **{**family.layer_options(block), **options})
    with torch.no_grad():
        # Only this rank's slice is copied (flexmoe.parallel.layout); expert_weights are views, not copies.
        mine = shard_expert_state(expert_weights(block.experts), moe.layout, moe.ep_group.rank)
        for name, value in mine.items():
            getattr(moe.experts, name).copy_(value)
        if family.shared is not None:
            assert moe.shared is not None
            for name, value in shared_mlp_weights(getattr(block, family.shared)).items():
                getattr(moe.shared, name).copy_(value)
        if family.shared_gate is not None:
            assert moe.shared_gate is not None
            moe.shared_gate.weight.copy_(getattr(block, family.shared_gate).weight)
        if moe.expert_bias is not None and hasattr(router, "e_score_correction_bias"):
            moe.expert_bias.copy_(router.e_score_correction_bias)
    # Free the HF copies: the skeleton keeps shapes only.
    for part in ("experts", family.shared, family.shared_gate):
        if part is not None:
            getattr(block, part).to("meta")
    return ConvertedMoeBlock(family, moe, block)


def adapted_modules(module: nn.Module) -> list[str]:
    """Names (``""``: ``module`` itself) of the modules under ``module`` that an adapter wraps or parametrizes:
    PEFT's tuner layers (they have ``get_base_layer()``) and modules with torch parametrizations. Copying
    ``module``'s tensors, as convert and to_hf do, would drop their adaptation."""
    return [name for name, m in module.named_modules()
            if callable(getattr(m, "get_base_layer", None)) or parametrize.is_parametrized(m)]


def _materialize(module: nn.Module, like: Tensor) -> None:
    """Give every ``meta`` parameter and buffer of ``module`` real (uninitialised) storage like ``like``."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(sub, name, nn.Parameter(torch.empty(p.shape, device=like.device, dtype=like.dtype),
                                                requires_grad=p.requires_grad))
        for name, b in list(sub.named_buffers(recurse=False)):
            if b.is_meta:
                sub.register_buffer(name, torch.empty(b.shape, device=like.device, dtype=b.dtype))
