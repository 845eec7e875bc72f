"""Laying a model on a device mesh: expert parallelism over ``ep``, FSDP2 over the data-parallel ranks.

:func:`parallelize` does, in this order (docs/architecture.md, "Models larger than one rank"):

1. Every :class:`~flexmoe.MoELayer` spreads its experts over the mesh's ``ep`` dim. A layer built holding every
   expert (``group="single"``, the models' default) is rebuilt over that group keeping only this rank's experts
   (cut from its own, or left on the meta device when it was built there); a layer already on that group stays.
2. Optionally, activation checkpointing per block.
3. FSDP2 (``fully_shard``) per block and once more at the root. Within a unit, the expert parameters are
   sharded over the ranks that hold the same experts (``dp_shard``, replicated over ``dp_replicate``), every other
   parameter over all ranks of a replica (``dp_shard x ep``): one unit, two parameter groups, each with its own
   process group (FSDP2's per-parameter mesh).
4. On gloo (no device streams), the collectives overlapped with compute: each unit's forward gathers the next
   unit ahead, and reduce-scatters are waited for later, two in flight at most, at the end of backward at the
   latest (:mod:`flexmoe.sharding.fsdp_overlap`).

Gradients: FSDP divides every reduced gradient by the world size. A non-expert gradient is thereby the mean over
ranks, as under DDP. An expert's gradient already sums its expert-parallel group's tokens (through the
all-to-all) and is then summed over the ranks holding the same expert: divided by the world size, it too is the
gradient of the mean of all ranks' losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# FSDP2's per-parameter mesh: private, not re-exported by torch.distributed.fsdp, and absent from torch 2.11
# (present in 2.13). flexmoe imports on any torch >= 2.3; only parallelize needs it (_require_per_parameter_mesh).
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.tensor import Shard

from flexmoe.experts import FeedForwardExperts
from flexmoe.layer import MoELayer
from flexmoe.parallel.groups import SINGLE_PROCESS, resolve_group
from flexmoe.parallel.layout import ExpertLayout, shard_expert_state
from flexmoe.sharding.ddp import divide_gradients
from flexmoe.sharding.fsdp_overlap import overlap_gloo_collectives
from flexmoe.sharding.mesh import full_mesh, mesh_sizes
from flexmoe.sharding.model_experts import expert_parameters, named_moe_layers

__all__ = ["parallelize", "default_blocks", "place_experts"]


def parallelize(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, activation_checkpointing: bool = False,
                blocks: Sequence[nn.Module] | None = None) -> nn.Module:
    """Lay ``model`` on ``mesh`` (dims named from ``dp_replicate``, ``dp_shard``, ``ep``; see
    :func:`flexmoe.sharding.make_mesh`) in place, and return it (use the returned module: a model that *is* one
    MoELayer is replaced by its rebuilt layer).

    mp_policy: FSDP2's :class:`MixedPrecisionPolicy` (e.g. bf16 parameters, fp32 reduction), for every unit.
    reshard_after_forward: free each block's gathered parameters after its forward (gather again in backward);
        the last block, whose backward comes first, stays gathered.
    activation_checkpointing: recompute each block's activations in backward instead of keeping them.
    blocks: the FSDP units in forward order (default :func:`default_blocks`: the entries of the model's lists of
        blocks). On gloo each unit's forward starts gathering the next one's parameters
        (:func:`~flexmoe.sharding.fsdp_overlap.overlap_gloo_collectives`).

    Every rank calls this with the same model and mesh. Train the result as usual (its parameters are DTensors;
    gradients arrive averaged over all ranks); ``flexmoe.sharding.local_state_bytes`` says what each rank holds.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    _require_per_parameter_mesh()
    mesh = full_mesh(mesh)
    sizes = mesh_sizes(mesh)
    ep_group = mesh["ep"].get_group() if sizes["ep"] > 1 else SINGLE_PROCESS
    model = _place_every_layer(model, ep_group, data_parallel=sizes["dp_replicate"] * sizes["dp_shard"])
    for module in model.modules():
        if isinstance(module, FeedForwardExperts):
            # FSDP shards plain experts: a joined gate_up (a converted HF block's default) becomes w1 and w3
            # again, each its own parameter, as the state dict names them (before any optimizer is built).
            module.lay_gated_pairs_apart()
    units = list(default_blocks(model) if blocks is None else blocks)
    if activation_checkpointing:
        for block in units:
            checkpoint(block)

    policy = mp_policy or MixedPrecisionPolicy()
    experts = [p for _, p, _ in expert_parameters(model)]
    # No other rank holds this rank's experts: nothing to shard or reduce, so FSDP leaves them alone (its gathers
    # of them would only copy). Not under a policy that casts parameters: FSDP's gather is then the cast, as for
    # every other parameter, so the experts compute in the policy's dtype at every mesh.
    cast = policy.param_dtype is not None and any(p.dtype != policy.param_dtype for p in experts)
    experts_left_out = sizes["ep"] > 1 and sizes["dp_replicate"] * sizes["dp_shard"] == 1 and not cast
    _check_reduce_dtype(model, policy, sizes, experts_in_fsdp=bool(experts) and not experts_left_out)
    dense_mesh = _dense_mesh(mesh, sizes)
    if experts_left_out:
        # Their gradients already sum every rank's tokens: divide by the world.
        placement, ignored = _placement(mesh, sizes, set()), set(experts)
        divide_gradients(experts, dist.get_world_size())
    else:
        placement, ignored = _placement(mesh, sizes, {id(p) for p in experts}), None
    for i, block in enumerate(units):
        # The last block's backward runs first, right after the forward: resharding it would only gather it again
        # at once (torchtitan keeps it gathered too). Every other block is resharded as asked.
        last = i == len(units) - 1
        fully_shard(block, mesh=dense_mesh, shard_placement_fn=placement, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and not last, ignored_params=ignored)
    fully_shard(model, mesh=dense_mesh, shard_placement_fn=placement, mp_policy=policy, ignored_params=ignored)
    gloo = dist.get_backend(dense_mesh.get_group(dense_mesh.ndim - 1)) == "gloo"
    _divide_gradients_by_world(model, gloo=gloo)
    if gloo:
        overlap_gloo_collectives(model, units)
    return model


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: the entries of every ``nn.ModuleList`` one of whose entries holds an MoE layer (the
    GPT's ``blocks``, a Hugging Face model's ``layers``), outside MoE layers; none for a model without them."""
    inside_layers = {id(m) for _, layer in named_moe_layers(model) for m in layer.modules()}
    found: list[nn.Module] = []
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or id(module) in inside_layers:
            continue
        if any(isinstance(m, MoELayer) for entry in module for m in entry.modules()):
            found.extend(module)
    return found


def place_experts(layer: MoELayer, group: Any) -> MoELayer:
    """``layer`` with its experts spread over ``group`` (a process group, or "single"): the layer itself when it
    already is, else a new layer of the same options holding this rank's experts, sharing ``layer``'s router,
    shared experts and buffers. Its experts are cut from ``layer``'s, or stay on the meta device where
    ``layer``'s are (to be materialised per rank)."""
    target = resolve_group(group)
    if layer.ep_group.global_ranks == target.global_ranks and layer.ep_group.world_size == target.world_size:
        return layer
    if layer.ep_group.distributed:
        raise ValueError(f"this MoELayer spreads its experts over ranks {layer.ep_group.global_ranks}, the mesh's "
                         f"ep dim over {target.global_ranks}: build it with group='single' (every expert) or the "
                         f"mesh's ep group (mesh['ep'].get_group())")
    experts = layer.experts
    if not isinstance(experts, FeedForwardExperts):
        raise ValueError(f"parallelize cannot cut a custom experts module ({type(experts).__name__}) over ranks: "
                         "build the layer with group=mesh['ep'].get_group() and this rank's experts")
    weight = experts.w1
    parallel = dataclasses.replace(layer.parallel_options, ranks_per_node=None)  # one process's 1 is meaningless
    placed = MoELayer(layer.model_dim, layer.num_experts, layer.hidden_dim, group=group, device=torch.device("meta"),
                      dtype=weight.dtype, routing_options=layer.routing_options,
                      expert_options=layer.expert_options, parallel_options=parallel)
    placed.train(layer.training)
    placed.router, placed.shared, placed.shared_gate = layer.router, layer.shared, layer.shared_gate
    placed.expert_bias, placed.pending_load = layer.expert_bias, layer.pending_load
    if weight.device.type == "meta":
        return placed
    layout = ExpertLayout(layer.num_experts, target.world_size, layer.hidden_dim)
    # The state dict names the gated halves w1 and w3 whether or not the experts hold them joined (gate_up).
    local = shard_expert_state(dict(experts.state_dict()), layout, target.rank)
    placed.experts.to_empty(device=weight.device)
    placed.experts.load_state_dict(local)
    return placed


