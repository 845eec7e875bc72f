"""Which expert kernel runs a call: chosen by timing the candidates on the machine at hand, once per case bucket,
and cached on disk (docs/architecture.md, "Expert compute").

:class:`KernelChooser` answers, for rows, counts and weights, the kernel of :mod:`flexmoe.experts.kernels` to run:

* a forced kernel (``expert_kernel="segmented"``) wherever it runs, else the rule with a warning;
* ``"auto"``: the bucket's entry in memory, else in the cache file, else, where several kernels run the case,
  each timed on this call's own rows (forward, and backward when autograd records), the fastest kept and
  written to the cache file; where no timing may happen the rule (:data:`~flexmoe.experts.kernels.RULE_KERNEL`,
  the loop), kept for the bucket in memory.

Timing happens only in a plain call (:func:`~flexmoe.autograd_state.in_plain_call`), never: without a timer,
while compiling, inside a backward (a reentrant checkpoint's recomputation), under saved-tensor hooks (a
non-reentrant checkpoint's forward and recomputation, offloading), under a dispatch mode (selective
checkpointing, flop counting), on an expert-parallel rank (:meth:`KernelChooser.share`), or on an empty call (no
rows: nothing to time, and no graph to time a backward through). A checkpointed forward thus runs what its
recomputation runs: the bucket's decision in memory, else the cache file's, else the rule, then kept in memory.

The cache file is per machine (its name holds a fingerprint of the host, CPU and GPUs) and holds the torch and
flexmoe versions it was measured with: another version's file is ignored and rewritten. The ranks of an
expert-parallel group agree: :meth:`KernelChooser.share` gives every rank rank 0's table, and
:meth:`KernelChooser.calibrate` times the same cases on every rank and picks by the times summed over the group.
A kernel that raises at run time is replaced by the loop for its bucket, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flexmoe.autograd_state import in_plain_call
from flexmoe.device_clock import synchronize
from flexmoe.experts.kernels import (
    KERNELS,
    ROUTES,
    RULE_KERNEL,
    ExpertKernel,
    KernelCase,
    kernel_named,
    supported_kernels,
)
from flexmoe.experts.weights import WEIGHT_NAMES, ExpertWeights
from flexmoe.version import __version__

__all__ = ["KernelChooser", "choose_fused_route",
           "Timer", "time_kernel", "time_in_rounds", "timed_call", "timed_run", "default_cache_path",
           "machine_fingerprint", "torch_control_flow", "DEFAULT_CACHE_DIR"]

Timer = Callable[[str, Callable[[], object]], float]  # (kernel name, run it once) -> seconds per run
DEFAULT_CACHE_DIR = "~/.cache/flexmoe"
# Candidates are timed in rounds, each round running every candidate once in turn (so that a burst of other work
# on the machine slows all of them alike), the fastest round of each counting; after a warm-up round, this many
# rounds while a round costs less than _CHEAP_ROUND_SECONDS, else the warm-up round alone is the measurement (a
# large layer's first call must not cost several steps).
_ROUNDS = 3
_CHEAP_ROUND_SECONDS = 0.2
# Row kernels are timed on the rows of the first experts only, about this many rows: their relative speed per
# expert is what is measured (the routes, whose gain depends on the whole block's size, are timed whole).
_SAMPLE_ROWS = 8192


def time_kernel(name: str, run: Callable[[], object]) -> float:
    """Seconds of one ``run()`` (``name`` is for fake timers)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def time_in_rounds(timer: Timer, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each candidate's fastest time over interleaved rounds (above); ``runs``: name -> one run."""
    best = {name: timer(name, run) for name, run in runs.items()}  # the warm-up round
    if sum(best.values()) >= _CHEAP_ROUND_SECONDS:
        return best
    best = {name: math.inf for name in runs}
    for _ in range(_ROUNDS):
        for name, run in runs.items():
            best[name] = min(best[name], timer(name, run))
    return best


def sampled_call(rows: Tensor, counts: list[int], weights: ExpertWeights,
                 ) -> tuple[Tensor, list[int], ExpertWeights]:
    """The call on its first experts only, as many as hold ``_SAMPLE_ROWS`` rows (all of them when fewer):
    rows ``[n, M]``, their counts and weights ``[e, ...]`` (views)."""
    total, experts = 0, 0
    while experts < len(counts) and total < _SAMPLE_ROWS:
        total, experts = total + counts[experts], experts + 1
    if experts == len(counts):
        return rows, counts, weights
    cut = {n: (t[:experts] if t is not None else None) for n, t in zip(WEIGHT_NAMES, weights.tensors())}
    return rows[:total], counts[:experts], weights.with_tensors(**cut)


def machine_fingerprint() -> str:
    """A short hash of what kernel speed depends on outside torch: host name, CPU model and count, GPUs."""
    parts = [socket.gethostname(), platform.machine(), platform.processor(), str(os.cpu_count())]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        parts += sorted({line for line in cpuinfo.read_text().splitlines() if line.startswith("model name")})
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def default_cache_path(cache_dir: str | os.PathLike[str] = DEFAULT_CACHE_DIR) -> Path:
    """``<cache_dir>/kernels-<machine fingerprint>.json``."""
    return Path(cache_dir).expanduser() / f"kernels-{machine_fingerprint()}.json"


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "flexmoe": __version__}


