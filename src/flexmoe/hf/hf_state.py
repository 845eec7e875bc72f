"""A converted block's weights in Hugging Face's own names and layout, both ways (docs/architecture.md, "Hugging
Face models (flexmoe.hf)", "Saving and loading").

A :class:`~flexmoe.hf.block.ConvertedMoeBlock` keeps HF's router module itself (``moe.router.hf_router``) and
copies the other parts of HF's block into its :class:`~flexmoe.MoELayer`: the routed experts, the shared expert
and its gate (:class:`Part`). Each part is described once, by how flexmoe's tensors are read out of HF's module
and written back into it: views of HF's fused tensors (:func:`~flexmoe.hf.families.expert_weights`,
:func:`~flexmoe.hf.families.shared_mlp_weights`), or the family's own route for experts HF keeps one module each
(Switch Transformers' ``expert_{i}.wi`` / ``wo``: :meth:`~flexmoe.hf.families.Family.read_experts`,
:meth:`~flexmoe.hf.families.Family.write_experts`). ``convert`` reads (:func:`layer_values`), and writing fills an
HF module (:func:`write_hf`), which is how ``to_hf`` and the block's state dict are made. So the state dict comes
out of HF's own modules: HF's names, shapes and layouts (fused ``gate_up_proj``, GPT-OSS's interleaved columns,
per-expert Linears, transposes, biases) by construction, and ``save_pretrained`` / ``Trainer`` write what plain
``from_pretrained`` reads.

:func:`save_hf_names` (a state-dict post-hook of the block) and :func:`load_hf_names` (its load pre-hook) are the
two directions. Under expert parallelism ``state_dict()`` gathers every rank's experts: it is a collective, every
rank of the expert-parallel group must call it (``save_pretrained`` on every rank, ``is_main_process`` on one);
loading takes this rank's slice of HF's full tensors, without communication.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from flexmoe.checkpoint import gather_experts
from flexmoe.hf.families import Family, copy_into_views, shared_mlp_sources, shared_mlp_weights
from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import ExpertLayout, shard_expert_state


class ConvertedBlock(Protocol):
    """What this module reads of a :class:`~flexmoe.hf.block.ConvertedMoeBlock` (which imports this module): its
    layer, its HF family and the emptied HF block."""

    @property
    def moe(self) -> MoELayer: ...

    @property
    def hf_family(self) -> Family: ...

    @property
    def hf_skeleton(self) -> Any: ...

__all__ = ["ROUTER", "Part", "layer_parts", "layer_values", "write_hf", "layer_requires_grad", "hf_requires_grad",
           "materialize", "experts_like", "layer_module", "hf_scratch", "save_hf_names", "load_hf_names"]

ROUTER = "moe.router.hf_router."  # where the block holds HF's router module (its state-dict prefix)


def _gate_weight(gate: Any) -> dict[str, Tensor]:
    """The shared expert's sigmoid gate ``nn.Linear(M, 1)``: its weight ``[1, M]``, as the layer holds it."""
    return {"weight": gate.weight}


@dataclass(frozen=True)
class Part:
    """A part of HF's block that the layer holds a copy of.

    hf_name: its attribute in HF's block (``"experts"``, ``"shared_expert"``, ...). layer_name: the layer's module
    holding it (``"experts"``, ``"shared"``, ``"shared_gate"``). read: the layer's tensors out of the HF module
    (the experts' ``[E, ...]``, every expert), views of its tensors or copies. write(module, tensors): the layer's
    tensors (every expert) into the HF module (under ``no_grad``). sources: for each layer tensor's name, the HF
    parameters it is read from (one fused tensor, or one per expert), whose ``requires_grad`` it shares; its keys
    are the part's layer tensors. routed: the routed experts, held per rank under expert parallelism.
    """

    hf_name: str
    layer_name: str
    read: Callable[[Any], dict[str, Tensor]]
    write: Callable[[Any, dict[str, Tensor]], None]
    sources: Callable[[Any], dict[str, list[Tensor]]]
    routed: bool = False


