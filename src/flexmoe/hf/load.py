"""``flexmoe.hf.load``: a ``save_pretrained`` directory onto a device mesh, each rank reading only what it holds
(docs/architecture.md, "Hugging Face models (flexmoe.hf)", "Loading by shard").

The model is built on the meta device from the directory's config, converted (:func:`flexmoe.hf.convert`), laid
on the mesh (:func:`flexmoe.parallel.parallelize`) and allocated; only then is anything read. Every tensor the rank
holds is a rectangle of a global tensor (a DTensor's local shard, or all of it); its values come from the box of
the stored tensor that rectangle covers:

* a tensor the converted model names as HF does (attention, norms, embeddings, HF's router): the same box;
* a tensor of a converted block's :class:`~flexmoe.hf.hf_state.Part` (routed experts, shared expert, its gate):
  a view of HF's tensors (transposes, halves of ``gate_up_proj``). The view is traced: the part's ``read`` is run
  on a copy of HF's module whose tensors hold their own flat element indices, so the layer tensor holds, at each
  element, the index of the HF element it shows. The indices of the rank's rectangles give the HF box to read
  (one per HF tensor, covering every layer tensor it backs), and where in it each element lies. Routed experts
  are traced one expert at a time (the view is the same for each), and read for the rank's experts only.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from flexmoe.hf.block import ConvertedMoeBlock
from flexmoe.hf.convert import convert
from flexmoe.hf.hf_state import Part, layer_module, layer_parts
from flexmoe.hf.stored import Box, SafetensorsReader, StoredTensors, box_shape
from flexmoe.layer import MoELayer
from flexmoe.sharding.dcp import own_tensors
from flexmoe.sharding.fsdp import parallelize
from flexmoe.sharding.materialize import allocate

__all__ = ["load", "held_box"]


def load(directory: str | Path, mesh: DeviceMesh | None = None, *, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None, mp_policy: MixedPrecisionPolicy | None = None,
         activation_checkpointing: bool = False, reader: SafetensorsReader | None = None,
         **options: Any) -> nn.Module:
    """The HF causal LM saved in ``directory`` (``save_pretrained``: safetensors, one file or sharded with
    ``model.safetensors.index.json``), converted to flexmoe and laid on ``mesh``, each rank reading from the files
    only the tensors, and the boxes of them, that it holds: its experts' rows, its FSDP shards of the rest.

    mesh: a :func:`flexmoe.parallel.make_mesh` mesh (every rank calls ``load``); None: one process holding
        every expert, not parallelized.
    dtype: the parameters' dtype (the stored tensors are cast); device: where one process's model lives
        (default the CPU; with a mesh, the mesh's device).
    mp_policy, activation_checkpointing: passed to :func:`~flexmoe.parallel.parallelize`.
    reader: the :class:`~flexmoe.hf.stored.SafetensorsReader` to read with (default one of ``directory``).
    options: :func:`flexmoe.hf.convert`'s layer options (``group`` is the mesh's, not an option here).

    Returns the model in eval mode, as ``from_pretrained`` does. Raises ``FileNotFoundError`` for a directory
    without ``config.json`` or safetensors weights, ``ValueError`` naming the tensors the files lack, and for
    hidden-sharded experts (fewer experts than ``ep`` ranks) or an expert family stored per expert module (Switch).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"directory {directory} has no config.json (a save_pretrained directory)")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh (flexmoe.parallel.make_mesh) or None, got {type(mesh).__name__}")
    if mesh is not None and device is not None:
        raise ValueError("device= is for one process (mesh=None); with a mesh the model lives on the mesh's device")
    if "group" in options:
        raise ValueError("load() takes no group= option: experts are spread over the mesh's ep dim (mesh=None: "
                         "one process holding every expert)")
    if reader is not None and not isinstance(reader, SafetensorsReader):
        raise TypeError(f"reader must be a flexmoe.hf.stored.SafetensorsReader, got {type(reader).__name__}")

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    convert(model, group="single", **options)
    if mesh is not None:
        model = parallelize(model, mesh, mp_policy=mp_policy, activation_checkpointing=activation_checkpointing)
    allocate(model, device or (None if mesh is not None else "cpu"))
    if mesh is None:
        model.tie_weights()  # to_empty made each meta parameter a new one, a tied one twice
    with reader or SafetensorsReader(directory) as files:
        fill(model, StoredTensors(files, model))
    return model.eval()