def _place_every_layer(model: nn.Module, group: Any, data_parallel: int) -> nn.Module:
    if isinstance(model, MoELayer):
        _check_balance(model, "<root>", data_parallel)
        return place_experts(model, group)
    for name, layer in named_moe_layers(model):  # a list: the loop replaces the layers it walks
        _check_balance(layer, name, data_parallel)
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, place_experts(layer, group))
    return model


def _check_reduce_dtype(model: nn.Module, policy: MixedPrecisionPolicy, sizes: dict[str, int], *,
                        experts_in_fsdp: bool) -> None:
    """Refuse gradients reduced in float16/float64 where a parameter group is sharded over one rank (dp_shard = ep
    = 1; or the experts, when FSDP holds them, with dp_shard = 1): torch 2.13 divides those gradients twice
    (before and after the skipped reduce-scatter)."""
    dtypes = {policy.reduce_dtype or policy.param_dtype or p.dtype for p in model.parameters()}
    risky = sorted(str(d) for d in dtypes if d not in (torch.float32, torch.bfloat16))
    if not risky:
        return
    if sizes["dp_shard"] * sizes["ep"] == 1:
        over_one_rank = "dp_shard=1 and ep=1 (parameters sharded over one rank)"
    elif experts_in_fsdp and sizes["dp_shard"] == 1:
        over_one_rank = "dp_shard=1 (the experts sharded over one rank)"
    else:
        return
    raise ValueError(f"parallelize: gradients reduced in {risky} with {over_one_rank} would be divided twice by "
                     f"torch's FSDP; reduce in float32 "
                     f"(mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32)) or shard over more ranks")


