"""Fit the all-to-all scale model (:mod:`flexmoe.tuning.a2a_scale`) to a cluster's own measurements.

The constants that ship for Azure NDv4 come from published all-to-all numbers that stop at 32 nodes. A user with
a cluster has better data: the log of NCCL's ``alltoall_perf`` (nccl-tests) at a few scales. This module reads
those logs and fits the same constants to them, so that ``flexmoe simulate --profile mine.json`` prices the
all-to-all the user's fabric actually delivers:

* :func:`parse_alltoall_perf`: one log -> :class:`AllToAllRun` (ranks, ranks per node from the host names in the
  ``# Rank`` lines, and the out-of-place time of every message size);
* :func:`fit_run`: one run -> the per-message cost and the bandwidth of its slowest level, by a weighted least
  squares of ``t / m = alpha + s / bandwidth`` (m messages of s bytes each; weights make it a relative fit, so
  the 1 KiB rows set alpha and the GiB rows the bandwidth);
* :func:`fit_scale`: all runs -> :class:`~flexmoe.tuning.a2a_scale.A2AScale`: NVLink bandwidth from a one-node
  run, the inter-node share ``e(N)`` and the per-message cost ``alpha(P)`` by least squares across runs
  (their forms are :func:`~flexmoe.tuning.a2a_scale.inter_efficiency` and
  :func:`~flexmoe.tuning.a2a_scale.message_cost`), one network peer's rate from a 2-rank run over 2 nodes.

``flexmoe fit-a2a`` (:mod:`flexmoe.apps.fit_a2a`) wraps it. docs/cost_model.md, "Fitting a cluster's own
all-to-all", says which run fixes which constant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flexmoe.tuning.a2a_scale import A2AScale

__all__ = ["AllToAllRun", "RunFit", "parse_alltoall_perf", "fit_run", "fit_scale", "run_seconds",
           "weighted_linear_fit"]

# "#  Rank  3 Group  0 Pid 1234 on node-a device  3 [0x4c] NVIDIA A100-SXM4-80GB" (newer nccl-tests) or
# "#   Rank  3 Pid 1234 on node-a device  3 [0x4c] ..." (2021 and before).
_RANK_LINE = re.compile(r"^#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device")
# Only rows whose third field is a data type are measurements: "size count type redop [root] time algbw ...".
_DTYPES = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double", "bfloat16",
           "fp8_e4m3", "fp8_e5m2", "int", "char"}


def _floats(tokens: list[str]) -> list[float | None]:
    out: list[float | None] = []
    for t in tokens:
        try:
            out.append(float(t))
        except ValueError:
            out.append(None)
    return out


def _row_time_us(size: float, rest: list[str]) -> float | None:
    """The out-of-place time of a data row: the first number followed by its own algbw (size / time, printed
    to 0.01 GB/s). Before it may stand the reduction op (a word, or nothing for all-to-all in old nccl-tests)
    and the root (-1); old logs print large times without decimals, so only algbw tells a time from a root."""
    values = _floats(rest[:4])
    for k in range(len(values) - 1):
        time_us, algbw = values[k], values[k + 1]
        if time_us is None or algbw is None or time_us <= 0:
            continue
        if abs(size / time_us / 1e3 - algbw) <= max(0.02 * algbw, 0.006):
            return time_us
    return None


@dataclass(frozen=True)
class AllToAllRun:
    """One ``alltoall_perf`` run.

    ranks / ranks_per_node: the exchange's size and how many of its ranks share a host.
    points: ``(bytes per rank, seconds)`` for every size, the out-of-place time.
    source: where it came from (a file name), for the fit's report.
    """

    ranks: int
    ranks_per_node: int
    points: tuple[tuple[float, float], ...]
    source: str = ""

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


@dataclass(frozen=True)
class RunFit:
    """What one run says: each of its ``messages`` messages on the slowest level costs ``alpha_s`` plus its
    bytes at ``bandwidth_Bps``; ``level`` is ``"intra"`` (one node), ``"inter"`` or ``"peer"`` (2 ranks on 2
    nodes: one network peer)."""

    run: AllToAllRun
    level: str
    messages: int
    alpha_s: float
    bandwidth_Bps: float


def parse_alltoall_perf(text: str, source: str = "") -> AllToAllRun:
    """Read one nccl-tests ``alltoall_perf`` log (as printed, header included).

    The ranks and their hosts come from the ``# Rank`` lines (every host must hold the same number of ranks);
    each data row gives ``(size in bytes, out-of-place time in seconds)``. A row whose algbw disagrees with
    size / time by more than 2% means the columns were misread, and is refused.
    """
    hosts: dict[int, str] = {}
    points: list[tuple[float, float]] = []
    for line in text.splitlines():
        rank = _RANK_LINE.match(line.strip())
        if rank:
            hosts[int(rank.group(1))] = rank.group(2)
            continue
        fields = line.split()
        if len(fields) < 6 or line.lstrip().startswith("#") or fields[2] not in _DTYPES:
            continue
        if not fields[0].isdigit():
            continue
        size = float(fields[0])
        if size <= 0:
            continue
        time_us = _row_time_us(size, fields[3:])
        if time_us is None:
            raise ValueError(f"{source or 'alltoall_perf log'}: cannot read the row of size {int(size)} "
                             f"({' '.join(fields[3:8])} ...); expected nccl-tests columns 'size count type "
                             "[redop] [root] time algbw busbw ...' with algbw = size / time")
        points.append((size, time_us * 1e-6))
    if not hosts:
        raise ValueError(f"{source or 'alltoall_perf log'}: no '# Rank N ... on HOST device' lines; expected the "
                         "whole log of alltoall_perf, header included (it names each rank's host)")
    if not points:
        raise ValueError(f"{source or 'alltoall_perf log'}: no measurement rows (size count type redop time ...)")
    ranks = len(hosts)
    if sorted(hosts) != list(range(ranks)):
        raise ValueError(f"{source or 'alltoall_perf log'}: rank lines {sorted(hosts)} are not 0..{ranks - 1}")
    per_host: dict[str, int] = {}
    for host in hosts.values():
        per_host[host] = per_host.get(host, 0) + 1
    if len(set(per_host.values())) != 1:
        raise ValueError(f"{source or 'alltoall_perf log'}: hosts hold different numbers of ranks {per_host}; "
                         "expected the same number on every host")
    return AllToAllRun(ranks=ranks, ranks_per_node=next(iter(per_host.values())), points=tuple(points),
                       source=source)


def weighted_linear_fit(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """Least squares for y = a + c x with weights w on the residuals (w = 1/y: relative residuals); also what
    ``flexmoe calibrate`` fits its message times with (:func:`flexmoe.apps.calibrate_fits.fit_alpha_beta`)."""
    sw = sum(w * w for w in ws)
    sx = sum(w * w * x for w, x in zip(ws, xs))
    sy = sum(w * w * y for w, y in zip(ws, ys))
    sxx = sum(w * w * x * x for w, x in zip(ws, xs))
    sxy = sum(w * w * x * y for w, x, y in zip(ws, xs, ys))
    det = sw * sxx - sx * sx
    if det == 0:
        return 0.0, sy / sx if sx else 0.0
    c = (sw * sxy - sx * sy) / det
    a = (sy - c * sx) / sw
    return a, c


def fit_run(run: AllToAllRun) -> RunFit:
    """The per-message cost and bandwidth of the run's slowest level (see the module docstring)."""
    n, g = run.ranks, run.ranks_per_node
    if n < 2:
        raise ValueError(f"{run.source}: an all-to-all of {n} rank says nothing about the links")
    if g == n:
        level, messages = "intra", n - 1
    elif n == 2:
        level, messages = "peer", 1
    else:
        level, messages = "inter", n - g
    sizes = [s / n for s, _ in run.points]
    if len(set(sizes)) < 2:
        raise ValueError(f"{run.source}: need at least two different message sizes to separate latency from "
                         "bandwidth")
    per_message = [t / messages for _, t in run.points]
    alpha, inverse_bw = weighted_linear_fit(sizes, per_message, [1.0 / y for y in per_message])
    if inverse_bw <= 0:
        raise ValueError(f"{run.source}: the time does not grow with the message size; expected a sweep from "
                         "small (latency) to large (bandwidth) sizes")
    return RunFit(run=run, level=level, messages=messages, alpha_s=max(alpha, 0.0), bandwidth_Bps=1.0 / inverse_bw)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Ordinary least squares ``y = a + b x``; one point (or one distinct x) gives ``(mean y, 0)``."""
    if len(set(xs)) < 2:
        return sum(ys) / len(ys), 0.0
    return weighted_linear_fit(xs, ys, [1.0] * len(xs))


def fit_scale(runs: list[AllToAllRun], line_Bps: float, sm_share: float) -> tuple[A2AScale, list[RunFit]]:
    """The scale model's constants from ``runs`` (at least one spanning several nodes), and each run's fit.

    line_Bps: one GPU's NIC line rate (bytes per second, one direction); the inter-node shares are fractions of it.
    sm_share: the share of SMs a communication kernel holds (alltoall_perf cannot tell; it prices overlap).
    """
    if line_Bps <= 0:
        raise ValueError(f"line_Bps must be > 0 (one GPU's NIC rate in bytes per second), got {line_Bps}")
    if not 0.0 <= sm_share < 1.0:
        raise ValueError(f"sm_share must be in [0, 1), got {sm_share}")
    fits = [fit_run(r) for r in runs]
    inter = [f for f in fits if f.level == "inter"]
    if not inter:
        raise ValueError("need at least one run over several nodes with more than one rank in all (the inter-node "
                         "constants come from it); got only " + ", ".join(
                             f"{f.run.ranks} ranks on {f.run.nodes} node(s)" for f in fits))
    # e(N) = e_inf + (e_2 - e_inf) * 2 / N: a line in x = 2 / N.
    e_inf, slope = _line([2.0 / f.run.nodes for f in inter], [f.bandwidth_Bps / line_Bps for f in inter])
    e_2 = e_inf + slope
    if e_inf <= 0 or e_2 <= 0:
        raise ValueError(f"the fitted inter-node share goes to {min(e_inf, e_2):.3g} of the line; expected a "
                         "positive share at every scale (check line_Bps and the runs)")
    # alpha(P) = alpha0 + gamma * P over every run's per-message cost.
    alpha0, gamma = _line([float(f.run.ranks) for f in fits], [f.alpha_s for f in fits])
    intra = [f for f in fits if f.level == "intra"]
    intra_bw = max(f.bandwidth_Bps for f in intra) if intra else line_Bps * 8  # no one-node run: NVLink-class
    peer = [f for f in fits if f.level == "peer"]
    peer_bw = max(f.bandwidth_Bps for f in peer) if peer else line_Bps  # no pair run: one peer fills the NIC
    scale = A2AScale(intra_bandwidth_Bps=intra_bw, inter_line_Bps=line_Bps, inter_efficiency_2=e_2,
                     inter_efficiency_many=e_inf, alpha_s=max(alpha0, 0.0), per_peer_s=max(gamma, 0.0),
                     peer_Bps=peer_bw, sm_share=sm_share)
    return scale, fits


def run_seconds(fit: RunFit, bytes_per_rank: float) -> float:
    """The time the run's own fit gives at ``bytes_per_rank`` (to report how well each run is fitted)."""
    return fit.messages * (fit.alpha_s + bytes_per_rank / fit.run.ranks / fit.bandwidth_Bps)
