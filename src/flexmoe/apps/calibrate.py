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
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import check_writable_dir
from flexmoe.apps.progress import StepBar
from flexmoe.launch import spawn_ranks
from flexmoe.tuning.profile import LOCAL_PROFILE_PATH, ComputeSpec, LinkSpec, Profile

__all__ = ["add_arguments", "run", "calibrate", "fit_roofline", "fit_alpha_beta"]

# (rows, in, out): expert-like shapes, from thin (few rows per expert) to large.
GEMM_SHAPES = [(m, k, n) for m in (32, 128, 512, 2048) for k, n in ((128, 256), (512, 1024), (512, 2048), (1024, 512))]
# Quick (tests): small enough for bf16 on a CPU without bf16 units (~1-3 GFLOP/s), still thin to square.
QUICK_GEMM_SHAPES = [(32, 128, 256), (128, 512, 1024), (512, 256, 512), (1024, 512, 256)]


def _median_time(fn: Callable[[], Any], reps: int, warmup: int = 1, budget_s: float = 3.0) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    Slow calls stop early once ``budget_s`` is spent (after two timed calls at least): a bf16 GEMM that
    takes seconds on a CPU without bf16 units needs no five repetitions to be told apart from noise.
    """
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < reps and (len(samples) < 2 or spent < budget_s):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------------- fits


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
        a, c = _weighted_linear_fit(xs, ys, ws)  # t = a + c * x
        if c <= 0:
            continue
        a = max(a, 0.0)
        err = sum(abs(a + c * x - y) / y for x, y in zip(xs, ys)) / len(xs)
        if best is None or err < best[0]:
            best = (err, ComputeSpec(peak_flops=1.0 / c, overhead_s=a, half_dim=half))
    if best is None:
        raise RuntimeError("GEMM timings could not be fitted (all slopes non-positive)")
    return best[1]


def _weighted_linear_fit(xs: list[float], ys: list[float], ws: list[float]) -> tuple[float, float]:
    """Least squares for y = a + c x with weights w on the residuals (w = 1/y: relative residuals)."""
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
    a, c = _weighted_linear_fit(xs, ys, [1.0 / y for y in ys])
    if c <= 0:  # latency-bound everywhere: take the largest sample's throughput as the bandwidth
        big = max(samples, key=lambda s: s["message_bytes"])
        c = big["seconds"] / big["messages"] / big.get("contention", 1.0) / big["message_bytes"]
    return max(a, 0.0), 1.0 / c


# ------------------------------------------------------------------------------------------ single rank


def measure_compute(quick: bool = False) -> dict[str, Any]:
    """GEMM samples per dtype, memory / gather / scatter bandwidths and the per-op overhead, one thread."""
    import torch

    torch.set_num_threads(1)
    reps = 3 if quick else 5
    gemm: dict[str, list[dict[str, float]]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        rows = []
        for m, k, n in QUICK_GEMM_SHAPES if quick else GEMM_SHAPES:
            # Timed as in training: forward addmm, then backward (input and weight gradients) through
            # autograd, so allocation of fresh outputs and autograd bookkeeping are part of what is fitted.
            x = torch.randn(m, k, dtype=dtype, requires_grad=True)
            w = torch.randn(k, n, dtype=dtype, requires_grad=True)
            bias = torch.randn(n, dtype=dtype, requires_grad=True)
            grad = torch.randn(m, n, dtype=dtype)

            def step() -> None:
                x.grad = w.grad = bias.grad = None
                torch.addmm(bias, x, w).backward(grad)

            seconds = _median_time(step, reps) / 3  # three GEMMs of the same flops
            rows.append({"m": m, "n": n, "k": k, "seconds": seconds})
        gemm[name] = rows

    big = torch.randn(8 * 1024 * 1024 // 4 * 4)  # 32 MB of float32: well beyond the caches
    dst = torch.empty_like(big)
    copy_s = _median_time(lambda: dst.copy_(big), reps)
    memory_bw = 2 * big.numel() * 4 / copy_s

    tokens, dim, rows_n = 4096, 512, 8192
    x = torch.randn(tokens, dim)
    index = torch.randint(0, tokens, (rows_n,))
    gathered = x.index_select(0, index)
    gather_s = _median_time(lambda: x.index_select(0, index), reps)
    scatter_s = _median_time(lambda: torch.zeros(tokens, dim).index_add_(0, index, gathered), reps)
    moved = 2 * rows_n * dim * 4

    leaf = torch.randn(4, requires_grad=True)

    def tiny_chain() -> None:  # 4 forward ops, ~4 backward nodes, backward machinery: ~10 ops
        y = ((leaf * 2.0 + 1.0).relu()).sum()
        y.backward()

    op_s = _median_time(tiny_chain, 50, warmup=5) / 10

    # unbind's backward: per-expert weight gradients stacked into one fresh [E, M, H] gradient.
    pieces = [torch.randn(512, 1024) for _ in range(8)]
    stack_s = _median_time(lambda: torch.stack(pieces), 3 * reps)
    stack_bw = sum(p.numel() for p in pieces) * 4 / stack_s

    # First touch: a 64 MiB buffer (above glibc's mmap threshold) is mapped anew by every allocation.
    fresh_bytes = 64 * 2**20
    fresh_s = _median_time(lambda: torch.empty(fresh_bytes, dtype=torch.uint8).fill_(1), reps)
    return {
        "gemm": gemm,
        "gemm_timing": "forward + backward of addmm with autograd, per GEMM (time / 3)",
        "memory_bandwidth_Bps": memory_bw,
        "gather_bandwidth_Bps": moved / gather_s,
        "scatter_bandwidth_Bps": moved / scatter_s,
        "op_overhead_s": op_s,
        "grad_stack_bandwidth_Bps": stack_bw,
        "first_touch_bandwidth_Bps": fresh_bytes / fresh_s,
    }


# --------------------------------------------------------------------------------------------- multi-rank


def _comm_worker(quick: bool) -> list[dict[str, Any]] | None:
    """One gloo rank (started by :func:`flexmoe.launch.spawn_ranks`): ping-pong between ranks 0 and 1,
    all-to-all at several sizes, then a2a/GEMM overlap. Rank 0 returns every rank's measurements."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reps = 5 if quick else 9
    results: dict[str, Any] = {"p2p": [], "a2a": []}
    try:
        # The first collectives pay for connection setup: run a few before timing anything.
        warm = torch.zeros(world * 256)
        for _ in range(5):
            dist.all_to_all_single(torch.empty_like(warm), warm)
            dist.barrier()
        results["gemm_alone_s"], results["gemm_together_s"] = _concurrent_gemm(rank, reps)
        if world == 2:
            for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 22):
                buf = torch.zeros(nbytes // 4)

                def pingpong() -> None:
                    if rank == 0:
                        dist.send(buf, 1)
                        dist.recv(buf, 1)
                    else:
                        dist.recv(buf, 0)
                        dist.send(buf, 0)

                dist.barrier()
                seconds = _median_time(pingpong, reps, warmup=3) / 2
                results["p2p"].append({"messages": 1, "message_bytes": nbytes, "seconds": seconds})
        for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24):
            count = max(nbytes // 4 // world * world, world)
            send = torch.randn(count)
            recv = torch.empty(count)

            def a2a() -> None:
                dist.all_to_all_single(recv, send)

            dist.barrier()
            seconds = _median_time(a2a, reps, warmup=3)
            results["a2a"].append({"world": world, "messages": world - 1, "message_bytes": count * 4 / world,
                                   "seconds": seconds})
        # Overlap: an asynchronous all-to-all beside a GEMM that takes about as long.
        send = torch.randn((1 << 22) // 4)
        recv = torch.empty_like(send)
        a = torch.randn(512, 512)
        bmat = torch.randn(512, 1024)

        def comm_only() -> None:
            dist.all_to_all_single(recv, send)

        comm_s = _median_time(comm_only, reps)
        flop_s = _median_time(lambda: a @ bmat, reps)
        n_gemm = max(1, round(comm_s / flop_s))

        def compute_only() -> None:
            for _ in range(n_gemm):
                a @ bmat

        def both() -> None:
            work = dist.all_to_all_single(recv, send, async_op=True)
            compute_only()
            work.wait()

        dist.barrier()
        compute_s = _median_time(compute_only, reps)
        dist.barrier()
        both_s = _median_time(both, reps)
        hidden = (comm_s + compute_s - both_s) / max(min(comm_s, compute_s), 1e-12)
        results["overlap"] = {"comm_s": comm_s, "compute_s": compute_s, "both_s": both_s,
                              "efficiency": min(max(hidden, 0.0), 1.0)}
        # Every rank's timings, so rank 0 can report the slowest (the all-to-all waits for it).
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, results)
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _concurrent_gemm(rank: int, reps: int) -> tuple[float, float]:
    """(seconds on rank 0 alone, seconds with every rank at once) of one expert-sized GEMM, forward + backward."""
    import torch
    import torch.distributed as dist

    x = torch.randn(512, 512, requires_grad=True)
    w = torch.randn(512, 1024, requires_grad=True)
    grad = torch.randn(512, 1024)

    def step() -> None:
        x.grad = w.grad = None
        (x @ w).backward(grad)

    # Alone and together take turns three times, so a burst of load from other processes does not land on
    # one side only.
    alone, together = [], []
    for _ in range(3):
        dist.barrier()
        if rank == 0:  # the others wait in the barrier, blocked on a socket
            alone.append(_median_time(step, reps))
        dist.barrier()
        together.append(_median_time(step, reps))
    dist.barrier()
    return (statistics.median(alone) if alone else 0.0), statistics.median(together)


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


def measure_comm(world: int, quick: bool = False, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Start ``world`` gloo processes on 127.0.0.1 and return every rank's measurements."""
    ranks = spawn_ranks(world, _comm_worker, [quick], timeout=timeout, what=f"gloo calibration with {world} ranks")
    return list(ranks[0].value)


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
