"""Checkpoints of a sharded run with ``torch.distributed.checkpoint`` (DCP): each rank writes only its shards,
and a checkpoint loads at any mesh (one process included), DCP cutting every tensor for the loading rank.

DCP matches tensors by name and global shape. The non-expert parameters (and their AdamW states) are FSDP
DTensors whose global shape is the model's. An expert tensor's DTensor, though, spans only the experts of one
expert-parallel rank (``[E / ep, ...]``, sharded over ``dp_shard``); here it is written as a shard of the layer's
global ``[E, ...]`` tensor (``Shard(0)`` over ``ep``), the form flexmoe's own checkpoints use, so the same file
fits any ``ep``. That step gathers one expert tensor of this rank's experts over ``dp_shard`` at a time.
Experts sharded along the hidden dim (``num_experts < ep``) are refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from flexmoe.experts.modules import joined_parameter_halves, side_by_side_halves
from flexmoe.layer import MoELayer
from flexmoe.sharding.mesh import full_mesh
from flexmoe.sharding.model_experts import expert_parameters

__all__ = ["save_sharded", "load_sharded", "own_tensors"]


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 mesh: DeviceMesh | None = None) -> None:
    """Write ``model`` (and ``optimizer``'s states) to the directory ``path`` with DCP; every rank calls it.

    mesh: the mesh the model was laid on (:func:`~flexmoe.sharding.parallelize`); None for one process.
    """
    state = _global_state(model, optimizer, mesh)
    with warnings.catch_warnings():
        # mesh=None in one process is the documented way to save here; DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, checkpoint_id=str(path))


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 mesh: DeviceMesh | None = None) -> None:
    """Load a :func:`save_sharded` checkpoint into ``model`` (and ``optimizer``), saved at any mesh, into this
    mesh (None: one process). The model must have been built, laid out and materialised (its values are
    overwritten); the optimizer's states are created here if it has none yet."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"no DCP checkpoint directory at {path}")
    state = _global_state(model, optimizer, mesh)
    with warnings.catch_warnings():
        # mesh=None in one process is the documented way to load here; DCP warns that it assumes so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=str(path))
    # The expert tensors of a layer that spreads its experts over ranks come back in the global form (_as_global)
    # and are cut for this rank here; any other (one process, or every expert on every rank, FSDP-sharded or not)
    # came back in its own form, as every other tensor did.
    experts = {name: layer for name, layer in _expert_params(model).items() if layer.ep_group.distributed}
    with torch.no_grad():
        for name, target in own_tensors(model).items():  # parameters (joined ones by halves) and buffers
            if name in experts:
                _copy_local(target, state["model"][name])
            elif not isinstance(target, DTensor):
                target.copy_(state["model"][name])
    if optimizer is not None:
        halves = joined_parameter_halves(model)
        loaded = state["optimizer"]
        current: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
        split = _split_optimizer_state(current, halves)["state"]  # a joined parameter's states as views
        halved = {name for names in halves.values() for name in names}
        with torch.no_grad():
            for name, entries in loaded["state"].items():
                for key, value in entries.items():
                    target = split[name][key]
                    if (name in experts or name in halved) and isinstance(target, Tensor) and target.dim() > 0:
                        _copy_local(target, value)
                    elif name in halved:  # the step, one for both halves
                        current["state"][next(j for j, n in halves.items() if name in n)][key] = value
                    else:
                        current["state"][name][key] = value  # loaded in the same form as the optimizer's
        joined_of = {name: joined for joined, names in halves.items() for name in names}
        groups = [{**group, "params": list(dict.fromkeys(joined_of.get(n, n) for n in group["params"]))}
                  for group in loaded["param_groups"]]
        set_optimizer_state_dict(model, optimizer, {**loaded, "state": current["state"], "param_groups": groups},
                                 options=StateDictOptions(strict=True))


def _global_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                  mesh: DeviceMesh | None) -> dict[str, Any]:
    """The DCP state: ``{"model": name -> tensor, "optimizer": FQN-keyed optimizer state}``, expert tensors (and
    their optimizer states) in global form."""
    experts = _expert_params(model)
    root = full_mesh(mesh) if mesh is not None else None
    model_state = {name: _as_global(value.detach(), experts.get(name), root)
                   for name, value in own_tensors(model).items()}
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        # New dicts: the inner ones of get_optimizer_state_dict are the optimizer's own.
        optim_state = _split_optimizer_state(dict(get_optimizer_state_dict(model, optimizer)),
                                             joined_parameter_halves(model))
        state["optimizer"] = {**optim_state, "state": {
            name: {key: _as_global(value, experts.get(name), root)
                   if isinstance(value, Tensor) and value.dim() > 0 else value for key, value in entries.items()}
            for name, entries in optim_state["state"].items()}}
    return state


