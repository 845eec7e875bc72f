"""The fits of ``flexmoe calibrate`` (:mod:`flexmoe.apps.calibrate`): a GEMM roofline with a bent compute roof, an
alpha-beta model of messages, and the compute slots a shared machine leaves. Pure functions of the samples.
"""

from __future__ import annotations

import statistics

from flexmoe.tuning.a2a_measured import weighted_linear_fit
from flexmoe.tuning.profile import ComputeSpec

__all__ = ["fit_roofline", "fit_alpha_beta", "compute_slots"]


def fit_roofline(samples: list[dict[str, float]]) -> ComputeSpec:
    """Fit ``t = overhead + flops / (peak * d / (d + d_half))`` to GEMM samples {m, n, k, seconds}.

    For each d_half on a grid, (overhead, 1/peak) is a linear least-squares fit weighted by 1/t (relative
    error, so small GEMMs count as much as large ones); the d_half with the smallest relative error wins.
    """
    best: tuple[float, ComputeSpec] | None = None
    for half in (0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0):
        xs, ys, ws = [], [], []
        for s in samples:
            d = min(s["m"], s["n"], s["k"])
            eff = d / (d + half) if half > 0 else 1.0
            xs.append(2.0 * s["m"] * s["n"] * s["k"] / eff)
            ys.append(s["seconds"])
            ws.append(1.0 / s["seconds"])
        a, c = weighted_linear_fit(xs, ys, ws)  # t = a + c * x
        if c <= 0:
            continue
        a = max(a, 0.0)
        err = sum(abs(a + c * x - y) / y for x, y in zip(xs, ys)) / len(xs)
        if best is None or err < best[0]:
            best = (err, ComputeSpec(peak_flops=1.0 / c, overhead_s=a, half_dim=half))
    if best is None:
        raise RuntimeError("GEMM timings could not be fitted (all slopes non-positive)")
    return best[1]


def fit_alpha_beta(samples: list[dict[str, float]]) -> tuple[float, float]:
    """Fit ``t = messages * (alpha + message_bytes / bandwidth)`` to {messages, message_bytes, seconds}.

    Returns ``(alpha_s, bandwidth_Bps)``; relative residuals, non-negative alpha. A point-to-point sample has
    ``messages = 1``; an all-to-all of S bytes over W ranks has ``messages = W - 1`` and ``message_bytes = S/W``.
    An optional ``contention`` (ranks per compute slot, >= 1) divides the time first: the same slow-down the
    model applies when transfers share oversubscribed cores.
    """
    # Divide by the message count (and contention): t/m = alpha + bytes/bw, one linear fit across every W.
    xs = [s["message_bytes"] for s in samples]
    ys = [s["seconds"] / s["messages"] / s.get("contention", 1.0) for s in samples]
    a, c = weighted_linear_fit(xs, ys, [1.0 / y for y in ys])
    if c <= 0:  # latency-bound everywhere: take the largest sample's throughput as the bandwidth
        big = max(samples, key=lambda s: s["message_bytes"])
        c = big["seconds"] / big["messages"] / big.get("contention", 1.0) / big["message_bytes"]
    return max(a, 0.0), 1.0 / c



def compute_slots(samples: dict[int, float], cores: int) -> float:
    """Ranks that compute at once at full speed, from {world: slow-down of a GEMM with world ranks at once}.

    A summary of ``rank_slowdown`` (the model's fallback slow-down is ``max(1, ranks / slots)``): each world
    that slowed down by more than noise (5%) gives ``world / slow-down``; the median of those, between 1 and the
    core count. None slowed: every rank
    had its own core, so the largest world measured (capped by the cores).
    """
    estimates = [world / slow for world, slow in samples.items() if slow > 1.05]
    if not estimates:
        return float(min(max(samples, default=cores), cores))
    return float(min(max(statistics.median(estimates), 1.0), cores))