@torch.no_grad()
def fill(model: nn.Module, stored: StoredTensors) -> None:
    """Write every parameter and persistent buffer of the allocated, converted ``model`` from ``stored``, this
    rank's part of each; set the non-persistent buffers (HF's rotary tables: HF's own ``_init_weights``)."""
    handled: set[str] = set()
    missing: list[str] = []
    for prefix, block in [(n, m) for n, m in model.named_modules() if isinstance(m, ConvertedMoeBlock)]:
        handled |= _fill_block(prefix + ".", block, stored, missing)
    persistent = own_tensors(model)
    for name, target in persistent.items():
        if name in handled:
            continue
        if name not in stored:
            missing.append(name)
            continue
        _copy_box(target, stored, name)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} of the model's tensors: {sorted(missing)[:8]}")
    _set_non_persistent_buffers(model)


def held_box(target: Tensor) -> Box:
    """The box of its global tensor that ``target`` holds: a DTensor's local shard, or all of a plain tensor."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return tuple((o, o + s) for o, s in zip(offset, shape))
    return tuple((0, s) for s in target.shape)


def _local(target: Tensor) -> Tensor:
    return target.to_local() if isinstance(target, DTensor) else target


def _copy_box(target: Tensor, stored: StoredTensors, name: str) -> None:
    """``target``'s rectangle of the model's tensor ``name``, read from ``stored`` (nothing for an empty shard)."""
    box = held_box(target)
    if math.prod(box_shape(box)) == 0:
        return
    local = _local(target)
    local.copy_(stored.read(name, box).reshape(local.shape))


def _fill_block(prefix: str, block: ConvertedMoeBlock, stored: StoredTensors, missing: list[str]) -> set[str]:
    """Fill converted block ``block`` (at ``prefix``) from HF's names; the model names it filled."""
    family, moe = block.hf_family, block.moe
    handled: set[str] = set()
    router = prefix + family.router + "."
    hf_router = moe.router.hf_router
    assert isinstance(hf_router, nn.Module)  # HFRouterLogits holds HF's router module
    # DeepSeek-V3's e_score_correction_bias is both HF's router buffer and the layer's expert_bias: read once.
    same_as_bias = {"e_score_correction_bias": moe.expert_bias} if moe.expert_bias is not None else {}
    for key, target in own_tensors(hf_router).items():
        handled.add(prefix + "moe.router.hf_router." + key)
        if router + key not in stored:
            missing.append(router + key)
            continue
        _copy_box(target, stored, router + key)
        if key in same_as_bias:
            handled.add(prefix + "moe.expert_bias")
            same_as_bias.pop(key).copy_(target)
    if same_as_bias:  # a selection bias HF's router does not hold: the layer's alone
        bias = router + "e_score_correction_bias"
        handled.add(prefix + "moe.expert_bias")
        if bias not in stored:
            missing.append(bias)
        else:
            _copy_box(same_as_bias["e_score_correction_bias"], stored, bias)
    for part in layer_parts(family):
        handled |= _fill_part(prefix, block, part, stored, missing)
    return handled


