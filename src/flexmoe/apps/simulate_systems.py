"""The MoE systems the papers compare, as cost-model configurations, and the peak memory each one needs.

``flexmoe simulate --system NAME`` prices one layer of a shape as each system would run it:

* ``flexmoe``: flexmoe's layer, index dispatch of the real rows, the (r, d, all-to-all) the model ranks best;
* ``tutel-2dh`` / ``tutel-linear``: Tutel's fast encode/decode (index dispatch) with its fixed-size padded
  exchange of the whole ``E x C`` buffer, over the 2-D hierarchical or the linear all-to-all, d = 1;
* ``deepspeed`` / ``fairseq``: the GShard dispatch both used in 2021-22 (one-hot ``[T, E, C]`` masks and
  einsums, experts computing every padded slot) with torch's linear all-to-all (Tutel's paper, section 5.2:
  "Fairseq and DeepSpeed MoE perform the same as they use an equivalent MoE layer implementation");
* ``fastmoe``: FastMoE, index dispatch of the real rows, no capacity limit (dropless), linear all-to-all;
* ``fastermoe``: FastMoE plus FasterMoE's smart schedule (the best pipelining degree) and expert shadowing
  (:func:`~flexmoe.tuning.cost_model.choose_shadowed` on the load); its topology-aware gate changes the routing
  itself and is not modelled.

``--setting r=..,d=..,a2a=..`` fixes what a system would otherwise choose or default to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flexmoe.tuning.cost_model import (
    DTYPE_BYTES,
    LayerConfig,
    allgather_time,
    broadcast_time,
    choose_shadowed,
    expert_rows,
    memory_time,
    predict,
    score_candidates,
    valid_r,
)
from flexmoe.tuning.profile import Profile

__all__ = ["SYSTEMS", "Setting", "parse_systems", "parse_setting", "system_config", "price_system", "step_seconds",
           "gate_sync_time", "optimizer_time", "peak_memory"]

SYSTEMS = ("flexmoe", "tutel-2dh", "tutel-linear", "deepspeed", "fairseq", "fastermoe", "fastmoe")
OVERLAP_DEGREES = (1, 2, 4, 8)

# Bytes per element of the [T, E, C] tensors the GShard gating keeps at its peak (fairseq's top2gating and the
# dispatch / combine einsums, counted from the code path): combine1_sec, combine2_sec and combine_weights in
# float32, the dispatch mask as bool and cast to float32 for the einsum, and the einsum's contiguous copy of the
# permuted mask (forward), or the gradients of the same (backward): six float32 and one bool.
DENSE_TEC_BYTES = 6 * 4 + 1


@dataclass(frozen=True)
class Setting:
    """What ``--setting`` fixes; None leaves the system's own choice."""

    r: int | None = None
    d: int | None = None
    a2a: str | None = None


def parse_systems(text: str) -> list[str]:
    """``"tutel-2dh,deepspeed"`` (or ``"all"``) -> the system names, checked."""
    names = list(SYSTEMS) if text.strip() == "all" else [p.strip() for p in text.split(",") if p.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if not names or unknown:
        raise ValueError(f"--system takes a comma list of {', '.join(SYSTEMS)} (or 'all'); got {text!r}")
    return names


def parse_setting(text: str) -> Setting:
    """``"r=1,d=4,a2a=2dh"`` -> :class:`Setting` (any subset of the three keys)."""
    values: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or key not in ("r", "d", "a2a") or key in values:
            raise ValueError(f"--setting takes r=INT, d=INT and a2a=flat|2dh, each at most once; got {text!r}")
        if key == "a2a":
            if value not in ("flat", "2dh"):
                raise ValueError(f"--setting a2a must be 'flat' or '2dh', got {value!r}")
            values[key] = value
            continue
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"--setting {key} must be an integer, got {value!r}") from None
        if number < (0 if key == "r" else 1):
            raise ValueError(f"--setting {key} must be >= {0 if key == 'r' else 1}, got {number}")
        values[key] = number
    if not values:
        raise ValueError(f"--setting needs at least one of r=, d=, a2a=; got {text!r}")
    return Setting(**values)


