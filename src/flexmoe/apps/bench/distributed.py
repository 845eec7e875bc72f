"""``flexmoe bench`` under torchrun (or ``--nproc N``): every (r, d, all-to-all) setting side by side.

``--tokens`` is per rank; every setting is timed side by side, with the exposed all-to-all share of the step,
then ``parallel="auto"``'s choice and the single-rank compute floor of the same per-rank work. ``--sleep-ms S``
swaps the experts for ones that stall S ms per forward (and per backward) without using the CPU, which shows how
much communication pipelining (d > 1) hides when compute does not compete for the cores.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.apps.bench.config import DTYPES, BenchConfig, build_layer, floor_case, fwd_bwd, make_inputs
from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.layer import MoELayer

if TYPE_CHECKING:
    from flexmoe.parallel import ParallelSetting

__all__ = ["SleepyExperts", "CpuAccount", "node_cpu_jiffies", "idle_share", "paired_ratio", "AUTO_STEPS",
           "bench_distributed", "format_distributed", "distributed_conclusions"]


# -------------------------------------------------------------------------------------------- distributed


class SleepyExperts(nn.Module):
    """A custom expert that stalls without using the CPU: ``sleep_s`` per forward and again per backward,
    spread over the rows (``sleep_s * rows / expected_rows``) so that d chunks stall as long as one chunk
    of all rows would. Output: ``x * scale`` (one parameter, so that gradients flow)."""

    def __init__(self, num_experts: int, sleep_s: float, expected_rows: int) -> None:
        super().__init__()
        self.num_experts, self.sleep_s, self.expected_rows = num_experts, sleep_s, expected_rows
        self.scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        stall = self.sleep_s * x.shape[0] / self.expected_rows
        scale = torch.repeat_interleave(self.scale, torch.tensor(counts)).unsqueeze(-1)
        return _Stall.apply(x, stall) * scale.to(x.dtype)


class _Stall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


def _stall_floor(experts: nn.Module, counts: list[int], cfg: BenchConfig) -> Callable[[], None]:
    """A forward + backward step of :class:`SleepyExperts` alone on ``counts`` rows per local expert."""
    assert isinstance(experts, SleepyExperts), "the stall floor times the stalling experts"
    rows = torch.zeros(sum(counts), cfg.model_dim, dtype=DTYPES[cfg.dtype], requires_grad=True)
    return fwd_bwd(lambda: experts(rows, counts), torch.ones_like(rows), experts)


def node_cpu_jiffies() -> tuple[int, int] | None:
    """This node's ``(idle, total)`` CPU time since boot in clock ticks, all cores, from the first line of
    ``/proc/stat`` (idle counts iowait; total is user to steal, guest time being inside user); None where there is
    no ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[3] + ticks[4], sum(ticks)


def idle_share(spans: Sequence[tuple[int, int]]) -> float | None:
    """The idle share of the node over ``spans``, each an ``(idle, total)`` difference of
    :func:`node_cpu_jiffies`; None without spans or ticks."""
    total = sum(t for _, t in spans)
    return sum(i for i, _ in spans) / total if total > 0 else None