class KernelChooser:
    """The kernel of each call (module docstring).

    kernel: ``"auto"`` or a kernel name (:data:`~flexmoe.experts.kernels.KERNELS`); cache_path: the JSON file of
    measured choices (None: kept in memory only); timer: ``timer(name, run) -> seconds`` (None: never time, the
    rule decides what no cache entry says). ``decisions`` maps each bucket seen to its kernel, ``timings`` each
    measured bucket to its candidates' seconds.

    :meth:`for_options` builds the chooser of a layer's experts from the class defaults ``default_timer`` and
    ``default_cache_dir`` (a test suite sets both to None: the rule, deterministic, and no file read)."""

    default_timer: Timer | None = staticmethod(time_kernel)
    default_cache_dir: str | None = DEFAULT_CACHE_DIR

    def __init__(self, kernel: str = "auto", *, route: str = "auto",
                 cache_path: str | os.PathLike[str] | None = None, timer: Timer | None = time_kernel) -> None:
        if not isinstance(kernel, str):
            raise TypeError(f"expert_kernel must be a str, got {type(kernel).__name__}")
        if kernel in ROUTES:
            raise ValueError(f"expert_kernel={kernel!r} names a route of the expert stage, not a kernel: use "
                             f"expert_route={kernel!r}")
        if kernel != "auto":
            kernel_named(kernel)  # a ValueError naming the known kernels
        if not isinstance(route, str):
            raise TypeError(f"expert_route must be a str, got {type(route).__name__}")
        if route not in ("auto", *ROUTES):
            raise ValueError(f"expert_route must be one of {['auto', *ROUTES]}, got {route!r}")
        self.kernel, self.route = kernel, route
        self.last_kernel: str | None = None  # the kernel of the last run() (None before the first)
        self.cache_path = None if cache_path is None else Path(cache_path).expanduser()
        self.timer = timer
        self.times_calls = True  # False on an expert-parallel rank: its peers would time other cases
        self.decisions: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self._cache: dict[str, str] | None = None  # the cache file's choices, once read
        self._warned: set[str] = set()

    @classmethod
    def for_options(cls, kernel: str, cache_dir: str | None, route: str = "auto") -> KernelChooser:
        """The chooser of ``ExpertOptions(expert_kernel=kernel, kernel_cache=cache_dir, expert_route=route)``:
        cache_dir None is ``default_cache_dir``; the timer is ``default_timer``."""
        directory = cls.default_cache_dir if cache_dir is None else cache_dir
        return cls(kernel, route=route, cache_path=None if directory is None else default_cache_path(directory),
                   timer=cls.default_timer)

    # ---- choosing ---------------------------------------------------------------------------------------------

    def run(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
        """rows ``[N, M]`` sorted by expert, ``counts[e]`` rows each -> ``[N, M]``, by this call's kernel; a kernel
        that raises is replaced by the loop (for its bucket, from then on) with a warning."""
        case = KernelCase.of(rows, counts, weights)
        kernel = self.kernel_for(case, rows, counts, weights)
        self.last_kernel = kernel.name
        if kernel.name == RULE_KERNEL or case.compiling:  # a traced call's failure is the compiler's to report
            return kernel.run(rows, counts, weights)
        try:
            return kernel.run(rows, counts, weights)
        except Exception as error:  # noqa: BLE001 - any failure of an optional kernel: the loop is always right
            if torch_control_flow(error):
                raise  # torch's own signal (checkpoint's early stop, dynamo's), not the kernel's failure
            bucket = case.bucket()
            warnings.warn(f"expert kernel {kernel.name!r} failed on {bucket} ({type(error).__name__}: {error}); "
                          f"the loop runs this case instead", RuntimeWarning, stacklevel=2)
            self.decisions[bucket] = self.last_kernel = RULE_KERNEL
            return KERNELS[RULE_KERNEL].run(rows, counts, weights)

    def kernel_for(self, case: KernelCase, rows: Tensor | None = None, counts: list[int] | None = None,
                   weights: ExpertWeights | None = None) -> ExpertKernel:
        """The kernel for ``case``; with rows, counts and weights given, an unmeasured bucket may be timed on them."""
        if self.kernel in KERNELS:
            return self._forced(case)
        if case.compiling:
            return KERNELS[RULE_KERNEL]  # a traced graph must not depend on what this process measured
        bucket = case.bucket()
        name = self.decisions.get(bucket) or self._cached(bucket)
        if name is None or name not in KERNELS or KERNELS[name].supports(case) is not None:
            candidates = supported_kernels(case)
            if len(candidates) > 1 and rows is not None and counts is not None and weights is not None \
                    and case.active > 0 and self.may_time():
                name = self._measure(bucket, candidates, rows, counts, weights)
            else:
                name = RULE_KERNEL
        self.decisions[bucket] = name
        return KERNELS[name]

    def prepare(self, rows: Tensor, counts: list[int], weights: ExpertWeights) -> None:
        """Decide (time, where it may) the kernel of a call before a route that contains it is timed, so that the
        route's timing holds the kernel's run, not its timing."""
        self.kernel_for(KernelCase.of(rows, counts, weights), rows, counts, weights)

    def known(self, bucket: str) -> str | None:
        """The decision for ``bucket`` in memory or in the cache file, else None."""
        return self.decisions.get(bucket) or self._cached(bucket)

    def choose_route(self, bucket: str, routes: dict[str, Callable[[], object]], rule: str) -> str:
        """Which of the expert stage's ``routes`` (name: one timed run, :func:`timed_run`) a call of ``bucket``
        takes: a forced one (``route``), else ``rule`` under a forced kernel (it runs inside the rows route), else
        the measured one (memory, cache file, or timed now), else ``rule``."""
        if self.route in routes:
            return self.route
        if self.kernel != "auto":
            return rule  # a forced row kernel runs inside the rows route
        name = self.decisions.get(bucket) or self._cached(bucket)
        if name in routes:
            self.decisions[bucket] = name
            return name
        if not self.may_time():
            # Kept: a checkpointed forward and its recomputation (where nothing is timed) take the same route.
            self.decisions[bucket] = rule
            return rule
        assert self.timer is not None
        return self._decide(bucket, time_in_rounds(self.timer, routes), rule)

    def _forced(self, case: KernelCase) -> ExpertKernel:
        kernel = KERNELS[self.kernel]
        reason = kernel.supports(case)
        if reason is None:
            return kernel
        if self.kernel not in self._warned:
            self._warned.add(self.kernel)
            warnings.warn(f"expert_kernel={self.kernel!r} does not run {case.bucket()} ({reason}); the loop runs "
                          f"such calls", RuntimeWarning, stacklevel=3)
        return KERNELS[RULE_KERNEL]

    def may_time(self) -> bool:
        """Whether this call may time kernels or routes (module docstring): a timer, a rank of its own, a plain
        call. A caller that builds inputs only for timing (:meth:`prepare`) builds them only then."""
        # Only a plain call: in a checkpointed forward the timing runs would be saved beside the call's own
        # tensors (and not in its recomputation, which then fails), inside a backward they would nest autograd
        # passes, under a dispatch mode they would be recorded or replayed (module docstring).
        return self.timer is not None and self.times_calls and in_plain_call()

    def _measure(self, bucket: str, candidates: list[ExpertKernel], rows: Tensor, counts: list[int],
                 weights: ExpertWeights) -> str:
        assert self.timer is not None
        sample = sampled_call(rows, counts, weights)
        times = time_in_rounds(self.timer, {k.name: timed_call(k, *sample) for k in candidates})
        return self._decide(bucket, times)

    def _decide(self, bucket: str, times: dict[str, float], rule: str = RULE_KERNEL) -> str:
        """The fastest of ``times`` for ``bucket`` (a tie: ``rule``), kept in memory and in the cache file."""
        name = min(times, key=lambda n: (times[n], n != rule))
        self.decisions[bucket], self.timings[bucket] = name, dict(times)
        self._store(bucket, name, times)
        return name

    # ---- agreeing over ranks ----------------------------------------------------------------------------------

    def share(self, group: Any) -> None:
        """Every rank of ``group`` (a torch.distributed group) takes rank 0's measured table (memory and cache),
        and stops timing calls of its own: ranks route different rows, so they would time different buckets at
        different calls. Collective: every rank calls it (the layer does, at construction)."""
        import torch.distributed as dist

        table = [{**self._read_cache(), **self.decisions}]
        dist.broadcast_object_list(table, src=dist.get_global_rank(group, 0), group=group)
        self.decisions = dict(table[0])
        self._cache = {}  # rank 0's file is in the table; this rank's own is not read
        self.times_calls = False

    def calibrate(self, calls: list[tuple[Tensor, list[int], ExpertWeights]], group: Any = None) -> dict[str, str]:
        """Time every supported kernel on each call ``(rows, counts, weights)`` and keep the fastest per bucket;
        with a torch.distributed ``group`` the times are summed over its ranks first, so that all choose alike
        (collective: every rank calls it with calls of the same buckets). Returns ``{bucket: kernel}``."""
        timer = self.timer or time_kernel
        chosen: dict[str, str] = {}
        for rows, counts, weights in calls:
            case = KernelCase.of(rows, counts, weights)
            candidates = [k.name for k in supported_kernels(case)]
            measured = time_in_rounds(timer, {n: timed_call(KERNELS[n], rows, counts, weights) for n in candidates})
            times = torch.tensor([measured[n] for n in candidates], dtype=torch.float64)
            if group is not None:
                import torch.distributed as dist

                dist.all_reduce(times, group=group)
            chosen[case.bucket()] = self._decide(case.bucket(), dict(zip(candidates, times.tolist())))
        return chosen

    # ---- the cache file ---------------------------------------------------------------------------------------

    def _cached(self, bucket: str) -> str | None:
        return self._read_cache().get(bucket)

    def _read_cache(self) -> dict[str, str]:
        """The cache file's choices when it was written by this torch and flexmoe, else nothing (read once)."""
        if self._cache is None:
            content = None if self.cache_path is None else _load(self.cache_path)
            valid = content is not None and content.get("versions") == _versions()
            known = set(KERNELS) | set(ROUTES)
            choices = content.get("choices", {}) if valid and content is not None else {}
            self._cache = {b: n for b, n in choices.items() if n in known}
        return self._cache

    def _store(self, bucket: str, name: str, times: dict[str, float]) -> None:
        if self.cache_path is None:
            return
        content = _load(self.cache_path)
        if content is None or content.get("versions") != _versions():
            content = {"versions": _versions(), "choices": {}, "seconds": {}}
        content["choices"][bucket] = name
        content["seconds"][bucket] = times
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(content, indent=1, sort_keys=True))
        partial.replace(self.cache_path)  # atomic: a reader sees the old file or the new one


