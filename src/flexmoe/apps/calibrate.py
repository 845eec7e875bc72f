"""``flexmoe calibrate``: measure this machine and write a JSON profile the cost model reuses.

Micro-benchmarks, each timed as the median of a few repetitions. On a shared machine other processes take
their share of the cores; a median sees the same share a layer's step will see (a minimum would catch the
rare quiet moments of a short benchmark and be too optimistic for a long step). ``validate-model`` times the
layer the same way:

* GEMM throughput per dtype over a range of shapes, fitted to a roofline with a bent compute roof
  (``overhead + flops / (peak * d / (d + d_half))``, d the smallest dimension);
* streaming memory bandwidth, row gather (``index_select``) and scatter-add (``index_add``) bandwidth, and the
  fixed cost of one autograd op;
* point-to-point and all-to-all latency and bandwidth over gloo on 127.0.0.1, with real processes at 2 and 4
  ranks, fitted to alpha-beta; and how much of an asynchronous all-to-all hides behind a GEMM;
* compute slow-down with 2 and 4 ranks busy at once (the same GEMM timed by one rank alone, then by every rank
  together), kept per rank count (``rank_slowdown``) and summed up as compute slots. On a dedicated machine
  the slots are the cores; on a shared one, what the other processes leave, which is what the layer gets too.

Every rank runs single-threaded (``threads_per_rank = 1``), the setting ``validate-model`` measures the layer in.

The micro-benchmarks live in :mod:`~flexmoe.apps.calibrate_measure`, the fits in
:mod:`~flexmoe.apps.calibrate_fits`; this module turns them into a :class:`~flexmoe.tuning.profile.Profile` and is
the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexmoe.apps.calibrate_fits import compute_slots, fit_alpha_beta, fit_roofline
from flexmoe.apps.calibrate_measure import measure_comm, measure_compute
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import check_writable_dir
from flexmoe.apps.progress import StepBar
from flexmoe.tuning.profile import LOCAL_PROFILE_PATH, LinkSpec, Profile

__all__ = ["add_arguments", "run", "calibrate", "calibrate_kernels", "summarize", "fit_roofline", "fit_alpha_beta",
           "compute_slots", "measure_compute", "measure_comm"]


# ------------------------------------------------------------------------------------------------- profile


def _merge_ranks(per_rank: list[dict[str, Any]], key: str) -> list[dict[str, float]]:
    """Per sample, the slowest rank's time (collectives finish when the last rank does)."""
    merged = []
    for i, sample in enumerate(per_rank[0][key]):
        worst = max(rank[key][i]["seconds"] for rank in per_rank)
        merged.append({**sample, "seconds": worst})
    return merged