def _fill_part(prefix: str, block: ConvertedMoeBlock, part: Part, stored: StoredTensors,
               missing: list[str]) -> set[str]:
    """Fill the layer's tensors of ``part`` through the traced views of HF's tensors (see the module docstring)."""
    moe = block.moe
    if part.routed and moe.layout.shards_per_expert > 1:
        raise ValueError(f"{prefix}: experts sharded along the hidden dim (num_experts={moe.num_experts} < ep="
                         f"{moe.ep_group.world_size}) cannot be loaded by shard; use num_experts >= ep")
    path, module = layer_module(moe, part)
    first_expert = moe.layout.experts_of_rank(moe.ep_group.rank).start
    handled = set()
    # Each layer tensor's wanted elements, grouped by the HF tensor (and experts) they come from: GPT-OSS's w1 and
    # w3 are interleaved columns of one gate_up_proj, and one read of the box covering both reads each element once.
    wanted: dict[tuple[str, Box], list[tuple[Tensor, tuple[Tensor, ...]]]] = {}
    for name, (hf_key, shape, ids) in _traced(part, getattr(block.hf_skeleton, part.hf_name)).items():
        handled.add(f"{prefix}moe.{path}.{name}")
        source = f"{prefix}{part.hf_name}.{hf_key}"
        if source not in stored:
            missing.append(source)
            continue
        target = getattr(module, name)
        box = held_box(target)
        if math.prod(box_shape(box)) == 0:
            continue
        lead: Box = ()
        if part.routed:  # ids: one expert's; the experts' rows are read as they are
            (e0, e1), *inner = box
            lead, box, ids, shape = ((first_expert + e0, first_expert + e1),), tuple(inner), ids[0], shape[1:]
        region = ids[tuple(slice(start, stop) for start, stop in box)]
        coords = torch.unravel_index(region.reshape(-1), shape)
        wanted.setdefault((source, lead), []).append((_local(target), coords))
    for (source, lead), targets in wanted.items():
        dims = range(len(targets[0][1]))
        low = [min(int(c[d].min()) for _, c in targets) for d in dims]
        high = [max(int(c[d].max()) for _, c in targets) + 1 for d in dims]
        values = stored.read(source, (*lead, *zip(low, high)))
        for local, coords in targets:
            picked = values[(slice(None),) * len(lead) + tuple(c - lo for c, lo in zip(coords, low))]
            local.copy_(picked.reshape(local.shape))
    return handled


def _traced(part: Part, hf_module: nn.Module) -> dict[str, tuple[str, tuple[int, ...], Tensor]]:
    """For each of ``part``'s layer tensors: (the HF tensor it is a view of, by its name in ``hf_module``; that
    tensor's shape as traced; the layer tensor as a view of it holding its flat element indices). A routed part is
    traced on one expert (``[1, ...]``)."""
    scratch = copy.deepcopy(hf_module)
    for module in scratch.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            shape = (1, *p.shape[1:]) if part.routed else tuple(p.shape)
            ids = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
            setattr(module, key, nn.Parameter(ids, requires_grad=False))
    names = {id(p): key for key, p in scratch.named_parameters()}
    sources = part.sources(scratch)
    if any(len(tensors) != 1 for tensors in sources.values()):
        raise ValueError(f"{type(hf_module).__name__}: one HF tensor per expert (Switch Transformers' experts) "
                         f"cannot be loaded by shard; load with from_pretrained and convert")
    views = part.read(scratch)
    return {name: (names[id(sources[name][0])], tuple(sources[name][0].shape), views[name]) for name in sources}


def _set_non_persistent_buffers(model: nn.Module) -> None:
    """Non-persistent buffers are in no checkpoint: flexmoe's (load counters) start at zero, HF's (rotary tables)
    are computed by the model's own ``_init_weights``."""
    init = getattr(model, "_init_weights", None)
    inside_layers = {id(m) for layer in model.modules() if isinstance(layer, MoELayer) for m in layer.modules()}
    for module in model.modules():
        buffers = [b for k in module._non_persistent_buffers_set if (b := module._buffers.get(k)) is not None]
        for b in buffers:
            b.zero_()
        if buffers and id(module) not in inside_layers and callable(init):
            init(module)
