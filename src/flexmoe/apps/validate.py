"""``flexmoe validate-model``: measure the real layer, predict it with the cost model, report the error.

Every configuration is timed as forward + backward of :class:`flexmoe.MoELayer` (the median of a few steps
after warm-up, as calibration times its micro-benchmarks; with several ranks a step lasts as long as its
slowest rank), one thread per rank as in the calibrated profile. Single-rank runs happen in this process;
multi-rank runs start real gloo processes on 127.0.0.1 with the expert-parallel layer (``group=``). The
"dense" dispatch kind is a GShard/fairseq-style reference built here from the same router and plan: one-hot
``[T, E, C]`` tensors and two einsums, experts computing every padded slot.

The model is given what a running layer knows: the configuration and the routed load per expert (the plan's
counts before drops), never the measured time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from typing import Any

from flexmoe.apps.calibrate import calibrate
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, NON_NEGATIVE
from flexmoe.apps.progress import StepBar
from flexmoe.launch import RanksFailed, spawn_ranks
from flexmoe.layer import MoELayer
from flexmoe.tuning.cost_model import LayerConfig, predict
from flexmoe.tuning.profile import LOCAL_PROFILE_PATH, Profile, load_profile

__all__ = ["DEFAULT_CONFIGS", "add_arguments", "run", "measure_single", "validate", "distributed_layer_available"]

_BASE = {"tokens": 2048, "model_dim": 512, "hidden_dim": 1024, "experts": 8, "k": 2, "capacity_factor": 1.25,
         "dtype": "float32", "ranks": 1, "dispatch": "index"}

# Spread over the axes the model has: size, experts, k, capacity (incl. dropless), dtype, dispatch kind,
# ranks, r, d, all-to-all algorithm.
DEFAULT_CONFIGS: list[dict[str, Any]] = [
    {**_BASE},
    {**_BASE, "tokens": 1024, "model_dim": 256, "hidden_dim": 512, "experts": 4, "k": 1, "capacity_factor": 1.0},
    {**_BASE, "tokens": 4096, "model_dim": 256, "hidden_dim": 512, "experts": 16, "capacity_factor": 0.0},
    # bf16 GEMMs run at ~1-3 GFLOP/s on this AVX2 CPU (no native bf16 units): a small shape keeps it quick.
    {**_BASE, "tokens": 512, "model_dim": 256, "hidden_dim": 512, "experts": 4, "dtype": "bfloat16"},
    {**_BASE, "tokens": 512, "model_dim": 128, "hidden_dim": 256},
    {**_BASE, "tokens": 1024, "hidden_dim": 2048, "experts": 32, "k": 4},
    {**_BASE, "tokens": 1024, "model_dim": 256, "hidden_dim": 512, "dispatch": "dense"},
    {**_BASE, "dispatch": "dense"},
    # expert parallel (need MoELayer(group=...)):
    {**_BASE, "ranks": 2},
    {**_BASE, "ranks": 2, "tokens": 1024, "experts": 2, "k": 1, "capacity_factor": 0.0},
    {**_BASE, "ranks": 2, "experts": 1, "k": 1, "r": 1},
    {**_BASE, "ranks": 2, "overlap_degree": 2},
    {**_BASE, "ranks": 4, "tokens": 1024},
    {**_BASE, "ranks": 4, "tokens": 1024, "a2a": "2dh", "ranks_per_node": 2},
    {**_BASE, "ranks": 4, "tokens": 1024, "experts": 2, "k": 1, "r": 2},
]

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def distributed_layer_available() -> bool:
    """Whether MoELayer takes ``group=`` (the expert-parallel layer of issue 3)."""
    return "group" in inspect.signature(MoELayer.__init__).parameters


# ----------------------------------------------------------------------------------------------- measuring


def _dense_forward(layer: Any, x: Any) -> Any:
    """GShard/fairseq-style forward with the layer's own router, plan and experts, dense one-hot dispatch."""
    import torch

    from flexmoe.routing.plan import make_plan
    from flexmoe.routing.routers import route

    tokens = x.reshape(-1, layer.model_dim)
    logits = route(layer.router, tokens, dtype=layer.router_dtype, training=True)
    plan = make_plan(logits, layer.k, capacity_factor=layer.capacity_factor, normalize_weights=True)
    t, e, c = tokens.shape[0], layer.num_experts, plan.capacity
    kept = plan.slot >= 0
    token_ids = torch.arange(t).unsqueeze(1).expand_as(plan.slot)[kept]
    combine_weights = torch.zeros(t, e, c, dtype=tokens.dtype)
    combine_weights = combine_weights.index_put(
        (token_ids, plan.expert_index[kept], plan.slot[kept]), plan.weight[kept].to(tokens.dtype))
    dispatch_mask = (combine_weights != 0).to(tokens.dtype)
    expert_in = torch.einsum("sec,sm->ecm", dispatch_mask, tokens)
    expert_out = layer.experts(expert_in.reshape(e * c, -1), [c] * e).reshape(e, c, -1)
    return torch.einsum("sec,ecm->sm", combine_weights, expert_out)


