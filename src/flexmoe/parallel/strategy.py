"""How a layer's experts run: one strategy object, chosen when the layer is built.

Every strategy takes this rank's expert rows ``rows: [N, M]`` sorted by global expert with ``counts: [E]`` rows
per expert, and returns ``[N, M]``: row n through expert ``row_expert[n]``, exactly what one process holding all
experts computes. Before dispatching rows the layer offers the call's tokens and plan to ``run_tokens``: the
all-to-all strategies send tokens instead where the setting is r = 1, d = 1 over whole built-in experts
(:mod:`flexmoe.parallel.token_exchange`), and return the combined ``[T, M]``; ``parallel="auto"`` takes every
such call (rows through the layer's dispatch and combine, so that each candidate is timed over the same span);
every other case returns None.

* :class:`LocalExperts`: one process holds every expert; the rows go straight through the expert module.
* :class:`AllToAllExperts`: expert parallelism with a static :class:`ParallelSetting` (r, overlap degree,
  all-to-all algorithm): :class:`~flexmoe.parallel.expert_parallel.ExpertParallel`.
* :class:`PairwiseExperts`: FasterMoE's pairwise schedule (:mod:`flexmoe.parallel.pairwise`).
* :class:`AutoExperts`: ``parallel="auto"``: a :class:`~flexmoe.parallel.auto.Chooser` picks the setting of
  each call; the stage is timed so the chooser learns.
* :class:`~flexmoe.parallel.replicas.ReplicatedExperts`: ``redundant_experts=R``: R replica slots per rank
  copying hot experts, each expert's rows split among its holders.
* :class:`ShadowedExperts` wraps any of the three expert-parallel ones: the hot experts a
  :class:`~flexmoe.parallel.ShadowPolicy` picks are computed locally on broadcast weights, the other rows go
  through the wrapped strategy.

:func:`build_strategy` picks one from :class:`~flexmoe.parallel.options.ParallelOptions`. A call's options may
differ from the layer's (``moe(x, r=2)``); ``pinned`` names the options the call gave explicitly (with
``parallel="auto"`` they narrow the candidates). A new transport is a new strategy class here plus its case in
:func:`build_strategy` (docs/architecture.md, "Where new things go").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from flexmoe.experts import FeedForwardExperts
from flexmoe.parallel.auto import AutoContext, Chooser, MeasuringChooser, StageTimer, candidates, capacity_bucket
from flexmoe.parallel.expert_parallel import ExpertParallel, ParallelSetting
from flexmoe.parallel.layout import ExpertLayout
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.pairwise import check_pairwise, run_pairwise
from flexmoe.parallel.replicas import ReplicatedExperts, check_replicas_supported
from flexmoe.parallel.shadow import ShadowContext, ShadowPolicy, check_shadow_supported, choose_experts, run_shadowed
from flexmoe.parallel.token_exchange import local_route, route_from_counts

__all__ = ["LayerShape", "RowsPath", "ExpertStrategy", "LocalExperts", "AllToAllExperts", "PairwiseExperts",
           "AutoExperts", "ShadowedExperts", "build_strategy", "check_parallel_options"]

NOTHING_PINNED: frozenset[str] = frozenset()
# The caller's rows path for run_tokens: (tokens [T, M], run_rows: rows [N, M] -> [N, M]) -> [T, M].
RowsPath = Callable[[Tensor, Callable[[Tensor], Tensor]], Tensor]


@dataclass(frozen=True)
class LayerShape:
    """What the choosers and shadow policies may know of the layer: its sizes (hidden_dim of a whole expert)."""

    model_dim: int
    hidden_dim: int
    num_experts: int
    k: int
    glu: bool = False


class ExpertStrategy(Protocol):
    """Runs the experts of one call (see the module docstring)."""

    last_shadowed: list[int]

    @property
    def last_choice(self) -> ParallelSetting | None:
        """The setting of the last call (None before the first, or without expert parallelism)."""

    def run(self, rows: Tensor, counts: list[int], options: ParallelOptions,
            pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor: ...

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        """tokens: ``[T, M]``, a plan's rows (``row_token`` / ``row_weight``: ``[N]`` sorted by expert, counts
        ``[E]``) -> ``[T, M]`` each token's weighted sum over its experts, when this strategy takes the call:
        sending tokens (:mod:`flexmoe.parallel.token_exchange`), or (``parallel="auto"``, which times every
        candidate over the same span) rows through ``rows_path(tokens, run_rows)``, the caller's dispatch,
        ``run_rows`` and combine. None: the caller dispatches rows and calls :meth:`run`."""


class LocalExperts:
    """Every expert in this process (no expert-parallel group): the parallel options have nothing to change."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts
        self.last_choice: ParallelSetting | None = None
        self.last_shadowed: list[int] = []

    def run(self, rows: Tensor, counts: list[int], options: ParallelOptions,
            pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        return self.experts(rows, counts)

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        return None


class _GroupStrategy:
    """A strategy over an expert-parallel group: gathers every rank's counts, then :meth:`run_counted`."""

    def __init__(self, ep: ExpertParallel) -> None:
        self.ep = ep
        self.last_choice: ParallelSetting | None = None
        self.last_shadowed: list[int] = []

    def run(self, rows: Tensor, counts: list[int], options: ParallelOptions,
            pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        return self.run_counted(rows, counts, self.ep.gather_counts(counts, rows.device), options, pinned)

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        return None  # rows (pairwise schedule)

    def run_counted(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], options: ParallelOptions,
                    pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        """rows and counts as :meth:`run`; all_counts: ``[W][E]`` every rank's counts (already gathered)."""
        raise NotImplementedError


class AllToAllExperts(_GroupStrategy):
    """Expert parallelism with the static setting of the options (r, overlap_degree, a2a, ranks_per_node)."""

    def run_counted(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], options: ParallelOptions,
                    pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        setting = options.setting
        self.ep.check(setting)
        self.last_choice = setting
        return self.ep.run(rows, counts, all_counts, setting)

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        setting = options.setting
        if not self.ep.serves_tokens(setting, tokens):
            return None
        self.last_choice = setting
        return self.ep.run_tokens(tokens, row_token, row_weight, counts, setting)

    def run_device_counts(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: Tensor,
                          options: ParallelOptions, rows_path: RowsPath, send_tokens: bool) -> tuple[Tensor, bool]:
        """A call whose plan left its counts on the device (``counts``: ``[E]``, never read here; ``row_token`` /
        ``row_weight``: ``[N]`` its rows sorted by expert): ``[T, M]`` and whether tokens were sent.

        The call's one host read is the split sizes: every rank's counts, all-gathered on the device, their copy
        to the host started before anything else runs and read where the first exchange needs it. Sending tokens
        (``send_tokens`` and :meth:`~ExpertParallel.serves_tokens`), :func:`~flexmoe.parallel.token_exchange.
        token_route` gathers them with the tokens per destination; sending rows, the gather starts before
        ``rows_path`` (the caller's dispatch, the experts, combine) dispatches, and every host number of the
        exchange (this rank's counts, the splits, the rows per local expert) comes from that one read."""
        setting = options.setting
        self.ep.check(setting)
        self.last_choice = setting
        if send_tokens and self.ep.serves_tokens(setting, tokens):
            return self.ep.run_tokens(tokens, row_token, row_weight, counts, setting), True
        gathered = self.ep.start_gather_counts(counts)  # [W, E], in flight while the rows are dispatched

        def run_rows(rows: Tensor) -> Tensor:
            all_counts = gathered.tolist()  # the read
            return self.ep.run(rows, all_counts[self.ep.eg.rank], all_counts, setting)

        return rows_path(tokens, run_rows), False

    def run_padded(self, rows: Tensor, capacity: int, options: ParallelOptions) -> Tensor:
        """rows: ``[E * C, M]`` a padded plan's, every expert ``capacity`` (C) rows, the empty ones included ->
        ``[E * C, M]``, each row through its expert. Every rank sends each expert exactly C rows (the same C on
        every rank: a capacity given as a number), so the split sizes are known before routing and the exchange
        reads nothing from the device; the experts compute the empty rows too, which no pair reads back."""
        setting = options.setting
        self.ep.check(setting)
        self.last_choice = setting
        counts = [capacity] * self.ep.layout.num_experts
        return self.ep.run(rows, counts, [counts] * self.ep.eg.world_size, setting)


class PairwiseExperts(_GroupStrategy):
    """The exchange as W-1 pairwise steps overlapping the expert compute (FasterMoE's smart schedule)."""

    def run_counted(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], options: ParallelOptions,
                    pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        check_pairwise(self.ep.layout, options.r, options.overlap_degree, options.a2a, options.parallel)
        self.last_choice = options.setting
        return run_pairwise(self.ep.eg, self.ep.layout, self.ep.experts, rows, all_counts)


class AutoExperts(_GroupStrategy):
    """``parallel="auto"``: the chooser picks each call's setting per capacity bucket; the options the call
    pinned (r, overlap_degree, a2a) narrow the candidates."""

    def __init__(self, ep: ExpertParallel, chooser: Chooser, shape: LayerShape) -> None:
        super().__init__(ep)
        self.chooser, self.shape = chooser, shape
        self._pending_timer: StageTimer | None = None

    def run_counted(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], options: ParallelOptions,
                    pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        bucket, setting = self._choose(all_counts, rows.dtype, options, pinned)
        return self._timed_rows(rows, counts, all_counts, bucket, setting)

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        # One all-gather for the chooser and the token exchange both: each rank's per-expert counts and, when
        # tokens may be sent, how many tokens it sends each rank (each all-gather waits for the slowest rank).
        local = (local_route(row_token, counts, tokens.shape[0], self.ep.eg.world_size)
                 if options.token_exchange and self.ep.can_send_tokens else None)
        mine = torch.tensor(counts, dtype=torch.long, device=tokens.device)
        gathered = self.ep.gather_counts(mine if local is None else torch.cat([mine, local.tokens_to]))
        all_counts = [row[:len(counts)] for row in gathered]
        bucket, setting = self._choose(all_counts, tokens.dtype, options, pinned)
        # Every candidate is timed from the tokens to the combined output: sending rows needs the dispatch and
        # combine that sending tokens replaces, so timing the exchange alone would favour rows.
        timer = self._timer(bucket, setting)
        marked = timer.enter(tokens)
        if local is not None and self.ep.serves_tokens(setting, tokens):
            route = route_from_counts(local, [row[len(counts):] for row in gathered], all_counts)
            y = self.ep.run_tokens(marked, row_token, row_weight, counts, setting, route)
        else:
            y = rows_path(marked, lambda rows: self.ep.run(rows, counts, all_counts, setting))
        return timer.leave(y)

    def _choose(self, all_counts: list[list[int]], dtype: torch.dtype, options: ParallelOptions,
                pinned: AbstractSet[str]) -> tuple[tuple, ParallelSetting]:
        """This call's capacity bucket and setting: the chooser's pick among the candidates the call allows."""
        if self._pending_timer is not None:
            self._pending_timer.flush()
        r = options.r if "r" in pinned else None
        overlap_degree = options.overlap_degree if "overlap_degree" in pinned else None
        a2a = options.a2a if "a2a" in pinned else None
        g = options.ranks_per_node
        valid = self.ep.valid_r()
        tokens = options.token_exchange and self.ep.can_send_tokens
        settings = [s for s in candidates(valid, self.ep.eg.world_size, g, token_exchange=tokens)
                    if (r is None or s.r == r) and (overlap_degree is None or s.overlap_degree == overlap_degree)
                    and (a2a is None or s.a2a == a2a)]
        if not settings:
            raise ValueError(f"parallel='auto' has no candidate with r={r}, overlap_degree={overlap_degree}, "
                             f"a2a={a2a!r}; valid r: {valid}")
        bucket = (capacity_bucket(all_counts), torch.is_grad_enabled(), r, overlap_degree, a2a, g)
        shape = self.shape
        context = AutoContext(self.ep.eg, all_counts, shape.model_dim, shape.hidden_dim, shape.num_experts, shape.k,
                              dtype, shape.glu)
        setting = self.chooser.choose(bucket, settings, context)
        self.last_choice = setting
        return bucket, setting

    def _timer(self, bucket: tuple, setting: ParallelSetting) -> StageTimer:
        """Times this call's expert stage, forward and backward, for the chooser's record of ``setting``."""
        timer = StageTimer(lambda seconds: self.chooser.record(bucket, setting, seconds))
        self._pending_timer = timer
        return timer

    def _timed_rows(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], bucket: tuple,
                    setting: ParallelSetting) -> Tensor:
        timer = self._timer(bucket, setting)
        return timer.leave(self.ep.run(timer.enter(rows), counts, all_counts, setting))


class ShadowedExperts:
    """Shadowing around another expert-parallel strategy: each call the policy picks hot experts, their owners
    broadcast the weights, every rank computes its own rows of them, the rest goes through ``inner``."""

    def __init__(self, inner: _GroupStrategy, policy: ShadowPolicy, shape: LayerShape) -> None:
        check_shadow_supported(inner.ep.layout, inner.ep.experts)
        self.inner, self.policy, self.shape = inner, policy, shape
        self.last_shadowed: list[int] = []

    @property
    def last_choice(self) -> ParallelSetting | None:
        return self.inner.last_choice

    def run(self, rows: Tensor, counts: list[int], options: ParallelOptions,
            pinned: AbstractSet[str] = NOTHING_PINNED) -> Tensor:
        ep = self.inner.ep
        all_counts = ep.gather_counts(counts, rows.device)
        self.last_shadowed = self._choose(all_counts, options)
        if not self.last_shadowed:
            return self.inner.run_counted(rows, counts, all_counts, options, pinned)
        run_rest = functools.partial(self.inner.run_counted, options=options, pinned=pinned)
        experts = ep.experts
        assert isinstance(experts, FeedForwardExperts)  # check_shadow_supported in __init__
        return run_shadowed(experts, ep.eg, ep.layout, rows, counts, all_counts, self.last_shadowed, run_rest)

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   options: ParallelOptions, pinned: AbstractSet[str], rows_path: RowsPath) -> Tensor | None:
        return None  # the shadowed experts' rows are split from the rest before the exchange

    def _choose(self, all_counts: list[list[int]], options: ParallelOptions) -> list[int]:
        if options.r == 0:
            return []  # r=0 already gives every rank every expert
        experts = self.inner.ep.experts
        dtype = next((p.dtype for p in experts.parameters()), torch.float32)
        context = ShadowContext(
            self.inner.ep.layout, self.shape.model_dim, self.shape.hidden_dim, self.shape.k, dtype,
            glu=self.shape.glu, a2a=options.a2a, ranks_per_node=options.ranks_per_node,
            overlap_degree=options.overlap_degree,
        )
        return choose_experts(self.policy, all_counts, context)


