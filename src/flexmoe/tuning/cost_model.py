"""The cost model: the time of one MoE layer's forward + backward, from a hardware profile.

Pure functions of (:class:`~flexmoe.tuning.profile.Profile`, :class:`LayerConfig`); nothing here touches a
tensor or a process group, so the model is cheap enough to run inside the layer's ``parallel="auto"`` and
the shadowing policy, and to sweep thousands of configurations in ``flexmoe simulate``.

The pieces (docs/cost_model.md has the equations):

* compute: every GEMM on a roofline, ``overhead + max(flops / (peak * m / (m + m_half)), bytes / bw)``;
* memory-bound ops (gather, scatter-add, elementwise) at their calibrated bandwidths plus a per-op overhead;
* communication: alpha-beta per link level (inside a node, between nodes). A flat all-to-all sends W-1
  messages of S/W bytes per rank; the 2-D hierarchical one sends G-1 messages of S/G inside the node, then N-1
  messages of S/N between nodes, plus two local re-layout copies;
* pipelining with degree d: d chunks, each a2a overlapping the previous chunk's compute;
* the straggler: every all-to-all waits for the busiest rank, so the layer runs at the pace of the rank with
  the most expert rows; shadowing an expert moves its rows to their source ranks at the price of a weight
  broadcast (forward) and a gradient reduce (backward).

None of the papers' speed-ups is written in: they follow from message counts and sizes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexmoe.parallel.layout import experts_per_rank, shards_per_expert
from flexmoe.parallel.layout import valid_r as layout_valid_r
from flexmoe.tuning.a2a_scale import A2AScale, inter_bandwidth, message_cost, scale_for
from flexmoe.tuning.profile import ComputeSpec, LinkSpec, Profile

__all__ = [
    "DTYPE_BYTES",
    "LayerConfig",
    "Breakdown",
    "gemm_time",
    "memory_time",
    "first_touch_time",
    "p2p_time",
    "PLACEMENTS",
    "price_placements",
    "choose_placement",
    "a2a_flat_time",
    "a2a_2dh_time",
    "a2a_time",
    "allgather_time",
    "broadcast_time",
    "pipelined_time",
    "ffn_times",
    "expert_rows",
    "token_reach",
    "sends_tokens",
    "valid_r",
    "layer_time",
    "slowdown_at",
    "predict",
    "score_candidates",
    "rank_candidates",
    "prune_candidates",
    "choose_shadowed",
]

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}

# Framework ops per stage (kernel launches / dispatcher calls / autograd nodes), counted from the code paths of
# flexmoe.layer (router, make_plan, dispatch, combine) and experts.FeedForwardExperts, forward + backward.
OPS_ROUTER_PLAN = 60
OPS_PER_EXPERT = 14  # addmm, act, addmm forward; 2x(2 mm + bias sum) + act backward; split/cat share
OPS_DISPATCH_COMBINE = 16
OPS_PER_CHUNK = 8  # per pipeline chunk and direction: slicing, async a2a handles, wait, cat
OPS_DENSE_DISPATCH = 24  # one-hot masks, two einsums forward, three backward, reshapes


@dataclass(frozen=True)
class LayerConfig:
    """One MoE layer on ``ranks`` expert-parallel ranks; ``tokens`` is the per-rank token count.

    experts: global experts E. With E >= W each rank holds E/W whole experts; with E < W each expert is sharded
        over s = W/E ranks along the hidden dimension. ``r`` picks the parallel style (docs/architecture.md,
        "Experts over ranks"): r = 0 gathers every expert on every rank (no all-to-all, any layout),
        1 <= r <= s (r | s) keeps weights r-way sharded inside groups of r ranks and gathers them across the s/r
        groups (r = s: pure model parallel, no gather; r = 1 with whole experts: plain expert parallelism).
    capacity_factor: as in the layer (0: dropless). ``dispatch`` is "index" (gather/scatter-add, rows only for
        real tokens) or "dense" (the GShard/fairseq one-hot einsum, experts compute every padded slot).
    a2a: "flat" or "2dh"; overlap_degree: pipeline chunks d; ranks_per_node: None takes the profile's.
    skew: the hottest expert's load over the mean (expert 0 is hot, the others share the rest evenly), or
        ``expert_shares`` (fractions of the routed (token, choice) pairs per expert, summing to 1).
    shadowed: global ids of experts whose weights are broadcast to every rank (FasterMoE), E >= W only.
    padded_a2a: capacity mode exchanges the full E x C buffer (a fixed-size all-to-all, as Tutel and GShard do)
        rather than the real rows with uneven splits (flexmoe's layer). Dense dispatch always pads.
    token_exchange: at r = 1, d = 1 over whole experts (index dispatch, no padding, no shadowing) each token goes
        once to every rank holding one of its experts, as flexmoe's layer does (docs/architecture.md, "Each
        token once per rank"); False prices one row per (token, expert) pair, as the peers send.
    replicas: per rank, the experts its replica slots copy, -1 for an empty slot (``redundant_experts``, whole
        experts, rows sent):
        an expert's rows are split evenly among its owner and its copies, and the copies' weights travel each
        step (an all-to-all forward, its gradients back), :mod:`flexmoe.parallel.replicas`.
    """

    tokens: int
    model_dim: int
    hidden_dim: int
    experts: int
    k: int = 2
    capacity_factor: float = 1.25
    dtype: str = "float32"
    ranks: int = 1
    ranks_per_node: int | None = None
    r: int | None = None
    overlap_degree: int = 1
    a2a: str = "flat"
    dispatch: str = "index"
    skew: float = 1.0
    expert_shares: tuple[float, ...] | None = None
    shadowed: tuple[int, ...] = ()
    glu: bool = False
    padded_a2a: bool = False
    token_exchange: bool = True
    replicas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("tokens", "model_dim", "hidden_dim", "experts", "k", "ranks", "overlap_degree"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k > self.experts:
            raise ValueError(f"k={self.k} > experts={self.experts}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.a2a not in ("flat", "2dh"):
            raise ValueError(f"a2a must be 'flat' or '2dh', got {self.a2a!r}")
        if self.dispatch not in ("index", "dense"):
            raise ValueError(f"dispatch must be 'index' or 'dense', got {self.dispatch!r}")
        e, w = self.experts, self.ranks
        if e % w and w % e:
            raise ValueError(f"experts={e} and ranks={w}: one must divide the other")
        if self.skew < 1.0:
            raise ValueError(f"skew is the hottest load over the mean, >= 1; got {self.skew}")
        if self.r is not None and self.r not in valid_r(self):
            raise ValueError(f"r={self.r} is not valid for {e} experts on {w} ranks; valid: {valid_r(self)}")

    @property
    def shards(self) -> int:
        """s: ranks sharing one expert (1 when E >= W), by the layout's rule."""
        return shards_per_expert(self.experts, self.ranks)

    @property
    def experts_per_rank(self) -> int:
        return experts_per_rank(self.experts, self.ranks)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def resolved_r(self) -> int:
        """r, defaulting to 1 as MoELayer does (whole experts: plain expert parallelism; sharded: gathered)."""
        return 1 if self.r is None else self.r

    def shares(self) -> list[float]:
        """Fraction of all routed (token, choice) pairs going to each expert."""
        if self.expert_shares is not None:
            if len(self.expert_shares) != self.experts:
                raise ValueError(f"expert_shares needs {self.experts} entries, got {len(self.expert_shares)}")
            total = float(sum(self.expert_shares))
            return [x / total for x in self.expert_shares]
        e = self.experts
        hot = min(self.skew / e, 1.0)
        rest = (1.0 - hot) / (e - 1) if e > 1 else 0.0
        return [hot] + [rest] * (e - 1)

    def capacity(self) -> int:
        """Per-expert capacity per source rank, as the layer computes it (dropless: the largest local load)."""
        t, e, k, cf = self.tokens, self.experts, self.k, self.capacity_factor
        if cf > 0:
            return math.ceil(k * cf * t / e)
        max_load = math.ceil(t * k * max(self.shares()))
        if cf == 0:
            return max_load
        return min(max_load, math.ceil(k * -cf * t / e))


@dataclass
class Breakdown:
    """Predicted seconds of one forward + backward, by stage, for the straggler rank."""

    router_plan: float = 0.0
    dispatch_combine: float = 0.0
    experts: float = 0.0  # expert compute (forward + backward), before overlap
    a2a: float = 0.0  # all-to-all time (forward + backward), before overlap
    pipelined: float = 0.0  # experts + a2a after chunking and overlap
    weights_comm: float = 0.0  # all-gather / reduce-scatter of sharded expert weights (r < s)
    shadow_comm: float = 0.0  # broadcast + reduce of shadowed experts
    total: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- compute


def gemm_time(spec: ComputeSpec, memory_bandwidth: float, m: int, n: int, k: int, dtype_bytes: int) -> float:
    """Seconds for ``[m, k] @ [k, n]`` on the roofline of ``spec``.

    The compute roof bends down as ``d / (d + half_dim)`` with d the smallest dimension (thin GEMMs cannot keep
    the units busy); the memory roof moves the three matrices once.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    d = min(m, n, k)
    efficiency = d / (d + spec.half_dim) if spec.half_dim > 0 else 1.0
    moved = (m * k + k * n + m * n) * dtype_bytes
    return spec.overhead_s + max(flops / (spec.peak_flops * efficiency), moved / memory_bandwidth)


def memory_time(num_bytes: float, bandwidth: float, ops: int = 0, op_overhead: float = 0.0) -> float:
    """A memory-bound stage: bytes over bandwidth plus a fixed cost per op."""
    return num_bytes / bandwidth + ops * op_overhead


# glibc's largest mmap threshold on 64-bit: buffers at least this large are mapped fresh at every allocation
# (and unmapped when freed), so every one of their pages faults when first written; smaller ones are reused
# from the heap.
FRESH_MAPPING_BYTES = 32 * 2**20


def first_touch_time(profile: Profile, buffer_bytes: float, count: int = 1) -> float:
    """Page-fault cost of ``count`` freshly allocated buffers of ``buffer_bytes`` each (0 below the threshold)."""
    if profile.first_touch_bandwidth_Bps <= 0 or buffer_bytes < FRESH_MAPPING_BYTES:
        return 0.0
    return count * buffer_bytes / profile.first_touch_bandwidth_Bps


def ffn_times(profile: Profile, rows: float, model_dim: int, hidden_dim: int, dtype: str, glu: bool = False,
              ) -> tuple[float, float]:
    """(forward, backward) seconds of one expert FFN over ``rows`` rows.

    Forward: x@w1 [rows, M]x[M, H] (and x@w3 with GLU), act, h@w2 [rows, H]x[H, M]. Backward: for each GEMM one
    GEMM for the input gradient and one for the weight gradient (2x the forward flops), and the activation's
    backward. Elementwise traffic: act forward reads/writes rows*H; backward reads two and writes one.
    """
    rows_i = int(math.ceil(rows))
    if rows_i <= 0:
        return 0.0, 0.0
    spec = profile.compute_for(dtype)
    b = DTYPE_BYTES[dtype]
    bw = profile.memory_bandwidth_Bps
    up = gemm_time(spec, bw, rows_i, hidden_dim, model_dim, b)  # x @ w1: [rows, M] x [M, H]
    down = gemm_time(spec, bw, rows_i, model_dim, hidden_dim, b)  # h @ w2: [rows, H] x [H, M]
    n_up = 2 if glu else 1
    # Backward of x@w1: grad_x [rows,H]x[H,M] and grad_w1 [M,rows]x[rows,H]; of h@w2: grad_h and grad_w2.
    up_bwd = (gemm_time(spec, bw, rows_i, model_dim, hidden_dim, b)
              + gemm_time(spec, bw, model_dim, hidden_dim, rows_i, b))
    down_bwd = (gemm_time(spec, bw, rows_i, hidden_dim, model_dim, b)
                + gemm_time(spec, bw, hidden_dim, model_dim, rows_i, b))
    act_elems = rows_i * hidden_dim
    act_fwd = memory_time(2 * act_elems * b * (2 if glu else 1), bw)
    act_bwd = memory_time(3 * act_elems * b * (2 if glu else 1) + 2 * act_elems * b, bw)  # + bias-grad reduce
    ops = OPS_PER_EXPERT * profile.op_overhead_s
    fwd = n_up * up + down + act_fwd + ops / 3
    bwd = n_up * up_bwd + down_bwd + act_bwd + 2 * ops / 3
    return fwd, bwd


# ------------------------------------------------------------------------------------------- communication


def p2p_time(link: LinkSpec, num_bytes: float) -> float:
    """One point-to-point message: alpha + bytes / bandwidth."""
    return link.alpha_s + num_bytes / link.bandwidth_Bps if num_bytes > 0 else 0.0


def _a2a_level(link: LinkSpec, messages: int, message_bytes: float) -> float:
    # A rank's messages on one level leave through one port: their latencies and bytes add up.
    if messages <= 0:
        return 0.0
    return messages * (link.a2a_alpha_s + message_bytes / link.a2a_bandwidth_Bps)


def _scaled_level(scale: A2AScale, messages: int, message_bytes: float, peers: int, nodes: int) -> float:
    """One level of an all-to-all under the fitted scale model (:mod:`flexmoe.tuning.a2a_scale`): every message
    pays the per-message cost of an exchange among ``peers`` ranks; its bytes move at the NVLink bandwidth
    (``nodes == 1``) or at what ``messages`` remote peers get of the NIC when ``nodes`` nodes exchange at once
    (:func:`~flexmoe.tuning.a2a_scale.inter_bandwidth`)."""
    if messages <= 0:
        return 0.0
    if nodes <= 1:
        bandwidth = scale.intra_bandwidth_Bps
    else:
        bandwidth = inter_bandwidth(scale, nodes, messages)
    return messages * (message_cost(scale, peers) + message_bytes / bandwidth)


def a2a_flat_time(profile: Profile, num_bytes: float, ranks: int, ranks_per_node: int) -> float:
    """Flat (linear) all-to-all of ``num_bytes`` per rank: W-1 messages of S/W, G-1 of them inside the node.

    The intra-node and inter-node messages travel on different links at the same time, so the slower level sets
    the time. With a fitted scale model every message pays the per-message cost of a W-rank exchange and the
    inter-node bytes get the share of the line rate that N = W/G nodes exchanging at once get.
    """
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    g = min(ranks_per_node, ranks)
    size = num_bytes / ranks
    scale = scale_for(profile)
    if scale is not None:
        nodes = max(ranks // g, 1)
        return max(_scaled_level(scale, g - 1, size, ranks, 1),
                   _scaled_level(scale, ranks - g, size, ranks, nodes))
    return max(_a2a_level(profile.intra, g - 1, size), _a2a_level(profile.inter, ranks - g, size))


def a2a_2dh_time(profile: Profile, num_bytes: float, ranks: int, ranks_per_node: int) -> float:
    """2-D hierarchical all-to-all (Tutel): G-1 messages of S/G inside the node, then N-1 of S/N between nodes.

    Each phase is preceded by a local re-layout of the S bytes (read + write at memory bandwidth) that groups
    rows by destination, which is what makes the messages large. With a fitted scale model the intra phase is an
    exchange among G peers and the inter phase among N (the ranks with the same local index).
    """
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    g = min(ranks_per_node, ranks)
    n = ranks // g
    scale = scale_for(profile)
    if scale is not None:
        intra = _scaled_level(scale, g - 1, num_bytes / g, g, 1)
        inter = _scaled_level(scale, n - 1, num_bytes / n, n, n)
    else:
        intra = _a2a_level(profile.intra, g - 1, num_bytes / g)
        inter = _a2a_level(profile.inter, n - 1, num_bytes / n)
    relayout = 2 * memory_time(2 * num_bytes, profile.memory_bandwidth_Bps, ops=2, op_overhead=profile.op_overhead_s)
    return intra + inter + relayout


def a2a_time(profile: Profile, num_bytes: float, ranks: int, ranks_per_node: int, algorithm: str) -> float:
    if algorithm == "flat":
        return a2a_flat_time(profile, num_bytes, ranks, ranks_per_node)
    if algorithm == "2dh":
        return a2a_2dh_time(profile, num_bytes, ranks, ranks_per_node)
    raise ValueError(f"unknown all-to-all algorithm {algorithm!r}")


def _link_for(profile: Profile, group_size: int, ranks_per_node: int) -> LinkSpec:
    """The slowest link a group of consecutive ranks spans."""
    return profile.intra if group_size <= ranks_per_node else profile.inter


def allgather_time(profile: Profile, total_bytes: float, group_size: int, ranks_per_node: int) -> float:
    """Ring all-gather (also the cost of a reduce-scatter) of ``total_bytes`` over ``group_size`` ranks."""
    if group_size <= 1 or total_bytes <= 0:
        return 0.0
    link = _link_for(profile, group_size, ranks_per_node)
    steps = group_size - 1
    return steps * (link.alpha_s + total_bytes / group_size / link.bandwidth_Bps)


def broadcast_time(profile: Profile, num_bytes: float, group_size: int, ranks_per_node: int) -> float:
    """Pipelined tree broadcast (also a reduce): log2(p) latencies plus the bytes once over the slowest link."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    link = _link_for(profile, group_size, ranks_per_node)
    return math.ceil(math.log2(group_size)) * link.alpha_s + num_bytes / link.bandwidth_Bps


def pipelined_time(a2a_in: float, compute: float, a2a_out: float, chunks: int, overlap_efficiency: float = 1.0,
                   chunk_overhead: float = 0.0, compute_slowdown: float = 0.0) -> float:
    """Dispatch a2a -> compute -> combine a2a, split into ``chunks`` chunks.

    Arguments are the times of *one chunk*. The first chunk runs its stages in sequence; each later chunk costs
    the larger of its communication and the previous chunk's compute, plus the part of the smaller one that does
    not overlap (``1 - overlap_efficiency``). While a transfer runs beside it, compute is ``1 + compute_slowdown``
    times slower (the communication kernel holds some of the SMs). Every chunk pays ``chunk_overhead``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if compute_slowdown < 0:
        raise ValueError(f"compute_slowdown must be >= 0, got {compute_slowdown}")
    first = a2a_in + compute + a2a_out
    comm = a2a_in + a2a_out
    shared = compute * (1.0 + compute_slowdown)
    steady = max(comm, shared) + (1.0 - overlap_efficiency) * min(comm, shared)
    return first + (chunks - 1) * steady + chunks * chunk_overhead


# ------------------------------------------------------------------------------------------------ the layer


def valid_r(config: LayerConfig) -> list[int]:
    """The r values the layer allows for this shape (built-in experts): the layout's own rule,
    :func:`flexmoe.parallel.layout.valid_r`."""
    return layout_valid_r(config.shards, config.ranks)


def expert_rows(config: LayerConfig) -> list[float]:
    """Global rows each expert computes (all source ranks), after capacity (dense dispatch: every padded slot)."""
    w, t, k = config.ranks, config.tokens, config.k
    cap = config.capacity()
    if config.dispatch == "dense":
        return [float(w * cap)] * config.experts
    rows = []
    for share in config.shares():
        per_source = t * k * share
        if config.capacity_factor != 0:
            per_source = min(per_source, cap)
        rows.append(w * per_source)
    return rows


def token_reach(config: LayerConfig) -> list[float]:
    """Per rank, the chance that a token has at least one of its k experts there (it is then sent there once).

    A rank whose experts take a share p of the pairs counts as ``n = p * E`` experts; a token's k experts are k
    distinct ones, so it misses the rank with probability ``prod_{i<k} (E - n - i) / (E - i)`` (exact for even
    shares: E=64, W=4, k=8 reaches 0.914 of the ranks, 3.66 per token)."""
    e, k, per_rank = config.experts, config.k, config.experts_per_rank
    shares = config.shares()
    reach = []
    for rank in range(config.ranks):
        n = sum(shares[rank * per_rank:(rank + 1) * per_rank]) * e
        miss = 1.0
        for i in range(k):
            miss *= max(e - n - i, 0.0) / (e - i)
        reach.append(1.0 - miss)
    return reach


def sends_tokens(config: LayerConfig) -> bool:
    """Whether the layer sends tokens rather than rows at this config (:func:`token_reach`): ``token_exchange``,
    more than one rank, whole experts, r = 1, d = 1, index dispatch without padding, nothing shadowed."""
    return (config.token_exchange and config.ranks > 1 and config.shards == 1 and config.resolved_r() == 1
            and config.overlap_degree == 1 and config.dispatch == "index" and not config.padded_a2a
            and not config.shadowed and not config.replicas)


def _ranks_per_node(profile: Profile, config: LayerConfig) -> int:
    """G of the all-to-all: the ranks grouped as one node (the config's, for 2DH, else the machine's)."""
    g = config.ranks_per_node or profile.ranks_per_node
    return max(1, min(g, config.ranks))


def _contention(profile: Profile, config: LayerConfig) -> float:
    """Compute slow-down when more ranks share a machine than it has compute slots (CPU ranks on few cores).

    Physical, so the profile's ranks per node, not the config's: grouping 4 ranks of one 2-core host as
    2 x 2 for a 2-D all-to-all does not give them more cores.
    """
    on_host = max(1, min(profile.ranks_per_node, config.ranks))
    if profile.rank_slowdown:
        return slowdown_at(profile.rank_slowdown, on_host)
    return max(1.0, on_host / max(profile.compute_slots_per_node, 1))


def slowdown_at(measured: dict[str, float], ranks: int) -> float:
    """Compute slow-down of ``ranks`` busy ranks on one host from the calibrated points (1 rank: 1).

    Linear between measured rank counts; past the largest one every extra rank shares the same cores, so
    the slow-down grows in proportion to the ranks.
    """
    points = sorted([(1, 1.0)] + [(int(n), max(float(x), 1.0)) for n, x in measured.items() if int(n) > 1])
    for (n0, x0), (n1, x1) in zip(points, points[1:]):
        if ranks <= n1:
            return x0 + (x1 - x0) * (ranks - n0) / (n1 - n0)
    n_max, x_max = points[-1]
    return x_max * ranks / n_max


def _router_plan_time(profile: Profile, config: LayerConfig) -> float:
    # The router GEMM runs in float32 whatever the model dtype ([T, M] x [M, E], and twice more backward).
    spec = profile.compute_for("float32")
    t, m, e, k = config.tokens, config.model_dim, config.experts, config.k
    bw = profile.memory_bandwidth_Bps
    gate = gemm_time(spec, bw, t, e, m, 4) + gemm_time(spec, bw, t, m, e, 4) + gemm_time(spec, bw, m, e, t, 4)
    # softmax, stable sort over E, z-loss, balance loss: a few passes over [T, E]; slot assignment over T*k.
    passes = 12 * t * e * 4 + 2 * t * e * 4 * max(math.log2(e), 1) + 24 * t * k * 8
    return gate + memory_time(passes, bw, OPS_ROUTER_PLAN, profile.op_overhead_s)


def _index_dispatch_combine_time(profile: Profile, config: LayerConfig, rows: float) -> float:
    """Gather the rows, weight and scatter-add them back, forward and backward (local, O(T*k*M))."""
    m, b, t = config.model_dim, config.dtype_bytes, config.tokens
    row_bytes = rows * m * b
    gather = 2 * row_bytes / profile.gather_bandwidth_Bps  # read + write
    scatter = 2 * row_bytes / profile.scatter_bandwidth_Bps
    elementwise = (3 * row_bytes * 3 + t * m * b) / profile.memory_bandwidth_Bps  # weight mul fwd/bwd, zeros, dw
    # forward: gather (dispatch) + scatter (combine); backward: scatter (dispatch's) + gather (combine's).
    return 2 * gather + 2 * scatter + elementwise + OPS_DISPATCH_COMBINE * profile.op_overhead_s


def _dense_dispatch_combine_time(profile: Profile, config: LayerConfig) -> float:
    """The GShard einsums: dispatch 'sec,sm->ecm' and combine 'sec,ecm->sm' as [E*C, T] GEMMs, plus masks."""
    t, m, e, b = config.tokens, config.model_dim, config.experts, config.dtype_bytes
    ec = e * config.capacity()
    spec = profile.compute_for(config.dtype)
    bw = profile.memory_bandwidth_Bps
    one = gemm_time(spec, bw, ec, m, t, b)  # [E*C, T] x [T, M] (and its transposes: same flops)
    # forward: dispatch + combine; backward: dispatch's input grad, combine's expert-output and weight grads.
    gemms = 5 * one
    masks = 6 * t * ec * b / bw  # one-hot [T, E, C] built, cast, and read back for the weight gradient
    # Fresh [T, E, C] buffers every step: combine weights, dispatch mask, and the weights' gradient.
    fresh = first_touch_time(profile, t * ec * b, count=3)
    return gemms + masks + fresh + OPS_DENSE_DISPATCH * profile.op_overhead_s


def _weight_bytes(config: LayerConfig) -> float:
    """Bytes of one whole expert's weight matrices (w1, w2 and w3 with GLU), without biases."""
    return (3 if config.glu else 2) * config.model_dim * config.hidden_dim * config.dtype_bytes


def _param_bytes(config: LayerConfig) -> float:
    m, h = config.model_dim, config.hidden_dim
    return ((3 if config.glu else 2) * m * h + h + m) * config.dtype_bytes


@dataclass
class _Layout:
    """What the layer's stages share about where rows go at one config (:func:`_layout`).

    capacity: per-expert capacity per source rank; shares: each expert's fraction of the routed pairs; rows: the
    global rows each expert computes (:func:`expert_rows`); shadowed: the experts every rank computes its own
    tokens of (whole experts over several ranks, r > 0 only); replicated: whether replica slots are in use;
    copies: holders of each expert (its owner and its replicas); held_copies: per rank, the experts its replica
    slots hold (empty unless replicated); reach: per rank, the share of tokens it receives when the layer sends
    tokens (:func:`token_reach`), None when it sends rows.
    """

    capacity: int
    shares: list[float]
    rows: list[float]
    shadowed: set[int]
    replicated: bool
    copies: list[int]
    held_copies: list[list[int]]
    reach: list[float] | None


def _layout(config: LayerConfig) -> _Layout:
    """The :class:`_Layout` of ``config``; ``ValueError`` for a shadowed expert out of range or replicas where
    the layer cannot place them."""
    w, e, s, r = config.ranks, config.experts, config.shards, config.resolved_r()
    capacity, rows, shares = config.capacity(), expert_rows(config), config.shares()
    shadowed = set(config.shadowed) if s == 1 and w > 1 and r > 0 else set()
    for x in shadowed:
        if not 0 <= x < e:
            raise ValueError(f"shadowed expert {x} out of range [0, {e})")
    replicated = bool(config.replicas) and s == 1 and w > 1 and r == 1
    if config.replicas and not replicated:
        raise ValueError("replicas need whole experts (experts % ranks == 0) over several ranks at r = 1")
    copies = [1] * e
    held_copies = [[x for x in slots if x >= 0] for slots in config.replicas] if replicated else []
    for slots in held_copies:
        for x in slots:
            copies[x] += 1
    reach = token_reach(config) if sends_tokens(config) else None
    return _Layout(capacity, shares, rows, shadowed, replicated, copies, held_copies, reach)


def _local_rows(config: LayerConfig, lay: _Layout) -> float:
    """Rows this rank sends out through the all-to-all (and gathers / scatters locally): the tokens sent and the
    partial sums back when it sends tokens, else one row per kept (token, choice) pair, or every padded slot."""
    t, k = config.tokens, config.k
    if lay.reach is not None:
        return t * sum(lay.reach)
    if config.dispatch == "index" and config.capacity_factor == 0:
        return t * k
    if config.dispatch == "index":
        return sum(min(t * k * sh, lay.capacity) for sh in lay.shares)
    return config.experts * lay.capacity


def _ffn(profile: Profile, config: LayerConfig, rows: float, hidden: int, slow: float) -> tuple[float, float]:
    """(forward, backward) seconds of one expert's FFN on ``rows`` rows, in d chunks of rows / d each."""
    d = config.overlap_degree
    f, bk = ffn_times(profile, rows / d, config.model_dim, hidden, config.dtype, config.glu)
    return f * d * slow, bk * d * slow


def _straggler_compute(profile: Profile, config: LayerConfig, lay: _Layout, slow: float) -> tuple[float, float, int]:
    """Whole experts (s = 1): (forward, backward, rank) of the rank with the most expert work, its share of the
    shadowed experts' rows included (every rank computes its own tokens of those)."""
    w, h = config.ranks, config.hidden_dim
    per_rank = config.experts_per_rank
    worst = (-1.0, 0.0, 0.0, 0)
    for rank in range(w):
        fwd = bwd = 0.0
        held = list(range(rank * per_rank, (rank + 1) * per_rank))
        held += lay.held_copies[rank] if lay.replicated else []
        for x in held:
            if x in lay.shadowed:
                continue
            f, bk = _ffn(profile, config, lay.rows[x] / lay.copies[x], h, slow)
            fwd, bwd = fwd + f, bwd + bk
        if fwd + bwd > worst[0]:
            worst = (fwd + bwd, fwd, bwd, rank)
        if config.expert_shares is None and rank >= 1 and not lay.shadowed and not lay.replicated:
            break  # with the built-in skew, ranks 1.. are identical: rank 1 stands for all of them
    _, c_fwd, c_bwd, straggler = worst
    shadow_fwd = shadow_bwd = 0.0
    for x in lay.shadowed:
        f, bk = _ffn(profile, config, lay.rows[x] / w, h, slow)
        shadow_fwd += f
        shadow_bwd += bk
    return c_fwd + shadow_fwd, c_bwd + shadow_bwd, straggler


def _expert_compute(profile: Profile, config: LayerConfig, lay: _Layout, slow: float) -> tuple[float, float, int]:
    """(forward, backward) expert seconds of the straggler (the rank with the most work) and its rank."""
    w, e, s, r, h = config.ranks, config.experts, config.shards, config.resolved_r(), config.hidden_dim
    if w > 1 and r == 0:
        # Every rank runs its own tokens through every (gathered) expert: no all-to-all, no straggler.
        c_fwd = c_bwd = 0.0
        for x in range(e):
            f, bk = _ffn(profile, config, lay.rows[x] / w, h, slow)
            c_fwd, c_bwd = c_fwd + f, c_bwd + bk
        return c_fwd, c_bwd, 0
    if s == 1:
        return _straggler_compute(profile, config, lay, slow)
    # s ranks share expert x: s/r groups split its rows; inside a group r ranks hold H/r each, same rows.
    hottest = max(range(e), key=lambda x: lay.rows[x])
    c_fwd, c_bwd = _ffn(profile, config, lay.rows[hottest] * r / s, h // r, slow)
    return c_fwd, c_bwd, hottest * s


def _grad_stack_time(profile: Profile, config: LayerConfig, slow: float) -> float:
    """Backward's gathering of the per-expert weight gradients into the batched parameters' gradients."""
    w, e, s, r = config.ranks, config.experts, config.shards, config.resolved_r()
    local_weights = _weight_bytes(config) * (e if w > 1 and r == 0 else config.experts_per_rank)
    if s > 1 and r > 0:
        local_weights = _weight_bytes(config) / s
    stack_bw = profile.grad_stack_bandwidth_Bps or profile.memory_bandwidth_Bps / 2
    n_weights = 3 if config.glu else 2  # one stacked gradient [E_local, M, H] per weight tensor
    return (local_weights / stack_bw + first_touch_time(profile, local_weights / n_weights, n_weights)) * slow


def _a2a_bytes(config: LayerConfig, lay: _Layout, straggler: int) -> float:
    """All-to-all bytes of the straggler per direction: what it sends, or what it receives if more (hot experts)."""
    w, e, s, r = config.ranks, config.experts, config.shards, config.resolved_r()
    t, k, m, b, cap = config.tokens, config.k, config.model_dim, config.dtype_bytes, lay.capacity
    if w == 1 or r == 0:
        return 0.0
    if s > 1:
        # Each row goes to the r ranks of one group (replicated), and r partial results come back.
        return (e * cap if config.padded_a2a and config.capacity_factor != 0 else t * k) * r * m * b
    per_rank = config.experts_per_rank
    mine = list(range(straggler * per_rank, (straggler + 1) * per_rank))
    mine += lay.held_copies[straggler] if lay.replicated else []
    send_rows: float
    recv_rows: float
    if config.padded_a2a and config.capacity_factor != 0 or config.dispatch == "dense":
        send_rows = sum(cap for x in range(e) if x not in lay.shadowed)
        recv_rows = w * cap * sum(1 for x in mine if x not in lay.shadowed)
    elif lay.reach is not None:
        send_rows, recv_rows = t * sum(lay.reach), w * t * lay.reach[straggler]
    else:
        send_rows = sum(t * k * lay.shares[x] for x in range(e) if x not in lay.shadowed)
        recv_rows = sum(lay.rows[x] / lay.copies[x] for x in mine if x not in lay.shadowed)
    return max(send_rows * m * b, recv_rows * m * b)


def _exchange_times(profile: Profile, config: LayerConfig, volume: float, g: int, slow: float,
                    compute: tuple[float, float], tokens_out: bool) -> tuple[float, float]:
    """(all-to-all seconds before overlap, experts and all-to-all after chunking and overlap), forward +
    backward, for ``volume`` bytes per direction and the straggler's ``compute`` (forward, backward) seconds."""
    w, d, t, k = config.ranks, config.overlap_degree, config.tokens, config.k
    comm_slow = slow if profile.comm_uses_compute else 1.0
    chunk_a2a = a2a_time(profile, volume / d, w, g, config.a2a) * comm_slow
    a2a = 4 * chunk_a2a * d  # dispatch + combine, forward and backward
    # Sending tokens adds, per direction, the exchange of the pairs' weight, token index and expert ([T*k, 3]
    # float64). Its count all-gather replaces the row exchange's (neither is priced).
    pairs_a2a = a2a_time(profile, t * k * 24, w, g, config.a2a) * comm_slow if tokens_out else 0.0
    a2a += 2 * pairs_a2a
    overhead = OPS_PER_CHUNK * profile.op_overhead_s if d > 1 else 0.0
    # Overlap needs an idle engine: with ranks outnumbering the cores that also move the bytes, nothing hides.
    eta = 0.0 if profile.comm_uses_compute and slow > 1 else profile.overlap_efficiency
    # A fitted GPU model says what overlap costs instead: the transfer hides whole, the compute beside it slows.
    scale = scale_for(profile)
    slowdown = 0.0
    if scale is not None:
        eta, slowdown = 1.0, scale.sm_share
    fwd = pipelined_time(chunk_a2a, compute[0] / d, chunk_a2a, d, eta, overhead, slowdown) + pairs_a2a
    bwd = pipelined_time(chunk_a2a, compute[1] / d, chunk_a2a, d, eta, overhead, slowdown) + pairs_a2a
    return a2a, fwd + bwd


def _weights_comm_time(profile: Profile, config: LayerConfig, lay: _Layout, g: int, comm_slow: float) -> float:
    """Expert weights moved each step: gathered for r < s (forward all-gather, backward reduce-scatter of the
    gradients), or the replicas' copies sent from their owners and their gradients back."""
    w, e, s, r = config.ranks, config.experts, config.shards, config.resolved_r()
    p = _param_bytes(config)
    seconds = 0.0
    if w > 1 and r == 0:
        seconds = 2 * allgather_time(profile, e * p, w, g) * comm_slow
    elif s > 1 and r < s:
        seconds = 2 * allgather_time(profile, p / r, s // r, g) * comm_slow
    if lay.replicated:
        # One all-to-all each way, as large as the busiest sender's (the owner of the most copied experts) or
        # receiver's.
        per_rank = config.experts_per_rank
        sent = max(sum(lay.copies[x] - 1 for x in range(o * per_rank, (o + 1) * per_rank)) for o in range(w))
        received = max(len(slots) for slots in lay.held_copies)
        seconds = 2 * a2a_time(profile, max(sent, received) * p, w, g, config.a2a) * comm_slow
    return seconds


def layer_time(profile: Profile, config: LayerConfig) -> Breakdown:
    """Predicted forward + backward seconds of one MoE layer, with its breakdown."""
    g = _ranks_per_node(profile, config)
    slow = _contention(profile, config)
    lay = _layout(config)
    out = Breakdown()
    out.router_plan = _router_plan_time(profile, config) * slow
    if config.dispatch == "dense":
        out.dispatch_combine = _dense_dispatch_combine_time(profile, config) * slow
    else:
        out.dispatch_combine = _index_dispatch_combine_time(profile, config, _local_rows(config, lay)) * slow
    c_fwd, c_bwd, straggler = _expert_compute(profile, config, lay, slow)
    c_bwd += _grad_stack_time(profile, config, slow)
    out.experts = c_fwd + c_bwd
    volume = _a2a_bytes(config, lay, straggler)
    out.a2a, out.pipelined = _exchange_times(profile, config, volume, g, slow, (c_fwd, c_bwd), lay.reach is not None)
    comm_slow = slow if profile.comm_uses_compute else 1.0
    out.weights_comm = _weights_comm_time(profile, config, lay, g, comm_slow)
    # broadcast + gradient reduce
    shadow_bytes = _param_bytes(config)
    out.shadow_comm = 2 * len(lay.shadowed) * broadcast_time(profile, shadow_bytes, config.ranks, g) * comm_slow
    out.total = out.router_plan + out.dispatch_combine + out.pipelined + out.weights_comm + out.shadow_comm
    out.details = {"straggler_rank": straggler, "a2a_bytes": volume, "capacity": lay.capacity,
                   "r": config.resolved_r(), "shards": config.shards, "ranks_per_node": g, "contention": slow,
                   "sends_tokens": lay.reach is not None}
    return out


def predict(profile: Profile, config: LayerConfig) -> float:
    """Predicted forward + backward seconds of one layer."""
    return layer_time(profile, config).total


# ------------------------------------------------------------------------------------------------- choices

_CANDIDATE_KEYS = ("r", "overlap_degree", "a2a")


def _apply(config: LayerConfig, candidate: Any) -> LayerConfig:
    """A candidate as a dict (r / overlap_degree or d / a2a / ranks_per_node / token_exchange), a tuple
    ``(r, d, a2a)``, or any object with those attributes (the layer's ``ParallelSetting``); a ``ranks_per_node``
    of None keeps the config's."""
    if isinstance(candidate, dict):
        changes = {("overlap_degree" if key == "d" else key): value for key, value in candidate.items()}
        unknown = set(changes) - set(_CANDIDATE_KEYS) - {"shadowed", "ranks_per_node", "token_exchange"}
        if unknown:
            raise ValueError(f"unknown candidate keys {sorted(unknown)}")
    elif isinstance(candidate, tuple):
        changes = dict(zip(_CANDIDATE_KEYS, candidate))
    else:
        changes = {key: getattr(candidate, key) for key in _CANDIDATE_KEYS + ("ranks_per_node", "token_exchange")
                   if hasattr(candidate, key)}
    if changes.get("ranks_per_node") is None:
        changes.pop("ranks_per_node", None)
    return replace(config, **changes)


def score_candidates(profile: Profile, config: LayerConfig, candidates: Iterable[Any]) -> list[tuple[float, Any]]:
    """``(predicted seconds, candidate)`` for each candidate setting, fastest first (ties keep input order)."""
    scored = [(predict(profile, _apply(config, c)), i, c) for i, c in enumerate(candidates)]
    scored.sort(key=lambda item: (item[0], item[1]))
    return [(seconds, c) for seconds, _, c in scored]


def rank_candidates(profile: Profile, config: LayerConfig, candidates: Iterable[Any]) -> list[Any]:
    """The candidates sorted by predicted layer time, best first.

    ``parallel="auto"`` measures only the first few of them. Candidates are dicts (``{"r": 1,
    "overlap_degree": 2, "a2a": "2dh"}``) or tuples ``(r, d, a2a)``; they are returned unchanged.
    """
    return [c for _, c in score_candidates(profile, config, candidates)]


def prune_candidates(profile: Profile, config: LayerConfig, candidates: Iterable[Any], keep: int = 3) -> list[Any]:
    """The ``keep`` candidates the model ranks best: the short list ``parallel="auto"`` times.

    :class:`flexmoe.tuning.ModelGuidedChooser` does this for the layer (the model picks the short list,
    the clock picks the winner, so a model error costs at most a slower runner-up).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return rank_candidates(profile, config, candidates)[:keep]


def choose_shadowed(profile: Profile, config: LayerConfig, tokens_per_expert: Sequence[float],
                    max_shadowed: int | None = None) -> list[int]:
    """Which experts to shadow, given the global (token, choice) count each expert received this step.

    Greedy, hottest first (FasterMoE): shadow the next expert only while the layer gets faster, i.e. while the
    straggler time saved exceeds the extra broadcast + reduce of its weights. Returns global expert ids. Priced
    with the row exchange throughout: a layer that shadows sends rows, also when it shadows nothing.
    """
    if len(tokens_per_expert) != config.experts:
        raise ValueError(f"tokens_per_expert needs {config.experts} entries, got {len(tokens_per_expert)}")
    if config.ranks == 1 or config.shards > 1 or config.resolved_r() == 0 or sum(tokens_per_expert) <= 0:
        return []
    base = replace(config, expert_shares=tuple(float(x) for x in tokens_per_expert), shadowed=(),
                   token_exchange=False)
    best = predict(profile, base)
    chosen: list[int] = []
    limit = config.experts if max_shadowed is None else max_shadowed
    for x in sorted(range(config.experts), key=lambda i: -tokens_per_expert[i]):
        if len(chosen) >= limit:
            break
        trial = predict(profile, replace(base, shadowed=tuple(chosen + [x])))
        if trial >= best:
            break  # colder experts save even less
        best = trial
        chosen.append(x)
    return sorted(chosen)


PLACEMENTS = ("static", "shadowing", "replicated")


def price_placements(profile: Profile, config: LayerConfig, load: Sequence[float], redundant: int
                     ) -> dict[str, tuple[float, Any]]:
    """The predicted layer seconds of each way to place experts under ``load`` (``[E]`` rows per expert, e.g.
    the recent window), whole experts at r = 1, rows sent (shadowing and replicas send rows):

    * ``static``: the layout alone;
    * ``shadowing``: FasterMoE's hot experts broadcast each step (:func:`choose_shadowed`);
    * ``replicated``: ``redundant`` slots per rank placed by
      :func:`~flexmoe.parallel.placement.eplb_placement`. Re-placing moves no weights or optimizer state
      (the copies are fetched from their owners every step, priced in ``weights_comm``), so a move costs
      nothing beyond that.

    Returns name -> (seconds, what was chosen: the shadowed experts or the placement's replicas)."""
    from flexmoe.parallel.placement import eplb_placement  # parallel never imports tuning: no cycle

    if len(load) != config.experts:
        raise ValueError(f"load needs {config.experts} entries (one per expert), got {len(load)}")
    base = replace(config, expert_shares=tuple(float(x) for x in load), shadowed=(), replicas=(),
                   token_exchange=False, r=1, overlap_degree=1)
    shadowed = choose_shadowed(profile, base, load)
    placement = eplb_placement(load, config.ranks, redundant)
    return {"static": (predict(profile, base), ()),
            "shadowing": (predict(profile, replace(base, shadowed=tuple(shadowed))), tuple(shadowed)),
            "replicated": (predict(profile, replace(base, replicas=placement.replicas)), placement.replicas)}


def choose_placement(profile: Profile, config: LayerConfig, load: Sequence[float], redundant: int) -> str:
    """The fastest of :data:`PLACEMENTS` by :func:`price_placements` (ties: the simpler, in that order)."""
    prices = price_placements(profile, config, load, redundant)
    return min(PLACEMENTS, key=lambda name: (prices[name][0], PLACEMENTS.index(name)))
