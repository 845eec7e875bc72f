"""Running the experts of one layer over an expert-parallel group.

Input: this rank's expert rows ``[N, M]`` sorted by global expert, with per-expert counts ``[E]`` (the local
plan's ``counts``). Output: ``[N, M]``, row n being expert ``row_expert[n]`` applied to row n, exactly what a
single process holding all experts computes. How the work is spread is a :class:`ParallelSetting`:

* ``r`` (adaptive parallelism, docs/architecture.md "Experts over ranks"), with s = shards per expert and g = s / r:
  - ``r = 0``: every rank gathers all experts' weights and computes its own rows; no all-to-all.
  - ``r >= 1`` (r divides s): the s ranks of an expert form g replica groups of r ranks; a group's ranks
    hold r hidden pieces of the expert (each gathered from g consecutive shards when g > 1). Source rank
    ``src`` sends its rows of expert e to the group ``src % g``, replicated to its r ranks; each computes a
    partial FFN over its piece and the partial results are summed back at the source.
    ``r = s`` keeps the weights sharded (model-parallel); ``r = 1`` gathers whole experts (data-parallel).
    With whole experts (s = 1) ``r = 1`` is plain expert parallelism.
* ``overlap_degree`` d: chunks pipelined by :mod:`flexmoe.parallel.overlap`.
* ``a2a``: "flat" or "2dh" (:mod:`flexmoe.parallel.alltoall`), ``ranks_per_node`` for 2dh.

With whole built-in experts, ``r = 1`` and ``d = 1`` the layer sends tokens instead of rows (:meth:`run_tokens`,
:mod:`flexmoe.parallel.token_exchange`): each token once per rank holding one of its experts, the weighted sum
of its experts there coming back.

The layout of parameters never changes with the setting (:mod:`flexmoe.parallel.layout`), so any setting may
be used at any call. Gradients: every expert parameter receives the sum over all ranks' rows (each rank's
loss differentiated through the exchanges), the same on every rank holding a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.autograd_state import autocast_on
from flexmoe.experts import FeedForwardExperts, differentiated_weights
from flexmoe.experts.weights import WEIGHT_NAMES
from flexmoe.parallel.alltoall import CommStats, Exchange, HostCopy, SplitMatrix, make_exchange, transpose
from flexmoe.parallel.groups import ExpertGroup
from flexmoe.parallel.layout import HIDDEN_DIM, ExpertLayout
from flexmoe.parallel.overlap import pipelined_exchange
from flexmoe.parallel.token_exchange import TokenRoute, exchange_tokens
from flexmoe.parallel.weights import gather_from_peers, replica_grad

__all__ = ["ParallelSetting", "ExpertParallel", "split_evenly", "permute_rows"]


def permute_rows(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """``x[order]`` for a permutation ``order`` of x's rows (``inverse`` its inverse: ``order[inverse[i]] == i``):
    ``[n, M]`` -> ``[n, M]``. Its backward is the gather ``grad[inverse]``, where ``index_select``'s would fill
    a zero ``[n, M]`` tensor and scatter-add into it. The caller vouches that ``order`` is a permutation."""
    return _PermuteRows.apply(x, order, inverse)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass(frozen=True)
class ParallelSetting:
    """How one forward spreads the expert work (see the module docstring)."""

    r: int = 1
    overlap_degree: int = 1
    a2a: str = "flat"
    ranks_per_node: int | None = None
    # At r = 1, d = 1 over whole built-in experts: send tokens (:meth:`ExpertParallel.run_tokens`), else rows.
    token_exchange: bool = True

    def __str__(self) -> str:
        algo = f"2dh/{self.ranks_per_node}" if self.a2a == "2dh" else self.a2a
        rows = " rows" if self.r == 1 and self.overlap_degree == 1 and not self.token_exchange else ""
        return f"r={self.r} d={self.overlap_degree} a2a={algo}{rows}"


def split_evenly(n: int, d: int) -> list[int]:
    """``n`` rows cut into ``d`` pieces whose sizes differ by at most one (larger pieces first)."""
    q, rem = divmod(n, d)
    return [q + (1 if i < rem else 0) for i in range(d)]


@dataclass
class _Route:
    """The exchange of one forward, per chunk: what this rank sends and how it orders what it receives."""

    send_index: list[Tensor]      # per chunk: [n_c] rows of the local input, in destination order
    splits: list[SplitMatrix]     # per chunk: W x W rows
    to_expert_order: list[Tensor]  # per chunk: received (source, local expert) order -> (local expert, source)
    from_expert_order: list[Tensor]  # its inverse
    local_counts: list[list[int]]  # per chunk: rows per local expert after reordering
    # One chunk sending every local row once, in order (r = 1, d = 1): the rows go out and come back as they are.
    send_in_order: bool = False


class ExpertParallel:
    """The experts of one layer spread over ``eg`` per ``layout``; :meth:`run` computes expert rows."""

    def __init__(self, eg: ExpertGroup, layout: ExpertLayout, experts: nn.Module) -> None:
        self.eg, self.layout, self.experts = eg, layout, experts
        self.builtin = isinstance(experts, FeedForwardExperts)
        self.stats = CommStats()
        self._transports: dict[tuple[str, int | None], Exchange] = {}

    # ---- settings -------------------------------------------------------------------------------------

    def valid_r(self) -> list[int]:
        """The r this group may run with (:func:`flexmoe.parallel.layout.valid_r`)."""
        return self.layout.valid_r(self.builtin)

    def check(self, setting: ParallelSetting) -> None:
        if setting.r not in self.valid_r():
            why = "" if self.builtin else " (r=0 needs the built-in FeedForwardExperts)"
            raise ValueError(
                f"r={setting.r} is not valid for {self.layout.num_experts} experts over {self.eg.world_size} "
                f"ranks ({self.layout.shards_per_expert} shard(s) per expert); valid r: {self.valid_r()}{why}"
            )
        if isinstance(setting.overlap_degree, bool) or not isinstance(setting.overlap_degree, int) \
                or setting.overlap_degree < 1:
            raise ValueError(f"overlap_degree must be an int >= 1, got {setting.overlap_degree!r}")
        self.transport(setting)  # validates a2a and ranks_per_node

    def transport(self, setting: ParallelSetting) -> Exchange:
        key = (setting.a2a, setting.ranks_per_node if setting.a2a == "2dh" else None)
        if key not in self._transports:
            self._transports[key] = make_exchange(self.eg, setting.a2a, setting.ranks_per_node)
        return self._transports[key]

    # ---- counts ---------------------------------------------------------------------------------------

    def gather_counts(self, counts: list[int] | Tensor, device: torch.device | str = "cpu") -> list[list[int]]:
        """Every rank's per-expert row counts, ``[W][E]`` (one small all-gather; the same on every rank).

        counts: ``[E]`` this rank's (or any ``[C]`` ints per rank), as Python ints or a tensor; device: where
        they are exchanged (the rows' device; a tensor's own). The split sizes of the exchanges come from here:
        the one read of the host (:class:`~flexmoe.parallel.alltoall.HostCopy`), not one per rank."""
        return self.start_gather_counts(counts, device).tolist()

    def start_gather_counts(self, counts: list[int] | Tensor, device: torch.device | str = "cpu") -> HostCopy:
        """:meth:`gather_counts`, its host copy started but not yet read (``.tolist()`` reads it)."""
        mine = counts.to(torch.long) if isinstance(counts, Tensor) else \
            torch.tensor(counts, dtype=torch.long, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.eg.world_size)]
        self.eg.call("expert-count exchange", lambda: dist.all_gather(parts, mine, group=self.eg.group))
        return HostCopy(torch.stack(parts))  # [W, C]: one copy to the host for all ranks' counts

    # ---- the forward ----------------------------------------------------------------------------------

    def run(self, rows: Tensor, counts: list[int], all_counts: list[list[int]], setting: ParallelSetting) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert, counts: ``[E]``, all_counts: :meth:`gather_counts`.
        Returns ``[N, M]``: each row's expert output."""
        if setting.r == 0:
            return self._run_gathered(rows, counts)
        route = self._route(all_counts, setting)
        weights, keep = self._piece_weights(setting.r)
        # In order, the gather and the scatter-add back would each copy all rows for nothing (and their
        # backwards again). With permute_rows below: 0.90 of the 4-rank E=64 step (docs/architecture.md,
        # "The rows around the exchange").
        send = [rows] if route.send_in_order else [rows.index_select(0, idx) for idx in route.send_index]

        def compute(c: int, received: Tensor) -> Tensor:
            local = permute_rows(received, route.to_expert_order[c], route.from_expert_order[c])
            if weights is None:
                out = self.experts(local, route.local_counts[c])
            else:
                out = self._builtin_experts().ffn_with(local, route.local_counts[c], weights)
            if not out.requires_grad and torch.is_grad_enabled():
                # No rows here: still join the gradient exchange (every rank must run the same collectives),
                # also when the gradient reaches it only through the other ranks' expert weights (rows that
                # need no gradient, e.g. an input without requires_grad).
                anchor = received if received.requires_grad else _first_trainable(self.experts)
                if anchor is not None:
                    out = out + anchor.reshape(-1)[:0].sum().to(out.dtype)
            return permute_rows(out, route.from_expert_order[c], route.to_expert_order[c])

        back = pipelined_exchange(send, route.splits, compute, [transpose(s) for s in route.splits],
                                  self.transport(setting), self.stats)
        if route.send_in_order:
            out = back[0].to(rows.dtype)
        else:
            out = rows.new_zeros(rows.shape)
            for idx, b in zip(route.send_index, back):
                out = out.index_add(0, idx, b.to(out.dtype))  # sums the r partial results of replicated rows
        return _keep_in_graph(out, keep)

    # ---- r = 1, d = 1: each token once per rank -------------------------------------------------------------

    @property
    def can_send_tokens(self) -> bool:
        """Whether any call may send tokens: whole built-in experts."""
        return self.layout.shards_per_expert == 1 and self.builtin

    def serves_tokens(self, setting: ParallelSetting, tokens: Tensor) -> bool:
        """Whether a call at ``setting`` sends tokens (:meth:`run_tokens`): its ``token_exchange`` with r = 1 and
        d = 1 over whole built-in experts, the tokens in the experts' dtype and device, no autocast."""
        if not (setting.token_exchange and setting.r == 1 and setting.overlap_degree == 1 and self.can_send_tokens):
            return False
        w1 = self._builtin_experts().w1
        return (w1.dtype == tokens.dtype and w1.device == tokens.device
                and not autocast_on(tokens))

    def run_tokens(self, tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int] | Tensor,
                   setting: ParallelSetting, route: TokenRoute | None = None) -> Tensor:
        """tokens: ``[T, M]``; row_token / row_weight: ``[N]`` a plan's rows, sorted by global expert, counts
        ``[E]`` (Python ints, or a tensor on the tokens' device, not read); route: their route when the caller
        exchanged the counts already (:func:`~flexmoe.parallel.token_exchange.route_from_counts`) -> ``[T, M]``:
        each token's weighted sum over its experts, where :meth:`serves_tokens` holds."""
        self.check(setting)
        return exchange_tokens(tokens, row_token, row_weight.to(tokens.dtype), counts, self._builtin_experts(),
                               self.eg, self.transport(setting), self.stats, route)

    # ---- r >= 1: who sends what where --------------------------------------------------------------------

    def _served(self, dst: int, src: int, g: int) -> list[int]:
        """The global experts whose rows ``src`` sends to ``dst`` (in dst's local order)."""
        lay = self.layout
        if lay.shards_per_expert == 1:
            return list(lay.experts_of_rank(dst))
        return [lay.experts_of_rank(dst)[0]] if dst % g == src % g else []

    def _route(self, all_counts: list[list[int]], setting: ParallelSetting) -> _Route:
        W, me, d = self.eg.world_size, self.eg.rank, setting.overlap_degree
        g = self.layout.shards_per_expert // setting.r
        E_local = self.layout.experts_per_rank
        # pieces[src][e] = sizes of expert e's rows of src in each chunk.
        pieces = [[split_evenly(n, d) for n in row] for row in all_counts]
        starts = [0]
        for n in all_counts[me]:
            starts.append(starts[-1] + n)
        send_index, splits, to_order, from_order, local_counts = [], [], [], [], []
        in_order_end = 0  # the rows sent so far form 0 .. in_order_end, in order (-1: they do not)
        for c in range(d):
            S = [[sum(pieces[src][e][c] for e in self._served(dst, src, g)) for dst in range(W)]
                 for src in range(W)]
            idx = []
            for dst in range(W):
                for e in self._served(dst, me, g):
                    offset = starts[e] + sum(pieces[me][e][:c])
                    idx.append(torch.arange(offset, offset + pieces[me][e][c]))
                    in_order_end = in_order_end + pieces[me][e][c] if offset == in_order_end else -1
            send_index.append(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long))
            # Received blocks: by source, then by my local expert; the experts want local expert, then source.
            block = [[0] * E_local for _ in range(W)]
            for src in range(W):
                for j, e in enumerate(self._served(me, src, g)):
                    block[src][j] = pieces[src][e][c]
            block_start, pos = [[0] * E_local for _ in range(W)], 0
            for src in range(W):
                for j in range(E_local):
                    block_start[src][j] = pos
                    pos += block[src][j]
            perm = [torch.arange(block_start[src][j], block_start[src][j] + block[src][j])
                    for j in range(E_local) for src in range(W)]
            perm_t = torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long)
            inverse = torch.empty_like(perm_t)
            inverse[perm_t] = torch.arange(perm_t.numel())
            splits.append(S)
            to_order.append(perm_t)
            from_order.append(inverse)
            local_counts.append([sum(block[src][j] for src in range(W)) for j in range(E_local)])
        send_in_order = d == 1 and in_order_end == starts[-1]
        return _Route(send_index, splits, to_order, from_order, local_counts, send_in_order)

    # ---- weights ------------------------------------------------------------------------------------------

    def _builtin_experts(self) -> FeedForwardExperts:
        # Only the built-in experts are sharded (the layer refuses a custom module that would be) or gathered
        # (r = 0 is not in valid_r() for a custom module), so the weight-level paths always have them.
        assert isinstance(self.experts, FeedForwardExperts)
        return self.experts

    def _local_params(self) -> dict[str, Tensor | None]:
        return {name: getattr(self.experts, name, None) for name in WEIGHT_NAMES}

    @staticmethod
    def _present(params: dict[str, Tensor | None], names: list[str]) -> list[Tensor]:
        """The tensors of ``names`` (chosen among the parameters that are not None)."""
        present = [params[n] for n in names]
        return [t for t in present if t is not None]

    def _piece_weights(self, r: int) -> tuple[dict[str, Tensor | None] | None, list[Tensor]]:
        """The weights this rank computes with for r >= 1 (None: call the expert module itself), and the
        tensors whose backward is a collective (they must stay in every rank's graph)."""
        lay, eg = self.layout, self.eg
        s = lay.shards_per_expert
        if s == 1:
            return None, []
        params = self._local_params()
        keep: list[Tensor] = []
        first = (eg.rank // s) * s
        shard_peers = list(range(first, first + s))
        if params["b2"] is not None:
            params["b2"] = replica_grad(params["b2"], eg, shard_peers)
            keep.append(params["b2"])
        g = s // r
        q = (eg.rank % s) // g  # which of the r hidden pieces this rank computes
        if g > 1:
            base = first + q * g
            names = [n for n in WEIGHT_NAMES if n != "b2" and params[n] is not None]
            shards = gather_from_peers(torch.cat([t.reshape(-1) for t in self._present(params, names)]), eg,
                                       list(range(base, base + g)))
            keep.append(shards[0])
            for n, full in self._unflatten(names, shards).items():
                params[n] = torch.cat(full, dim=_hidden_dim(n))
        if q != 0:
            params["b2"] = None  # the bias is added once, by piece 0 of each replica group
        return params, keep

    def _unflatten(self, names: list[str], flats: list[Tensor]) -> dict[str, list[Tensor]]:
        """Split each gathered flat buffer back into the named local-shaped parameters."""
        local = self._present(self._local_params(), names)
        sizes = [p.numel() for p in local]
        out: dict[str, list[Tensor]] = {n: [] for n in names}
        for flat in flats:
            for n, p, t in zip(names, local, flat.split(sizes)):
                out[n].append(t.view_as(p))
        return out

    def _run_gathered(self, rows: Tensor, counts: list[int]) -> Tensor:
        """r = 0: gather every expert's weights on every rank and compute the local rows here."""
        lay, eg = self.layout, self.eg
        s, W = lay.shards_per_expert, eg.world_size
        params = self._local_params()
        if s > 1 and params["b2"] is not None:
            first = (eg.rank // s) * s
            params["b2"] = replica_grad(params["b2"], eg, list(range(first, first + s)))
        names = [n for n in WEIGHT_NAMES if params[n] is not None]
        flats = gather_from_peers(torch.cat([t.reshape(-1) for t in self._present(params, names)]), eg,
                                  list(range(W)))
        per_rank = self._unflatten(names, flats)
        full: dict[str, Tensor | None] = {n: None for n in WEIGHT_NAMES}
        for n in names:
            if s == 1:
                full[n] = torch.cat(per_rank[n], dim=0)
            elif HIDDEN_DIM[n] is None:  # b2: shard 0's copy of each expert
                full[n] = torch.cat([per_rank[n][e * s] for e in range(lay.num_experts)], dim=0)
            else:
                full[n] = torch.cat([torch.cat(per_rank[n][e * s:(e + 1) * s], dim=_hidden_dim(n))
                                     for e in range(lay.num_experts)], dim=0)
        keep = [flats[0]] + ([params["b2"]] if s > 1 and params["b2"] is not None else [])
        return _keep_in_graph(self._builtin_experts().ffn_with(rows, counts, full), keep)


def _hidden_dim(name: str) -> int:
    """The hidden dimension of a hidden-sharded parameter (every one but the replicated b2)."""
    dim = HIDDEN_DIM[name]
    if dim is None:
        raise ValueError(f"{name} is replicated across shards, it has no hidden dimension")
    return dim


def _first_trainable(module: nn.Module) -> Tensor | None:
    return next(iter(differentiated_weights(module)), None)


def _keep_in_graph(out: Tensor, tensors: list[Tensor]) -> Tensor:
    """``out`` plus an empty slice of each tensor: the same value, but every rank's backward now reaches the
    collectives behind ``tensors`` even when it had no rows for them (ranks must run the same collectives)."""
    for t in tensors:
        if t.requires_grad and torch.is_grad_enabled():
            out = out + t.reshape(-1)[:0].sum().to(out.dtype)
    return out
