"""The smart schedule (FasterMoE): the expert exchange as pairwise steps that overlap the expert compute.

Instead of one all-to-all (everything sent, then everything computed, then everything sent back), rank ``me``
works through its W peers one at a time:

    step 0:      compute my own rows of my experts (no transfer); meanwhile step 1's piece travels
    step i >= 1: wait for the piece from recv_from(i); launch step i+1's piece; compute piece i;
                 send its result back to recv_from(i) (and receive mine from send_to(i)) while i+1 computes

``send_to(i) = me + i``, ``recv_from(i) = me - i`` (mod W); when W is a power of two, the XOR pairing
``me ^ i`` is used instead (send and receive with the same peer: one full-duplex link per step). Every transfer
is a batch of ``dist.isend``/``dist.irecv`` (:func:`torch.distributed.batch_isend_irecv`, gloo and NCCL) that
both partners post at the same logical point of the schedule, so per pair the messages are issued in the same
order on both sides; a transfer of zero rows is skipped by both sides (sizes come from the all-gathered counts).

The backward pass is the mirror exchange with the same schedule: the gradient of each returned result goes to
the rank that computed it, which back-propagates through its piece and returns the input gradient. The whole
schedule is one autograd Function, so its point-to-point traffic never interleaves with other collectives.

Scope: whole experts (E % W == 0), ``r=1``, ``overlap_degree=1``, ``a2a="flat"``, ``parallel="static"``;
the pairing granularity is one rank (FasterMoE's grouping of ranks is not implemented). The layer raises a
ValueError for any other combination (:func:`check_pairwise`). Any expert module works (built-in or custom).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.experts import differentiated_weights
from flexmoe.parallel.groups import ExpertGroup
from flexmoe.parallel.layout import ExpertLayout

__all__ = ["SCHEDULES", "pairwise_peers", "check_pairwise", "PairwisePlan", "make_pairwise_plan", "run_pairwise"]

SCHEDULES = ("a2a", "pairwise")


def pairwise_peers(rank: int, world: int, step: int) -> tuple[int, int]:
    """(send_to, recv_from) of ``rank`` at ``step`` (0 <= step < world; step 0 is the rank itself)."""
    if world & (world - 1) == 0:
        peer = rank ^ step
        return peer, peer
    return (rank + step) % world, (rank - step) % world


def check_schedule(schedule: object) -> str:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return str(schedule)


def check_pairwise(layout: ExpertLayout, r: int, overlap_degree: int, a2a: str, parallel: str) -> None:
    """schedule="pairwise" replaces the all-to-all of plain expert parallelism; a clear ValueError for any
    setting it does not combine with."""
    problems = []
    if layout.shards_per_expert > 1:
        problems.append(f"whole experts (num_experts={layout.num_experts} is not a multiple of the world "
                        f"size {layout.world_size})")
    if r != 1:
        problems.append(f"r=1 (got r={r})")
    if overlap_degree != 1:
        problems.append(f"overlap_degree=1 (got {overlap_degree}; the pairwise steps already overlap)")
    if a2a != "flat":
        problems.append(f"a2a='flat' (got {a2a!r}; the schedule replaces the all-to-all)")
    if parallel != "static":
        problems.append(f"parallel='static' (got {parallel!r})")
    if problems:
        raise ValueError("schedule='pairwise' needs " + ", ".join(problems))


@dataclass(frozen=True)
class PairwisePlan:
    """Sizes of one pairwise exchange, the same on every rank (from the all-gathered counts).

    send_sizes[dst]: rows of this rank's input for rank dst's experts (contiguous, in rank order).
    recv_counts[src]: rows rank src sends here, per local expert ``[E_local]`` (sorted by local expert).
    """

    send_sizes: list[int]
    recv_counts: list[list[int]]

    @property
    def recv_sizes(self) -> list[int]:
        return [sum(c) for c in self.recv_counts]


def make_pairwise_plan(all_counts: list[list[int]], layout: ExpertLayout, rank: int) -> PairwisePlan:
    """all_counts ``[W][E]`` -> this rank's :class:`PairwisePlan`."""
    world = len(all_counts)
    mine = layout.experts_of_rank(rank)
    send = [sum(all_counts[rank][e] for e in layout.experts_of_rank(dst)) for dst in range(world)]
    recv = [[all_counts[src][e] for e in mine] for src in range(world)]
    return PairwisePlan(send, recv)


