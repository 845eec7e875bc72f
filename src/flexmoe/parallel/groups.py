"""The expert-parallel process group: resolution, config agreement, sub-groups and clear collective errors.

Every collective of a layer goes through an :class:`ExpertGroup`, which knows the group's ranks and timeout.
A collective that fails (a peer exited, or stalled past the timeout) is re-raised as
:class:`CollectiveError` naming the operation, the rank and the timeout, instead of a bare backend message.
"""

from __future__ import annotations

import datetime
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: this module's functions take ``group=group.WORLD`` as
# default arguments, evaluated at import. Imported later (DDP's constructor imports it, through torch._dynamo)
# they keep the world group alive past ``destroy_process_group()`` (torch 2.13), and then gloo's worker threads
# outlive the interpreter; see "Clean exits" in docs/architecture.md.
import torch.distributed.nn.functional  # noqa: F401

__all__ = [
    "CollectiveError",
    "ConfigMismatchError",
    "ExpertGroup",
    "resolve_group",
    "SINGLE_PROCESS",
    "check_config_agreement",
    "default_ranks_per_node",
]

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective of the expert-parallel group failed or timed out (a rank exited or stalled)."""


class ConfigMismatchError(ValueError):
    """The ranks of an expert-parallel group built layers with different configurations."""


def default_ranks_per_node() -> int | None:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node), or None when not launched by torchrun.

    Read once, when a layer is built, as the default of ``ranks_per_node``; never consulted in forward.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else None


def _group_timeout(group: Any) -> datetime.timedelta | None:
    # The timeout given to init_process_group / new_group; sub-groups we create inherit it.
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # backends without options (or other devices): keep the backend default
        return None


@dataclass(eq=False)
class ExpertGroup:
    """The ranks of one expert-parallel group, as seen from this process.

    ``group`` is None for a single process (world size 1, no collectives). ``global_ranks[i]`` is the global
    rank of group rank i. Sub-groups (for the 2-D hierarchical all-to-all) are created on first use and kept
    here, so they belong to the layer and not to a module-level cache.

    The process groups are held by weak references: torch.distributed owns them, and
    ``destroy_process_group()`` must be able to free them while layers are still alive. Freeing a gloo group
    joins its worker threads; a group that outlives the interpreter's shutdown instead has a worker thread
    release its last finished collective's tensors then, which needs the GIL, and the interpreter kills that
    thread: "terminate called without an active exception".
    """

    group_ref: Any  # weakref.ref to the process group, or None for a single process
    rank: int
    world_size: int
    global_ranks: list[int]
    timeout: datetime.timedelta | None
    _subgroups: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)  # weak references too

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def group(self) -> Any:
        """The process group (None for a single process); an error once it has been destroyed."""
        return None if self.group_ref is None else _alive(self.group_ref, self)

    def describe(self) -> str:
        t = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "the backend default"
        return f"rank {self.rank} of an expert-parallel group of {self.world_size} (timeout {t})"

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one collective (or wait on one), turning backend failures into :class:`CollectiveError`."""
        try:
            return fn()
        except CollectiveError:
            raise
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL raise RuntimeError (DistBackendError) on timeout
            raise CollectiveError(
                f"flexmoe {what} failed on {self.describe()}: a peer rank has probably exited, crashed or "
                f"stalled past the timeout. Backend said: {str(exc).strip()[:500]}"
            ) from exc

    def subgroup(self, group_ranks: list[int]) -> Any:
        """The process group of the listed group ranks (this rank must be one of them).

        Created once with ``use_local_synchronization`` so only members take part; every member asks for its
        sub-groups in the same order (the 2-D all-to-all asks for the node group, then the column group).
        """
        key = tuple(group_ranks)
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} is not in sub-group {list(key)}")
        if len(key) == self.world_size:
            return self.group
        if key not in self._subgroups:
            ranks = [self.global_ranks[i] for i in key]
            self._subgroups[key] = weakref.ref(self.call(
                "sub-group creation",
                lambda: dist.new_group(ranks, timeout=self.timeout, use_local_synchronization=True),
            ))
        return _alive(self._subgroups[key], self)


def _alive(ref: weakref.ref, eg: ExpertGroup) -> Any:
    group = ref()
    if group is None:
        raise CollectiveError(f"the process group of {eg.describe()} was destroyed (destroy_process_group); "
                              "build the layer again after init_process_group")
    return group


SINGLE_PROCESS = "single"


def resolve_group(group: Any = None) -> ExpertGroup:
    """The :class:`ExpertGroup` of ``group``: the world when None and torch.distributed is initialized,
    else a single process. ``group="single"`` (:data:`SINGLE_PROCESS`) asks for one process holding every
    expert even under torch.distributed (a reference model, or experts replicated by data parallelism)."""
    initialized = dist.is_available() and dist.is_initialized()
    if isinstance(group, str):
        if group != SINGLE_PROCESS:
            raise ValueError(f"group must be a process group, None or {SINGLE_PROCESS!r}, got {group!r}")
        return ExpertGroup(None, 0, 1, [0], None)
    if group is None:
        if not initialized:
            return ExpertGroup(None, 0, 1, [0], None)
        group = dist.group.WORLD
    elif not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group must be a process group, None or {SINGLE_PROCESS!r}, got {type(group).__name__}")
    elif not initialized:
        raise RuntimeError("MoELayer(group=...) needs torch.distributed to be initialized (init_process_group)")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the expert-parallel group passed as group=")
    ranks = dist.get_process_group_ranks(group)
    return ExpertGroup(weakref.ref(group), rank, world, list(ranks), _group_timeout(group))


def check_config_agreement(eg: ExpertGroup, config: dict[str, Any], what: str = "MoELayer") -> None:
    """Compare ``config`` across the group's ranks; raise :class:`ConfigMismatchError` on EVERY rank if any
    field differs, naming the fields and each rank's value."""
    if not eg.distributed:
        return
    gathered: list[Any] = [None] * eg.world_size
    eg.call(f"{what} configuration check", lambda: dist.all_gather_object(gathered, config, group=eg.group))
    differing = []
    for key in sorted({k for c in gathered for k in c}):
        values = [c.get(key, "<missing>") for c in gathered]
        if any(v != values[0] for v in values[1:]):
            per_rank = ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(values))
            differing.append(f"{key} ({per_rank})")
    if differing:
        raise ConfigMismatchError(
            f"the {eg.world_size} ranks of the expert-parallel group built {what} with different "
            f"configurations; every rank must use the same ones. Differing: " + "; ".join(differing)
        )
