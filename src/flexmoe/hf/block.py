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

from flexmoe.checkpoint import gather_experts
from flexmoe.hf.families import Family, shared_mlp_weights
from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import HIDDEN_DIM, shard_expert_state

__all__ = ["HFRouterLogits", "ConvertedMoeBlock", "build_converted_block"]


class HFRouterLogits(nn.Module):
    """HF's router module as flexmoe's gate: tokens ``[T, M]`` (or ``[B, S, M]``) -> its logits ``[T, E]``,
    element ``logits_at`` of the tuple it returns (its own choices are not used, flexmoe makes the plan), in
    ``score_dtype`` (None: as the router made them), the dtype HF's block computes its scores in: under autocast
    the router's linear map gives bf16 logits, which HF's softmax families upcast and DeepSeek-V3 does not."""

    def __init__(self, hf_router: nn.Module, *, logits_at: int = 0, score_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hf_router = hf_router
        self.logits_at = logits_at
        self.score_dtype = score_dtype

    def forward(self, x: Tensor) -> Tensor:
        logits = self.hf_router(x)[self.logits_at]
        logits = logits.reshape(-1, logits.shape[-1])
        return logits if self.score_dtype is None else logits.to(self.score_dtype)


class ConvertedMoeBlock(nn.Module):
    """An HF sparse-MoE block computed by flexmoe: ``forward(hidden_states [B, S, M]) -> [B, S, M]`` (GPT-OSS:
    ``(hidden_states, router_weights [B*S, k])`` as its block returns).

    ``moe`` is the :class:`~flexmoe.MoELayer` (its ``router.hf_router`` is HF's router module); ``family`` the
    family name; :meth:`to_hf` gives the HF block back with the current weights. Made by
    :func:`flexmoe.hf.convert`.
    """

    def __init__(self, family: Family, moe: MoELayer, hf_skeleton: nn.Module, expert_dropout: float = 0.0) -> None:
        super().__init__()
        self.family = family.name
        self.returns_router_scores = family.returns_router_scores
        self.expert_dropout = expert_dropout
        self.moe = moe
        # The emptied HF block, kept outside the module tree: its tensors are on "meta" (no memory, not
        # parameters of the model) until to_hf fills them; its router is the live one inside self.moe.
        self.__dict__["_hf_skeleton"] = hf_skeleton
        self.__dict__["_family"] = family

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.training and self.expert_dropout > 0:
            # HF's experts would drop hidden units here; flexmoe's have no dropout: refuse rather than differ.
            raise ValueError(
                f"the HF {self.family} experts apply dropout (p={self.expert_dropout}) in training, which flexmoe's "
                f"experts do not; convert a model whose expert dropout is 0 (e.g. from_pretrained(..., "
                f"dropout_rate=0.0)), or run this block in eval mode")
        out = self.moe(hidden_states)
        if self.returns_router_scores:
            plan = self.moe.last_plan
            assert plan is not None  # set by the forward just run
            return out, plan.weight
        return out

    def extra_repr(self) -> str:
        return f"family={self.family!r}"

    @torch.no_grad()
    def to_hf(self) -> nn.Module:
        """The HF block with this block's current weights (its own class, so ``save_pretrained`` writes HF's
        format). Under expert parallelism every rank of the group must call it (the experts are gathered)."""
        family: Family = self.__dict__["_family"]
        block: Any = self.__dict__["_hf_skeleton"]
        moe = self.moe
        local = {name: p.detach() for name, p in moe.experts.named_parameters(recurse=False) if name in HIDDEN_DIM}
        full = gather_experts(local, moe.layout, moe.ep_group.group) if moe.ep_group.distributed else local
        like = local["w1"]
        _materialize(block.experts, like)
        family.write_experts(block.experts, full)
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
    hf_experts = family.read_experts(block.experts)
    like = hf_experts["w1"]
    router = getattr(block, family.router)
    gate = HFRouterLogits(router, logits_at=family.router_logits_at, score_dtype=family.score_dtype(router))
    moe = MoELayer(model_dim, num_experts, hidden_dim, router=gate, group=group,
                   device=like.device, dtype=like.dtype, **{**family.layer_options(block), **options})
    with torch.no_grad():
        # Only this rank's slice is copied (flexmoe.parallel.layout); fused HF experts are read through views.
        mine = shard_expert_state(hf_experts, moe.layout, moe.ep_group.rank)
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
    return ConvertedMoeBlock(family, moe, block, expert_dropout=family.expert_dropout(block))


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
