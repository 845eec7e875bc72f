"""``flexmoe bench``: time one MoE layer (forward + backward) against the compute floor and reference layers.

Timings on a shared machine are noisy, so every number that matters is a ratio measured side by side in one
run: the cases take turns step by step (the order rotates every step), and each reports the median of its
steps. The cases (see :mod:`flexmoe.apps.baselines`):

* ``floor``: the expert FFNs on exactly the rows the router sent them, nothing else, one ``addmm`` pair per
  expert; every ``x floor`` is over this one;
* ``grouped floor``: the same rows by the fastest grouped GEMM torch offers (``torch._grouped_mm`` where it
  runs, else a padded ``bmm``, reported as the better of it and the loop);
* ``flexmoe``: :class:`flexmoe.MoELayer`, router to combine;
* ``gshard-einsum``: a GShard/fairseq-style dense-einsum layer with the same router and weights (a labelled
  reference kept in the benchmark, not a peer);
* peers when importable: DeepSpeed's ``MoE``, fairscale's ``MOELayer``, Tutel's ``moe_layer``; otherwise a line
  says why they were skipped.

``--memory`` adds the activation memory each case keeps for its backward (bytes of the tensors autograd saves,
parameters excluded) and the same for 64 experts at equal tokens, k and hidden size: index dispatch keeps
memory proportional to ``T * k * M``; a dense ``[T, E, C]`` dispatch grows with ``E * C``.
``--suite`` runs the standard configurations and checks each ratio against its target.
``--hf FAMILY`` times a Hugging Face MoE block on HF's experts implementations and on flexmoe
(:mod:`flexmoe.apps.bench_hf`).

Distributed (``torchrun --nproc_per_node=N -m flexmoe bench`` or ``flexmoe bench --nproc N``): ``--tokens`` is
per rank; every (r, d, all-to-all) setting is timed side by side, with the exposed all-to-all share of the
step, then ``parallel="auto"``'s choice and the single-rank compute floor of the same per-rank work.
``--sleep-ms S`` swaps the experts for ones that stall S ms per forward (and per backward) without using the
CPU, which shows how much communication pipelining (d > 1) hides when compute does not compete for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.apps.baselines import expert_floor, grouped_floor, grouped_floor_kind, gshard_einsum_forward
from flexmoe.apps.bench_suite import Measurement, SuiteCheck, SuiteSettings
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, FINITE, NON_NEGATIVE, POSITIVE, SEED
from flexmoe.experts import FeedForwardExperts
from flexmoe.launch import relaunch, under_torchrun
from flexmoe.layer import MoELayer

__all__ = ["BenchConfig", "add_arguments", "run", "time_side_by_side", "saved_activation_bytes", "bench_single",
           "floor_ratio_check", "memory_check"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration. ``tokens`` is per rank under torchrun."""

    tokens: int = 4096
    model_dim: int = 512
    hidden_dim: int = 1024
    experts: int = 8
    k: int = 2
    capacity_factor: float = 1.25
    dtype: str = "float32"
    glu: bool = False
    steps: int = 10
    warmup: int = 3
    seed: int = 0
    device: str = "cpu"

    def describe(self) -> str:
        cf = "dropless" if self.capacity_factor == 0 else f"cf={self.capacity_factor:g}"
        on = "" if self.device == "cpu" else f" on {self.device}"
        return (f"T={self.tokens} M={self.model_dim} H={self.hidden_dim} E={self.experts} k={self.k} {cf} "
                f"{self.dtype}{' glu' if self.glu else ''}{on}")


# --------------------------------------------------------------------------------------------- measuring


def wait_for(device: torch.device | str) -> None:
    """Block until the work queued on ``device`` is done (CUDA runs kernels asynchronously; the CPU does not)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_side_by_side(cases: dict[str, Callable[[], None]], steps: int, warmup: int,
                      sync: Callable[[float], float] = lambda t: t, desc: str | None = None,
                      device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Seconds of each case per step, the cases taking turns (order rotated each step so none always runs
    first). ``sync`` maps one local time to the time that counts (under torchrun: the slowest rank's).
    ``device``: where the cases run; each case's time ends when that device has finished its work.

    With ``desc``, a progress bar on stderr counts the rounds (every case once) and shows each case's running
    median over the floor's; the rows themselves exist only once all rounds are in, since the cases share them.
    """
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    bar = _progress_bar(warmup + steps, desc)
    for step in range(warmup + steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            wait_for(device)
            start = time.perf_counter()
            cases[name]()
            wait_for(device)
            elapsed = sync(time.perf_counter() - start)
            if step >= warmup:
                times[name].append(elapsed)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str("warm-up" if step < warmup else _running_ratios(times))
    if bar is not None:
        bar.close()
    return times


def _progress_bar(total: int, desc: str | None) -> Any:
    if desc is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="round", file=sys.stderr, dynamic_ncols=True, leave=False)