# ------------------------------------------------------------------------------------------------ transport


class _Transfers:
    """Point-to-point transfers in flight; :meth:`wait` blocks (with the group's timeout) until all are done."""

    def __init__(self, eg: ExpertGroup, ops: list) -> None:
        self.eg = eg
        self.works = eg.call("pairwise exchange", lambda: dist.batch_isend_irecv(ops)) if ops else []

    def wait(self) -> None:
        for work in self.works:
            if self.eg.timeout is not None:
                self.eg.call("pairwise exchange", functools.partial(work.wait, self.eg.timeout))
            else:
                self.eg.call("pairwise exchange", work.wait)
        self.works = []


def _p2p(eg: ExpertGroup, op: Callable, tensor: Tensor, peer: int, tag: int) -> dist.P2POp:
    return dist.P2POp(op, tensor, group=eg.group, group_peer=peer, tag=tag)


def pairwise_schedule(
    eg: ExpertGroup,
    blocks: list[Tensor],
    recv_sizes: list[int],
    compute: Callable[[int, Tensor], Tensor],
) -> list[Tensor]:
    """Send ``blocks[dst]`` ``[n_dst, M]`` to each rank, where ``compute(src, rows) -> [n_src, M]`` runs on the
    rows from ``src`` (``recv_sizes[src]`` of them), and collect the results: returns ``[n_dst, M]`` per dst.

    Tags: 2*step for pieces, 2*step+1 for results (gloo matches by tag; NCCL by order, which agrees).
    """
    world, me = eg.world_size, eg.rank
    tail = tuple(blocks[me].shape[1:])
    incoming: list[Tensor | None] = [None] * world
    results: list[Tensor | None] = [None] * world

    def post_pieces(step: int) -> _Transfers:
        to, frm = pairwise_peers(me, world, step)
        ops = []
        if blocks[to].shape[0]:
            ops.append(_p2p(eg, dist.isend, blocks[to].contiguous(), to, 2 * step))
        piece = incoming[frm] = blocks[me].new_empty((recv_sizes[frm],) + tail)
        if recv_sizes[frm]:
            ops.append(_p2p(eg, dist.irecv, piece, frm, 2 * step))
        return _Transfers(eg, ops)

    def post_results(step: int, result: Tensor) -> _Transfers:
        to, frm = pairwise_peers(me, world, step)
        ops = []
        if result.shape[0]:
            ops.append(_p2p(eg, dist.isend, result.contiguous(), frm, 2 * step + 1))
        back = results[to] = blocks[me].new_empty(blocks[to].shape)
        if blocks[to].shape[0]:
            ops.append(_p2p(eg, dist.irecv, back, to, 2 * step + 1))
        return _Transfers(eg, ops)

    pending = post_pieces(1) if world > 1 else None
    results[me] = compute(me, blocks[me])
    returning = []
    for step in range(1, world):
        assert pending is not None  # world > 1 here, and each step posted the next one's pieces
        pending.wait()
        if step + 1 < world:
            pending = post_pieces(step + 1)  # travels while this step computes
        frm = pairwise_peers(me, world, step)[1]
        piece = incoming[frm]
        assert piece is not None  # posted by post_pieces(step), received by the wait above
        returning.append(post_results(step, compute(frm, piece)))
        incoming[frm] = None
    for transfers in returning:
        transfers.wait()
    return results  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- autograd