def calibrate(worlds: tuple[int, ...] = (2, 4), quick: bool = False, log: Callable[[str], None] | None = None,
              ) -> Profile:
    """Run every micro-benchmark and fit a :class:`Profile` of this machine."""
    say = log or (lambda _msg: None)
    started = time.perf_counter()
    say("compute: GEMM roofline (float32, bfloat16), memory, gather/scatter, op overhead")
    comp = measure_compute(quick)
    compute = {name: fit_roofline(samples) for name, samples in comp["gemm"].items()}
    p2p: list[dict[str, float]] = []
    a2a: list[dict[str, float]] = []
    overlap: dict[int, float] = {}
    raw_overlap = {}
    cores = os.cpu_count() or 1
    measured_comm = {}
    slowdown = {}
    for world in worlds:
        say(f"communication: gloo on 127.0.0.1 with {world} ranks")
        per_rank = measure_comm(world, quick)
        measured_comm[world] = per_rank
        slowdown[world] = max(r["gemm_together_s"] for r in per_rank) / per_rank[0]["gemm_alone_s"]
    slots = compute_slots(slowdown, cores)
    for world, per_rank in measured_comm.items():
        # The loopback copies run on the same shared cores: divide that slow-down out of the fit.
        contention = max(1.0, slowdown[world])
        p2p += [{**s, "contention": contention} for s in _merge_ranks(per_rank, "p2p")] if per_rank[0]["p2p"] else []
        a2a += [{**s, "contention": contention} for s in _merge_ranks(per_rank, "a2a")]
        overlap[world] = statistics.median(rank["overlap"]["efficiency"] for rank in per_rank)
        raw_overlap[str(world)] = per_rank[0]["overlap"]
    # Overlap needs a free core for the transport: measure it where ranks do not outnumber the compute slots
    # (the model itself turns overlap off when they do).
    fitting = [eff for world, eff in overlap.items() if world <= slots] or list(overlap.values())
    p2p_alpha, p2p_bw = fit_alpha_beta(p2p) if p2p else fit_alpha_beta(a2a)
    a2a_alpha, a2a_bw = fit_alpha_beta(a2a)
    link = LinkSpec(name="gloo-loopback", alpha_s=p2p_alpha, bandwidth_Bps=p2p_bw, a2a_alpha_s=a2a_alpha,
                    a2a_bandwidth_Bps=a2a_bw)
    profile = Profile(
        name="local",
        description=f"this machine: {cores} CPU cores ({slots:.2f} free for compute), one thread per rank, "
                    f"gloo over 127.0.0.1 "
                    f"(calibrated {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC)",
        compute=compute,
        memory_bandwidth_Bps=comp["memory_bandwidth_Bps"],
        gather_bandwidth_Bps=comp["gather_bandwidth_Bps"],
        scatter_bandwidth_Bps=comp["scatter_bandwidth_Bps"],
        op_overhead_s=comp["op_overhead_s"],
        grad_stack_bandwidth_Bps=comp["grad_stack_bandwidth_Bps"],
        first_touch_bandwidth_Bps=comp["first_touch_bandwidth_Bps"],
        intra=link,
        inter=link,  # every rank shares one host: both levels are the same loopback
        ranks_per_node=1 << 16,
        compute_slots_per_node=slots,
        rank_slowdown={str(w): max(x, 1.0) for w, x in slowdown.items()},
        overlap_efficiency=statistics.median(fitting) if fitting else 0.0,
        comm_uses_compute=True,
        threads_per_rank=1,
        sources=["measured by `flexmoe calibrate` (flexmoe.apps.calibrate) on this machine"],
        assumptions=[
            "ranks run one thread each; more ranks than compute slots slow compute and loopback copies by "
            "ranks/slots",
            "overlap of communication with compute needs a free core: none when ranks outnumber cores",
            "all-to-all: messages of one rank on one link level are serialized (alpha-beta per message)",
            "medians of repeated timings; the slowest rank's median for collectives",
        ],
        measured={"gemm": comp["gemm"], "p2p": p2p, "a2a": a2a, "overlap": raw_overlap,
                  "seconds": time.perf_counter() - started},
    )
    return profile


# ------------------------------------------------------------------------------------------------ command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=LOCAL_PROFILE_PATH,
                        help=f"where to write the profile (default: {LOCAL_PROFILE_PATH}, what --profile local reads)")
    parser.add_argument("--ranks", default="2,4", help="rank counts for the gloo measurements (default: 2,4)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (tests)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON instead of a summary")
    parser.add_argument("--kernels", action="store_true",
                        help="instead of the profile: time the expert kernels at the benchmark suite's shapes and "
                             "write the choices to the kernel cache (what MoELayer's expert_kernel='auto' reads)")
    parser.add_argument("--kernel-cache", default="~/.cache/flexmoe",
                        help="--kernels: the cache directory (default: ~/.cache/flexmoe, the layer's default)")


# The benchmark suite's expert shapes, M=512: (tokens, experts, hidden, k, training).
KERNEL_SHAPES = ((4096, 8, 1024, 2, True), (4096, 64, 256, 8, True), (4096, 128, 128, 8, True),
                 (4096, 256, 64, 8, True), (8192, 64, 256, 8, True), (1, 64, 256, 8, False),
                 (8, 64, 256, 8, False), (64, 64, 256, 8, False))