def _time_steps(layer: Any, x: Any, dense: bool, steps: int, warmup: int, **call: Any,
                ) -> tuple[list[float], list[int]]:
    """Seconds of each timed forward + backward, and the routed load per expert of the last step."""
    import torch

    grad = torch.randn_like(x)
    samples = []
    for i in range(warmup + steps):
        layer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        y = _dense_forward(layer, x) if dense else layer(x, **call)
        y.backward(grad)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            samples.append(elapsed)
    with torch.no_grad():
        from flexmoe.routing.plan import make_plan
        from flexmoe.routing.routers import route

        logits = route(layer.router, x.reshape(-1, layer.model_dim), dtype=layer.router_dtype, training=False)
        load = make_plan(logits, layer.k, capacity_factor=layer.capacity_factor).load.tolist()
    return samples, load


def _build_layer(cfg: dict[str, Any], **extra: Any) -> Any:
    import torch

    dtype = getattr(torch, cfg["dtype"])
    return MoELayer(cfg["model_dim"], cfg["experts"], cfg["hidden_dim"], k=cfg["k"],
                    capacity_factor=cfg["capacity_factor"], dtype=dtype, **extra)


def measure_single(cfg: dict[str, Any], steps: int = 5, warmup: int = 2, seed: int = 0) -> tuple[float, list[int]]:
    """Seconds of one forward + backward of a single-process layer (one thread), and its routed load."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        layer = _build_layer(cfg)
        x = torch.randn(cfg["tokens"], cfg["model_dim"], dtype=getattr(torch, cfg["dtype"]), requires_grad=True)
        samples, load = _time_steps(layer, x, cfg["dispatch"] == "dense", steps, warmup)
        return statistics.median(samples), load
    finally:
        torch.set_num_threads(threads)


def _rank_worker(cfg: dict[str, Any], steps: int, warmup: int) -> dict[str, Any] | None:
    """One rank of a multi-rank measurement (started by :func:`flexmoe.launch.spawn_ranks`): the expert-parallel
    MoELayer over the gloo world group. Rank 0 returns ``{"seconds", "load"}`` of the whole group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(1234 + rank)  # each rank its own tokens
        extra: dict[str, Any] = {"group": dist.group.WORLD}
        call: dict[str, Any] = {}
        for key in ("r", "overlap_degree", "a2a", "ranks_per_node"):
            if cfg.get(key) is not None:
                call[key] = cfg[key]
        params = inspect.signature(_layer_class().__init__).parameters
        extra.update({k: v for k, v in call.items() if k in params})
        torch.manual_seed(0)  # identical router weights on every rank
        layer = _build_layer(cfg, **extra)
        torch.manual_seed(1234 + rank)
        x = torch.randn(cfg["tokens"], cfg["model_dim"], dtype=getattr(torch, cfg["dtype"]), requires_grad=True)
        dist.barrier()
        samples, load = _time_steps(layer, x, False, steps, warmup)
        # A step lasts as long as its slowest rank (every all-to-all waits for it); loads add up.
        times: list[Any] = [None] * world
        loads: list[Any] = [None] * world
        dist.all_gather_object(times, samples)
        dist.all_gather_object(loads, load)
        if rank == 0:
            per_step = [max(step) for step in zip(*times)]
            total = [sum(col) for col in zip(*loads)]
            return {"seconds": statistics.median(per_step), "load": total}
        return None
    finally:
        dist.destroy_process_group()