def _running_ratios(times: dict[str, list[float]]) -> str:
    """'case 1.02x' for every case, its median so far over the first case's (the floor's)."""
    medians = {name: statistics.median(v) for name, v in times.items() if v}
    first = next(iter(medians.values()), None)
    if not first:
        return ""
    return ", ".join(f"{name.split(' ')[0]} {m / first:.2f}x" for name, m in list(medians.items())[1:])


def saved_activation_bytes(step: Callable[[], Tensor], params: Sequence[Tensor]) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``step()`` (storages counted once, parameters
    excluded): the activation memory of a forward + backward beyond parameters and their gradients."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    del out
    return sum(saved.values())


def build_layer(cfg: BenchConfig, **extra: Any) -> MoELayer:
    torch.manual_seed(cfg.seed)
    return MoELayer(cfg.model_dim, cfg.experts, cfg.hidden_dim, k=cfg.k, capacity_factor=cfg.capacity_factor,
                    glu=cfg.glu, dtype=_DTYPES[cfg.dtype], **extra).to(cfg.device)


def random_rows(cfg: BenchConfig, rows: int, gen: torch.Generator) -> Tensor:
    """``[rows, model_dim]`` normal values drawn on the CPU (the same on every device), in ``cfg``'s dtype on
    ``cfg``'s device."""
    return torch.randn(rows, cfg.model_dim, generator=gen).to(cfg.device, _DTYPES[cfg.dtype])


