"""The flexmoe block that stands in for a Hugging Face sparse-MoE block (docs/architecture.md, "Hugging Face
models (flexmoe.hf)").

:class:`ConvertedMoeBlock` is a thin module around a :class:`~flexmoe.MoELayer`: ``forward`` is the layer's, on the
block's input ``[batch, seq, M]``. The router is HF's own router module, run through :class:`HFRouterLogits`: its
weight stays the one parameter of the gate, and because the module keeps its class, transformers' output recorders
(hooked on that class) still collect ``router_logits``, so ``output_router_logits=True`` gives HF's auxiliary loss;
while nothing hooks it, a router class whose forward flexmoe knows has its logits computed as that forward does,
without its top-k (:class:`HFRouterLogits`). The experts (and shared experts) are copied into the layer; only this
rank's experts under expert parallelism. The HF block itself is kept, emptied (its expert tensors on the ``meta``
device), as the skeleton :meth:`ConvertedMoeBlock.to_hf` fills again. The block's ``state_dict`` /
``load_state_dict`` speak HF's block's names and layout (:mod:`flexmoe.hf.hf_state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from flexmoe.experts.modules import parameter_of
from flexmoe.hf.families import Family, experts_implementation, implementation_named_by
from flexmoe.hf.hf_state import (
    experts_like,
    hf_requires_grad,
    hf_scratch,
    layer_module,
    layer_parts,
    layer_requires_grad,
    layer_values,
    load_hf_names,
    materialize,
    save_hf_names,
    write_hf,
)
from flexmoe.layer import MoELayer
from flexmoe.module_call import call_module, runs_unobserved

__all__ = ["HFRouterLogits", "ConvertedMoeBlock", "build_converted_block", "copied_requires_grad", "adapted_modules",
           "InitWithConvertedBlocks"]


def _linear_logits(router: Any, x: Tensor) -> Tensor:
    """Mixtral's, Qwen2-MoE's, Qwen3-MoE's and OLMoE's routers: ``F.linear`` of the flattened tokens (the layer
    passes them flat, ``[T, M]``: no reshape, one operation fewer)."""
    return F.linear(x if x.dim() == 2 else x.reshape(-1, router.hidden_dim), router.weight)


def _float32_linear_logits(router: Any, x: Tensor) -> Tensor:
    """DeepSeek-V3's router: ``F.linear`` of the tokens and the weight cast to float32 (under autocast the
    linear map still runs in autocast's dtype, as in HF's forward)."""
    return F.linear(x.view(-1, router.hidden_dim).type(torch.float32), router.weight.type(torch.float32))


def _biased_linear_logits(router: Any, x: Tensor) -> Tensor:
    """GPT-OSS's router: ``F.linear`` with its bias, on the tokens as given."""
    return F.linear(x, router.weight, router.bias)


# Element 0 of the tuple each of these HF router classes returns, computed as its forward computes it, without the
# softmax, top-k and normalisation whose results flexmoe's plan would throw away. Keyed by (module, class name):
# a subclass, a parametrized class (torch.nn.utils.parametrize, PEFT's target_parameters) or another version's
# class of the same name elsewhere runs its own forward. tests/test_hf_router_logits.py checks each against the
# module's forward.
_DIRECT_LOGITS: dict[tuple[str, str], Callable[[Any, Tensor], Tensor]] = {
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"): _linear_logits,
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeTopKRouter"): _linear_logits,
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"): _linear_logits,
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter"): _linear_logits,
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"): _float32_linear_logits,
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter"): _biased_linear_logits,
}


def direct_logits_of(router: nn.Module) -> Callable[[Any, Tensor], Tensor] | None:
    """The function computing ``router``'s logits as its class's forward does (:data:`_DIRECT_LOGITS`), or None
    for a class flexmoe does not know or whose forward was replaced on the instance."""
    cls = type(router)
    if "forward" in router.__dict__:
        return None
    return _DIRECT_LOGITS.get((cls.__module__, cls.__qualname__))


