"""Tutel's ``system``: joining the process group, data/model groups, per-rank file names, timing.

Tutel keeps the session of ``init_data_model_parallel`` (and the groups of ``create_groups_from_world``)
per process, so that ``get_local_session()`` and later calls find them; this module does the same, in
``_SESSIONS`` (and the backend chosen in ``_BACKEND``), because process groups must be created once and in
the same order on every rank.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ParallelEnv", "init_data_model_parallel", "create_groups_from_world", "create_standalone_group",
    "get_local_session", "record_time", "apply_rank_size_from_pattern", "save", "load",
]

log = logging.getLogger(__name__)

_SESSIONS: dict[int | str, ParallelEnv] = {}  # by group_count, and "default" for init_data_model_parallel
_BACKEND: dict[str, str] = {}  # "backend": the one this process joined with


@dataclass
class ParallelEnv:
    """The ranks of this process: ``global_rank`` of ``global_size``; the world cut into ``group_count``
    model groups of ``model_size`` consecutive ranks (this process is ``model_rank`` in ``model_group``), and
    data groups of the ranks with equal ``model_rank`` (this process is ``data_rank`` in ``data_group``)."""

    global_size: int
    global_rank: int
    group_count: int
    data_rank: int
    model_size: int
    model_rank: int
    local_device: torch.device | None
    data_group: Any
    model_group: Any
    global_group: Any
    is_distributed: bool
    is_cuda: bool = False
    dist_print: Callable[..., None] = field(default=print, repr=False)


def _launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _end_process_group() -> None:
    """At exit: destroy the process group this module created, before the interpreter shuts down.

    Destroying the group joins gloo's worker threads if nothing else holds it. A script's own objects (its
    ``ParallelEnv``, a DDP wrapper) usually still do at exit; then a worker thread may still be releasing the
    last collective's tensors, which needs the GIL, and a thread asking for it during shutdown aborts the
    process. The short sleep hands the GIL (and the CPU) over first. See "Clean exits" in docs/architecture.md.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    _SESSIONS.clear()
    gc.collect()
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if world() is not None:
        time.sleep(0.05)


def _resolve_backend(backend: str | None) -> str | None:
    if backend == "nccl" and not torch.cuda.is_available():
        # Tutel's default backend; without CUDA the same program runs on CPU with gloo.
        log.warning("backend 'nccl' needs CUDA, which is not available: using 'gloo' on CPU")
        return "gloo"
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
    return backend


def create_standalone_group() -> Any:
    """A process group of this rank alone (None without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = None
    for r in range(dist.get_world_size()):  # every rank must create every group, in the same order
        g = dist.new_group(ranks=[r])
        if r == dist.get_rank():
            mine = g
    return mine


def create_groups_from_world(group_count: int, include_init: str | None = None,
                             parent_group: Any = None) -> ParallelEnv:
    """This process's :class:`ParallelEnv` for ``group_count`` model groups (negative: ``world / -n``).

    ``include_init`` (a backend) first joins the process group when launched by torchrun. The result is
    kept per ``group_count``: asking again returns the same groups.
    """
    if parent_group is not None and dist.is_initialized() and \
            dist.get_world_size(parent_group) not in (1, dist.get_world_size()):
        raise ValueError("create_groups_from_world: splitting a sub-group is not supported (as in Tutel)")
    backend = _resolve_backend(include_init)
    if backend is not None:
        if "backend" in _BACKEND and _BACKEND["backend"] != backend:
            raise ValueError(f"one backend per process: {_BACKEND['backend']!r} already, got {backend!r}")
        _BACKEND["backend"] = backend
        if not dist.is_initialized() and _launched_by_torchrun():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=600))
            atexit.register(_end_process_group)  # Tutel's scripts never destroy the group they create
    if group_count in _SESSIONS:
        return _SESSIONS[group_count]

    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    count = world // -group_count if group_count < 0 else group_count
    if count < 1 or world % count:
        raise ValueError(f"group_count={group_count}: {count} groups do not divide the world of {world} ranks")
    model_size = world // count
    model_rank, data_rank = rank % model_size, rank // model_size

    model_group = data_group = global_group = None
    if distributed:
        global_group = model_group = data_group = dist.group.WORLD
        if model_size != world:
            for g in range(count):
                group = dist.new_group(ranks=list(range(g * model_size, (g + 1) * model_size)))
                if g == data_rank:
                    model_group = group
        if count != world:
            for m in range(model_size):
                group = dist.new_group(ranks=list(range(m, world, model_size)))
                if m == model_rank:
                    data_group = group

    backend = _BACKEND.get("backend")
    device: torch.device | None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu") if backend == "gloo" else None

    def dist_print(*args: Any) -> None:
        if rank == 0:
            print(*args)

    env = ParallelEnv(
        global_size=world, global_rank=rank, group_count=count, data_rank=data_rank, model_size=model_size,
        model_rank=model_rank, local_device=device, data_group=data_group, model_group=model_group,
        global_group=global_group, is_distributed=distributed, is_cuda=device is not None and device.type == "cuda",
        dist_print=dist_print if distributed else print,
    )
    _SESSIONS[group_count] = env
    return env


def init_data_model_parallel(group_count: int = 1, backend: str = "nccl") -> ParallelEnv:
    """Join the process group (when launched by torchrun) and return this process's :class:`ParallelEnv`.

    Without torchrun's environment this is a single process (``global_size == 1``). ``backend='nccl'``
    without CUDA falls back to gloo on CPU (Tutel would fail), so that Tutel's examples run unchanged on CPU.
    """
    env = create_groups_from_world(group_count=group_count, include_init=backend)
    _SESSIONS["default"] = env
    return env


def get_local_session() -> ParallelEnv:
    """The session of the last ``init_data_model_parallel``."""
    if "default" not in _SESSIONS:
        raise RuntimeError("no session: call system.init_data_model_parallel() first "
                           "(or system.record_time(is_cuda=False) for timing alone)")
    return _SESSIONS["default"]


def record_time(is_cuda: bool | None = None) -> float:
    """``time.time()`` after the GPU finished its queued work (when the session uses CUDA)."""
    if is_cuda is None:
        is_cuda = get_local_session().is_cuda
    if is_cuda:
        torch.cuda.synchronize()
    return time.time()


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """``filename`` with ``{rank}`` and ``{size}`` filled in; its directory created if ``create_dir``."""
    if "{rank}" not in filename:
        log.warning("file pattern %s has no {rank}: every rank would use the same file", filename)
    filename = filename.replace("{size}", str(size)).replace("{rank}", str(rank))
    directory = os.path.dirname(filename)
    if create_dir and directory:
        os.makedirs(directory, exist_ok=True)
    return filename


def save(t: torch.Tensor, path: str) -> None:
    """Save a tensor as a NumPy ``.npy`` file."""
    import numpy as np

    np.save(path, t.detach().cpu().numpy())


def load(path: str, device: Any = None) -> torch.Tensor:
    """Load a NumPy ``.npy`` file as a tensor."""
    import numpy as np

    return torch.tensor(np.load(path), device=device)