def choose_fused_route(kernels: KernelChooser, bucket: str, x: Tensor, weights: ExpertWeights,
                       run_fused: Callable[[Tensor], Tensor], run_rows: Callable[[Tensor], Tensor],
                       kernel_rows: Callable[[], tuple[Tensor, list[int]]]) -> bool:
    """Whether a call of ``bucket`` takes the fused route rather than the rows route: the one fused-against-rows
    timing, for the layer's expert stage (:class:`~flexmoe.experts.stage.ExpertStage`) and for a token exchange's
    receiving rank (:mod:`flexmoe.parallel.token_exchange`). x: the route's input (``[T, M]`` tokens or
    ``[u, M]`` received rows); run_fused / run_rows: one run of each route on it; kernel_rows: the rows route's
    rows ``[N, M]`` and counts, built only when the rows' kernel is to be timed first.

    A forced route (``kernels.route``) is taken as it is; under a forced kernel, the rows route; else
    :meth:`KernelChooser.choose_route` (memory, cache file, or timed now; the rule: rows). The caller has checked
    that both routes run the call."""
    if kernels.route != "auto" or kernels.kernel != "auto":
        return kernels.route == "fused"
    # The rows route's kernel first, so that its timing is not timed. Only where timing may happen: elsewhere (a
    # checkpointed forward) the rows built for it would be saved, unlike in the recomputation, which knows the
    # bucket by then.
    if kernels.known(bucket) is None and kernels.may_time():
        rows, counts = kernel_rows()
        kernels.prepare(rows, counts, weights)
    # The routes are timed forward only (autograd recording): a whole step each would make a cold cache's first
    # call of a large layer cost three steps; the forward pays the same [N, M] blocks the backward does.
    routes = {"fused": timed_run(run_fused, x, weights, backward=False),
              "rows": timed_run(run_rows, x, weights, backward=False)}
    return kernels.choose_route(bucket, routes, rule="rows") == "fused"


