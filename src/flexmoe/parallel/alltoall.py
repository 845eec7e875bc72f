"""All-to-all exchanges of rows: flat and 2-D hierarchical, asynchronous, differentiable.

An exchange moves the rows of ``x: [n, ...]`` between the W ranks of an :class:`ExpertGroup` according to a
*split matrix* ``S`` (W x W ints, the same on every rank): rank ``a`` sends ``S[a][b]`` rows to rank ``b``.
``x`` lists the rows for rank 0 first, then rank 1, ...; the result lists the rows received from rank 0 first,
then rank 1, ... The backward pass is the same exchange with ``S`` transposed.

Two algorithms give identical results:

* ``"flat"``: one ``all_to_all_single`` over the group (W - 1 messages per rank).
* ``"2dh"``: the ranks as N nodes x G local ranks (``rank = node * G + local``). Stage 1 exchanges inside the
  node (each rank collects what its node sends to the ranks of its local index); stage 2 exchanges between
  nodes among the ranks of one local index. (G - 1) + (N - 1) larger messages instead of W - 1.

Exchanges are *staged*: :meth:`Exchange.launch` starts stage 1 asynchronously and returns at once;
:meth:`PendingExchange.advance` waits for the current stage and launches the next one; ``finish`` returns the
rows. Every rank launches and waits at the same program points, so the collectives of all ranks are issued in
the same order (which gloo and NCCL require). :func:`start_exchange` / :func:`finish_exchange` wrap this in
autograd: the backward of ``finish`` launches the gradient exchange and the backward of ``start`` waits for
it, so autograd can run other work (the previous chunk's expert backward) while gradients travel.

The split matrix is the one value of an exchange the host must read (``all_to_all_single`` takes its sizes as
Python ints). The ranks exchange their counts on the device; :class:`HostCopy` starts the one device-to-host
copy of them at once and the caller reads its values only where the exchange of the rows needs them
(docs/architecture.md, "Experts over ranks").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.parallel.groups import ExpertGroup

__all__ = [
    "SplitMatrix",
    "HostCopy",
    "Exchange",
    "FlatAllToAll",
    "HierarchicalAllToAll",
    "PendingExchange",
    "CommStats",
    "make_exchange",
    "start_exchange",
    "finish_exchange",
    "exchange",
]

SplitMatrix = list[list[int]]
A2A_ALGORITHMS = ("flat", "2dh")


def transpose(splits: SplitMatrix) -> SplitMatrix:
    return [list(col) for col in zip(*splits)]


class HostCopy:
    """One device-to-host copy of ``values`` (any shape, integers), started now and read by :meth:`tolist`.

    On CUDA the copy goes into pinned host memory with ``non_blocking=True`` and an event marks its end: the host
    goes on (building the pairs of the token exchange) while the stream runs up to the copy, and waits only in
    :meth:`tolist`. Elsewhere it is a plain copy. Either way the values are those at the copy's start, and
    :meth:`tolist` is the one read of the host, however often it is called."""

    def __init__(self, values: Tensor) -> None:
        self._event: Any = None
        on_cuda = values.device.type == "cuda"
        # A non-blocking copy to pageable memory would be a blocking one: pin it (which only CUDA can).
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=on_cuda and torch.cuda.is_available())
        self._host.copy_(values, non_blocking=on_cuda)
        if on_cuda:  # the host waits for this event only, not for the work queued after the copy
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        self._values: Any = None

    def tolist(self) -> Any:
        """The values as (nested) Python ints: waits for the copy the first time."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.tolist()
        return self._values


@dataclass
class CommStats:
    """Seconds the calling thread spent launching or waiting for exchanges (the exposed communication), how many
    exchanges finished, and the rows this rank put into them (its own included)."""

    seconds: float = 0.0
    exchanges: int = 0
    rows: int = 0

    def reset(self) -> None:
        self.seconds = 0.0
        self.exchanges = 0
        self.rows = 0


class _Stage:
    """One asynchronous ``all_to_all_single`` over ``group``, and how to lay out its input and output."""

    def __init__(self, eg: ExpertGroup, group: Any, what: str, out: Tensor, inp: Tensor,
                 recv: list[int], send: list[int]) -> None:
        self.eg, self.what, self.out = eg, what, out
        if group is None:  # a group of one: the exchange is a copy
            out.copy_(inp)
            self.work = None
        else:
            self.work = eg.call(what, lambda: dist.all_to_all_single(out, inp, recv, send, group=group,
                                                                     async_op=True))

    def wait(self) -> Tensor:
        if self.work is not None:
            work = self.work
            self.eg.call(self.what, lambda: work.wait())
            self.work = None
        return self.out