def _layer_class() -> Any:
    return MoELayer


def measure_multi(cfg: dict[str, Any], steps: int = 5, warmup: int = 2, timeout: float = 180.0,
                  attempts: int = 2) -> tuple[float, list[int]]:
    """Seconds of one forward + backward with ``cfg['ranks']`` gloo processes, and the global routed load.

    A group whose rank dies is started again once (``attempts``) before the configuration is given up: one
    crashed process on a busy machine should not drop a row from the table; a second failure is reported.
    """
    for attempt in range(attempts):
        try:
            return _measure_multi_once(cfg, steps, warmup, timeout)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _measure_multi_once(cfg: dict[str, Any], steps: int, warmup: int, timeout: float) -> tuple[float, list[int]]:
    world = int(cfg["ranks"])
    try:
        ranks = spawn_ranks(world, _rank_worker, [cfg, steps, warmup], timeout=timeout,
                            what=f"{world}-rank measurement")
    except RanksFailed as e:
        ranks = e.results
        if ranks[0].value is None:  # rank 0 hands in the result after every rank handed in its timings
            raise
        # A crash while tearing down, after the measurement: keep it, but say so.
        print(f"validate-model: {world}-rank run measured, then a rank exited abnormally:\n"
              + "\n".join(f"rank {r.rank}: {r.stderr[-300:]}" for r in ranks if not r.ok), file=sys.stderr)
    result = ranks[0].value
    return float(result["seconds"]), list(result["load"])


# ---------------------------------------------------------------------------------------------- predicting


def model_config(cfg: dict[str, Any], load: list[int] | None = None) -> LayerConfig:
    """The cost model's view of a measured configuration (with the routed load per expert, if known)."""
    keys = set(LayerConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in cfg.items() if k in keys and v is not None}
    if load is not None and sum(load) > 0:
        kwargs["expert_shares"] = tuple(float(x) for x in load)
    return LayerConfig(**kwargs)


def _label(cfg: dict[str, Any]) -> str:
    parts = [f"W={cfg['ranks']}", f"T={cfg['tokens']}", f"M={cfg['model_dim']}", f"H={cfg['hidden_dim']}",
             f"E={cfg['experts']}", f"k={cfg['k']}", f"cf={cfg['capacity_factor']:g}", cfg["dtype"]]
    if cfg.get("dispatch") == "dense":
        parts.append("dense")
    for key, name in (("r", "r"), ("overlap_degree", "d"), ("a2a", "a2a"), ("ranks_per_node", "G")):
        if cfg.get(key) is not None:
            parts.append(f"{name}={cfg[key]}")
    return " ".join(parts)


