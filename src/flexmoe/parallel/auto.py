"""``parallel="auto"``: choose (r, d, all-to-all algorithm) at run time by timing the candidates.

The interface is two pieces a cost model can replace or wrap:

* :func:`candidates` lists every valid :class:`ParallelSetting` for a layer;
* a :class:`Chooser` picks one per forward (``choose``) and hears back how long it took (``record``). Each
  call also gets an :class:`AutoContext`: the layer's shape and this forward's rows per (rank, expert).

:class:`MeasuringChooser` (the layer's default) tries every candidate for ``trials`` forward+backward passes in
each capacity bucket, keeps the fastest, and uses it from then on. Its ``prune`` hook takes the candidate list
(and the context) and returns the ones worth timing. :class:`flexmoe.tuning.ModelGuidedChooser` is that hook
filled by the cost model: the model ranks every candidate for the bucket's real load and only the ``keep`` best
are timed, so the model picks the short list and the clock picks the winner. (The cost model lives in
:mod:`flexmoe.tuning`, which may import this package, never the reverse.)

The ranks agree on the choice: each candidate's time is the slowest rank's (one all-reduce at decision time),
ties go to the earlier candidate, and a pruned short list is rank 0's (broadcast), so every rank picks the
same setting even if their profiles differed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.device_clock import synchronize
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.groups import ExpertGroup

__all__ = ["candidates", "capacity_bucket", "AutoContext", "Chooser", "MeasuringChooser", "StageTimer", "Decision"]

DEFAULT_DEGREES = (1, 2, 4)


def candidates(
    valid_r: Sequence[int],
    world_size: int,
    ranks_per_node: int | None,
    degrees: Sequence[int] = DEFAULT_DEGREES,
    token_exchange: bool = False,
) -> list[ParallelSetting]:
    """Every setting worth trying: each valid r; for r >= 1 each overlap degree and each all-to-all algorithm
    (2dh only when ``ranks_per_node`` splits the group into several multi-rank nodes). r = 0 needs no
    all-to-all, so it appears once. With ``token_exchange`` (whole built-in experts), r = 1 and d = 1 appear
    twice: sending tokens, then sending rows."""
    algos: list[tuple[str, int | None]] = [("flat", None)]
    if ranks_per_node is not None and 1 < ranks_per_node < world_size and world_size % ranks_per_node == 0:
        algos.append(("2dh", ranks_per_node))
    out = []
    for r in valid_r:
        if r == 0:
            out.append(ParallelSetting(0, 1, "flat", None))
            continue
        for d in degrees:
            for a2a, g in algos:
                out.append(ParallelSetting(r, d, a2a, g, token_exchange))
                if token_exchange and r == 1 and d == 1:
                    out.append(ParallelSetting(r, d, a2a, g, False))
    return out


def capacity_bucket(all_counts: list[list[int]]) -> int:
    """The bucket of a forward: the largest per-expert row count over all ranks, rounded up to a power of 2
    (the same on every rank, since every rank sees every rank's counts)."""
    largest = max((max(row, default=0) for row in all_counts), default=0)
    return 1 << max(largest - 1, 0).bit_length()


@dataclass
class Decision:
    """The outcome of tuning one bucket: the chosen setting and the measured seconds of each candidate."""

    bucket: Hashable
    choice: ParallelSetting
    seconds: dict[ParallelSetting, float]

    def describe(self) -> str:
        times = ", ".join(f"{s}: {t * 1e3:.1f} ms" for s, t in sorted(self.seconds.items(), key=lambda kv: kv[1]))
        return f"bucket {self.bucket}: chose {self.choice} ({times})"


@dataclass(frozen=True)
class AutoContext:
    """What a chooser may look at: the layer's shape and the load of the forward that opened the bucket.

    all_counts: ``[W][E]`` rows each source rank sends to each global expert in this forward (after capacity);
        W = ``len(all_counts)`` is the expert-parallel world size.
    hidden_dim: one whole expert's hidden size (before any sharding over ranks).
    dtype: the dtype the experts compute in, e.g. ``torch.float32``.
    """

    eg: ExpertGroup
    all_counts: list[list[int]]
    model_dim: int
    hidden_dim: int
    num_experts: int
    k: int
    dtype: torch.dtype
    glu: bool = False


class Chooser(Protocol):
    """Picks the setting of each forward in auto mode."""

    def choose(self, bucket: Hashable, options: list[ParallelSetting], context: AutoContext) -> ParallelSetting:
        ...

    def record(self, bucket: Hashable, setting: ParallelSetting, seconds: float) -> None: ...


@dataclass
class _Bucket:
    options: list[ParallelSetting]
    times: dict[ParallelSetting, list[float]] = field(default_factory=dict)
    decision: Decision | None = None


Prune = Callable[[list[ParallelSetting], AutoContext], list[ParallelSetting]]


class MeasuringChooser:
    """Time each candidate ``trials`` times per bucket, then keep the fastest (see the module docstring).

    prune: ``(options, context) -> the options worth timing``, called once per bucket (None: time them all).
    """

    def __init__(self, trials: int = 2, prune: Prune | None = None) -> None:
        if trials < 1:
            raise ValueError(f"trials must be >= 1, got {trials}")
        self.trials, self.prune = trials, prune
        self.buckets: dict[Hashable, _Bucket] = {}

    @property
    def decisions(self) -> list[Decision]:
        return [b.decision for b in self.buckets.values() if b.decision is not None]

    def choose(self, bucket: Hashable, options: list[ParallelSetting], context: AutoContext) -> ParallelSetting:
        state = self.buckets.get(bucket)
        if state is None:
            state = self.buckets[bucket] = _Bucket(self._shortlist(list(options), context))
        if state.decision is not None:
            return state.decision.choice
        # Round-robin until every option has `trials` timings (counts are the same on every rank).
        for setting in state.options:
            if len(state.times.get(setting, [])) < self.trials:
                return setting
        state.decision = self._decide(bucket, state, context.eg)
        return state.decision.choice

    def record(self, bucket: Hashable, setting: ParallelSetting, seconds: float) -> None:
        state = self.buckets.get(bucket)
        if state is not None and state.decision is None:
            state.times.setdefault(setting, []).append(seconds)

    def _shortlist(self, options: list[ParallelSetting], context: AutoContext) -> list[ParallelSetting]:
        if self.prune is None or len(options) <= 1:
            return options
        kept = [s for s in self.prune(list(options), context) if s in options]
        if context.eg.distributed:  # rank 0's short list for everyone: the round-robin must match
            index = torch.full((len(options),), -1, dtype=torch.int64)
            index[: len(kept)] = torch.tensor([options.index(s) for s in kept], dtype=torch.int64)
            context.eg.call("auto-tuning short list", lambda: dist.broadcast(
                index, src=context.eg.global_ranks[0], group=context.eg.group))
            kept = [options[i] for i in index.tolist() if i >= 0]
        return kept or options

    def _decide(self, bucket: Hashable, state: _Bucket, eg: ExpertGroup) -> Decision:
        best = torch.tensor([min(state.times[s]) for s in state.options], dtype=torch.float64)
        if eg.distributed:  # every rank ranks the candidates by the slowest rank's time
            eg.call("auto-tuning agreement", lambda: dist.all_reduce(best, op=dist.ReduceOp.MAX, group=eg.group))
        i = int(torch.argmin(best))
        return Decision(bucket, state.options[i], dict(zip(state.options, best.tolist())))


class StageTimer:
    """Times one forward of the expert stage plus its backward, then reports the sum to ``on_done``.

    ``enter(rows)`` and ``leave(out)`` wrap the stage; in the backward the marks fire in reverse. Without a
    backward (inference) the forward time alone is reported when the next measurement starts or on flush.
    """

    def __init__(self, on_done: Callable[[float], None]) -> None:
        self.on_done = on_done
        self.forward = 0.0
        self.backward_start: float | None = None
        self._t0 = 0.0
        self._reported = False
        self.expects_backward = False

    def enter(self, rows: Tensor) -> Tensor:
        synchronize(rows.device)  # on an accelerator, the clock must not run ahead of the queued work
        self._t0 = time.perf_counter()
        return _Mark.apply(rows, self, "enter")

    def leave(self, out: Tensor) -> Tensor:
        synchronize(out.device)
        self.forward = time.perf_counter() - self._t0
        self.expects_backward = out.requires_grad
        if not self.expects_backward:
            self.flush()
        return _Mark.apply(out, self, "leave")

    def _mark_backward(self, where: str, device: torch.device) -> None:
        synchronize(device)
        now = time.perf_counter()
        if where == "leave":  # the stage's backward starts at its output
            self.backward_start = now
        elif self.backward_start is not None and not self._reported:
            self._reported = True
            self.on_done(self.forward + now - self.backward_start)

    def flush(self) -> None:
        """Report the forward time if no backward ever came."""
        if not self._reported:
            self._reported = True
            self.on_done(self.forward)


class _Mark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, timer: StageTimer, where: str) -> Tensor:
        ctx.timer, ctx.where = timer, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.timer._mark_backward(ctx.where, grad.device)
        return grad, None, None
