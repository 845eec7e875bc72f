"""``flexmoe train --fsdp``: the model (the GPT, or a converted Hugging Face model) laid on a device mesh by
:func:`flexmoe.parallel.parallelize` (FSDP2 over all ranks, experts over ``--ep``), its gradient clipping, its DCP
checkpoints, and what each rank holds.

Without ``--fsdp`` the job replicates the non-expert part (``wrap_ddp``, experts over all ranks); this module
holds only what differs under ``--fsdp``, so train.py and hf_job.py wire it in one place each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT
from flexmoe.parallel import default_blocks, load_sharded, local_state_bytes, make_mesh, parallelize, save_sharded

__all__ = ["add_mesh_flags", "check_mesh_flags", "lay_out", "blocks", "mixed_precision", "clip_sharded_gradients",
           "state_bytes_per_rank", "save_dcp_checkpoint", "latest_dcp_checkpoint", "load_dcp_checkpoint"]

DCP_PREFIX = "dcp-step_"
PARAM_DTYPES = ("float32", "bfloat16")


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--ep", type=COUNT, default=None,
      help="ranks the experts are spread over (default: all; fewer needs --fsdp, the rest shard them)")
    a("--fsdp", action="store_true",
      help="shard parameters, gradients and AdamW states with FSDP2 over all ranks (experts over the ranks "
           "outside their --ep group); checkpoints are then torch.distributed.checkpoint directories")
    a("--activation-checkpointing", action="store_true",
      help="recompute each block's activations in backward (needs --fsdp)")
    a("--param-dtype", choices=PARAM_DTYPES, default="float32",
      help="FSDP2's mixed precision (needs --fsdp): gather the parameters and compute every block in this dtype; "
           "the sharded weights, the gradients' reduction and AdamW stay float32 (default: float32 throughout)")


def check_mesh_flags(args: argparse.Namespace, world: int) -> None:
    """UsageError for a mesh the job cannot run: --ep not dividing the ranks, --ep or activation checkpointing
    without --fsdp."""
    ep = getattr(args, "ep", None)
    if ep is not None and world % ep:
        raise UsageError(f"--ep {ep} must divide the number of ranks {world}")
    if ep is not None and ep != world and not args.fsdp:
        raise UsageError(f"--ep {ep} of {world} ranks needs --fsdp (without it every rank holds a share of the "
                         f"experts: --ep is the number of ranks)")
    if args.activation_checkpointing and not args.fsdp:
        raise UsageError("--activation-checkpointing needs --fsdp")
    if getattr(args, "param_dtype", "float32") != "float32" and not args.fsdp:
        raise UsageError(f"--param-dtype {args.param_dtype} needs --fsdp (it is FSDP2's mixed precision)")


def mixed_precision(param_dtype: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for ``--param-dtype``: parameters gathered and used in that dtype, gradients reduced in
    float32 (None for float32: no casts)."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")
    if param_dtype == "float32":
        return None
    return MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)


def lay_out(model: nn.Module, ep: int | None, activation_checkpointing: bool,
            param_dtype: str = "float32") -> tuple[nn.Module, DeviceMesh]:
    """``model`` (every expert on every rank, same weights everywhere) laid on the mesh ``ep x dp_shard``, its
    blocks computing in ``param_dtype`` (:func:`mixed_precision`)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        raise UsageError("--fsdp needs more than one rank (--nproc N)")
    cfg = getattr(model, "cfg", None)
    num_experts = None if getattr(cfg, "dense", False) else getattr(cfg, "num_experts", None)
    if num_experts is not None and (ep or world) > num_experts:
        raise UsageError(f"--fsdp needs at least as many experts as --ep ranks ({num_experts} experts, "
                         f"ep={ep or world}): experts cut along their hidden dim are not supported with --fsdp")
    mesh = make_mesh(ep=ep or world)
    laid = parallelize(model, mesh, activation_checkpointing=activation_checkpointing, blocks=blocks(model),
                       mp_policy=mixed_precision(param_dtype))
    return laid, mesh


def blocks(model: nn.Module) -> list[nn.Module]:
    """A job's model's FSDP units, compiled one by one under ``--compile``: its blocks holding MoE layers
    (:func:`~flexmoe.parallel.default_blocks`), or, for the dense twin, its ``blocks``."""
    found = default_blocks(model)
    return found if found else list(getattr(model, "blocks", []))


@torch.no_grad()
def clip_sharded_gradients(model: nn.Module, max_norm: float) -> float:
    """Scale the gradients of a laid-out model so that their global L2 norm is at most ``max_norm``; the norm.

    Every rank holds a distinct shard of every gradient (FSDP over all ranks, experts over dp_shard within
    distinct ep groups), so the global sum of squares is the sum over ranks of the local ones.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        sq += local.double().square().sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
    return norm


def state_bytes_per_rank(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """Every rank's bytes of parameters, gradients and optimizer states (local shards), by rank."""
    mine = local_state_bytes(model, optimizer)
    if not dist.is_initialized():
        return [mine]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [int(v) for v in every]


def save_dcp_checkpoint(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, step: int,
                        extra: dict[str, Any], keep: int, before_commit: Callable[[], None] | None = None) -> Path:
    """``out/checkpoints/dcp-step_NNNNNN``: the DCP files, then ``meta.json`` (written last by rank 0: a directory
    without it is an unfinished checkpoint and is ignored) with the torch CPU and Python RNG states (the same on
    every rank: seeded alike, drawn alike); the oldest beyond ``keep`` are removed. ``before_commit``: called
    once this rank's files are written, before ``meta.json`` is (a fault test kills the rank there)."""
    path = out / "checkpoints" / f"{DCP_PREFIX}{step:06d}"
    save_sharded(path, model, optimizer, mesh=mesh)
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = path / "meta.json.tmp"
        py = random.getstate()
        rng = {"torch_cpu": torch.get_rng_state().tolist(), "python": [py[0], list(py[1]), py[2]]}
        tmp.write_text(json.dumps({"step": step, **extra, "rng": rng}))
        os.replace(tmp, path / "meta.json")
        for old in _finished(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def latest_dcp_checkpoint(out: Path) -> Path | None:
    """The newest finished DCP checkpoint of the run in ``out``, or None."""
    finished = _finished(out)
    return finished[-1] if finished else None


def load_dcp_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        mesh: DeviceMesh) -> dict[str, Any]:
    """Load a :func:`save_dcp_checkpoint` checkpoint (saved at any mesh) and its RNG states; returns its
    ``meta.json``."""
    load_sharded(path, model, optimizer, mesh=mesh)
    meta = json.loads((path / "meta.json").read_text())
    torch.set_rng_state(torch.tensor(meta["rng"]["torch_cpu"], dtype=torch.uint8))
    py = meta["rng"]["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    return meta


def _finished(out: Path) -> list[Path]:
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{DCP_PREFIX}*") if (p / "meta.json").is_file())