def calibrate_kernels(cache_dir: str, shapes: tuple[tuple[int, int, int, int, bool], ...] = KERNEL_SHAPES,
                      model_dim: int = 512) -> dict[str, str]:
    """Time every expert kernel that runs each shape (rows spread evenly over the experts, float32 on the CPU)
    and write the fastest per bucket to ``cache_dir``'s kernel cache; returns ``{bucket: kernel}``."""
    import torch

    from flexmoe.experts import FeedForwardExperts
    from flexmoe.experts.chooser import KernelChooser, default_cache_path

    chooser = KernelChooser(cache_path=default_cache_path(cache_dir))
    calls = []
    for tokens, experts, hidden, k, training in shapes:
        weights = FeedForwardExperts(experts, model_dim, hidden).requires_grad_(training).weights()
        rows = tokens * k
        counts = [rows // experts + (1 if e < rows % experts else 0) for e in range(experts)]
        calls.append((torch.randn(rows, model_dim), counts, weights))
    with torch.set_grad_enabled(True):
        return chooser.calibrate(calls)


def summarize(profile: Profile) -> str:
    lines = [f"profile {profile.name}: {profile.description}"]
    for name, spec in profile.compute.items():
        lines.append(f"  GEMM {name:9s} peak {spec.peak_flops / 1e9:8.1f} GFLOP/s"
                     f"  overhead {spec.overhead_s * 1e6:6.1f} us  half-dim {spec.half_dim:g}")
    lines.append(f"  memory {profile.memory_bandwidth_Bps / 1e9:.2f} GB/s"
                 f"  gather {profile.gather_bandwidth_Bps / 1e9:.2f} GB/s"
                 f"  scatter-add {profile.scatter_bandwidth_Bps / 1e9:.2f} GB/s"
                 f"  op {profile.op_overhead_s * 1e6:.1f} us"
                 f"  grad stack {profile.grad_stack_bandwidth_Bps / 1e9:.2f} GB/s"
                 f"  first touch {profile.first_touch_bandwidth_Bps / 1e9:.2f} GB/s")
    link = profile.intra
    lines.append(f"  p2p  alpha {link.alpha_s * 1e6:7.1f} us  bandwidth {link.bandwidth_Bps / 1e9:.2f} GB/s")
    lines.append(f"  a2a  alpha {link.a2a_alpha_s * 1e6:7.1f} us"
                 f"  bandwidth {link.a2a_bandwidth_Bps / 1e9:.2f} GB/s per message")
    lines.append(f"  overlap efficiency {profile.overlap_efficiency:.2f}  "
                 f"compute slots {profile.compute_slots_per_node:.2f}  slow-down by ranks {profile.rank_slowdown}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.kernels:
        check_writable_dir(Path(args.kernel_cache).expanduser(), "--kernel-cache")
        from flexmoe.experts.chooser import default_cache_path

        for bucket, kernel in calibrate_kernels(args.kernel_cache).items():
            print(f"{bucket}: {kernel}")
        print(f"wrote {default_cache_path(args.kernel_cache)}")
        return 0
    try:
        worlds = tuple(int(x) for x in str(args.ranks).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--ranks: expected comma-separated rank counts such as 2,4, got {args.ranks!r}") from None
    if not worlds or any(w < 2 for w in worlds):
        raise UsageError(f"--ranks: every entry must be >= 2 (e.g. 2,4), got {args.ranks!r}")
    if args.out.exists() and args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a directory; give the path of the profile's JSON file")
    check_writable_dir(args.out.parent, "--out")  # before minutes of measuring
    with StepBar(1 + len(worlds), "calibrate", enabled=not args.json) as bar:  # compute, then each world
        profile = calibrate(worlds, quick=args.quick, log=bar)
    path = profile.save(args.out)
    if args.json:
        print(profile.to_json())
    else:
        print(summarize(profile))
        print(f"wrote {path} in {profile.measured['seconds']:.1f} s")
    return 0