@dataclass
class CpuAccount:
    """What one case's calls cost in CPU: this process's CPU seconds per call (every thread of it, gloo's
    included) and the node's ``(idle, total)`` ticks over each call."""

    seconds: list[float]
    ticks: list[tuple[int, int]]

    @classmethod
    def wrap(cls, run: Callable[[], None]) -> tuple[Callable[[], None], CpuAccount]:
        """``run`` counted into a new account, and the account."""
        account = cls([], [])

        def counted() -> None:
            before, start = node_cpu_jiffies(), time.process_time()
            run()
            account.seconds.append(time.process_time() - start)
            after = node_cpu_jiffies()
            if before is not None and after is not None:
                account.ticks.append((after[0] - before[0], after[1] - before[1]))
        return counted, account


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _synced(step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        dist.barrier()
        step()
    return run


# parallel="auto" against the best static setting: the two are within a few percent (the same setting, once
# auto has chosen well), and at 5 steps the medians of a 4-rank step on 2 shared cores differed by up to 10%
# between layers that ran the very same setting (auto runs that chose the best static measured 1.04-1.10x it).
# So that comparison takes at least AUTO_STEPS rounds, its value the median of the per-round ratios (each
# round runs both, so a slow round slows both), and leaves out the settings the sweep timed at
# STATIC_CONTENDER x its best or more.
AUTO_STEPS = 15
STATIC_CONTENDER = 1.5


def paired_ratio(times: list[float], reference: list[float]) -> float:
    """The median over rounds of ``times[i] / reference[i]`` (two cases timed side by side, round by round)."""
    return statistics.median(t / r for t, r in zip(times, reference))


def _layer_options(cfg: BenchConfig, sleep_ms: float | None, ranks_per_node: int | None,
                   world: int) -> dict[str, Any]:
    """The options of every layer the distributed bench builds: over the world, and with ``sleep_ms`` the
    stalling experts (:class:`SleepyExperts`, whole experts per rank)."""
    extra: dict[str, Any] = {"group": dist.group.WORLD, "ranks_per_node": ranks_per_node}
    if sleep_ms is not None:
        if cfg.experts % world:
            raise ValueError(f"--sleep-ms needs whole experts per rank: --experts must be a multiple of {world}")
        expected = cfg.tokens * cfg.k  # rows one rank computes when the load is even
        extra["experts"] = SleepyExperts(cfg.experts // world, sleep_ms / 1e3, expected)
    return extra


def _setting_cases(layer: MoELayer, settings: list[ParallelSetting], x: Tensor,
                   grad: Tensor) -> tuple[dict[str, Callable[[], None]], dict[str, list[float]]]:
    """Per setting, a synced forward + backward step of ``layer`` run at it, and the seconds each step spent
    waiting on exchanges (appended per call)."""
    ep = layer._ep
    assert ep is not None  # a layer over a process group
    exposed: dict[str, list[float]] = {str(s): [] for s in settings}  # seconds waiting on exchanges, per step

    def timed_setting(s: ParallelSetting) -> Callable[[], None]:
        step = _synced(fwd_bwd(lambda: layer(x, r=s.r, overlap_degree=s.overlap_degree, a2a=s.a2a,
                                              ranks_per_node=s.ranks_per_node, token_exchange=s.token_exchange),
                                grad, layer))

        def run() -> None:
            ep.stats.reset()
            step()
            exposed[str(s)].append(ep.stats.seconds)
        return run

    return {str(s): timed_setting(s) for s in settings}, exposed


def _floor_step(layer: MoELayer, x: Tensor, cfg: BenchConfig, sleep_ms: float | None) -> Callable[[], None]:
    """The floor: this rank's experts alone on the rows it computes at r = 1, no exchange. With ``sleep_ms``,
    that is their stall: what a step would cost if the pipelining hid every exchange."""
    ep = layer._ep
    assert ep is not None  # a layer over a process group
    with torch.no_grad():
        layer(x)
    assert layer.last_plan is not None  # set by the forward above
    local = _local_counts(layer, ep.gather_counts(layer.last_plan.counts, x.device))
    step = floor_case(layer, local, cfg)[0] if sleep_ms is None else _stall_floor(layer.experts, local, cfg)
    return _synced(step)


def _counted(cases: dict[str, Callable[[], None]]) -> tuple[dict[str, Callable[[], None]], dict[str, CpuAccount]]:
    """Each case wrapped to count its CPU use into an account of its own (:meth:`CpuAccount.wrap`)."""
    counted, accounts = {}, {}
    for name, case in cases.items():
        counted[name], accounts[name] = CpuAccount.wrap(case)
    return counted, accounts


def _cpu_use(accounts: dict[str, CpuAccount], cfg: BenchConfig,
             world: int) -> tuple[dict[str, float], dict[str, float | None]]:
    """Per case, its CPU seconds per step (every thread of the process, mean over the ranks) and the node's idle
    share while it ran, warm-up steps dropped."""
    cpu_local = torch.tensor([statistics.median(a.seconds[cfg.warmup:]) for a in accounts.values()],
                             dtype=torch.float64)
    dist.all_reduce(cpu_local)
    cpu = dict(zip(accounts, (cpu_local / world).tolist()))
    idle = {n: idle_share(a.ticks[cfg.warmup:]) for n, a in accounts.items()}
    return cpu, idle


def _auto_layers(cfg: BenchConfig, extra: dict[str, Any], profile: str | None, auto_trials: int | None,
                 auto_runs: int) -> dict[str, MoELayer]:
    """``auto_runs`` layers with ``parallel="auto"`` and a fresh ``MeasuringChooser(auto_trials)`` each, and with
    ``profile`` one steered by the cost model."""
    from flexmoe.parallel import MeasuringChooser

    def chooser() -> MeasuringChooser:
        return MeasuringChooser() if auto_trials is None else MeasuringChooser(trials=auto_trials)

    autos = {"auto" if auto_runs == 1 else f"auto (run {i + 1})": build_layer(cfg, parallel="auto",
                                                                              chooser=chooser(), **extra)
             for i in range(auto_runs)}
    if profile is not None:
        from flexmoe.tuning import ModelGuidedChooser

        autos[f"auto (model {profile}, keep 3)"] = build_layer(
            cfg, parallel="auto", chooser=ModelGuidedChooser(profile, keep=3), **extra)
    return autos


def _tuned_auto_cases(autos: dict[str, MoELayer], layer: MoELayer, x: Tensor,
                      grad: Tensor) -> dict[str, Callable[[], None]]:
    """Each auto layer with ``layer``'s weights, stepped until it has tuned (each candidate tried, one kept);
    its synced forward + backward step."""
    auto_cases = {}
    for name, auto_layer in autos.items():
        auto_layer.load_state_dict(layer.state_dict())
        auto_step = fwd_bwd(partial(auto_layer, x), grad, auto_layer)
        while not auto_layer.auto_decisions:  # tuning: each candidate is tried, then one is kept
            auto_step()
        auto_cases[name] = _synced(auto_step)
    return auto_cases


def _auto_vs_static(autos: dict[str, MoELayer], auto_cases: dict[str, Callable[[], None]],
                    statics: dict[str, Callable[[], None]], cfg: BenchConfig,
                    show: bool) -> tuple[list[dict[str, Any]], str, float]:
    """The auto layers timed side by side with the static settings ``statics`` (:data:`AUTO_STEPS` rounds at
    least): per auto layer its choice, median and :func:`paired_ratio` to the best static of this same run;
    and that best static's name and median."""
    auto_times = time_side_by_side({**auto_cases, **statics}, max(cfg.steps, AUTO_STEPS), cfg.warmup,
                                   sync=_slowest, desc="timing auto" if show else None)
    auto_medians = {name: statistics.median(v) for name, v in auto_times.items()}
    best_with_auto = min(statics, key=auto_medians.__getitem__)
    auto_report = [{"name": name, "choice": str(m.auto_decisions[0].choice),
                    "seconds": auto_medians[name],
                    "ratio": paired_ratio(auto_times[name], auto_times[best_with_auto]),
                    "tuning": m.auto_decisions[0].describe()} for name, m in autos.items()]
    return auto_report, best_with_auto, auto_medians[best_with_auto]


def bench_distributed(cfg: BenchConfig, sleep_ms: float | None, ranks_per_node: int | None,
                      profile: str | None = None, degrees: tuple[int, ...] = (1, 2, 4),
                      show: bool = False, auto_trials: int | None = None, auto_runs: int = 1) -> dict[str, Any]:
    """Under torchrun: every (r, d, a2a) setting side by side, auto's choice (also steered by the cost model
    with ``profile``), the per-rank floor. With ``show`` rank 0 prints each part as soon as it is measured.

    The floor is :func:`~flexmoe.apps.baselines.expert_floor` on the rows this rank computes with r = 1, run on
    every rank at once (so under the same contention for the cores as the settings), the slowest rank's time.
    ``auto_runs`` layers tune ``parallel="auto"`` from scratch, each with ``MeasuringChooser(auto_trials)``
    (None: the chooser's default trials), and are timed side by side with the best static setting
    (:data:`AUTO_STEPS`, :func:`paired_ratio`).
    """
    from flexmoe.parallel import candidates

    rank, world = dist.get_rank(), dist.get_world_size()
    show = show and rank == 0
    extra = _layer_options(cfg, sleep_ms, ranks_per_node, world)
    layer = build_layer(cfg, **extra)
    x, grad = make_inputs(cfg, cfg.seed + 1 + rank)  # each rank its own tokens
    ep = layer._ep
    assert ep is not None  # a layer over a process group
    settings = candidates(ep.valid_r(), world, layer.parallel_options.ranks_per_node, degrees,
                          token_exchange=ep.can_send_tokens)
    cases, exposed = _setting_cases(layer, settings, x, grad)
    floor_name = "floor (1 rank, same per-rank rows)"
    cases[floor_name] = _floor_step(layer, x, cfg, sleep_ms)
    if show:
        print(_distributed_header(cfg, world, sleep_ms, torch.get_num_threads()), flush=True)
    # Where the time goes when the ranks share the cores: each case's CPU time per step and the node's idle share
    # while it ran. A step that keeps the cores busy costs its CPU work, not its waits.
    cases, accounts = _counted(cases)
    times = time_side_by_side(cases, cfg.steps, cfg.warmup, sync=_slowest,
                              desc=f"timing {len(cases)} settings" if show else None)
    cpu, idle = _cpu_use(accounts, cfg, world)
    medians = {name: statistics.median(v) for name, v in times.items()}
    # The calling thread's time inside exchanges (launching or waiting): the exposed communication, median
    # over the timed steps (warm-up steps dropped) as a share of the median step.
    comm_share = {name: statistics.median(v[cfg.warmup:]) / medians[name] for name, v in exposed.items()}

    best_static = min((str(s) for s in settings), key=lambda name: medians[name])
    floor = medians.get(floor_name)
    setting_rows = [{"setting": str(s), "seconds": medians[str(s)], "comm_share": comm_share[str(s)],
                     "x_floor": None if floor is None else medians[str(s)] / floor,
                     "cpu_seconds": cpu[str(s)], "idle": idle[str(s)]} for s in settings]
    floor_cpu = {"cpu_seconds": cpu[floor_name], "idle": idle[floor_name]} if floor is not None else None
    if show:
        print("\n".join(_distributed_rows(setting_rows, floor, floor_cpu)), flush=True)
        print("tuning parallel='auto' ...", flush=True)
    autos = _auto_layers(cfg, extra, profile, auto_trials, auto_runs)
    auto_cases = _tuned_auto_cases(autos, layer, x, grad)
    # The static settings again, side by side with auto: "best static" is the fastest of them in this same
    # run, so that noise between the sweep above and this run cannot favour either side. A setting the sweep
    # timed at 1.5x its best or more cannot be the best, and is left out of these longer rounds.
    contenders = [s for s in settings if medians[str(s)] < STATIC_CONTENDER * medians[best_static]]
    statics = {f"static {s}": cases[str(s)] for s in contenders}
    auto_report, best_with_auto, best_seconds = _auto_vs_static(autos, auto_cases, statics, cfg, show)
    return {
        "config": asdict(cfg), "world_size": world, "ranks_per_node": layer.ranks_per_node,
        "sleep_ms": sleep_ms, "threads_per_rank": torch.get_num_threads(),
        "settings": setting_rows,
        "floor_seconds": floor,
        "floor_cpu": floor_cpu,
        "auto": auto_report, "best_static": best_static,
        "best_static_with_auto": best_with_auto.removeprefix("static "),
        "best_static_seconds": best_seconds,
        "rank": rank,
    }


def _local_counts(layer: MoELayer, all_counts: list[list[int]]) -> list[int]:
    """Rows per local expert that this rank computes with r = 1 (every source's rows of its experts)."""
    experts = layer.layout.experts_of_rank(dist.get_rank())
    return [sum(row[e] for row in all_counts) for e in experts]


def _distributed_header(cfg: BenchConfig, world: int, sleep_ms: float | None, threads: int) -> str:
    stall = f", experts stall {sleep_ms:g} ms (no CPU)" if sleep_ms is not None else ""
    return (f"flexmoe bench: {world} ranks x {cfg.describe()} per rank, {threads} thread(s) per rank{stall}; "
            f"median of {cfg.steps} steps, slowest rank")


def _distributed_rows(settings: list[dict[str, Any]], floor: float | None,
                      floor_cpu: dict[str, Any] | None = None) -> list[str]:
    """The table: per setting its step, the exposed exchange wait, the step over the floor, and its CPU time per
    rank (mean over the ranks, every thread of the process), that over the floor's, and the node's idle share."""
    lines = [f"{'setting':<24}{'ms/step':>10}{'a2a wait':>10}{'share':>7}{'x floor':>9}"
             f"{'cpu ms/rank':>13}{'x floor':>9}{'idle':>7}"]
    floor_cpu_s = None if floor_cpu is None else floor_cpu["cpu_seconds"]

    def cpu_cells(row: dict[str, Any]) -> str:
        if row.get("cpu_seconds") is None:
            return ""
        ratio = f"{row['cpu_seconds'] / floor_cpu_s:>9.3f}" if floor_cpu_s else f"{'':>9}"
        idle = f"{row['idle']:>7.1%}" if row.get("idle") is not None else f"{'-':>7}"
        return f"{row['cpu_seconds'] * 1e3:>13.1f}{ratio}{idle}"

    for row in settings:
        ratio = f"{'':>9}" if row["x_floor"] is None else f"{row['x_floor']:>9.3f}"
        wait_ms = row["comm_share"] * row["seconds"] * 1e3
        lines.append(f"{row['setting']:<24}{row['seconds'] * 1e3:>10.1f}{wait_ms:>10.1f}{row['comm_share']:>7.0%}"
                     f"{ratio}{cpu_cells(row)}")
    if floor is not None:
        cells = cpu_cells(floor_cpu) if floor_cpu is not None else ""
        lines.append(f"{'floor (per-rank rows)':<24}{floor * 1e3:>10.1f}{'':>26}{cells}")
    return lines


def format_distributed(report: dict[str, Any]) -> str:
    return "\n".join([_distributed_header(BenchConfig(**report["config"]), report["world_size"],
                                          report["sleep_ms"], report["threads_per_rank"]),
                      *_distributed_rows(report["settings"], report["floor_seconds"], report.get("floor_cpu")),
                      *distributed_conclusions(report)])


def distributed_conclusions(report: dict[str, Any]) -> list[str]:
    lines = []
    best = report["best_static_seconds"]
    for auto in report["auto"]:
        lines.append(f"{auto['name']} chose {auto['choice']}: {auto['seconds'] * 1e3:.1f} ms vs best static "
                     f"{report['best_static_with_auto']} {best * 1e3:.1f} ms (median per-round ratio "
                     f"{auto['ratio']:.3f}x, all timed side by side)")
        lines.append(f"  tuning: {auto['tuning']}")
    if report["sleep_ms"] is not None:
        by = {row["setting"]: row["seconds"] for row in report["settings"]}
        d1 = next((v for k, v in by.items() if k.startswith("r=1 d=1 a2a=flat")), None)
        best = min(by.values())
        if d1:
            lines.append(f"pipelining: best setting {best / d1:.3f}x the time of d=1 "
                         f"({(d1 - best) * 1e3:.1f} ms of communication hidden per step)")
    return lines
