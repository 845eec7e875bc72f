"""Upcycling Hugging Face dense models into their MoE twin's form: each gate/up/down MLP becomes the twin family's
sparse block, converted (docs/architecture.md, "Upcycling"; the math is :mod:`flexmoe.upcycle`'s, whose
:func:`~flexmoe.upcycle` gives plain :class:`~flexmoe.MoELayer` s instead).

Llama and Mistral MLPs become Mixtral's ``MixtralSparseMoeBlock`` (normalised top-k), Qwen2 and Qwen3 MLPs
Qwen3-MoE's ``Qwen3MoeSparseMoeBlock`` (normalised unless ``normalize_weights=False``: HF's ``norm_topk_prob``).
The block is filled with the MLP's slices (its experts' ``down_proj`` times the scale sigma) and a zero router,
then :func:`flexmoe.hf.convert` makes it a :class:`~flexmoe.hf.block.ConvertedMoeBlock`, so the result is exactly
what converting the twin family's model gives: its state dict holds HF's block's names (``mlp.gate.weight``,
``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), :func:`flexmoe.hf.to_hf` turns it back into HF blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flexmoe.hf.convert import convert
from flexmoe.hf.families import family_of
from flexmoe.upcycle import check_upcycle_routing, check_upcycle_shape, expert_scale, is_gated_mlp, slice_experts
from flexmoe.validation import check_int

__all__ = ["upcycle_into_twin", "TWIN_FAMILIES"]

# The dense model type -> its MoE twin's block kind.
TWIN_FAMILIES = {"llama": "mixtral", "mistral": "mixtral", "qwen2": "qwen3_moe", "qwen3": "qwen3_moe"}


def upcycle_into_twin(model: nn.Module, *, num_experts: int, k: int, granularity: int = 1,
                      group: object | None = None, **options: Any) -> nn.Module:
    """Replace, in place, every gate/up/down MLP of HF dense ``model`` (``config.model_type`` one of
    :data:`TWIN_FAMILIES`) by its twin's converted sparse block with E experts, k per token, granularity g, whose
    output equals the MLP's at the start; returns ``model``. ``group`` and ``options`` are
    :func:`flexmoe.hf.convert`'s (``capacity_factor`` default 0: dropless); ``normalize_weights`` picks HF's
    ``norm_topk_prob`` for Qwen (Mixtral always normalises). ``ValueError`` for another model type, MLPs with
    biases, and the sizes and options :mod:`flexmoe.upcycle` refuses."""
    num_experts = check_int("num_experts", num_experts, 1)
    k = check_int("k", k, 1)
    granularity = check_int("granularity", granularity, 1)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in TWIN_FAMILIES:
        raise ValueError(f"upcycle() knows the MoE twins of HF model types {sorted(TWIN_FAMILIES)}, got "
                         f"{model_type!r} ({type(model).__name__})")
    normalize = bool(options.pop("normalize_weights", True))
    if TWIN_FAMILIES[model_type] == "mixtral" and not normalize:
        raise ValueError("normalize_weights=False has no Mixtral block (it always renormalises the top-k weights); "
                         "its Qwen twin has norm_topk_prob")
    options.setdefault("capacity_factor", 0.0)
    check_upcycle_routing({**options, "ties": options.get("ties", "lower")}, num_experts, k)
    options["ties"] = "lower"  # the stable tie order (convert's default follows torch.topk)
    mlps: list[tuple[str, Any]] = [(name, m) for name, m in model.named_modules() if is_gated_mlp(m)]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no gate/up/down MLP to upcycle")
    scale = expert_scale(num_experts, k, granularity, normalize_weights=normalize)
    blocks = []  # every block built before any is swapped in: a refusal leaves the model as it was
    for name, mlp in mlps:
        hidden = mlp.gate_proj.out_features
        check_upcycle_shape(num_experts, k, granularity, hidden)
        twin: Any = _twin_block(model_type, config, mlp, num_experts, k, hidden // granularity, normalize)
        dense = {"w1": mlp.gate_proj.weight.T, "w3": mlp.up_proj.weight.T, "w2": mlp.down_proj.weight.T}
        family = family_of(twin)
        assert family is not None  # both twin blocks are flexmoe families
        with torch.no_grad():
            family.write_experts(twin.experts, slice_experts(dense, num_experts, granularity, scale))
            twin.gate.weight.zero_()
        blocks.append((name, convert(twin, group=group, **options)))
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, block)
    return model


def _twin_block(model_type: str, config: Any, mlp: Any, num_experts: int, k: int, expert_hidden: int,
                normalize: bool) -> nn.Module:
    """An empty MoE twin block for ``mlp`` (its dtype and device), E experts of hidden ``expert_hidden``."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if getattr(mlp, proj).bias is not None:
            raise ValueError(f"{type(mlp).__name__}.{proj} has a bias, which the {TWIN_FAMILIES[model_type]} "
                             f"experts do not (mlp_bias=True has no MoE twin)")
    weight = mlp.gate_proj.weight
    sizes = dict(hidden_size=weight.shape[1], num_experts_per_tok=k, hidden_act=config.hidden_act)
    if TWIN_FAMILIES[model_type] == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block: nn.Module = MixtralSparseMoeBlock(MixtralConfig(
            **sizes, intermediate_size=expert_hidden, num_local_experts=num_experts, router_jitter_noise=0.0))
    else:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
            **sizes, moe_intermediate_size=expert_hidden, num_experts=num_experts, norm_topk_prob=normalize))
    return block.to(device=weight.device, dtype=weight.dtype)