class HFRouterLogits(nn.Module):
    """HF's router module as flexmoe's gate: tokens ``[T, M]`` (or ``[B, S, M]``) -> its logits ``[T, E]``,
    element ``logits_at`` of the tuple it returns (its own choices are not used, flexmoe makes the plan), in
    ``score_dtype`` (None: as the router made them), the dtype HF's block computes its scores in: under autocast
    the router's linear map gives bf16 logits, which HF's softmax families upcast and DeepSeek-V3 does not.

    When nothing observes the router (no hook, :func:`runs_unobserved`) and its class is one whose forward flexmoe
    knows (:func:`direct_logits_of`), the logits are computed as that forward computes them, without its top-k
    and weights: the same tensor in fewer operations. Otherwise the module runs, so its hooks see its output."""

    def __init__(self, hf_router: nn.Module, *, logits_at: int = 0, score_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hf_router = hf_router
        self.logits_at = logits_at
        self.score_dtype = score_dtype

    def forward(self, x: Tensor) -> Tensor:
        router = self.hf_router
        direct = direct_logits_of(router) if self.logits_at == 0 else None
        if direct is not None and runs_unobserved(router):
            logits = direct(router, x)
        else:
            logits = router(x)[self.logits_at]
        if logits.dim() != 2:
            logits = logits.reshape(-1, logits.shape[-1])
        return logits if self.score_dtype is None else logits.to(self.score_dtype)


class ConvertedMoeBlock(nn.Module):
    """An HF sparse-MoE block computed by flexmoe: ``forward(hidden_states [B, S, M]) -> [B, S, M]`` (GPT-OSS:
    ``(hidden_states, router_weights [B*S, k])`` as its block returns).

    ``moe`` is the :class:`~flexmoe.MoELayer` (its ``router.hf_router`` is HF's router module); ``family`` the
    family name; :meth:`to_hf` gives the HF block back with the current weights. Its state dict is the HF
    block's, names and layout (:func:`~flexmoe.hf.hf_state.save_hf_names`; under expert parallelism
    ``state_dict()`` gathers the experts: every rank must call it), and ``load_state_dict`` takes HF's block's
    (:func:`~flexmoe.hf.hf_state.load_hf_names`). Made by :func:`flexmoe.hf.convert`.
    """

    def __init__(self, family: Family, moe: MoELayer, hf_skeleton: nn.Module, expert_dropout: float = 0.0) -> None:
        super().__init__()
        self.family = family.name
        # The experts implementation HF's config named at conversion (None: the block has no config): a later
        # set_experts_implementation changes the config this block shares with the model, not its computation.
        hf_experts = getattr(hf_skeleton, "experts", None)
        self.converted_under = experts_implementation(hf_experts)
        # The config the model's set_experts_implementation changes (shared with the model, read at every call).
        self.__dict__["_hf_config"] = getattr(hf_experts, "config", None)
        self.returns_router_scores = family.returns_router_scores
        self.expert_dropout = expert_dropout
        self.moe = moe
        # The emptied HF block, kept outside the module tree: its tensors are on "meta" (no memory, not
        # parameters of the model) until to_hf fills them; its router is the live one inside self.moe.
        self.__dict__["_hf_skeleton"] = hf_skeleton
        self.__dict__["_family"] = family
        # The state dict is HF's block's (flexmoe.hf.hf_state): save_pretrained and Trainer write HF's format.
        self.register_state_dict_post_hook(save_hf_names)
        self.register_load_state_dict_pre_hook(load_hf_names)

    def forward(self, hidden_states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        if self.training and self.expert_dropout > 0:
            # HF's experts would drop hidden units here; flexmoe's have no dropout: refuse rather than differ.
            raise ValueError(
                f"the HF {self.family} experts apply dropout (p={self.expert_dropout}) in training, which flexmoe's "
                f"experts do not; convert a model whose expert dropout is 0 (e.g. from_pretrained(..., "
                f"dropout_rate=0.0)), or run this block in eval mode")
        if not torch.compiler.is_compiling():
            self._say_if_implementation_changed()
        moe = self.moe
        out = call_module(moe, hidden_states)
        if self.returns_router_scores:
            weight = moe.last_weight
            assert weight is not None  # set by the forward just run
            return out, weight
        return out

    def extra_repr(self) -> str:
        return f"family={self.family!r}"

    def _say_if_implementation_changed(self) -> None:
        """Warn, in one line, when the model's experts implementation was set after conversion
        (``model.set_experts_implementation``, or ``generate()`` switching ``grouped_mm`` to ``batched_mm`` for
        decoding off the CPU): this block computes its experts with flexmoe whatever the config names. Not an
        error, since ``generate()`` makes that switch by itself."""
        now = implementation_named_by(self.__dict__["_hf_config"])
        if now != self.converted_under:
            # One message per implementation name: Python's warning registry then shows it once, not per block.
            warnings.warn(f"experts_implementation={now!r} does not apply to the blocks flexmoe.hf.convert "
                          f"replaced (their experts are flexmoe's, fixed at conversion); flexmoe.hf.to_hf(model) "
                          f"gives HF's blocks back", UserWarning, stacklevel=3)

    @torch.no_grad()
    def initialize_as_hf(self, init_weights: Callable[[nn.Module], None]) -> None:
        """Initialise the layer's copies of HF's tensors as HF initialises its own block: ``init_weights`` is the
        HF model's ``_init_weights`` (one module at a time), applied to every module of a scratch copy of each
        copied part (experts, shared experts, shared gate: :func:`~flexmoe.hf.hf_state.layer_parts`), whose
        values (this rank's experts) are copied into the layer. DeepSeek-V3's ``expert_bias`` takes the router's
        ``e_score_correction_bias`` (HF's router is the live one: the model initialises it itself, before this
        block, whose children come first). A part whose layer tensors all carry HF's ``_is_hf_initialized`` flag
        (loaded) is left as it is, as HF leaves its own loaded tensors."""
        moe = self.moe
        like = experts_like(moe)
        for part in layer_parts(self.hf_family):
            _, held = layer_module(moe, part)
            scratch = hf_scratch(self, part)
            tensors = [parameter_of(held, name) for name in part.sources(scratch)]
            if all(getattr(t, "_is_hf_initialized", False) for t in tensors):
                continue
            materialize(scratch, like)
            for module in scratch.modules():
                init_weights(module)
            for name, value in layer_values(part, scratch, moe.layout, moe.ep_group.rank).items():
                getattr(held, name).copy_(value)
        hf_bias = getattr(moe.router.hf_router, "e_score_correction_bias", None)
        if moe.expert_bias is not None and isinstance(hf_bias, Tensor):
            moe.expert_bias.copy_(hf_bias)

    def refuse_unmerged_adapters(self) -> None:
        """``ValueError`` naming the modules of this block an adapter still wraps or parametrizes (PEFT's LoRA
        before ``merge_and_unload()``): :meth:`to_hf` copies tensors, so the HF block would drop the adapter."""
        adapted = adapted_modules(self)
        if adapted:
            raise ValueError(f"{self.family} block: {adapted} carry an unmerged adapter, which the HF block would "
                             f"drop; merge it first (peft_model.merge_and_unload()), then to_hf")

    @property
    def hf_family(self) -> Family:
        """The :class:`~flexmoe.hf.families.Family` of the HF block this block stands in for."""
        family: Family = self.__dict__["_family"]
        return family

    @property
    def hf_skeleton(self) -> Any:
        """The emptied HF block (its expert and shared tensors on ``meta``); its router is the live one."""
        return self.__dict__["_hf_skeleton"]

    def hf_requires_grad(self) -> list[dict[str, bool]]:
        """Per copied part (:func:`~flexmoe.hf.hf_state.layer_parts`), the ``requires_grad`` its HF tensors take in
        :meth:`to_hf`: the layer's. ``ValueError`` when ``w1`` and ``w3`` (one ``gate_up_proj``) disagree."""
        return [hf_requires_grad(part, getattr(self.hf_skeleton, part.hf_name), self.moe)
                for part in layer_parts(self.hf_family)]

    def to_hf(self) -> nn.Module:
        """The HF block with this block's current weights and ``requires_grad`` flags (its own class). Under
        expert parallelism every rank of the group must call it (the experts are gathered). Raises
        ``ValueError`` when two layer tensors of one HF tensor disagree on ``requires_grad`` (``w1``, ``w3``), and
        when the block carries an unmerged adapter (:meth:`refuse_unmerged_adapters`)."""
        self.refuse_unmerged_adapters()
        block, moe = self.hf_skeleton, self.moe
        parts = layer_parts(self.hf_family)
        for part, part_flags in zip(parts, self.hf_requires_grad()):
            hf_module = getattr(block, part.hf_name)
            materialize(hf_module, experts_like(moe))
            write_hf(part, hf_module, moe)
            for name, tensors in part.sources(hf_module).items():
                for source in tensors:
                    source.requires_grad_(part_flags[name])
        router = getattr(block, self.hf_family.router)
        if moe.expert_bias is not None and hasattr(router, "e_score_correction_bias"):
            with torch.no_grad():  # DeepSeek-V3's e_score_correction_bias, carried by expert_bias while converted
                router.e_score_correction_bias.copy_(moe.expert_bias)
        return block.train(self.training)  # the skeleton kept the mode it had when converted


# What a converted block does unless convert() is told otherwise, beyond its family's options: gated experts hold
# w1 and w3 as one parameter, gate_up, the layout of HF's gate_up_proj, so that the grouped GEMM reads them as one
# weight without a copy per call (flexmoe.sharding.parallelize lays them apart for FSDP2).
CONVERTED_DEFAULTS: dict[str, object] = {"joined_gate_up": True}


def build_converted_block(block: Any, family: Family, *, group: object | None,
                          options: dict[str, object]) -> ConvertedMoeBlock:
    """The :class:`ConvertedMoeBlock` for HF block ``block`` of ``family``, with ``options`` applied on top of the
    family's; ``block`` is emptied into the skeleton only once the layer is built (a bad option leaves it whole).
    The layer takes the dtype and device of the routed experts, and each layer tensor the ``requires_grad`` of the
    HF tensors it comes from (:func:`copied_requires_grad`, which raises before anything is built)."""
    model_dim, num_experts, hidden_dim = family.sizes(block)
    parts = layer_parts(family)
    flags = copied_requires_grad(block, family)
    like = parts[0].sources(block.experts)["w1"][0]
    router = getattr(block, family.router)
    gate = HFRouterLogits(router, logits_at=family.router_logits_at, score_dtype=family.score_dtype(router))
    moe = MoELayer(model_dim, num_experts, hidden_dim, router=gate, group=group, device=like.device,
                   dtype=like.dtype, **{**CONVERTED_DEFAULTS, **family.layer_options(block), **options})
    for part in parts:
        hf_module, layer_module = getattr(block, part.hf_name), getattr(moe, part.layer_name)
        with torch.no_grad():
            # Only this rank's experts are copied (flexmoe.parallel.layout); fused HF experts are read through views.
            for name, value in layer_values(part, hf_module, moe.layout, moe.ep_group.rank).items():
                getattr(layer_module, name).copy_(value)
        for name, flag in flags[part.hf_name].items():
            held = parameter_of(layer_module, name)  # a joined pair's w1, w3: gate_up
            assert held is not None  # a name the part's sources hold
            held.requires_grad_(flag)
    if moe.expert_bias is not None and hasattr(router, "e_score_correction_bias"):
        with torch.no_grad():
            moe.expert_bias.copy_(router.e_score_correction_bias)
    # Free the HF copies: the skeleton keeps shapes only.
    for part in parts:
        getattr(block, part.hf_name).to("meta")
    converted = ConvertedMoeBlock(family, moe, block, expert_dropout=family.expert_dropout(block))
    # In the HF block's mode: a model from from_pretrained is in eval, and a block left in training would jitter,
    # compute losses and skip the decoding path there.
    return converted.train(block.training)


def copied_requires_grad(block: Any, family: Family) -> dict[str, dict[str, bool]]:
    """For each part of HF block ``block`` that a converted layer copies (by its name in ``block``), the
    ``requires_grad`` each layer tensor takes: that of the HF tensors it comes from (``w1`` and ``w3`` both
    ``gate_up_proj``'s; Switch's ``w1`` every expert's ``wi``). Changes nothing, so ``convert`` checks every block
    before building any. Raises ``ValueError`` when a part's tensors are not in the routed experts' dtype and
    device (the layer holds one of each), and when the HF tensors of one layer tensor disagree on
    ``requires_grad`` (:func:`~flexmoe.hf.hf_state.layer_requires_grad`)."""
    parts = layer_parts(family)
    like = parts[0].sources(block.experts)["w1"][0]
    for part in parts:
        for name, tensors in part.sources(getattr(block, part.hf_name)).items():
            for source in tensors:
                if (source.dtype, source.device) != (like.dtype, like.device):
                    raise ValueError(f"{type(block).__name__}.{part.hf_name} ({name}) is {source.dtype} on "
                                     f"{source.device}, its experts {like.dtype} on {like.device}; the flexmoe "
                                     f"layer holds one dtype and device: cast the block first")
    return {part.hf_name: layer_requires_grad(part, getattr(block, part.hf_name)) for part in parts}


def adapted_modules(module: nn.Module) -> list[str]:
    """Names (``""``: ``module`` itself) of the modules under ``module`` that an adapter wraps or parametrizes:
    PEFT's tuner layers (they have ``get_base_layer()``) and modules with torch parametrizations. Copying
    ``module``'s tensors, as convert and to_hf do, would drop their adaptation."""
    return [name for name, m in module.named_modules()
            if callable(getattr(m, "get_base_layer", None)) or parametrize.is_parametrized(m)]



class InitWithConvertedBlocks:
    """The ``_init_weights`` that :func:`flexmoe.hf.convert` gives an HF model holding converted blocks (an
    attribute of that model instance; its class is untouched): the class's own ``_init_weights(module)``, and for a
    :class:`ConvertedMoeBlock` also :meth:`ConvertedMoeBlock.initialize_as_hf`. HF's ``init_weights()`` /
    ``initialize_weights()`` call ``_init_weights`` once per module (children first), so a model built on
    ``meta``, converted and materialised with ``to_empty`` gets its experts and buffers drawn as HF draws its own,
    not left uninitialised."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, module: nn.Module) -> None:
        model = self.model
        type(model)._init_weights(model, module)  # type: ignore[attr-defined]  # an HF PreTrainedModel's
        if isinstance(module, ConvertedMoeBlock):
            module.initialize_as_hf(lambda m: type(model)._init_weights(model, m))  # type: ignore[attr-defined]
