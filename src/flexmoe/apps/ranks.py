"""A job's processes: which backend their collectives take, which device each rank computes on, and the job's own
small collectives (losses, loads, signals) over whichever backend that is.

``flexmoe train --nproc N`` (or torchrun) starts N ranks. ``--backend auto`` takes NCCL when the job trains on
CUDA devices and gloo otherwise; ``--backend gloo`` with ``--device cuda`` keeps gloo, which carries CUDA tensors
for the collectives expert parallelism uses, so several ranks can share one GPU (how multi-rank logic is checked
on a one-GPU machine). Each rank computes on its local device: ``cuda:LOCAL_RANK`` (modulo the devices there are,
so ranks beyond the count share them), or the device named with an index.

NCCL moves device tensors only: the job's host-side numbers (a loss, a signal flag) go through the rank's device
there (:func:`all_reduce_host`) and come back to the host.

Restarts (``torchrun --max-restarts R``, ``flexmoe train --nproc N --max-restarts R``): every start of the workers
joins its process group under a key prefix of its own in the rendezvous store (:func:`restart_attempt`), and
``--collective-timeout`` bounds every collective (:func:`init_distributed`); a rank that times out asks the store
which ranks still answer (:func:`unanswering_ranks`), so its error names the one that hangs.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.apps.errors import UsageError

__all__ = ["BACKENDS", "resolve_backend", "rank_device", "init_distributed", "start_ranks", "all_reduce_host",
           "local_rank", "restart_attempt", "unanswering_ranks"]

BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``--backend`` for a job on ``device``: ``auto`` is NCCL on CUDA, gloo elsewhere; NCCL off CUDA, or where this
    torch has no NCCL, is a :class:`UsageError`."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if device.type != "cuda":
            raise UsageError(f"--backend nccl runs on CUDA devices (--device cuda), not {device.type}: gloo carries "
                             f"{device.type} tensors")
        if not dist.is_nccl_available():
            raise UsageError(f"--backend nccl: this torch {torch.__version__} was built without NCCL; use gloo")
    return backend


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 in one process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_device(device: torch.device, local: int) -> torch.device:
    """The device rank ``local`` (its rank on the node) computes on, for a job on ``device``: a CUDA device without
    an index is ``cuda:local`` modulo this node's devices (more ranks than GPUs share them, over gloo); any
    other device is itself."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", local % max(torch.cuda.device_count(), 1))


def restart_attempt() -> int:
    """Which start of the job's workers this process belongs to: 0 for the first, then one more at each restart
    (torchrun's ``TORCHELASTIC_RESTART_COUNT``; :func:`flexmoe.launch.launch_ranks` sets it alike)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# The rendezvous store this process joined its group through (None: not joined here), kept for the ranks' own
# exchanges outside the collectives (:func:`unanswering_ranks`).
_store: dist.Store | None = None


def init_distributed(backend: str = "gloo", device: torch.device | None = None,
                     timeout: float | None = None) -> tuple[int, int]:
    """(rank, world size) of this process: under torchrun (``WORLD_SIZE`` > 1) the process group is started here
    on ``backend`` if it is not yet, with ``device`` (this rank's, :func:`rank_device`) made current for CUDA and
    every collective bounded by ``timeout`` seconds (None: torch's default, 30 minutes on gloo); (0, 1) in one
    process."""
    global _store
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator and every later .cuda() go to this rank's GPU
    if world > 1 and not dist.is_initialized():
        limit = None if timeout is None else timedelta(seconds=timeout)
        store, rank, world = next(dist.rendezvous("env://", timeout=limit or timedelta(minutes=30)))
        # torchrun's agent serves one store for the whole job and keeps it across restarts: restarted workers
        # would read the addresses their dead predecessors left under the same keys, and gloo would connect to
        # ports nobody listens on any more ("connectFullMesh failed ... Connection refused"). Each start of the
        # workers keys its group under its own prefix instead.
        _store = dist.PrefixStore(f"flexmoe/attempt_{restart_attempt()}/", store)
        dist.init_process_group(backend, store=_store, rank=rank, world_size=world, timeout=limit)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def unanswering_ranks(tag: str, window: float) -> list[int] | None:
    """The ranks that do not answer within ``window`` seconds, after a collective failed (None where this process
    did not join its group through :func:`init_distributed`).

    Every rank that calls this with the same ``tag`` (the step that failed) writes its key into the rendezvous
    store, then waits for the others' keys: a rank that hangs (in a collective, a sleep, a dead lock) never
    writes its own. The store is a TCP server apart from the collectives' connections, so it answers even when
    those are broken."""
    if _store is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    _store.set(f"alive/{tag}/{rank}", "1")
    keys = {r: f"alive/{tag}/{r}" for r in range(world) if r != rank}
    deadline = time.monotonic() + window
    while keys and time.monotonic() < deadline:
        keys = {r: k for r, k in keys.items() if not _store.check([k])}
        time.sleep(0.05)
    return sorted(keys)


def start_ranks(backend: str, device: str, timeout: float | None = None) -> tuple[int, int, str]:
    """A job's start: ``--backend``, ``--device`` and ``--collective-timeout`` as given -> (rank, world size, this
    rank's device), the process group started on the resolved backend (:func:`resolve_backend`,
    :func:`rank_device`)."""
    wanted = torch.device(device)
    mine = rank_device(wanted, local_rank())
    rank, world = init_distributed(resolve_backend(backend, wanted), mine, timeout)
    return rank, world, str(mine)


def all_reduce_host(t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> Tensor:
    """All-reduce ``t`` (any device) in place and return it: over NCCL through this rank's current CUDA device
    (NCCL moves device tensors only), otherwise as it is."""
    if dist.get_backend(group) != "nccl" or t.device.type == "cuda":
        dist.all_reduce(t, op=op, group=group)
        return t
    on_device = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(on_device, op=op, group=group)
    return t.copy_(on_device)