def check_parallel_options(options: ParallelOptions, layout: ExpertLayout, experts: nn.Module,
                           ep: ExpertParallel | None) -> None:
    """The checks that need the layout and the expert module (at construction, on every rank)."""
    if options.redundant_experts:
        check_replicas_supported(options, ep, experts)
    if options.schedule == "pairwise":
        check_pairwise(layout, options.r, options.overlap_degree, options.a2a, options.parallel)
    if options.shadow_policy is not None:
        check_shadow_supported(layout, experts)
    if ep is not None:
        ep.check(options.setting)


def build_strategy(options: ParallelOptions, ep: ExpertParallel | None, experts: nn.Module, shape: LayerShape,
                   chooser: Chooser | None = None,
                   reuse: dict[tuple[str, str], _GroupStrategy | ReplicatedExperts] | None = None) -> ExpertStrategy:
    """The strategy for ``options``: local without a group, else pairwise / auto / all-to-all, wrapped for
    shadowing when the options name a policy. ``reuse`` keeps the unwrapped strategies by (schedule, parallel)
    so that a call switching back finds its state (the auto chooser's timings) again."""
    if ep is None:
        return LocalExperts(experts)
    if options.redundant_experts:
        # One per layer and R: it holds the placement and load window, which a call's other options keep.
        key = ("replicas", str(options.redundant_experts))
        replicated = None if reuse is None else reuse.get(key)
        if not isinstance(replicated, ReplicatedExperts):
            replicated = ReplicatedExperts(ep, options.redundant_experts)
            if reuse is not None:
                reuse[key] = replicated
        return replicated
    key = (options.schedule, options.parallel)
    kept = None if reuse is None else reuse.get(key)
    inner = kept if isinstance(kept, _GroupStrategy) else None
    if inner is None:
        if options.schedule == "pairwise":
            inner = PairwiseExperts(ep)
        elif options.parallel == "auto":
            inner = AutoExperts(ep, chooser if chooser is not None else MeasuringChooser(), shape)
        else:
            inner = AllToAllExperts(ep)
        if reuse is not None:
            reuse[key] = inner
    policy = options.shadow_policy
    return inner if policy is None else ShadowedExperts(inner, policy, shape)