def system_config(system: str, base: LayerConfig) -> LayerConfig:
    """``base`` (the shape: tokens, dims, experts, k, capacity factor, dtype, ranks) as ``system`` runs it, with
    the system's defaults for what it does not choose (r = 1 over sharded experts, d = 1, flat all-to-all)."""
    r = 1 if base.shards > 1 else None
    common = dict(r=r, overlap_degree=1, shadowed=(), replicas=())
    if system == "flexmoe":
        return replace(base, **common)  # type: ignore[arg-type]
    if system in ("tutel-2dh", "tutel-linear"):
        return replace(base, a2a="2dh" if system == "tutel-2dh" else "flat", dispatch="index", padded_a2a=True,
                       token_exchange=False, **common)  # type: ignore[arg-type]
    if system in ("deepspeed", "fairseq"):
        return replace(base, a2a="flat", dispatch="dense", padded_a2a=True, token_exchange=False,
                       **common)  # type: ignore[arg-type]
    if system in ("fastmoe", "fastermoe"):
        return replace(base, a2a="flat", dispatch="index", padded_a2a=False, token_exchange=False,
                       capacity_factor=0.0, **common)  # type: ignore[arg-type]
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")


def _fixed(config: LayerConfig, setting: Setting) -> LayerConfig:
    changes: dict[str, Any] = {}
    if setting.r is not None:
        changes["r"] = setting.r
    if setting.d is not None:
        changes["overlap_degree"] = setting.d
    if setting.a2a is not None:
        changes["a2a"] = setting.a2a
    return replace(config, **changes)


def gate_sync_time(profile: Profile, config: LayerConfig) -> float:
    """The data-parallel all-reduce of the router's weight gradient ``[M, E]`` (float32) over all W ranks, which
    every system runs each step (Tutel's helloworld.py all-reduces it by hand): the faster of a ring
    (a reduce-scatter and an all-gather) and a tree (a reduce and a broadcast), as NCCL picks."""
    w = config.ranks
    if w <= 1:
        return 0.0
    g = min(config.ranks_per_node or profile.ranks_per_node, w)
    size = 4.0 * config.model_dim * config.experts
    ring = 2 * allgather_time(profile, size, w, g)
    tree = 2 * broadcast_time(profile, size, w, g)
    return min(ring, tree)


def _local_experts(config: LayerConfig) -> tuple[int, int, int]:
    """(local experts, hidden width each holds, their parameter count with biases) on one rank: whole experts, or
    one 1/s shard of an expert when s ranks share it."""
    local = config.experts_per_rank if config.shards == 1 else 1
    hidden = config.hidden_dim if config.shards == 1 else config.hidden_dim // config.shards
    m = config.model_dim
    return local, hidden, local * ((3 if config.glu else 2) * m * hidden + hidden + m)


def optimizer_time(profile: Profile, config: LayerConfig) -> float:
    """Plain SGD over the rank's parameters, as Tutel's helloworld.py steps them each iteration: ``zero_grad``
    writes every gradient, ``step`` reads each parameter and its gradient and writes the parameter back; two
    kernels per parameter tensor (four per local expert: two weights and two biases, two for the router)."""
    local, _, expert_params = _local_experts(config)
    router_params = config.model_dim * config.experts  # float32 whatever the model dtype
    moved = 4 * expert_params * config.dtype_bytes + 4 * router_params * 4
    tensors = local * (5 if config.glu else 4) + 1
    return memory_time(moved, profile.memory_bandwidth_Bps, ops=2 * tensors, op_overhead=profile.op_overhead_s)