class _PairwiseRun:
    """One differentiable pairwise exchange: keeps each piece's autograd graph between forward and backward.

    params: the tensors differentiated (:func:`~flexmoe.experts.differentiated_weights`); names: their names
    when they are the experts module's own parameters, else None (an adapter's weights as read, ``w + delta``)."""

    def __init__(self, eg: ExpertGroup, plan: PairwisePlan, experts: nn.Module, params: list[Tensor],
                 names: list[str] | None) -> None:
        self.eg, self.plan, self.experts = eg, plan, experts
        # The module's own parameters enter the pieces' graphs as detached aliases: their gradient hooks (wrap_ddp's
        # division) then run once, on what _Pairwise returns, not inside each piece's grad as well. An adapter's
        # weights as read are no leaves, so no parameter hook runs inside the pieces: they enter as they are.
        self.aliases = None if names is None else {n: p.detach().requires_grad_(True) for n, p in zip(names, params)}
        self.params = params if self.aliases is None else list(self.aliases.values())
        self.pieces: dict[int, tuple[Tensor, Tensor]] = {}  # src -> (input leaf, output)

    def forward(self, rows: Tensor) -> Tensor:
        def compute(src: int, piece: Tensor) -> Tensor:
            if piece.shape[0] == 0:
                return piece
            leaf = piece.detach().requires_grad_(True)
            with torch.enable_grad():
                args = (leaf, self.plan.recv_counts[src])
                out = self.experts(*args) if self.aliases is None else \
                    torch.func.functional_call(self.experts, self.aliases, args)
            self.pieces[src] = (leaf, out)
            return out.detach()

        blocks = list(rows.split(self.plan.send_sizes))
        return torch.cat(pairwise_schedule(self.eg, blocks, self.plan.recv_sizes, compute))

    def backward(self, grad: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        param_grads: list[Tensor | None] = [None] * len(self.params)

        def compute(src: int, piece_grad: Tensor) -> Tensor:
            if src not in self.pieces:
                return piece_grad
            leaf, out = self.pieces[src]  # kept: a second backward then fails loudly, never silently
            got = torch.autograd.grad(out, [leaf] + self.params, piece_grad, allow_unused=True)
            for i, g in enumerate(got[1:]):
                if g is not None:
                    so_far = param_grads[i]
                    param_grads[i] = g if so_far is None else so_far + g
            return got[0] if got[0] is not None else torch.zeros_like(leaf)

        blocks = list(grad.contiguous().split(self.plan.send_sizes))
        grad_rows = torch.cat(pairwise_schedule(self.eg, blocks, self.plan.recv_sizes, compute))
        return grad_rows, param_grads


class _Pairwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, run: _PairwiseRun, *params: Tensor) -> Tensor:
        ctx.run = run
        return run.forward(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_rows, param_grads = ctx.run.backward(grad)
        return (grad_rows, None, *param_grads)


def run_pairwise(eg: ExpertGroup, layout: ExpertLayout, experts: nn.Module, rows: Tensor,
                 all_counts: list[list[int]]) -> Tensor:
    """rows ``[N, M]`` sorted by global expert (this rank's ``all_counts[rank]`` per expert) -> ``[N, M]``
    expert outputs, equal to the all-to-all path's. Differentiable in rows and the experts' parameters."""
    plan = make_pairwise_plan(all_counts, layout, eg.rank)
    # The weights as read (an adapter's w + delta inside its call), so that their gradient reaches the adapter.
    params = differentiated_weights(experts)
    own = {name: p for name, p in experts.named_parameters() if p.requires_grad}
    names = None
    if {id(p) for p in params} == {id(p) for p in own.values()}:
        names, params = list(own), list(own.values())
    if not torch.is_grad_enabled() or not (rows.requires_grad or params):
        with torch.no_grad():
            blocks = list(rows.split(plan.send_sizes))
            outs = pairwise_schedule(eg, blocks, plan.recv_sizes,
                                     lambda src, piece: experts(piece, plan.recv_counts[src]) if piece.shape[0]
                                     else piece)
            return torch.cat(outs)
    return _Pairwise.apply(rows, _PairwiseRun(eg, plan, experts, params, names), *params)