def _through_views(views: Callable[[Any], dict[str, Tensor]]) -> Callable[[Any, dict[str, Tensor]], None]:
    """A part's ``write`` when its ``read`` gives views of the HF module's tensors: copy into the views."""
    return lambda module, weights: copy_into_views(views(module), weights)


def _each_one(sources: Callable[[Any], dict[str, Tensor]]) -> Callable[[Any], dict[str, list[Tensor]]]:
    """A part's ``sources`` when each layer tensor is a view of one HF tensor."""
    return lambda module: {name: [tensor] for name, tensor in sources(module).items()}


def layer_parts(family: Family) -> list[Part]:
    """The parts of ``family``'s block that a converted layer holds."""
    parts = [Part("experts", "experts", family.read_experts, family.write_experts, family.expert_sources,
                  routed=True)]
    if family.shared is not None:
        parts.append(Part(family.shared, "shared", shared_mlp_weights, _through_views(shared_mlp_weights),
                          _each_one(shared_mlp_sources)))
    if family.shared_gate is not None:
        parts.append(Part(family.shared_gate, "shared_gate", _gate_weight, _through_views(_gate_weight),
                          _each_one(_gate_weight)))
    return parts


def layer_values(part: Part, hf_module: nn.Module, layout: ExpertLayout, rank: int) -> dict[str, Tensor]:
    """The layer's tensors of ``part`` read from HF module ``hf_module``: only rank ``rank``'s slice of the routed
    experts (``layout``); views, or copies where sliced or where the family reads per-expert modules."""
    values = part.read(hf_module)
    return shard_expert_state(values, layout, rank) if part.routed else values


def layer_module(moe: MoELayer, part: Part) -> tuple[str, nn.Module]:
    """``(path under the layer, module)`` of the layer's module holding ``part``: below any adapter wrapping it
    (PEFT's LoRA keeps the wrapped module as ``base_layer``, e.g. ``experts.base_layer``), whose own tensors are
    the part's unadapted weights; the adapter's tensors are the wrapper's and stay in the state dict as they are."""
    path, module = part.layer_name, getattr(moe, part.layer_name)
    while callable(getattr(module, "get_base_layer", None)) and isinstance(getattr(module, "base_layer", None),
                                                                           nn.Module):
        path, module = path + ".base_layer", module.base_layer
    return path, module


@torch.no_grad()
def write_hf(part: Part, hf_module: nn.Module, moe: MoELayer) -> None:
    """Write the layer's current tensors of ``part`` into HF module ``hf_module`` (real storage) with the part's
    ``write``. The routed experts are gathered from every rank: a collective under expert parallelism."""
    _, module = layer_module(moe, part)
    values = {name: _unsharded(getattr(module, name).detach()) for name in part.sources(hf_module)}
    if part.routed and moe.ep_group.distributed:
        values = gather_experts(values, moe.layout, moe.ep_group.group)
    part.write(hf_module, values)