def step_seconds(profile: Profile, config: LayerConfig) -> float:
    """One training step of the layer as Tutel's helloworld.py times it: forward + backward, the router's
    gradient all-reduce, and the SGD step (:func:`optimizer_time`)."""
    return predict(profile, config) + gate_sync_time(profile, config) + optimizer_time(profile, config)


def price_system(profile: Profile, system: str, base: LayerConfig, setting: Setting = Setting()
                 ) -> tuple[float, dict[str, Any]]:
    """Predicted forward + backward seconds of one layer of ``base`` under ``system``, and the setting used
    (``r``, ``d``, ``a2a``; ``shadowed`` for FasterMoE)."""
    config = system_config(system, base)
    adaptive = system in ("flexmoe", "fastermoe")
    if adaptive:
        # flexmoe searches r, d and the algorithm; FasterMoE's smart schedule only the pipelining degree.
        rs = [setting.r] if setting.r is not None else (valid_r(config) if system == "flexmoe" else [config.r])
        ds = [setting.d] if setting.d is not None else list(OVERLAP_DEGREES)
        algos = [setting.a2a] if setting.a2a is not None else (["flat", "2dh"] if system == "flexmoe" else ["flat"])
        candidates = [{"r": r, "overlap_degree": d, "a2a": a} for r in rs for d in ds for a in algos]
        _, best = score_candidates(profile, config, candidates)[0]
        config = replace(config, r=best["r"], overlap_degree=best["overlap_degree"], a2a=best["a2a"])
    else:
        config = _fixed(config, setting)
    used: dict[str, Any] = {"r": config.resolved_r(), "d": config.overlap_degree, "a2a": config.a2a}
    if system == "fastermoe" and config.shards == 1 and config.ranks > 1:
        load = expert_rows(config)
        shadow = choose_shadowed(profile, config, load)
        config = replace(config, expert_shares=tuple(load), shadowed=tuple(shadow))
        used["shadowed"] = len(shadow)
    return step_seconds(profile, config), used


def peak_memory(system: str, base: LayerConfig, optimizer_state_per_param: int = 0) -> dict[str, float]:
    """Peak bytes one GPU holds for one layer's forward + backward under ``system``, by part.

    * ``weights``: the local experts' parameters, their gradients and ``optimizer_state_per_param`` bytes of
      optimizer state per parameter (0: plain SGD, as Tutel's helloworld.py);
    * ``activations``: what the forward saves for the backward: the layer input ``[T, M]``, the rows the
      experts received (their first GEMM's input), the activation output ``[R, H]`` (its second GEMM's input),
      and the layer output ``[T, M]``;
    * ``transient``: the largest buffer alive only around one operation: the exchange buffer ``[R, M]``;
    * ``gating``: the GShard systems' ``[T, E, C]`` tensors (:data:`DENSE_TEC_BYTES` per element); the index
      systems' ``[T, E]`` gate probabilities (float32) instead.

    Not included: the CUDA context, NCCL's buffers, the caching allocator's slack.
    """
    config = system_config(system, base)
    b = DTYPE_BYTES[config.dtype]
    t, m, e, k = config.tokens, config.model_dim, config.experts, config.k
    _, hidden, params = _local_experts(config)
    weights = params * (2 * b + optimizer_state_per_param)
    if config.padded_a2a or config.dispatch == "dense":
        sent_rows = float(e * config.capacity())  # every padded slot travels
    else:
        sent_rows = float(t * k)
    received_rows = sum(expert_rows(config)) / config.ranks if config.ranks > 0 else sent_rows
    activations = (2 * t * m + received_rows * m + received_rows * hidden) * b
    transient = max(sent_rows, received_rows) * m * b
    if config.dispatch == "dense":
        gating = float(t) * e * config.capacity() * DENSE_TEC_BYTES
    else:
        gating = float(t) * e * 4 * 2  # probabilities and their gradient
    total = weights + activations + transient + gating
    return {"weights": weights, "activations": activations, "transient": transient, "gating": gating,
            "total": total}