def own_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter (tied ones once) and persistent buffer of ``model``, by its own name: what
    ``state_dict()`` holds before any state-dict hook renames it (a converted HF block's gives HF's names and
    gathers its experts, flexmoe.hf.hf_state), so that model and optimizer states name a tensor alike. FSDP
    parameters as their sharded DTensors (a unit left gathered after its forward is resharded first)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    tensors: dict[str, Tensor] = dict(model.named_parameters())
    for joined, halves in joined_parameter_halves(model).items():
        for name, half in zip(halves, side_by_side_halves(tensors.pop(joined))):
            tensors[name] = half
    for prefix, sub in model.named_modules():
        for key, b in sub.named_buffers(recurse=False):
            if b is not None and key not in sub._non_persistent_buffers_set:
                tensors[f"{prefix}.{key}" if prefix else key] = b
    return tensors


def _split_optimizer_state(state: dict[str, Any], halves: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (``get_optimizer_state_dict``'s) with each joined parameter's entry as two
    entries named by its halves: tensor states cut into halves (views), scalars (the step) shared."""
    split = {**state, "state": dict(state["state"])}
    for joined, names in halves.items():
        entries = split["state"].pop(joined, None)
        if entries is None:
            continue
        for i, name in enumerate(names):
            split["state"][name] = {key: side_by_side_halves(value)[i]
                                    if isinstance(value, Tensor) and value.dim() > 0 else value
                                    for key, value in entries.items()}
    split["param_groups"] = [{**group, "params": [n for p in group["params"] for n in halves.get(p, (p,))]}
                             for group in state["param_groups"]]
    return split


def _as_global(value: Any, layer: MoELayer | None, mesh: DeviceMesh | None) -> Any:
    """``value`` as DCP should see it: an expert tensor of an expert-parallel layer as this rank's block of the
    global ``[E, ...]`` tensor (a DTensor sharded over ``ep``); anything else as it is."""
    if layer is None or not layer.ep_group.distributed:
        return value
    if mesh is None:
        raise ValueError("save_sharded/load_sharded: the model spreads experts over ranks; pass mesh= (the mesh "
                         "given to parallelize)")
    if layer.layout.shards_per_expert > 1:
        raise ValueError(f"save_sharded: experts sharded along the hidden dim (num_experts={layer.num_experts} < "
                         f"ep={layer.ep_group.world_size}) are not supported; use num_experts >= ep")
    ep_local = value.full_tensor() if isinstance(value, DTensor) else value  # [E / ep, ...]
    return DTensor.from_local(ep_local, mesh, [Replicate(), Replicate(), Shard(0)], run_check=False)


def _copy_local(target: Tensor, loaded: Tensor) -> None:
    """Copy this rank's part of ``loaded`` (global form, see :func:`_as_global`) into ``target``."""
    ep_local = loaded.to_local() if isinstance(loaded, DTensor) else loaded
    if isinstance(target, DTensor):
        part = distribute_tensor(ep_local, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(part)
    else:
        target.copy_(ep_local)


def _expert_params(model: nn.Module) -> dict[str, MoELayer]:
    """Name of every expert parameter -> its layer (a joined ``gate_up``'s halves too, as checkpoints name it)."""
    halves = joined_parameter_halves(model)
    return {n: layer for name, _, layer in expert_parameters(model) for n in (name, *halves.get(name, ()))}
