"""The micro-benchmarks of ``flexmoe calibrate`` (:mod:`flexmoe.apps.calibrate`), each timed as the median of a few
repetitions: GEMMs per dtype, memory, gather and scatter bandwidths and the per-op overhead in one process
(:func:`measure_compute`); point-to-point, all-to-all, their overlap with a GEMM and the compute slow-down of
ranks busy at once over gloo on 127.0.0.1 (:func:`measure_comm`). Every rank runs single-threaded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from flexmoe.launch import spawn_ranks

__all__ = ["GEMM_SHAPES", "QUICK_GEMM_SHAPES", "median_time", "measure_compute", "measure_comm"]

# (rows, in, out): expert-like shapes, from thin (few rows per expert) to large.
GEMM_SHAPES = [(m, k, n) for m in (32, 128, 512, 2048) for k, n in ((128, 256), (512, 1024), (512, 2048), (1024, 512))]
# Quick (tests): small enough for bf16 on a CPU without bf16 units (~1-3 GFLOP/s), still thin to square.
QUICK_GEMM_SHAPES = [(32, 128, 256), (128, 512, 1024), (512, 256, 512), (1024, 512, 256)]


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1, budget_s: float = 3.0) -> float:
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

            seconds = median_time(step, reps) / 3  # three GEMMs of the same flops
            rows.append({"m": m, "n": n, "k": k, "seconds": seconds})
        gemm[name] = rows

    big = torch.randn(8 * 1024 * 1024 // 4 * 4)  # 32 MB of float32: well beyond the caches
    dst = torch.empty_like(big)
    copy_s = median_time(lambda: dst.copy_(big), reps)
    memory_bw = 2 * big.numel() * 4 / copy_s

    tokens, dim, rows_n = 4096, 512, 8192
    x = torch.randn(tokens, dim)
    index = torch.randint(0, tokens, (rows_n,))
    gathered = x.index_select(0, index)
    gather_s = median_time(lambda: x.index_select(0, index), reps)
    scatter_s = median_time(lambda: torch.zeros(tokens, dim).index_add_(0, index, gathered), reps)
    moved = 2 * rows_n * dim * 4

    leaf = torch.randn(4, requires_grad=True)

    def tiny_chain() -> None:  # 4 forward ops, ~4 backward nodes, backward machinery: ~10 ops
        y = ((leaf * 2.0 + 1.0).relu()).sum()
        y.backward()

    op_s = median_time(tiny_chain, 50, warmup=5) / 10

    # unbind's backward: per-expert weight gradients stacked into one fresh [E, M, H] gradient.
    pieces = [torch.randn(512, 1024) for _ in range(8)]
    stack_s = median_time(lambda: torch.stack(pieces), 3 * reps)
    stack_bw = sum(p.numel() for p in pieces) * 4 / stack_s

    # First touch: a 64 MiB buffer (above glibc's mmap threshold) is mapped anew by every allocation.
    fresh_bytes = 64 * 2**20
    fresh_s = median_time(lambda: torch.empty(fresh_bytes, dtype=torch.uint8).fill_(1), reps)
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
                seconds = median_time(pingpong, reps, warmup=3) / 2
                results["p2p"].append({"messages": 1, "message_bytes": nbytes, "seconds": seconds})
        for nbytes in (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24):
            count = max(nbytes // 4 // world * world, world)
            send = torch.randn(count)
            recv = torch.empty(count)

            def a2a() -> None:
                dist.all_to_all_single(recv, send)

            dist.barrier()
            seconds = median_time(a2a, reps, warmup=3)
            results["a2a"].append({"world": world, "messages": world - 1, "message_bytes": count * 4 / world,
                                   "seconds": seconds})
        # Overlap: an asynchronous all-to-all beside a GEMM that takes about as long.
        send = torch.randn((1 << 22) // 4)
        recv = torch.empty_like(send)
        a = torch.randn(512, 512)
        bmat = torch.randn(512, 1024)

        def comm_only() -> None:
            dist.all_to_all_single(recv, send)

        comm_s = median_time(comm_only, reps)
        flop_s = median_time(lambda: a @ bmat, reps)
        n_gemm = max(1, round(comm_s / flop_s))

        def compute_only() -> None:
            for _ in range(n_gemm):
                a @ bmat

        def both() -> None:
            work = dist.all_to_all_single(recv, send, async_op=True)
            compute_only()
            work.wait()

        dist.barrier()
        compute_s = median_time(compute_only, reps)
        dist.barrier()
        both_s = median_time(both, reps)
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
            alone.append(median_time(step, reps))
        dist.barrier()
        together.append(median_time(step, reps))
    dist.barrier()
    return (statistics.median(alone) if alone else 0.0), statistics.median(together)



def measure_comm(world: int, quick: bool = False, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Start ``world`` gloo processes on 127.0.0.1 and return every rank's measurements."""
    ranks = spawn_ranks(world, _comm_worker, [quick], timeout=timeout, what=f"gloo calibration with {world} ranks")
    return list(ranks[0].value)

