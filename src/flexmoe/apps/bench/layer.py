"""``flexmoe bench``: time one MoE layer (forward + backward) against the compute floor and reference layers.

Every number is a ratio of cases timed side by side (:mod:`flexmoe.apps.bench.timing`). The cases (see
:mod:`flexmoe.apps.baselines`):

* ``floor``: the expert FFNs on exactly the rows the router sent them, nothing else, one ``addmm`` pair per
  expert; every ``x floor`` is over this one;
* ``grouped floor``: the same rows by the fastest grouped GEMM torch offers (``torch._grouped_mm`` where it
  runs, else a padded ``bmm``, reported as the better of it and the loop);
* ``flexmoe``: :class:`flexmoe.MoELayer`, router to combine;
* ``gshard-einsum``: a GShard/fairseq-style dense-einsum layer with the same router and weights (a labelled
  reference kept in the benchmark, not a peer);
* peers when importable (on the CPU): DeepSpeed's ``MoE``, fairscale's ``MOELayer``, Tutel's ``moe_layer``;
  otherwise a line says why they were skipped.

``--memory`` adds the activation memory each case keeps for its backward (bytes of the tensors autograd saves,
parameters excluded) and the same for 64 experts at equal tokens, k and hidden size: index dispatch keeps
memory proportional to ``T * k * M``; a dense ``[T, E, C]`` dispatch grows with ``E * C``. The suite's "layer"
group (:func:`layer_checks`) is built from :func:`floor_ratio_check` and :func:`memory_check`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.apps.baselines import grouped_floor_kind, gshard_einsum_forward
from flexmoe.apps.bench.config import DTYPES, BenchConfig, build_layer, floor_case, fwd_bwd, make_inputs
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings
from flexmoe.apps.bench.timing import saved_activation_bytes, time_side_by_side
from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.kernels import RULE_KERNEL
from flexmoe.layer import MoELayer

__all__ = ["bench_single", "format_single", "floor_ratio_check", "memory_check", "layer_checks"]


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
        cases[name] = fwd_bwd(partial(forward, x), grad, module)
    return cases, skipped


def _peer_ffn(cfg: BenchConfig) -> nn.Module:
    dtype = DTYPES[cfg.dtype]
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
                drop_tokens=cfg.capacity_factor > 0, use_rts=False).to(DTYPES[cfg.dtype])
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
    layer = MOELayer(Top2Gate(cfg.model_dim, cfg.experts), experts).to(DTYPES[cfg.dtype])
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
    ).to(DTYPES[cfg.dtype])
    return layer, lambda x: layer(x.unsqueeze(0)).squeeze(0)


# -------------------------------------------------------------------------------------------- one process


def bench_single(cfg: BenchConfig, *, peers: bool = True, reference: bool = True,
                 memory: bool = False, show: bool = False) -> dict[str, Any]:
    """Time the layer, the floor and the references side by side; returns the report (see ``--json``).

    With ``show`` the report is printed as it forms: the configuration and routing plan first, a progress bar
    while the cases are timed, the table when they are, then the activation memory when measured.
    """
    layer = build_layer(cfg)
    x, grad = make_inputs(cfg, cfg.seed + 1)
    with torch.no_grad():
        layer(x)
    plan = layer.last_plan
    assert plan is not None  # set by the forward above
    plan_report = {"capacity": plan.capacity, "dropped_fraction": plan.dropped_fraction,
                   "rows_computed": sum(plan.counts), "tokens_per_expert": plan.counts}
    if show:
        print("\n".join(_single_header(cfg, torch.get_num_threads(), plan_report)), flush=True)
    floor_step, floor_forward = floor_case(layer, plan.counts, cfg)
    cases: dict[str, Callable[[], None]] = {
        "floor": floor_step,
        "grouped floor": floor_case(layer, plan.counts, cfg, grouped=True)[0],
        "flexmoe": fwd_bwd(lambda: layer(x), grad, layer),
    }
    if reference:
        cases["gshard-einsum"] = fwd_bwd(lambda: gshard_einsum_forward(layer, x), grad, layer)
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


def warmed_up(layer: MoELayer, x: Tensor) -> MoELayer:
    """``layer`` after one forward and backward on ``x``: the expert-kernel chooser times its candidates in a
    layer's first calls (on a cold cache), and those timing runs are no part of what a training step keeps."""
    layer(x).sum().backward()
    layer.zero_grad(set_to_none=True)
    return layer


def _memory_report(cfg: BenchConfig, layer: MoELayer, x: Tensor, floor_forward: Callable) -> dict[str, Any]:
    params = list(layer.parameters())
    out: dict[str, float] = {
        "floor_bytes": saved_activation_bytes(floor_forward, params),
        "flexmoe_bytes": saved_activation_bytes(lambda: layer(x), params),
        "gshard_einsum_bytes": saved_activation_bytes(lambda: gshard_einsum_forward(layer, x), params),
    }
    wide = replace(cfg, experts=64)  # same T, k and hidden size, 8x the experts
    wide_layer = warmed_up(build_layer(wide), x)
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
    """Activation memory (bytes autograd saves) at ``wide_experts`` over ``cfg``'s, same T, k and H, both layers
    computing their experts alike (the rule's kernel, :data:`~flexmoe.experts.kernels.RULE_KERNEL`): what is
    checked is how the data path's memory grows with E. The chooser may take another route at each E (the fused
    one keeps less), so the note gives both layers' memory with the chooser too."""
    def measure(settings: SuiteSettings) -> Measurement:
        narrow = replace(cfg, seed=settings.seed, device=settings.device)
        x, _ = make_inputs(narrow, narrow.seed + 1)
        saved: dict[str, dict[int, int]] = {RULE_KERNEL: {}, "auto": {}}
        for kernel, per_e in saved.items():
            for experts in (cfg.experts, wide_experts):
                layer = warmed_up(build_layer(replace(narrow, experts=experts), expert_kernel=kernel), x)
                per_e[experts] = saved_activation_bytes(partial(layer, x), list(layer.parameters()))
        same = saved[RULE_KERNEL]
        ratio = same[wide_experts] / same[cfg.experts]
        mib = 2**-20

        def pair(per_e: dict[int, int]) -> str:
            return (f"{per_e[cfg.experts] * mib:.1f} MiB at E={cfg.experts}, "
                    f"{per_e[wide_experts] * mib:.1f} MiB at E={wide_experts}")

        return Measurement(ratio, f"x E={cfg.experts}", {"bytes": saved},
                           f"{pair(same)} ({RULE_KERNEL}); chosen kernels: {pair(saved['auto'])}")
    return SuiteCheck(group, label, target, measure)


def layer_checks() -> list[SuiteCheck]:
    """The suite's "layer" group: one process, T=4096 M=512 H=1024 E=8 k=2 unless said (flexmoe.apps.bench.suite)."""
    return [
        floor_ratio_check("fp32 cf=1.25", BenchConfig(), 1.10),
        floor_ratio_check("fp32 dropless", BenchConfig(capacity_factor=0.0), 1.10),
        # Few steps: without native bf16 units (AVX2-only CPUs) bf16 matmuls run ~30x slower than fp32.
        floor_ratio_check("bf16 cf=1.25", BenchConfig(dtype="bfloat16", steps=3, warmup=1), 1.30),
        memory_check("activation memory E=64 / E=8", BenchConfig(), 64, 1.2),
    ]
