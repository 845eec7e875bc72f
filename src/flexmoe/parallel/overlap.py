"""Adaptive pipelining: d chunks whose all-to-all overlaps the expert compute of their neighbours.

The expert input is split into ``d`` chunks (each expert's rows cut into d near-equal pieces, so every chunk
is itself "rows sorted by expert"). With asynchronous collectives the schedule is

    launch send[0]
    for c in 0..d-1:
        launch send[c+1]                # travels while chunk c computes
        wait send[c]; compute chunk c   # (2dh: the previous sends advance to their next stage here)
        launch return[c]                # travels while chunk c+1 computes
    wait every return

and in the backward pass autograd interleaves the same way (see :mod:`flexmoe.parallel.alltoall`). The
overlap never depends on the device: gloo runs asynchronous collectives on its own threads, so on CPU the
transfer of one chunk proceeds while the main thread computes another.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from flexmoe.parallel.alltoall import (
    CommStats,
    Exchange,
    SplitMatrix,
    Ticket,
    advance,
    finish_exchange,
    start_exchange,
)

__all__ = ["pipelined_exchange"]


def pipelined_exchange(
    send_rows: list[Tensor],
    send_splits: list[SplitMatrix],
    compute: Callable[[int, Tensor], Tensor],
    return_splits: list[SplitMatrix],
    transport: Exchange,
    stats: CommStats | None = None,
) -> list[Tensor]:
    """Send chunk c's rows, compute them where they land, send the results back; chunks overlap.

    send_rows[c]: ``[n_c, M]`` rows in destination order; ``compute(c, received) -> [m_c, M]`` runs on the
    rows received for chunk c (in source order) and returns them in source order; ``return_splits[c]`` is
    ``send_splits[c]`` transposed. Returns, per chunk, the rows sent back: ``[n_c, M]`` aligned with
    ``send_rows[c]``. Differentiable.
    """
    d = len(send_rows)
    sends: list[tuple[Tensor, Ticket]] = [start_exchange(send_rows[0], transport, send_splits[0], stats)]
    returns: list[tuple[Tensor, Ticket]] = []
    for c in range(d):
        if c + 1 < d:
            sends.append(start_exchange(send_rows[c + 1], transport, send_splits[c + 1], stats))
        received = finish_exchange(*sends[c])
        out = compute(c, received)
        returns.append(start_exchange(out, transport, return_splits[c], stats))
        # Multi-stage (2dh) exchanges move on to their next stage after each compute: same point on every rank.
        if c + 1 < d:
            advance(sends[c + 1][1])
        for r in returns[:-1]:
            advance(r[1])
    return [finish_exchange(*r) for r in returns]