def torch_control_flow(error: BaseException) -> bool:
    """Whether ``error`` is one of torch's own control-flow signals passing through a kernel's run, never a
    kernel's failure: a checkpoint's early stop of its recomputation or its consistency error, or any exception
    of dynamo (graph breaks, tracing restarts)."""
    from torch.utils.checkpoint import CheckpointError, _StopRecomputationError

    if isinstance(error, (_StopRecomputationError, CheckpointError)):
        return True
    dynamo_exc = sys.modules.get("torch._dynamo.exc")  # loaded whenever dynamo has run; not imported for a check
    return dynamo_exc is not None and isinstance(error, dynamo_exc.TorchDynamoException)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def timed_call(kernel: ExpertKernel, rows: Tensor, counts: list[int], weights: ExpertWeights) -> Callable[[], object]:
    """One run of ``kernel`` on these rows as the call will run it (:func:`timed_run`)."""
    return timed_run(lambda x: kernel.run(x, counts, weights), rows, weights)


def timed_run(run: Callable[[Tensor], Tensor], x: Tensor, weights: ExpertWeights,
              backward: bool = True) -> Callable[[], object]:
    """One ``run(x)`` as the call will run it: forward, and when autograd records and ``backward``, the backward to
    ``x`` (a copy) and every weight that wants a gradient (``torch.autograd.grad``: nothing is accumulated into
    ``.grad``). Each run returns once ``x``'s device has finished it (:func:`~flexmoe.device_clock.synchronize`),
    so that a timer around it measures the work, not the kernel launches."""
    work: Callable[[], object]
    if not backward or not weights.needs_grad(x):
        work = partial(run, x)
    else:
        copy = x.detach().requires_grad_(x.requires_grad)
        inputs = [t for t in (copy, *weights.present()) if t.requires_grad]

        def work() -> object:  # forward and backward
            out = run(copy)
            return torch.autograd.grad(out, inputs, torch.ones_like(out), allow_unused=True)

    def finished_run() -> object:
        result = work()
        synchronize(x.device)
        return result

    synchronize(x.device)  # what was queued before the timing must not count in the first run's time
    return finished_run
