"""``convert`` and ``to_hf``: Hugging Face MoE blocks to flexmoe and back, in place (docs/architecture.md, "Hugging
Face models (flexmoe.hf)")."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from flexmoe.experts import ExpertOptions
from flexmoe.hf.block import (
    ConvertedMoeBlock,
    InitWithConvertedBlocks,
    adapted_modules,
    build_converted_block,
    copied_requires_grad,
)
from flexmoe.hf.families import FAMILIES, family_of
from flexmoe.layer import MoELayer
from flexmoe.parallel.options import ParallelOptions
from flexmoe.routing.options import RoutingOptions

__all__ = ["convert", "to_hf", "FAMILY_OPTIONS"]

# Options the family decides (they describe the HF block's function and weights); convert refuses them.
FAMILY_OPTIONS = frozenset({
    "router", "router_bias", "score_func", "num_expert_groups", "num_limited_groups", "route_scale",
    "glu", "bias", "activation", "glu_limit", "shared_experts", "shared_hidden_dim", "shared_gate",
})
_LAYER_OPTIONS = frozenset(f.name for cls in (RoutingOptions, ExpertOptions, ParallelOptions)
                           for f in dataclasses.fields(cls))


def convert(model: nn.Module, *, group: object | None = None, **options: Any) -> nn.Module:
    """Replace, in place, every supported sparse-MoE block of ``model`` with a flexmoe
    :class:`~flexmoe.hf.block.ConvertedMoeBlock` carrying its weights, and return ``model``; given a single
    block, return its replacement.

    Families (by block class): Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2 (``topk_method=
    "greedy"``), DeepSeek-V3, GLM-4.5 (GLM4-MoE), GPT-OSS and Switch Transformers (``SwitchTransformersSparseMLP``:
    top-1, ``expert_capacity`` per sequence, a dropped token's MLP output 0 as in HF's; its experts' dropout is
    refused in training). The converted model computes HF's function: the same logits (to float32 rounding), the
    same loss, and with ``output_router_logits=True`` the same ``router_logits`` and auxiliary loss (HF's router
    module is kept and still recorded); ``generate()`` and the KV cache work unchanged. Its ``state_dict()`` is
    HF's model's (names, shapes, layouts: ``save_pretrained`` and ``Trainer`` write plain HF checkpoints; under
    expert parallelism a collective, every rank calls it), and ``load_state_dict`` takes HF's state dicts. Each
    parameter keeps its ``requires_grad``, dtype and device (``w1`` and ``w3`` both take ``gate_up_proj``'s flag;
    Switch's ``w1`` / ``w2`` that of every expert's ``wi`` / ``wo``, which must agree). Under ``torch.autocast``
    it routes as HF's does (``router_dtype=None``: HF's router runs under the autocast, its bf16 logits are scored
    in the dtype HF scores them in, and ``ties="topk"`` breaks equal scores as HF's ``torch.topk``), so the same
    experts are chosen. DeepSeek-V3's ``e_score_correction_bias`` becomes the layer's ``expert_bias``
    (``balance="bias"``, ``bias_update_rate=0``: fixed, as HF keeps it). Differences: in a model cast to bf16
    (not under autocast) HF's Switch router takes the argmax of probabilities rounded to bf16, flexmoe of float32
    ones; Mixtral's ``router_jitter_noise`` (training only) jitters the router's input only, HF's the experts'
    input too.

    group: the expert-parallel ``torch.distributed`` group (default: the world when torch.distributed is
        initialized, else one process; ``"single"``: one process holding every expert). Each rank keeps only its
        own experts (docs/architecture.md, "Experts over ranks"); wrap the model with
        :func:`flexmoe.parallel.ddp.wrap_ddp` so the rest stays data-parallel. Every rank must call ``convert``.
    options: :class:`~flexmoe.MoELayer` keywords applied on top of the family's. The defaults reproduce HF
        (dropless, ``capacity_factor=0``). These change nothing but speed: ``r``, ``overlap_degree``, ``a2a``,
        ``ranks_per_node``, ``parallel`` ("auto"), ``chooser``, ``shadow``, ``schedule``, ``joined_gate_up`` (True
        here: the routed experts' ``w1`` and ``w3`` as one parameter, ``gate_up``, as HF's ``gate_up_proj``,
        read in place; LoRA then targets ``experts.gate_up``; pass False for two parameters, e.g. to apply FSDP2's
        ``fully_shard`` by hand: :func:`flexmoe.sharding.parallelize` lays them apart itself). These change the
        function away from HF's: ``capacity`` / ``capacity_factor`` > 0 (a capacity drops tokens past it),
        ``k``, ``normalize_weights``, ``balance`` (``"aux"`` drops DeepSeek-V3's bias from the selection),
        ``bias_update_rate`` > 0 (moves the bias every step), ``batch_prioritized``, ``score_at="dispatch"``,
        ``second_expert``, ``cross_node_share``, ``jitter``, ``gate_noise``, ``router_input_dropout``;
        ``aux_loss_type`` only changes flexmoe's own ``moe.aux_loss`` (HF computes its loss from the router
        logits), ``router_dtype`` the routing precision (``torch.float32``: the router outside autocast), ``ties``
        (``"lower"``: equal scores to the lower expert index, the same on every device). The options that
        describe the block itself (:data:`FAMILY_OPTIONS`: router, experts' activation, biases, shared experts,
        score function, groups, scale) are the family's: passing one, or a name that is no MoELayer option, is a
        ``ValueError`` naming it.

    Adapters: one outside the MoE blocks (PEFT's LoRA on attention) is kept and keeps working. One inside a block
    (LoRA on HF's ``gate_up_proj`` / ``down_proj``, on a shared expert or the router, a torch parametrization) is a
    ``ValueError`` naming it: convert copies the block's tensors and would drop it. Merge it first, or convert
    the plain model and put LoRA on flexmoe's experts, ``peft.LoraConfig(target_parameters=["experts.gate_up",
    "experts.w2"])`` (a converted block's gated pair is one parameter, ``gate_up``, as HF's ``gate_up_proj``;
    docs/architecture.md, "Adapters on the experts").

    Raises ``ValueError`` naming the class for an unsupported block, and for a model with no supported block (or
    with an MoE-looking block of an unsupported class); naming the tensors, when some of Switch's experts are
    frozen and others not (flexmoe holds them all in one tensor).
    """
    _check_module(model)
    _check_options(options)
    if family_of(model) is not None:
        _refuse_adapters(model, type(model).__name__)
        return _convert_block(model, group, options)
    if isinstance(model, ConvertedMoeBlock):
        raise ValueError("model is already a flexmoe ConvertedMoeBlock (flexmoe.hf.to_hf gives the HF block back)")
    blocks = [(name, m) for name, m in model.named_modules() if family_of(m) is not None]
    unsupported = _unsupported_moe_blocks(model)
    if unsupported:
        raise ValueError(f"{type(model).__name__} has sparse-MoE blocks flexmoe cannot convert: "
                         f"{sorted(unsupported)}; supported block classes: {sorted(FAMILIES)}")
    if not blocks:
        done = " (its blocks are converted already)" if any(
            isinstance(m, ConvertedMoeBlock) for m in model.modules()) else ""
        raise ValueError(f"{type(model).__name__} is not a supported sparse-MoE block and contains none{done} "
                         f"(supported block classes: {sorted(FAMILIES)})")
    for name, block in blocks:  # every block checked before any is emptied into its skeleton
        _refuse_adapters(block, name)
        family = family_of(block)
        assert family is not None  # found by its family
        copied_requires_grad(block, family)
    # Build every replacement before swapping any in, so that a bad option leaves the model untouched.
    converted = [(name, _convert_block(block, group, options)) for name, block in blocks]
    for name, new in converted:
        _replace(model, name, new)
    _init_converted_blocks_too(model)
    return model


def to_hf(model: nn.Module) -> nn.Module:
    """The reverse of :func:`convert`, in place: every :class:`~flexmoe.hf.block.ConvertedMoeBlock` of ``model``
    becomes its HF block again with the current (trained) weights, including DeepSeek-V3's
    ``e_score_correction_bias`` (flexmoe's ``expert_bias``); returns ``model``, or, given a single converted block,
    the HF block. ``model.save_pretrained`` then writes HF's own format, which plain ``transformers`` loads.

    Collective under expert parallelism: every rank of the group must call it (each block's experts are gathered
    from the ranks). Each HF tensor takes the ``requires_grad`` of the layer's tensors it holds. The HF parameters
    are new tensors: build the optimizer again to continue training (saving needs no ``to_hf``: a converted
    model's ``state_dict`` is already HF's). Raises ``ValueError`` when ``model`` holds no converted block, when
    ``w1`` and ``w3`` of one block (one ``gate_up_proj``) disagree on ``requires_grad``, and when a block carries
    an unmerged adapter (the HF block would drop it: ``merge_and_unload()`` first).
    """
    _check_module(model)
    if isinstance(model, ConvertedMoeBlock):
        return model.to_hf()
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, ConvertedMoeBlock)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} holds no flexmoe block to export (flexmoe.hf.convert makes them)")
    for _, block in blocks:  # before any block goes back, so that a refusal leaves the model as it was
        block.refuse_unmerged_adapters()
        block.hf_requires_grad()
    for name, block in blocks:  # the same order on every rank: each gather is a collective
        _replace(model, name, block.to_hf())
    for module in model.modules():  # HF's own _init_weights again (convert set one that also knows its blocks)
        if isinstance(module.__dict__.get("_init_weights"), InitWithConvertedBlocks):
            del module.__dict__["_init_weights"]
    return model


def _init_converted_blocks_too(model: nn.Module) -> None:
    """Give every HF ``PreTrainedModel`` in ``model`` that holds a converted block the ``_init_weights`` that also
    initialises converted blocks (:class:`~flexmoe.hf.block.InitWithConvertedBlocks`), so that HF's
    ``init_weights()`` (which calls the innermost model's ``_init_weights`` per module) and
    ``model.apply(model._init_weights)`` reach their experts. An attribute of each instance: the class is not
    changed."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not isinstance(module.__dict__.get("_init_weights"),
                                                                  InitWithConvertedBlocks) \
                and any(isinstance(m, ConvertedMoeBlock) for m in module.modules()):
            module.__dict__["_init_weights"] = InitWithConvertedBlocks(module)


def _convert_block(block: nn.Module, group: object | None, options: dict[str, Any]) -> ConvertedMoeBlock:
    family = family_of(block)
    assert family is not None  # callers pick supported blocks
    return build_converted_block(block, family, group=group, options=options)


def _refuse_adapters(block: nn.Module, where: str) -> None:
    """``ValueError`` when an adapter wraps or parametrizes part of HF block ``block`` (at ``where``): convert
    copies the block's tensors into flexmoe's experts, so the adapter would be silently dropped."""
    adapted = adapted_modules(block)
    if adapted:
        parts = [f"{where}.{name}" if name else where for name in adapted]
        raise ValueError(f"{parts} carry an adapter (PEFT LoRA or a torch parametrization), which convert would "
                         f"drop (it copies the block's weights). Either merge it into the weights first "
                         f"(peft_model.merge_and_unload()) and convert the merged model, or convert the plain "
                         f"model, then put LoRA on flexmoe's experts: peft.LoraConfig(target_parameters="
                         f"['experts.gate_up', 'experts.w2']), and merge_and_unload() before to_hf "
                         f"(docs/architecture.md, 'Adapters on the experts'). Adapters outside the MoE blocks "
                         f"(attention, embeddings) are kept as they are")


def _check_module(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a transformers model or one of its sparse-MoE blocks), got "
                        f"{type(model).__name__}")


def _check_options(options: dict[str, Any]) -> None:
    family_owned = sorted(set(options) & FAMILY_OPTIONS)
    if family_owned:
        raise ValueError(f"convert() options {family_owned} are fixed by the HF block's family (they describe its "
                         f"weights and routing); leave them out")
    unknown = sorted(set(options) - _LAYER_OPTIONS)
    if unknown:
        raise ValueError(f"convert() got unknown options {unknown}; options are MoELayer keywords "
                         f"(RoutingOptions, ExpertOptions, ParallelOptions fields)")


def _unsupported_moe_blocks(model: nn.Module) -> set[str]:
    """Class names of modules that look like a sparse-MoE block (a router beside an ``experts`` module) but whose
    class no family knows; supported and already converted blocks are not looked into."""
    found: set[str] = set()

    def visit(module: nn.Module) -> None:
        if family_of(module) is not None or isinstance(module, (ConvertedMoeBlock, MoELayer)):
            return
        children = dict(module.named_children())
        if "experts" in children and ("gate" in children or "router" in children):
            found.add(type(module).__name__)
            return
        for child in children.values():
            visit(child)

    visit(model)
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