def _unsharded(tensor: Tensor) -> Tensor:
    """A layer tensor whole on this rank: an FSDP-sharded one (a DTensor, laid out by ``flexmoe.parallel.
    parallelize``) gathered over its mesh, a collective; under expert parallelism still this rank's experts."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def layer_requires_grad(part: Part, hf_module: nn.Module) -> dict[str, bool]:
    """For each of ``part``'s layer tensors, the ``requires_grad`` it takes in ``convert``: its HF parameters'.

    Raises ``ValueError`` when those disagree (Switch's experts frozen one by one): the layer holds every expert
    in one tensor, which is frozen or not as a whole.
    """
    flags = {}
    for name, sources in part.sources(hf_module).items():
        frozen = [s for s in sources if not s.requires_grad]
        if frozen and len(frozen) < len(sources):
            names = [_name_in(hf_module, s) for s in frozen]
            raise ValueError(
                f"{part.hf_name}: {names} are frozen (requires_grad=False) and the rest of the tensors flexmoe "
                f"holds as one moe.{part.layer_name}.{name} are not; freeze all of them or none before convert")
        flags[name] = not frozen
    return flags


def hf_requires_grad(part: Part, hf_module: nn.Module, moe: MoELayer) -> dict[str, bool]:
    """For each of ``part``'s layer tensors, the ``requires_grad`` its HF tensors take back: the layer tensor's.

    Raises ``ValueError`` when two layer tensors of one HF tensor disagree (``w1`` and ``w3`` are both
    ``gate_up_proj``): HF's model cannot freeze one without the other.
    """
    sources = part.sources(hf_module)
    _, module = layer_module(moe, part)
    flags = {name: bool(getattr(module, name).requires_grad) for name in sources}
    for name, tensors in sources.items():
        for other, other_tensors in sources.items():
            shared = [t for t in tensors if any(t is o for o in other_tensors)]
            if shared and flags[other] != flags[name]:
                raise ValueError(
                    f"moe.{part.layer_name}.{name} (requires_grad={flags[name]}) and moe.{part.layer_name}.{other} "
                    f"(requires_grad={flags[other]}) are one HF tensor, {part.hf_name}.{_name_in(hf_module, shared[0])}"
                    f": freeze both or neither before to_hf")
    return flags


def _name_in(module: nn.Module, parameter: Tensor) -> str:
    """``parameter``'s name in ``module``."""
    return next(n for n, p in module.named_parameters() if p is parameter)


def materialize(module: nn.Module, like: Tensor) -> None:
    """Give every ``meta`` parameter and buffer of ``module`` real (uninitialised) storage on ``like``'s device,
    parameters in ``like``'s dtype."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(sub, name, nn.Parameter(torch.empty(p.shape, device=like.device, dtype=like.dtype),
                                                requires_grad=p.requires_grad))
        for name, b in list(sub.named_buffers(recurse=False)):
            if b.is_meta:
                sub.register_buffer(name, torch.empty(b.shape, device=like.device, dtype=b.dtype))


def experts_like(moe: MoELayer) -> Tensor:
    """A tensor of the layer's routed experts: their dtype and device, which every copied part shares."""
    w1 = moe.expert_stage.experts.w1  # below any adapter wrapping moe.experts
    assert isinstance(w1, Tensor)  # FeedForwardExperts' first weight, [E_local, M, H]
    return w1


def hf_scratch(block: ConvertedBlock, part: Part) -> nn.Module:
    """A new HF module of ``part``'s kind, its tensors on ``meta`` (a copy of the block's emptied skeleton part)."""
    return copy.deepcopy(getattr(block.hf_skeleton, part.hf_name))


def save_hf_names(block: ConvertedBlock, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of a converted block: its entries become HF's block's, in place.

    HF's router keeps its entries under HF's name (DeepSeek-V3's ``e_score_correction_bias`` taking the layer's
    ``expert_bias``, the bias the layer routes with); each :class:`Part` is written into a scratch HF module whose
    state dict replaces the layer's entries. Entries the hook does not know (another module's, an adapter's) stay.
    Collective under expert parallelism (the experts are gathered).
    """
    family, moe = block.hf_family, block.moe
    router = prefix + family.router + "."
    for key in [k for k in state_dict if k.startswith(prefix + ROUTER)]:
        state_dict[router + key[len(prefix + ROUTER):]] = state_dict.pop(key)
    bias_key = router + "e_score_correction_bias"
    if moe.expert_bias is not None and bias_key in state_dict:
        state_dict[bias_key] = state_dict.pop(prefix + "moe.expert_bias").to(state_dict[bias_key].dtype)
    for part in layer_parts(family):
        scratch = hf_scratch(block, part)
        materialize(scratch, experts_like(moe))
        write_hf(part, scratch, moe)
        path, _ = layer_module(moe, part)
        for name in part.sources(scratch):
            state_dict.pop(f"{prefix}moe.{path}.{name}", None)
        for key, value in scratch.state_dict().items():
            state_dict[f"{prefix}{part.hf_name}.{key}"] = value
    # HF's order too: the block's entries (the last ones so far) in the order of HF's block's submodules.
    entries = {key: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
    for child, _ in block.hf_skeleton.named_children():
        for key in [k for k in entries if k.startswith(f"{prefix}{child}.")]:
            state_dict[key] = entries.pop(key)
    state_dict.update(entries)


@torch.no_grad()
def load_hf_names(block: ConvertedBlock, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                  strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load pre-hook of a converted block: HF's names in ``state_dict`` become the layer's, in place.

    A part given in HF's names is read through its views (this rank's slice of the experts); a part given in the
    layer's own names loads as it is. A part given in neither is missing: its HF names go to ``missing_keys``
    (so ``strict`` loading raises naming them; otherwise the layer keeps its values), never initialised anew. A
    part given only in part (``gate_up_proj`` without ``down_proj``), or with HF tensors of the wrong shape, is
    an error whatever ``strict`` says.
    """
    family, moe = block.hf_family, block.moe
    hf_router = cast(nn.Module, moe.router.hf_router)
    router = prefix + family.router + "."
    bias_key = router + "e_score_correction_bias"
    bias_given = bias_key in state_dict
    for key, current in hf_router.state_dict(keep_vars=True).items():
        if router + key in state_dict:
            state_dict[prefix + ROUTER + key] = state_dict.pop(router + key)
        elif prefix + ROUTER + key not in state_dict:
            missing_keys.append(router + key)
            state_dict[prefix + ROUTER + key] = current.detach()
    if moe.expert_bias is not None and prefix + "moe.expert_bias" not in state_dict:
        state_dict[prefix + "moe.expert_bias"] = (state_dict[prefix + ROUTER + "e_score_correction_bias"]
                                                  if bias_given else moe.expert_bias.detach())
    for part in layer_parts(family):
        _load_part(block, part, state_dict, prefix, missing_keys, error_msgs)


def _load_part(block: ConvertedBlock, part: Part, state_dict: dict[str, Any], prefix: str,
               missing_keys: list[str], error_msgs: list[str]) -> None:
    """:func:`load_hf_names` for one part."""
    moe = block.moe
    skeleton = getattr(block.hf_skeleton, part.hf_name)
    hf_keys = {f"{prefix}{part.hf_name}.{key}": key for key in skeleton.state_dict(keep_vars=True)}
    path, layer_held = layer_module(moe, part)
    own = {f"{prefix}moe.{path}.{name}": name for name in part.sources(skeleton)}
    given = [key for key in hf_keys if key in state_dict]
    if not given and all(key in state_dict for key in own):
        return  # the layer's own names
    if given:
        scratch = hf_scratch(block, part)
        try:  # assign: the scratch module holds the given tensors themselves (shapes are still checked)
            scratch.load_state_dict({hf_keys[key]: state_dict.pop(key) for key in hf_keys if key in state_dict},
                                    strict=True, assign=True)
        except RuntimeError as exc:
            absent = sorted(set(hf_keys) - set(given))
            error_msgs.append(f"{prefix}{part.hf_name}: its HF tensors load together; " + (
                f"missing {absent} beside {sorted(given)}" if absent else str(exc).replace("\n", " ")))
        else:
            values = layer_values(part, scratch, moe.layout, moe.ep_group.rank)
            for key, name in own.items():
                state_dict[key] = values[name]
            return
    else:
        missing_keys.extend(hf_keys)
    for key, name in own.items():  # not loaded: the layer keeps its values, reported under HF's names only
        state_dict.setdefault(key, getattr(layer_held, name).detach())