def _reorder(x: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    """The blocks of ``x`` (``sizes`` rows each) concatenated in ``order``."""
    if order == list(range(len(order))):
        return x
    blocks = x.split(sizes)
    picked = [blocks[i] for i in order if sizes[i]]
    if not picked:
        return x[:0]
    return torch.cat(picked) if len(picked) > 1 else picked[0]


class PendingExchange:
    """An exchange in flight: a list of stage functions, the current stage's work, and the final rows."""

    def __init__(self, stages: list, stats: CommStats | None) -> None:
        self._stages = list(stages)
        self._stats = stats
        self._current: _Stage | None = None
        self._value: Tensor | None = None
        self._timed(self._next, None)

    def _timed(self, fn, arg):
        t0 = time.perf_counter()
        try:
            return fn(arg)
        finally:
            if self._stats is not None:
                self._stats.seconds += time.perf_counter() - t0

    def _next(self, prev: Tensor | None) -> None:
        stage_fn = self._stages.pop(0)
        self._current = stage_fn(prev)

    def advance(self) -> None:
        """Wait for the current stage and launch the next (no-op for a single-stage exchange)."""
        if self._stages and self._current is not None:
            prev = self._timed(self._wait_current, None)
            self._timed(self._next, prev)

    def _wait_current(self, _: None) -> Tensor:
        # __init__ launched the first stage, so there is always a current one.
        assert self._current is not None
        return self._current.wait()

    def finish(self) -> Tensor:
        """Run the remaining stages to completion and return the received rows."""
        if self._value is None:
            while self._stages:
                self.advance()
            self._value = self._timed(self._wait_current, None)
            if self._stats is not None:
                self._stats.exchanges += 1
        return self._value


class Exchange:
    """An all-to-all algorithm over an :class:`ExpertGroup`."""

    name = "?"

    def __init__(self, eg: ExpertGroup) -> None:
        self.eg = eg

    def launch(self, x: Tensor, splits: SplitMatrix, stats: CommStats | None = None) -> PendingExchange:
        """Start moving ``x`` (rows in destination order) per ``splits``; see the module docstring."""
        raise NotImplementedError

    @staticmethod
    def _count(x: Tensor, stats: CommStats | None) -> None:
        if stats is not None:
            stats.rows += x.shape[0]


class FlatAllToAll(Exchange):
    name = "flat"

    def launch(self, x: Tensor, splits: SplitMatrix, stats: CommStats | None = None) -> PendingExchange:
        me, eg = self.eg.rank, self.eg
        self._count(x, stats)
        send = list(splits[me])
        recv = [row[me] for row in splits]

        def stage(_: Tensor | None) -> _Stage:
            out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
            return _Stage(eg, eg.group, "all-to-all", out, x.contiguous(), recv, send)

        return PendingExchange([stage], stats)


class HierarchicalAllToAll(Exchange):
    """2-D hierarchical all-to-all with ``ranks_per_node`` (G) local ranks per node."""

    name = "2dh"

    def __init__(self, eg: ExpertGroup, ranks_per_node: int) -> None:
        super().__init__(eg)
        w = eg.world_size
        if ranks_per_node < 1 or w % ranks_per_node != 0:
            raise ValueError(
                f"a2a='2dh' needs ranks_per_node to divide the expert-parallel world size {w}, got "
                f"{ranks_per_node} (valid: {[g for g in range(1, w + 1) if w % g == 0]})"
            )
        self.local = ranks_per_node
        self.nodes = w // ranks_per_node
        node, local = divmod(eg.rank, self.local)
        self.node, self.local_rank = node, local
        # Node group first, then the column (same local index) group: the same order on every rank.
        node_ranks = [node * self.local + j for j in range(self.local)]
        col_ranks = [n * self.local + local for n in range(self.nodes)]
        # Created here, looked up at each launch: the layer keeps no process group alive (see ExpertGroup).
        self._node_ranks = node_ranks if self.local > 1 else None
        self._col_ranks = col_ranks if self.nodes > 1 else None
        for ranks in (self._node_ranks, self._col_ranks):  # create both now, in this order on every rank
            if ranks is not None:
                eg.subgroup(ranks)

    @property
    def node_group(self) -> Any:
        return None if self._node_ranks is None else self.eg.subgroup(self._node_ranks)

    @property
    def col_group(self) -> Any:
        return None if self._col_ranks is None else self.eg.subgroup(self._col_ranks)

    def launch(self, x: Tensor, splits: SplitMatrix, stats: CommStats | None = None) -> PendingExchange:
        eg, G, N = self.eg, self.local, self.nodes
        self._count(x, stats)
        n, lr = self.node, self.local_rank
        me = eg.rank
        tail = tuple(x.shape[1:])

        # Stage 1, inside the node: to local peer j go my rows for the ranks (n', j), n' = 0..N-1.
        send_sizes = list(splits[me])
        order1 = [n2 * G + j for j in range(G) for n2 in range(N)]  # blocks by (j, n')
        send1 = [sum(splits[me][n2 * G + j] for n2 in range(N)) for j in range(G)]
        # From local peer j come its rows for the ranks (n', lr): blocks by (j, n').
        src1 = [n * G + j for j in range(G)]
        recv_blocks1 = [splits[src][n2 * G + lr] for src in src1 for n2 in range(N)]
        recv1 = [sum(splits[src][n2 * G + lr] for n2 in range(N)) for src in src1]
        # Stage 2, between nodes: to node n' go the blocks for rank (n', lr), from every local source j.
        order2 = [j * N + n2 for n2 in range(N) for j in range(G)]  # (j, n') blocks -> by (n', j)
        send2 = [sum(splits[n * G + j][n2 * G + lr] for j in range(G)) for n2 in range(N)]
        recv2 = [sum(splits[n2 * G + j][me] for j in range(G)) for n2 in range(N)]

        def stage1(_: Tensor | None) -> _Stage:
            inp = _reorder(x, send_sizes, order1).contiguous()
            out = x.new_empty((sum(recv1),) + tail)
            return _Stage(eg, self.node_group, "2dh all-to-all (intra-node)", out, inp, recv1, send1)

        def stage2(prev: Tensor) -> _Stage:
            inp = _reorder(prev, recv_blocks1, order2).contiguous()
            out = x.new_empty((sum(recv2),) + tail)
            # Received blocks arrive by (node n'', local j) = source rank order: nothing to reorder after.
            return _Stage(eg, self.col_group, "2dh all-to-all (inter-node)", out, inp, recv2, send2)

        return PendingExchange([stage1, stage2], stats)


def make_exchange(eg: ExpertGroup, algorithm: str, ranks_per_node: int | None) -> Exchange:
    """The :class:`Exchange` for ``algorithm`` ("flat" or "2dh")."""
    if algorithm == "flat":
        return FlatAllToAll(eg)
    if algorithm == "2dh":
        if ranks_per_node is None:
            raise ValueError("a2a='2dh' needs ranks_per_node (or torchrun's LOCAL_WORLD_SIZE to default it)")
        return HierarchicalAllToAll(eg, ranks_per_node)
    raise ValueError(f"a2a must be one of {A2A_ALGORITHMS}, got {algorithm!r}")


@dataclass(eq=False)
class Ticket:
    """Links the autograd nodes of one exchange: the forward rows in flight and the gradients in flight."""

    transport: Exchange
    splits: SplitMatrix
    stats: CommStats | None = None
    forward: PendingExchange | None = None
    backward: PendingExchange | None = None
    shape_tail: tuple[int, ...] = field(default=())


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, ticket: Ticket) -> Tensor:
        ticket.forward = ticket.transport.launch(x.detach(), ticket.splits, ticket.stats)
        ctx.ticket = ticket
        return x.new_empty(0)  # a token: orders the graph, carries no data

    @staticmethod
    def backward(ctx, _grad_token: Tensor):
        pending, ctx.ticket.backward = ctx.ticket.backward, None
        return pending.finish(), None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token: Tensor, ticket: Ticket) -> Tensor:
        ctx.ticket = ticket
        # Let go of the exchange once it has delivered: the ticket lives in this node's ctx, and a ctx that
        # (through the exchange) referenced the node's own output would form a cycle that is never freed.
        pending, ticket.forward = ticket.forward, None
        # The token comes out of _Start, which launched the exchange: autograd ran it before this node.
        assert pending is not None, "finish_exchange before start_exchange"
        return pending.finish()

    @staticmethod
    def backward(ctx, grad: Tensor):
        t = ctx.ticket
        t.backward = t.transport.launch(grad.contiguous(), transpose(t.splits), t.stats)
        return grad.new_empty(0), None


def start_exchange(x: Tensor, transport: Exchange, splits: SplitMatrix, stats: CommStats | None = None
                   ) -> tuple[Tensor, Ticket]:
    """Launch the exchange of ``x`` (differentiable); returns ``(token, ticket)`` for :func:`finish_exchange`."""
    ticket = Ticket(transport, splits, stats)
    return _Start.apply(x, ticket), ticket


def finish_exchange(token: Tensor, ticket: Ticket) -> Tensor:
    """The received rows of the exchange started by :func:`start_exchange`."""
    return _Finish.apply(token, ticket)


def advance(ticket: Ticket) -> None:
    """Progress a multi-stage forward exchange to its next stage (for pipelining; no-op when flat)."""
    if ticket.forward is not None:
        ticket.forward.advance()


def exchange(x: Tensor, transport: Exchange, splits: SplitMatrix, stats: CommStats | None = None) -> Tensor:
    """The blocking, differentiable exchange: ``x`` rows in destination order -> rows in source order."""
    token, ticket = start_exchange(x, transport, splits, stats)
    return finish_exchange(token, ticket)
