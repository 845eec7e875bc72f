"""The device mesh a model is laid on: named dims ``dp_replicate``, ``dp_shard`` and ``ep`` over the world.

Ranks are numbered ``(dp_replicate, dp_shard, ep)`` row-major, ``ep`` innermost: the ranks of one expert-parallel
group are consecutive, as :class:`~flexmoe.parallel.ExpertLayout` numbers them, and the ranks holding the same
experts (one per expert-parallel group) are those that differ in the two data-parallel dims only.

* ``ep``: the experts of every MoE layer are spread over these ranks (expert parallelism).
* ``dp_shard``: parameters, gradients and optimizer states are sharded over these ranks (FSDP); the non-expert
  parameters over ``dp_shard x ep`` (every rank of a replica), the experts over ``dp_shard``.
* ``dp_replicate``: whole replicas of that (HSDP); gradients are all-reduced across them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flexmoe.validation import check_int

__all__ = ["MESH_DIMS", "make_mesh", "full_mesh", "mesh_sizes"]

MESH_DIMS = ("dp_replicate", "dp_shard", "ep")


def make_mesh(*, ep: int = 1, dp_shard: int = -1, dp_replicate: int = 1,
              device_type: str | None = None) -> DeviceMesh:
    """A :class:`DeviceMesh` of the world with the dims :data:`MESH_DIMS`, sizes ``(dp_replicate, dp_shard, ep)``.

    ``dp_shard=-1`` takes the ranks left over (world / (ep * dp_replicate)). The sizes must multiply to the
    world size. ``device_type``: where the mesh's tensors live (default: the accelerator when one is present,
    else "cpu"). Needs ``torch.distributed`` initialized; every rank calls it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("make_mesh needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size()
    ep = check_int("ep", ep, 1)
    dp_replicate = check_int("dp_replicate", dp_replicate, 1)
    if dp_shard == -1:
        if world % (ep * dp_replicate) != 0:
            raise ValueError(f"ep={ep} x dp_replicate={dp_replicate} must divide the world size {world}")
        dp_shard = world // (ep * dp_replicate)
    dp_shard = check_int("dp_shard", dp_shard, 1)
    if dp_replicate * dp_shard * ep != world:
        raise ValueError(f"dp_replicate={dp_replicate} x dp_shard={dp_shard} x ep={ep} = "
                         f"{dp_replicate * dp_shard * ep} ranks, but the world has {world}")
    return init_device_mesh(device_type or _default_device_type(), (dp_replicate, dp_shard, ep),
                            mesh_dim_names=MESH_DIMS)


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """Each of :data:`MESH_DIMS` -> its size in ``mesh`` (1 where the mesh has no such dim)."""
    names = _checked_names(mesh)
    return {dim: mesh.size(names.index(dim)) if dim in names else 1 for dim in MESH_DIMS}


def full_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with all three :data:`MESH_DIMS` (a missing dim has size 1), the same ranks in the same order.

    A mesh that has them all is returned as is; otherwise a new mesh is built (every rank must call this).
    """
    names = _checked_names(mesh)
    if names == MESH_DIMS:
        return mesh
    sizes = mesh_sizes(mesh)
    ranks = mesh.mesh.reshape(tuple(sizes[d] for d in MESH_DIMS))
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=MESH_DIMS)


def _checked_names(mesh: DeviceMesh) -> tuple[str, ...]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh (see flexmoe.sharding.make_mesh), "
                        f"got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim or any(n not in MESH_DIMS for n in names):
        raise ValueError(f"mesh dims must be named from {list(MESH_DIMS)}, got {list(mesh.mesh_dim_names or [])}")
    order = [MESH_DIMS.index(n) for n in names]
    if order != sorted(set(order)):
        raise ValueError(f"mesh dims must appear once each, in the order {list(MESH_DIMS)}, got {list(names)}")
    return names


def _default_device_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"