def _inputs(cfg: BenchConfig, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = random_rows(cfg, cfg.tokens, gen).requires_grad_()
    grad = random_rows(cfg, cfg.tokens, gen)
    return x, grad


def _fwd_bwd(forward: Callable[[], Tensor], grad: Tensor, module: nn.Module | None) -> Callable[[], None]:
    def step() -> None:
        if module is not None:
            module.zero_grad(set_to_none=True)
        forward().backward(grad)
    return step


def _floor_case(layer: MoELayer, counts: list[int], cfg: BenchConfig, grouped: bool = False,
                ) -> tuple[Callable[[], None], Callable]:
    """A forward + backward step of the floor (``grouped``: the grouped-GEMM floor) on random rows of the
    routed counts, and its forward alone."""
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    rows = random_rows(cfg, sum(counts), gen).requires_grad_()
    grad = random_rows(cfg, sum(counts), gen)
    experts = layer.experts
    assert isinstance(experts, FeedForwardExperts), "the floor times the built-in FFN experts"
    forward = partial(grouped_floor if grouped else expert_floor, experts, rows, counts)
    return _fwd_bwd(forward, grad, layer.experts), forward


# ------------------------------------------------------------------------------------------------- peers


def _peer_cases(cfg: BenchConfig, x: Tensor, grad: Tensor) -> tuple[dict[str, Callable[[], None]], list[str]]:
    """DeepSpeed, fairscale and Tutel layers of the same size, where importable; and why the others are not."""
    cases: dict[str, Callable[[], None]] = {}
    skipped: list[str] = []
    for name, build in (("deepspeed-moe", _deepspeed_layer), ("fairscale-moe", _fairscale_layer),
                        ("tutel-moe", _tutel_layer)):
        try:
            module, forward = build(cfg)
            with torch.no_grad():
                forward(x)  # a peer that cannot run this configuration fails here, not mid-measurement
        except Exception as exc:  # a peer that is missing or fails to build is reported, never fatal
            skipped.append(f"{name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        cases[name] = _fwd_bwd(partial(forward, x), grad, module)
    return cases, skipped


def _peer_ffn(cfg: BenchConfig) -> nn.Module:
    dtype = _DTYPES[cfg.dtype]
    return nn.Sequential(nn.Linear(cfg.model_dim, cfg.hidden_dim), nn.GELU(),
                         nn.Linear(cfg.hidden_dim, cfg.model_dim)).to(dtype)


def _single_rank_world() -> None:
    """Peers need torch.distributed even on one process: a 1-rank gloo group over an in-process store."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _deepspeed_layer(cfg: BenchConfig) -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    import deepspeed  # noqa: F401
    from deepspeed.moe.layer import MoE

    _single_rank_world()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(cfg.seed)
    layer = MoE(cfg.model_dim, _peer_ffn(cfg), num_experts=cfg.experts, ep_size=1, k=cfg.k,
                capacity_factor=max(cfg.capacity_factor, 0.0) or 1.0, min_capacity=0,
                drop_tokens=cfg.capacity_factor > 0, use_rts=False).to(_DTYPES[cfg.dtype])
    return layer, lambda x: layer(x.unsqueeze(0))[0].squeeze(0)


def _fairscale_layer(cfg: BenchConfig) -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    from fairscale.nn import MOELayer, Top2Gate

    if cfg.k != 2:
        raise ValueError("fairscale's MOELayer has only a top-2 gate")
    _single_rank_world()
    torch.manual_seed(cfg.seed)
    experts = nn.ModuleList(_peer_ffn(cfg) for _ in range(cfg.experts))
    if cfg.tokens % cfg.experts:
        raise ValueError("fairscale's MOELayer needs the batch to be a multiple of the expert count")
    layer = MOELayer(Top2Gate(cfg.model_dim, cfg.experts), experts).to(_DTYPES[cfg.dtype])
    # Its input must be [batch, seq, M] with batch a multiple of the local expert count.
    return layer, lambda x: layer(x.reshape(cfg.experts, -1, cfg.model_dim)).reshape(x.shape)


def _tutel_layer(cfg: BenchConfig) -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    from tutel import moe as tutel_moe

    _single_rank_world()
    torch.manual_seed(cfg.seed)
    layer = tutel_moe.moe_layer(
        gate_type={"type": "top", "k": cfg.k, "capacity_factor": cfg.capacity_factor},
        model_dim=cfg.model_dim,
        experts={"type": "ffn", "count_per_node": cfg.experts, "hidden_size_per_expert": cfg.hidden_dim},
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
    ).to(_DTYPES[cfg.dtype])
    return layer, lambda x: layer(x.unsqueeze(0)).squeeze(0)


# -------------------------------------------------------------------------------------------- one process


def bench_single(cfg: BenchConfig, *, peers: bool = True, reference: bool = True,
                 memory: bool = False, show: bool = False) -> dict[str, Any]:
    """Time the layer, the floor and the references side by side; returns the report (see ``--json``).

    With ``show`` the report is printed as it forms: the configuration and routing plan first, a progress bar
    while the cases are timed, the table when they are, then the activation memory when measured.
    """
    layer = build_layer(cfg)
    x, grad = _inputs(cfg, cfg.seed + 1)
    with torch.no_grad():
        layer(x)
    plan = layer.last_plan
    assert plan is not None  # set by the forward above
    plan_report = {"capacity": plan.capacity, "dropped_fraction": plan.dropped_fraction,
                   "rows_computed": sum(plan.counts), "tokens_per_expert": plan.counts}
    if show:
        print("\n".join(_single_header(cfg, torch.get_num_threads(), plan_report)), flush=True)
    floor_step, floor_forward = _floor_case(layer, plan.counts, cfg)
    cases: dict[str, Callable[[], None]] = {
        "floor": floor_step,
        "grouped floor": _floor_case(layer, plan.counts, cfg, grouped=True)[0],
        "flexmoe": _fwd_bwd(lambda: layer(x), grad, layer),
    }
    if reference:
        cases["gshard-einsum"] = _fwd_bwd(lambda: gshard_einsum_forward(layer, x), grad, layer)
    skipped: list[str] = []
    if peers and cfg.device != "cpu":
        skipped.append(f"peers: skipped on {cfg.device} (DeepSpeed, fairscale and Tutel are compared on the CPU)")
    elif peers:
        peer_cases, skipped = _peer_cases(cfg, x, grad)
        cases.update(peer_cases)
    if show:
        for line in skipped:
            print(line, flush=True)
    times = time_side_by_side(cases, cfg.steps, cfg.warmup, desc=f"timing {len(cases)} cases" if show else None,
                              device=cfg.device)
    floor = statistics.median(times["floor"])
    rows = []
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append({"case": name, "seconds": median, "tokens_per_s": cfg.tokens / median,
                     "x_floor": median / floor})
    assert isinstance(layer.experts, FeedForwardExperts)  # checked by _floor_case
    kind = grouped_floor_kind(layer.experts, x)
    grouped = statistics.median(times["grouped floor"])
    if kind != "torch._grouped_mm":  # no grouped GEMM here: the better of padded bmm and the loop
        grouped = min(grouped, floor)
    flexmoe_seconds = statistics.median(times["flexmoe"])
    report: dict[str, Any] = {
        "config": asdict(cfg), "threads": torch.get_num_threads(), "rows": rows, "skipped": skipped,
        "plan": plan_report,
        "floors": {"loop_seconds": floor, "grouped_seconds": grouped, "grouped_kind": kind,
                   "flexmoe_x_grouped_floor": flexmoe_seconds / grouped},
    }
    if show:
        print("\n".join(_single_rows(report)), flush=True)
    if memory:
        if show:
            print("measuring activation memory (and E=64) ...", flush=True)
        report["memory"] = _memory_report(cfg, layer, x, floor_forward)
        if show:
            print(_memory_line(report["memory"]), flush=True)
    return report


def _memory_report(cfg: BenchConfig, layer: MoELayer, x: Tensor, floor_forward: Callable) -> dict[str, Any]:
    params = list(layer.parameters())
    out: dict[str, float] = {
        "floor_bytes": saved_activation_bytes(floor_forward, params),
        "flexmoe_bytes": saved_activation_bytes(lambda: layer(x), params),
        "gshard_einsum_bytes": saved_activation_bytes(lambda: gshard_einsum_forward(layer, x), params),
    }
    wide = replace(cfg, experts=64)  # same T, k and hidden size, 8x the experts
    wide_layer = build_layer(wide)
    out["flexmoe_bytes_e64"] = saved_activation_bytes(lambda: wide_layer(x), list(wide_layer.parameters()))
    out["gshard_einsum_bytes_e64"] = saved_activation_bytes(lambda: gshard_einsum_forward(wide_layer, x),
                                                            list(wide_layer.parameters()))
    out["flexmoe_e64_over_e8"] = out["flexmoe_bytes_e64"] / out["flexmoe_bytes"]
    out["gshard_einsum_e64_over_e8"] = out["gshard_einsum_bytes_e64"] / out["gshard_einsum_bytes"]
    return out


def _single_header(cfg: BenchConfig, threads: int, plan: dict[str, Any]) -> list[str]:
    return [
        f"flexmoe bench: {cfg.describe()}, {threads} threads, median of {cfg.steps} steps "
        f"(forward + backward, cases interleaved)",
        f"plan: capacity {plan['capacity']}, {plan['rows_computed']} rows computed, "
        f"dropped {plan['dropped_fraction']:.2%}",
    ]


def _single_rows(report: dict[str, Any]) -> list[str]:
    lines = [f"{'case':<16}{'ms/step':>10}{'tokens/s':>12}{'x floor':>9}"]
    for row in report["rows"]:
        lines.append(f"{row['case']:<16}{row['seconds'] * 1e3:>10.1f}{row['tokens_per_s']:>12.0f}"
                     f"{row['x_floor']:>9.3f}")
    floors = report["floors"]
    lines.append(f"floors: loop {floors['loop_seconds'] * 1e3:.1f} ms, grouped ({floors['grouped_kind']}) "
                 f"{floors['grouped_seconds'] * 1e3:.1f} ms; flexmoe {floors['flexmoe_x_grouped_floor']:.3f}x "
                 f"the grouped floor")
    return lines


def _memory_line(mem: dict[str, Any]) -> str:
    mib = 1 / 2**20
    return (f"activation memory (saved for backward): floor {mem['floor_bytes'] * mib:.1f} MiB, flexmoe "
            f"{mem['flexmoe_bytes'] * mib:.1f} MiB (E=64: {mem['flexmoe_bytes_e64'] * mib:.1f} MiB, "
            f"{mem['flexmoe_e64_over_e8']:.2f}x), gshard-einsum {mem['gshard_einsum_bytes'] * mib:.1f} MiB "
            f"(E=64: {mem['gshard_einsum_bytes_e64'] * mib:.1f} MiB, {mem['gshard_einsum_e64_over_e8']:.2f}x)")


def format_single(report: dict[str, Any]) -> str:
    cfg = BenchConfig(**report["config"])
    lines = _single_header(cfg, report["threads"], report["plan"]) + _single_rows(report) + report["skipped"]
    if report.get("memory"):
        lines.append(_memory_line(report["memory"]))
    return "\n".join(lines)


def floor_ratio_check(label: str, cfg: BenchConfig, target: float, group: str = "layer") -> SuiteCheck:
    """flexmoe's time over the (loop) floor's at ``cfg``, the floors and flexmoe (and peers if allowed)
    interleaved; the note gives the ratio to the grouped-GEMM floor too."""
    def measure(settings: SuiteSettings) -> Measurement:
        run_cfg = replace(cfg, steps=min(cfg.steps, settings.steps), warmup=min(cfg.warmup, settings.warmup),
                          seed=settings.seed, device=settings.device)
        report = bench_single(run_cfg, peers=settings.peers, reference=False, show=settings.show)
        ratio = next(r["x_floor"] for r in report["rows"] if r["case"] == "flexmoe")
        floors = report["floors"]
        note = (f"{floors['flexmoe_x_grouped_floor']:.3f}x the grouped floor ({floors['grouped_kind']}, itself "
                f"{floors['grouped_seconds'] / floors['loop_seconds']:.3f}x the loop floor)")
        return Measurement(ratio, "x floor", {"report": report}, note)
    return SuiteCheck(group, label, target, measure)


def memory_check(label: str, cfg: BenchConfig, wide_experts: int, target: float, group: str = "layer",
                 ) -> SuiteCheck:
    """Activation memory (bytes autograd saves) at ``wide_experts`` over ``cfg``'s, same T, k and H."""
    def measure(settings: SuiteSettings) -> Measurement:
        narrow = replace(cfg, seed=settings.seed, device=settings.device)
        x, _ = _inputs(narrow, narrow.seed + 1)
        saved = {}
        for experts in (cfg.experts, wide_experts):
            layer = build_layer(replace(narrow, experts=experts))
            saved[experts] = saved_activation_bytes(partial(layer, x), list(layer.parameters()))
        ratio = saved[wide_experts] / saved[cfg.experts]
        mib = 2**-20
        return Measurement(ratio, f"x E={cfg.experts}", {"bytes": saved},
                           f"{saved[cfg.experts] * mib:.1f} MiB at E={cfg.experts}, "
                           f"{saved[wide_experts] * mib:.1f} MiB at E={wide_experts}")
    return SuiteCheck(group, label, target, measure)


def layer_checks() -> list[SuiteCheck]:
    """The suite's "layer" group: one process, T=4096 M=512 H=1024 E=8 k=2 unless said (flexmoe.apps.bench_suite)."""
    return [
        floor_ratio_check("fp32 cf=1.25", BenchConfig(), 1.10),
        floor_ratio_check("fp32 dropless", BenchConfig(capacity_factor=0.0), 1.10),
        # Few steps: without native bf16 units (AVX2-only CPUs) bf16 matmuls run ~30x slower than fp32.
        floor_ratio_check("bf16 cf=1.25", BenchConfig(dtype="bfloat16", steps=3, warmup=1), 1.30),
        memory_check("activation memory E=64 / E=8", BenchConfig(), 64, 1.2),
    ]


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
    rows = torch.zeros(sum(counts), cfg.model_dim, dtype=_DTYPES[cfg.dtype], requires_grad=True)
    return _fwd_bwd(lambda: experts(rows, counts), torch.ones_like(rows), experts)


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
    from flexmoe.parallel import MeasuringChooser, ParallelSetting, candidates

    rank, world = dist.get_rank(), dist.get_world_size()
    show = show and rank == 0
    extra: dict[str, Any] = {"group": dist.group.WORLD, "ranks_per_node": ranks_per_node}
    if sleep_ms is not None:
        if cfg.experts % world:
            raise ValueError(f"--sleep-ms needs whole experts per rank: --experts must be a multiple of {world}")
        expected = cfg.tokens * cfg.k  # rows one rank computes when the load is even
        extra["experts"] = SleepyExperts(cfg.experts // world, sleep_ms / 1e3, expected)
    layer = build_layer(cfg, **extra)
    x, grad = _inputs(cfg, cfg.seed + 1 + rank)  # each rank its own tokens
    ep = layer._ep
    assert ep is not None  # a layer over a process group
    settings = candidates(ep.valid_r(), world, layer.parallel_options.ranks_per_node, degrees,
                          token_exchange=ep.can_send_tokens)
    exposed: dict[str, list[float]] = {str(s): [] for s in settings}  # seconds waiting on exchanges, per step

    def timed_setting(s: ParallelSetting) -> Callable[[], None]:
        step = _synced(_fwd_bwd(lambda: layer(x, r=s.r, overlap_degree=s.overlap_degree, a2a=s.a2a,
                                              ranks_per_node=s.ranks_per_node, token_exchange=s.token_exchange),
                                grad, layer))

        def run() -> None:
            ep.stats.reset()
            step()
            exposed[str(s)].append(ep.stats.seconds)
        return run

    cases = {str(s): timed_setting(s) for s in settings}
    floor_name = "floor (1 rank, same per-rank rows)"
    with torch.no_grad():
        layer(x)
    assert layer.last_plan is not None  # set by the forward above
    local = _local_counts(layer, ep.gather_counts(layer.last_plan.counts))
    # The floor: this rank's experts alone on its rows, no exchange. With --sleep-ms, that is their stall: what
    # a step would cost if the pipelining hid every exchange.
    floor_step = _floor_case(layer, local, cfg)[0] if sleep_ms is None else _stall_floor(layer.experts, local, cfg)
    cases[floor_name] = _synced(floor_step)
    # Where the time goes when the ranks share the cores: each case's CPU time per step (mean over the ranks) and
    # the node's idle share while it ran. A step that keeps the cores busy costs its CPU work, not its waits.
    accounts: dict[str, CpuAccount] = {}
    for name in list(cases):
        cases[name], accounts[name] = CpuAccount.wrap(cases[name])
    if show:
        print(_distributed_header(cfg, world, sleep_ms, torch.get_num_threads()), flush=True)
    times = time_side_by_side(cases, cfg.steps, cfg.warmup, sync=_slowest,
                              desc=f"timing {len(cases)} settings" if show else None)
    medians = {name: statistics.median(v) for name, v in times.items()}
    cpu_local = torch.tensor([statistics.median(accounts[n].seconds[cfg.warmup:]) for n in cases],
                             dtype=torch.float64)
    dist.all_reduce(cpu_local)
    cpu = dict(zip(cases, (cpu_local / world).tolist()))
    idle = {n: idle_share(accounts[n].ticks[cfg.warmup:]) for n in cases}
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
    def chooser() -> MeasuringChooser:
        return MeasuringChooser() if auto_trials is None else MeasuringChooser(trials=auto_trials)

    autos = {"auto" if auto_runs == 1 else f"auto (run {i + 1})": build_layer(cfg, parallel="auto",
                                                                              chooser=chooser(), **extra)
             for i in range(auto_runs)}
    if profile is not None:
        from flexmoe.tuning import ModelGuidedChooser

        autos[f"auto (model {profile}, keep 3)"] = build_layer(
            cfg, parallel="auto", chooser=ModelGuidedChooser(profile, keep=3), **extra)
    auto_cases = {}
    for name, auto_layer in autos.items():
        auto_layer.load_state_dict(layer.state_dict())
        auto_step = _fwd_bwd(partial(auto_layer, x), grad, auto_layer)
        while not auto_layer.auto_decisions:  # tuning: each candidate is tried, then one is kept
            auto_step()
        auto_cases[name] = _synced(auto_step)
    # The static settings again, side by side with auto: "best static" is the fastest of them in this same
    # run, so that noise between the sweep above and this run cannot favour either side. A setting the sweep
    # timed at 1.5x its best or more cannot be the best, and is left out of these longer rounds.
    contenders = [s for s in settings if medians[str(s)] < STATIC_CONTENDER * medians[best_static]]
    statics = {f"static {s}": cases[str(s)] for s in contenders}
    auto_times = time_side_by_side({**auto_cases, **statics}, max(cfg.steps, AUTO_STEPS), cfg.warmup,
                                   sync=_slowest, desc="timing auto" if show else None)
    auto_medians = {name: statistics.median(v) for name, v in auto_times.items()}
    best_with_auto = min(statics, key=auto_medians.__getitem__)
    auto_report = [{"name": name, "choice": str(m.auto_decisions[0].choice),
                    "seconds": auto_medians[name],
                    "ratio": paired_ratio(auto_times[name], auto_times[best_with_auto]),
                    "tuning": m.auto_decisions[0].describe()} for name, m in autos.items()]
    return {
        "config": asdict(cfg), "world_size": world, "ranks_per_node": layer.ranks_per_node,
        "sleep_ms": sleep_ms, "threads_per_rank": torch.get_num_threads(),
        "settings": setting_rows,
        "floor_seconds": floor,
        "floor_cpu": floor_cpu,
        "auto": auto_report, "best_static": best_static,
        "best_static_with_auto": best_with_auto.removeprefix("static "),
        "best_static_seconds": auto_medians[best_with_auto],
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
                      *_distributed_conclusions(report)])


def _distributed_conclusions(report: dict[str, Any]) -> list[str]:
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


# ----------------------------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    a = parser.add_argument
    a("--tokens", type=COUNT, default=d.tokens, help="tokens per step (per rank under torchrun)")
    a("--model-dim", type=COUNT, default=d.model_dim, help="model (token) dimension M")
    a("--hidden-dim", type=COUNT, default=d.hidden_dim, help="hidden dimension H of each expert's FFN")
    a("--num-experts", "--experts", dest="experts", type=COUNT, default=d.experts,
      help="number of experts E (global under torchrun); --experts is the older spelling")
    a("--k", type=COUNT, default=d.k, help="experts per token (top-k)")
    a("--capacity-factor", type=FINITE, default=d.capacity_factor, help="0: dropless, < 0: adaptive")
    a("--dtype", choices=sorted(_DTYPES), default=d.dtype, help="parameter and activation dtype")
    a("--glu", action="store_true", help="gated (SwiGLU-style) experts")
    a("--steps", type=COUNT, default=d.steps, help="timed steps per case (median reported)")
    a("--warmup", type=NON_NEGATIVE, default=d.warmup, help="untimed steps per case first")
    a("--seed", type=SEED, default=d.seed, help="seed of the weights and inputs")
    a("--device", type=_device, default=d.device,
      help="where the layer and every suite check run: cpu (default), cuda, cuda:1, ...; a check that only means "
           "something on the CPU (peers, gloo expert parallelism) says it was skipped")
    a("--threads", type=COUNT, default=None, help="torch threads (default: all cores, shared by local ranks)")
    a("--no-peers", action="store_true", help="skip DeepSpeed / fairscale / Tutel even when importable")
    a("--memory", action="store_true", help="also report activation memory, and E=64 at equal T, k, H")
    a("--suite", action="store_true",
      help="measure every target of the suite (flexmoe.apps.bench_suite) and print each against its target")
    a("--suite-groups", type=_names, default=None,
      help="run only these comma-separated suite groups, e.g. layer,fine-grained (default: all)")
    a("--suite-one-process", action="store_true",
      help="--suite: measure every check in this process (default: each in a fresh process, so that no check "
           "inherits the allocator state the checks before it left)")
    a("--families", action="store_true",
      help="DeepSeek-style routing vs plain top-k at E=64 (8 groups), k=8 (overrides --experts, --k)")
    a("--nproc", type=COUNT, default=1, help="launch N local ranks (gloo on 127.0.0.1)")
    a("--ranks-per-node", type=COUNT, default=None, help="for the 2-D hierarchical all-to-all (default: torchrun's)")
    a("--sleep-ms", type=POSITIVE, default=None,
      help="distributed: experts that stall this long per pass without using the CPU (overlap check) "
           "(default: real experts)")
    a("--degrees", type=_degrees, default=(1, 2, 4), help="distributed: overlap degrees to time (default: 1,2,4)")
    a("--profile", default=None,
      help="distributed: also run parallel='auto' steered by this cost-model profile ('local', 'a100-ndv4', a "
           "path) (default: none)")
    a("--hf", default=None, metavar="FAMILY",
      help="time one Hugging Face MoE block on HF's experts implementations and on flexmoe (flexmoe.apps.bench_hf): "
           "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss or all; needs transformers (default: off)")
    a("--hf-memory-gib", type=POSITIVE, default=1.0,
      help="--hf: skip HF batched_mm where its per-pair weight copies need more than this (default: 1)")
    a("--auto-trials", type=COUNT, default=None,
      help="distributed: timed trials per candidate for parallel='auto' (default: MeasuringChooser's own count)")
    a("--auto-runs", type=COUNT, default=1,
      help="distributed: tune parallel='auto' this many times from scratch, each timed against the best static")
    a("--json", action="store_true", help="print the report as JSON")


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated group names, got {text!r}")
    return names


def _device(text: str) -> str:
    """A device this machine has: ``cpu`` or ``cuda[:index]`` with CUDA available."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device that torch {torch.__version__} "
                                         f"can use")
    if (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def _degrees(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"overlap degrees must be >= 1, got {text!r}")
    return values


def _config(args: argparse.Namespace) -> BenchConfig:
    """The layer's configuration; each flag's range was checked as it was parsed (:mod:`flexmoe.apps.flags`)."""
    if args.k > args.experts:
        raise UsageError(f"--k {args.k} must be at most --num-experts {args.experts}")
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.sleep_ms is not None and args.experts % world:
        raise UsageError(f"--sleep-ms needs whole experts per rank: --num-experts {args.experts} must be a multiple "
                         f"of the {world} ranks")
    if args.device != "cpu" and (args.nproc > 1 or under_torchrun()):
        raise UsageError(f"--device {args.device}: the distributed benchmark runs on CPU ranks (gloo) only")
    return BenchConfig(args.tokens, args.model_dim, args.hidden_dim, args.experts, args.k, args.capacity_factor,
                       args.dtype, args.glu, args.steps, args.warmup, args.seed, args.device)


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.nproc > 1 and not under_torchrun():
        argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
        return relaunch(args.nproc, "bench", _without_nproc(argv))
    if under_torchrun():
        return _run_distributed(cfg, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.suite or args.suite_groups:
        from flexmoe.apps.bench_suite import format_suite_table, run_suite_checks, run_suite_isolated, suite_checks
        try:
            checks = suite_checks(args.suite_groups)
        except ValueError as exc:
            raise UsageError(f"--suite-groups: {exc}") from None
        settings = SuiteSettings(steps=cfg.steps, warmup=cfg.warmup, seed=cfg.seed, peers=not args.no_peers,
                                 show=not args.json, device=cfg.device)
        if args.suite_one_process:
            results = run_suite_checks(checks, settings)
        else:
            results = run_suite_isolated(args.suite_groups, settings, torch.get_num_threads())
        print(json.dumps({"suite": results}, indent=1) if args.json else format_suite_table(results))
        return 0
    if args.hf is not None:
        from flexmoe.apps.bench_hf import run_hf
        return run_hf(args.hf, steps=cfg.steps, warmup=cfg.warmup, seed=cfg.seed, memory_gib=args.hf_memory_gib,
                      tokens=cfg.tokens, model_dim=cfg.model_dim, as_json=args.json, device=cfg.device)
    if args.families:
        from flexmoe.apps.bench_families import bench_families, format_families
        report = bench_families(cfg)
        print(json.dumps(report, indent=1) if args.json else format_families(report))
        return 0
    report = bench_single(cfg, peers=not args.no_peers, memory=args.memory, show=not args.json)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out


def _run_distributed(cfg: BenchConfig, args: argparse.Namespace) -> int:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun, like RANK and WORLD_SIZE
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        report = bench_distributed(cfg, args.sleep_ms, args.ranks_per_node, args.profile, args.degrees,
                                   show=not args.json, auto_trials=args.auto_trials, auto_runs=args.auto_runs)
        if report["rank"] == 0:
            print(json.dumps(report, indent=1) if args.json else "\n".join(_distributed_conclusions(report)),
                  flush=True)
    finally:
        dist.destroy_process_group()
    return 0
