"""How an all-to-all costs at scale: constants fitted to published all-to-all measurements only.

The plain alpha-beta model (one latency and one bandwidth per link) prices an all-to-all of 2,048 GPUs like one
of 16 with more messages. Published all-to-all measurements show four effects on top of that, and this module
holds one constant for each, fitted from the numbers in :data:`PUBLISHED` by :func:`fit`:

* **per-message cost growing with peers**: each chunk a rank sends costs ``alpha(P) = alpha0 + gamma * P``
  seconds of latency beside its bytes, P the ranks in the exchange (NCCL progresses one send and one receive per
  peer; more peers, more connections to poll);
* **the bandwidth a message actually gets**: the inter-node link delivers a fraction ``e(N)`` of its line rate
  when N nodes exchange at once, ``e(N) = e_inf + (e_2 - e_inf) * 2 / N`` (two nodes: one clean NIC-to-NIC
  path; many nodes: every NIC sends to and receives from all the others, and the fabric's congestion
  takes its share);
* **one peer cannot fill a NIC**: NCCL drives each network peer through a fixed number of channels (2 by
  default), so the messages to one remote peer move at most ``peer_Bps``; a level whose messages go to m remote
  peers at once gets ``min(line * e(N), m * peer_Bps)`` (it matters where 2DH exchanges with a single other node);
* **compute slowed while NCCL runs**: a communication kernel holds a share ``sm_share`` of the GPU's SMs, so the
  compute it overlaps runs ``1 + sm_share`` times longer.

Nothing here was fitted to a step time of an MoE layer: the figures the simulator reproduces
(``flexmoe simulate --reproduce``) are predictions, not inputs. docs/cost_model.md lists every source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

__all__ = ["A2AScale", "PUBLISHED", "fit", "scale_for", "inter_efficiency", "inter_bandwidth", "message_cost"]

MiB = 2**20


@dataclass(frozen=True)
class A2AScale:
    """The fitted all-to-all constants of one machine (SI units).

    intra_bandwidth_Bps: bytes per second a GPU moves into an intra-node all-to-all (NVLink, one direction).
    inter_line_Bps: the line rate of one GPU's NIC (one direction).
    inter_efficiency_2 / inter_efficiency_many: the fraction of the line rate an inter-node all-to-all gets
        with 2 nodes and with many nodes (:func:`inter_efficiency`).
    alpha_s / per_peer_s: the per-message cost ``alpha_s + per_peer_s * peers`` (:func:`message_cost`).
    peer_Bps: the most one network peer's messages get (:func:`inter_bandwidth`).
    sm_share: share of the SMs a communication kernel holds while it runs beside compute.
    """

    intra_bandwidth_Bps: float
    inter_line_Bps: float
    inter_efficiency_2: float
    inter_efficiency_many: float
    alpha_s: float
    per_peer_s: float
    peer_Bps: float
    sm_share: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> A2AScale:
        """The constants from a profile's ``a2a_scale``; every field present, each a positive number (sm_share
        may be 0)."""
        names = [f.name for f in fields(cls)]
        missing, unknown = sorted(set(names) - set(data)), sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(f"a2a_scale: expected exactly the constants {names}; missing {missing}, "
                             f"unknown {unknown}")
        for name in names:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"a2a_scale.{name}: expected a number, got {value!r}")
            if value < 0 or (value == 0 and name not in ("sm_share", "alpha_s", "per_peer_s")):
                raise ValueError(f"a2a_scale.{name}: expected a positive number, got {value!r}")
        return cls(**{name: float(data[name]) for name in names})


# The published measurements, as (what was measured, the numbers). docs/cost_model.md cites each one.
PUBLISHED: dict[str, dict[str, float]] = {
    # Hwang et al., Tutel, MLSys 2023 (arXiv 2206.03382), appendix A.2: an intra-node all-to-all of S = 128 MiB
    # on m = 8 A100s (Azure NDv4) takes ~600 us with n = 8; cut into the n/m chunks per peer of a 2,048-GPU
    # exchange it takes ~5 ms.
    "tutel_intra": {"bytes": 128 * MiB, "gpus_per_node": 8, "us_n8": 600.0, "us_n2048": 5000.0, "n": 2048},
    # microsoft/mscclpp docs/performance-ndmv4.md (commit 85e664c, 2023-06): nccl-tests alltoall_perf with NCCL
    # 2.17.1 on Azure NDm A100 v4, 2 nodes x 8 GPUs (HDR 200 Gb/s per GPU): 1 GiB per rank at a bus bandwidth of
    # 37.80 GB/s (busbw = algbw * (n - 1) / n, algbw = bytes / time).
    "ndv4_nccl_alltoall": {"bytes": 2**30, "ranks": 16, "gpus_per_node": 8, "line_Bps": 25e9, "busbw_Bps": 37.80e9},
    # The same table, 2 nodes x 1 GPU (one peer over the network): 1 GiB per rank at a bus bandwidth of 15.48 GB/s.
    "ndv4_nccl_alltoall_pair": {"bytes": 2**30, "ranks": 2, "busbw_Bps": 15.48e9},
    # deepseek-ai/DeepEP docs/legacy.md, low-latency kernels (H800, CX7 400 Gb/s ~50 GB/s per NIC, pure RDMA):
    # dispatch RDMA bandwidth 48 / 43 / 39 / 39 GB/s at EP 32 / 64 / 128 / 256 (4 to 32 nodes of 8), counting
    # the 1/nodes of traffic that stays in the node; the remote bandwidth is bw * (1 - 1/nodes).
    "deepep_low_latency": {"line_Bps": 50e9, "ep32": 48e9, "ep64": 43e9, "ep128": 39e9, "ep256": 39e9},
    # NVIDIA/nccl issue #1531: alltoall_perf on 8 nodes x 8 H800 (400 Gb/s NICs): 8 MiB per rank in 337.8 us.
    "nccl_64_ranks": {"bytes": 8 * MiB, "ranks": 64, "gpus_per_node": 8, "line_Bps": 50e9, "us": 337.8},
    # deepseek-ai/DeepEP README (V2): the inter-node EP 8 x 2 kernel runs on 12 of an H100's 132 SMs.
    "deepep_sms": {"sms": 12, "total_sms": 132},
}


def inter_efficiency(scale: A2AScale, nodes: int) -> float:
    """Fraction of the NIC line rate an all-to-all over ``nodes`` nodes gets (1 node: no inter-node traffic)."""
    if nodes <= 1:
        return 1.0
    return scale.inter_efficiency_many + (scale.inter_efficiency_2 - scale.inter_efficiency_many) * 2.0 / nodes


def inter_bandwidth(scale: A2AScale, nodes: int, peers_at_once: int) -> float:
    """Bytes per second one GPU's inter-node messages get when ``nodes`` nodes exchange at once and its messages
    go to ``peers_at_once`` remote peers: the fabric's share of the line, or what that many NCCL peers can
    carry if less."""
    return min(scale.inter_line_Bps * inter_efficiency(scale, nodes), peers_at_once * scale.peer_Bps)


def message_cost(scale: A2AScale, peers: int) -> float:
    """Seconds of latency one message costs in an exchange among ``peers`` ranks."""
    return scale.alpha_s + scale.per_peer_s * peers


def fit(inter_line_Bps: float = 25e9) -> A2AScale:
    """The constants from :data:`PUBLISHED`, in order (each step uses only the ones before it).

    1. intra bandwidth: Tutel's 128 MiB intra-node exchange, 7/8 of it leaving each GPU in 600 us;
    2. alpha0: the same exchange cut into n/m chunks per peer at n = 2,048 costs 4.4 ms more for its
       7 * 2048 / 8 - 7 extra chunks (8 peers: the peer term is negligible there);
    3. e_2: NCCL's all-to-all on two NDv4 nodes: the inter-node half of each GPU's 1 GiB over the measured time,
       against the line rate (its 8 message latencies, ~20 us of 27 ms, are left out); e_inf: DeepEP's remote
       bandwidth over its line rate, averaged over 4 to 32 nodes;
    4. gamma: nccl #1531's 64-rank exchange minus its bytes at e(8) leaves a per-message cost at 64 peers; its
       excess over alpha0 per extra peer;
    5. peer_Bps: NCCL's all-to-all between two NDv4 nodes with one GPU each: the remote half of 1 GiB over
       the measured time (busbw is exactly that for two ranks);
    6. sm_share: DeepEP's SMs over the GPU's.
    """
    t = PUBLISHED["tutel_intra"]
    m = t["gpus_per_node"]
    intra_bw = t["bytes"] * (m - 1) / m / (t["us_n8"] * 1e-6)
    extra_chunks = (m - 1) * t["n"] / m - (m - 1)
    alpha0 = (t["us_n2048"] - t["us_n8"]) * 1e-6 / extra_chunks

    two = PUBLISHED["ndv4_nccl_alltoall"]
    n, g = two["ranks"], two["gpus_per_node"]
    seconds = two["bytes"] / (two["busbw_Bps"] * n / (n - 1))
    e_2 = two["bytes"] * (n - g) / n / seconds / two["line_Bps"]
    dep = PUBLISHED["deepep_low_latency"]
    remote = [dep[f"ep{ep}"] * (1 - 8 / ep) / dep["line_Bps"] for ep in (32, 64, 128, 256)]
    e_inf = sum(remote) / len(remote)

    n64 = PUBLISHED["nccl_64_ranks"]
    ranks, g = int(n64["ranks"]), int(n64["gpus_per_node"])
    nodes = ranks // g
    e_8 = e_inf + (e_2 - e_inf) * 2.0 / nodes
    inter_bytes = n64["bytes"] * (ranks - g) / ranks
    residual = n64["us"] * 1e-6 - inter_bytes / (n64["line_Bps"] * e_8)
    per_message = residual / (ranks - g)
    gamma = max(per_message - alpha0, 0.0) / (ranks - g)

    pair = PUBLISHED["ndv4_nccl_alltoall_pair"]
    pair_seconds = pair["bytes"] / (pair["busbw_Bps"] * pair["ranks"] / (pair["ranks"] - 1))
    peer_bw = pair["bytes"] / pair["ranks"] / pair_seconds

    sms = PUBLISHED["deepep_sms"]
    return A2AScale(intra_bandwidth_Bps=intra_bw, inter_line_Bps=inter_line_Bps, inter_efficiency_2=e_2,
                    inter_efficiency_many=e_inf, alpha_s=alpha0, per_peer_s=gamma, peer_Bps=peer_bw,
                    sm_share=sms["sms"] / sms["total_sms"])


# The machines with a fit: Azure NDv4 (A100, HDR 200 Gb/s per GPU). Other profiles keep the plain alpha-beta
# model (a calibrated CPU profile measures its own links).
_FITTED = {"a100-ndv4": fit(inter_line_Bps=25e9)}


class _Described(Protocol):
    """What :func:`scale_for` reads of a :class:`~flexmoe.tuning.profile.Profile` (which imports this module)."""

    name: str
    a2a_scale: dict[str, float]


def scale_for(profile: _Described | str) -> A2AScale | None:
    """The fitted constants of ``profile``: its own ``a2a_scale`` (fitted to the cluster's measurements by
    ``flexmoe fit-a2a``), else the published fit of a profile of that name, else None (plain alpha-beta
    all-to-all)."""
    if isinstance(profile, str):
        return _FITTED.get(profile)
    if profile.a2a_scale:
        return A2AScale.from_dict(profile.a2a_scale)
    return _FITTED.get(profile.name)