def validate(profile: Profile, configs: list[dict[str, Any]], steps: int = 5, warmup: int = 2,
             log: Any = None, rounds: int = 1) -> dict[str, Any]:
    """Measure and predict every configuration; returns {"median_abs_error", "rows", "skipped"}.

    With ``rounds > 1`` the configurations are measured in turn, round after round, and each keeps the median
    of its rounds: on a shared machine the load drifts over minutes, and taking turns spreads every
    configuration over the same stretch of time instead of giving the first ones a quiet minute and the last
    ones a busy one.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cfgs = [{**_BASE, **cfg} for cfg in configs]
    multi_ok = distributed_layer_available()
    samples: dict[int, list[float]] = {i: [] for i in range(len(cfgs))}
    loads: dict[int, list[int]] = {}
    failed: dict[int, str] = {}
    for i, cfg in enumerate(cfgs):
        if cfg["ranks"] > 1 and not multi_ok:
            failed[i] = "MoELayer has no group= yet (expert-parallel layer not landed)"
    for round_index in range(rounds):
        for i, cfg in enumerate(cfgs):
            if i in failed:
                continue
            if log:
                log(f"round {round_index + 1}/{rounds}: measuring {_label(cfg)}")
            try:
                measure = measure_single if cfg["ranks"] == 1 else measure_multi
                seconds, loads[i] = measure(cfg, steps, warmup)
            except Exception as exc:  # a configuration the layer refuses must not hide the others
                failed[i] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                continue
            samples[i].append(seconds)
    rows = []
    for i, cfg in enumerate(cfgs):
        if i in failed:
            continue
        measured = statistics.median(samples[i])
        predicted = predict(profile, model_config(cfg, loads[i]))
        rows.append({**cfg, "label": _label(cfg), "predicted_s": predicted, "measured_s": measured,
                     "error": (predicted - measured) / measured, "rounds_s": samples[i]})
    errors = [abs(r["error"]) for r in rows]
    skipped = [{**cfgs[i], "reason": reason} for i, reason in sorted(failed.items())]
    return {"profile": profile.name, "median_abs_error": statistics.median(errors) if errors else None,
            "rows": rows, "skipped": skipped}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'configuration':78s} {'measured':>10s} {'predicted':>10s} {'error':>7s}"]
    for r in result["rows"]:
        lines.append(f"{r['label']:78s} {r['measured_s'] * 1e3:8.1f}ms {r['predicted_s'] * 1e3:8.1f}ms "
                     f"{r['error'] * 100:+6.1f}%")
    for s in result["skipped"]:
        lines.append(f"skipped {_label(s)}: {s['reason']}")
    med = result["median_abs_error"]
    lines.append(f"median absolute error: {med * 100:.1f}% over {len(result['rows'])} configurations"
                 if med is not None else "no configuration measured")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="local",
                        help="profile to predict with: 'local' (calibrated here; calibrates first if missing) "
                             "or a JSON path")
    parser.add_argument("--recalibrate", action="store_true", help="calibrate again before validating")
    parser.add_argument("--steps", type=COUNT, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=2, help="untimed steps first")
    parser.add_argument("--rounds", type=COUNT, default=2,
                        help="measure every configuration this many times, in turn, and keep the median "
                             "(default: 2; a shared machine's load drifts over minutes)")
    parser.add_argument("--max-ranks", type=COUNT, default=4, help="skip configurations with more ranks")
    parser.add_argument("--json", action="store_true", help="print {median_abs_error, rows} as JSON")


def run(args: argparse.Namespace) -> int:
    if args.profile != "local":
        try:
            load_profile(args.profile)
        except (ValueError, FileNotFoundError) as exc:
            raise UsageError(f"--profile: {exc}") from None
    if args.profile == "local" and (args.recalibrate or not LOCAL_PROFILE_PATH.exists()):
        with StepBar(3, f"calibrating (writes {LOCAL_PROFILE_PATH})", enabled=not args.json) as bar:
            calibrate(log=bar).save(LOCAL_PROFILE_PATH)  # compute, then 2 and 4 ranks
    profile = load_profile(args.profile)
    configs = [c for c in DEFAULT_CONFIGS if c.get("ranks", 1) <= args.max_ranks]
    with StepBar(args.rounds * len(configs), "validate-model", enabled=not args.json) as bar:
        result = validate(profile, configs, steps=args.steps, warmup=args.warmup, log=bar, rounds=args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0