def _check_balance(layer: MoELayer, name: str, data_parallel: int) -> None:
    moving = layer.routing_options.balance == "bias" and layer.routing_options.bias_update_rate > 0
    if moving and data_parallel > 1:
        raise ValueError(f"MoE layer {name}: balance='bias' with data-parallel dims (dp_replicate x dp_shard = "
                         f"{data_parallel}) is not supported: its load is summed over the ep group only, so the "
                         f"replicas' biases would drift apart; use a mesh of ep alone, bias_update_rate=0 (a fixed "
                         f"bias), or balance='aux'")


def _divide_gradients_by_world(model: nn.Module, gloo: bool) -> None:
    """Every FSDP unit divides its reduced gradients by the world size (see the module docstring)."""
    world = float(dist.get_world_size())
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        module.set_gradient_divide_factor(world)
        # gloo has neither AVG nor PREMUL_SUM: divide around a SUM instead. Not for a parameter group sharded over
        # one rank: torch 2.13 would divide its gradients twice (before the skipped reduce-scatter, and after).
        for group in module._get_fsdp_state()._fsdp_param_groups:
            info = group.mesh_info
            group.force_sum_reduction_for_comms = gloo and isinstance(info, FSDPMeshInfo) and info.shard_mesh_size > 1


def _dense_mesh(mesh: DeviceMesh, sizes: dict[str, int]) -> DeviceMesh:
    """The non-expert parameters' mesh: sharded over dp_shard x ep (flattened), replicated over dp_replicate."""
    shard = mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    return mesh["dp_replicate", "dp_shard_ep"] if sizes["dp_replicate"] > 1 else shard


def _placement(mesh: DeviceMesh, sizes: dict[str, int],
               expert_params: set[int]) -> Callable[[nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn``: the parameters in ``expert_params`` (ids) sharded over the ranks holding
    the same experts, every other one over the unit's mesh. Each on its leading dim, unless that dim is shorter than
    the number of shards (a shared expert stored as ``[1, M, H]``: one rank would hold all of it), then on the
    first dim that divides evenly (FSDP2 needs even shards off dim 0)."""
    expert_info: FSDPMeshInfo | None = None
    if sizes["ep"] > 1 and expert_params:
        if sizes["dp_replicate"] > 1:
            expert_info = HSDPMeshInfo(mesh["dp_replicate", "dp_shard"], shard_mesh_dim=1, replicate_mesh_dim=0)
        else:
            expert_info = FSDPMeshInfo(mesh["dp_shard"], shard_mesh_dim=0)  # one object: FSDP groups by it
    dense_shards = sizes["dp_shard"] * sizes["ep"]

    def placement(p: nn.Parameter) -> Any:
        if expert_info is not None and id(p) in expert_params:
            return _fsdp_common.ShardPlacementResult(Shard(_balanced_dim(p, sizes["dp_shard"])), expert_info)
        dim = _balanced_dim(p, dense_shards)
        return Shard(dim) if dim else None

    return placement


def _balanced_dim(p: nn.Parameter, shards: int) -> int:
    """The dim to shard ``p`` on over ``shards`` ranks (see :func:`_placement`)."""
    if p.dim() == 0 or p.shape[0] >= shards:
        return 0
    return next((d for d in range(1, p.dim()) if p.shape[d] % shards == 0), 0)


def _require_per_parameter_mesh() -> None:
    """parallelize shards experts and the rest over different ranks in one FSDP2 unit, which needs FSDP2's
    per-parameter mesh (``ShardPlacementResult``): say so by name on a torch without it, rather than fail inside."""
    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        raise RuntimeError(
            f"flexmoe.sharding.parallelize needs FSDP2's per-parameter mesh (torch.distributed.fsdp."
            f"_fully_shard._fsdp_common.ShardPlacementResult), which torch {torch.__version__} lacks (torch 2.13 has "
            f"it): upgrade torch, or replicate the non-expert part with flexmoe.sharding.wrap_ddp")
