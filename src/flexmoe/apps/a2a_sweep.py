"""``flexmoe a2a-sweep``: time torch.distributed's all-to-all over a range of sizes and write an alltoall_perf log.

    torchrun --nnodes 4 --nproc-per-node 8 ... -m flexmoe a2a-sweep --device cuda --out a2a-32.log
    flexmoe a2a-sweep --nproc 4 --out a2a-4.log                      # 4 local ranks (gloo on the CPU)
    flexmoe fit-a2a --line-gbps 200 --out mine.json a2a-8.log a2a-32.log a2a-256.log

What a cluster's users need to fit the simulator to it (:mod:`flexmoe.apps.fit_a2a`) without nccl-tests: every
rank times ``all_to_all_single`` of S bytes per rank (S from ``--min-bytes`` to ``--max-bytes``, times
``--factor``), as MoE layers call it, and rank 0 writes the log in nccl-tests' ``alltoall_perf`` layout: one
``# Rank`` line per rank naming its host and device, then ``size count type redop root time algbw busbw`` per
size (time: the slowest rank's mean over ``--iters`` calls after ``--warmup``, in microseconds).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, NON_NEGATIVE, POSITIVE, check_writable_dir
from flexmoe.launch import relaunch, under_torchrun

__all__ = ["add_arguments", "run", "sweep_sizes", "format_log"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="where rank 0 writes the log")
    parser.add_argument("--min-bytes", type=COUNT, default=1024, help="smallest size, bytes per rank")
    parser.add_argument("--max-bytes", type=COUNT, default=64 * 2**20, help="largest size, bytes per rank")
    parser.add_argument("--factor", type=COUNT, default=4, help="each size is the last one times this (>= 2)")
    parser.add_argument("--iters", type=COUNT, default=5, help="timed calls per size")
    parser.add_argument("--warmup", type=NON_NEGATIVE, default=2, help="untimed calls per size first")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (each rank its local GPU)")
    parser.add_argument("--backend", default="auto", help="auto (NCCL on CUDA, gloo elsewhere), gloo or nccl")
    parser.add_argument("--collective-timeout", type=POSITIVE, default=600.0,
                        help="seconds a call may wait for a peer before the sweep fails")
    parser.add_argument("--nproc", type=COUNT, default=1,
                        help="start this many local ranks (without torchrun); 1: run as launched")


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int, ranks: int) -> list[int]:
    """The sizes (bytes per rank) of the sweep, each rounded down to whole 4-byte elements for every rank."""
    if factor < 2:
        raise UsageError(f"--factor must be >= 2, got {factor}")
    if max_bytes < min_bytes:
        raise UsageError(f"--max-bytes {max_bytes} is below --min-bytes {min_bytes}")
    unit = 4 * ranks
    sizes: list[int] = []
    size = min_bytes
    while size <= max_bytes:
        rounded = max(size // unit, 1) * unit
        if not sizes or rounded != sizes[-1]:
            sizes.append(rounded)
        size *= factor
    return sizes


def format_log(hosts: list[str], devices: list[str], pids: list[int], rows: list[tuple[int, float]],
               backend: str) -> str:
    """The log in alltoall_perf's layout: ``rows`` are (bytes per rank, seconds)."""
    ranks = len(hosts)
    lines = [f"# flexmoe a2a-sweep: torch.distributed all_to_all_single over {backend}, {ranks} ranks",
             "#", "# Using devices"]
    for r, (host, device, pid) in enumerate(zip(hosts, devices, pids)):
        index = device.split(":")[1] if ":" in device else "0"
        lines.append(f"#  Rank {r:2d} Group  0 Pid {pid:6d} on {host} device {index:>2s} [{device}] {device}")
    lines.append("#       size         count      type   redop    root     time   algbw   busbw #wrong")
    lines.append("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)")
    for size, seconds in rows:
        algbw = size / seconds / 1e9
        busbw = algbw * (ranks - 1) / ranks
        lines.append(f"{size:12d} {size // 4:13d}     float    none      -1 {seconds * 1e6:8.1f} {algbw:7.2f} "
                     f"{busbw:7.2f}    N/A")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    # The flags are checked before any rank starts (a bad one would otherwise end rank 0 alone, the others
    # waiting for it in their first collective); only the rank that writes the log needs its directory.
    sweep_sizes(args.min_bytes, args.max_bytes, args.factor, 1)
    if os.environ.get("RANK", "0") == "0":
        check_writable_dir(args.out.parent, "--out")
    if args.nproc > 1 and not under_torchrun():
        argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
                ("out", "min_bytes", "max_bytes", "factor", "iters", "warmup", "device", "backend",
                 "collective_timeout")]
        return relaunch(args.nproc, "a2a-sweep", argv)
    import torch
    import torch.distributed as dist

    from flexmoe.apps.ranks import start_ranks

    rank, world, device = start_ranks(args.backend, args.device, args.collective_timeout)
    if world < 2:
        raise UsageError("a2a-sweep needs 2 or more ranks: launch it with torchrun, or give --nproc N")
    sizes = sweep_sizes(args.min_bytes, args.max_bytes, args.factor, world)
    on_cuda = device.startswith("cuda")
    rows = []
    for size in sizes:
        send = torch.ones(size // 4, dtype=torch.float32, device=device)
        recv = torch.empty_like(send)
        for _ in range(args.warmup):
            dist.all_to_all_single(recv, send)
        dist.barrier()
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_to_all_single(recv, send)
        if on_cuda:
            torch.cuda.synchronize()
        mine = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        rows.append((size, float(mine)))
    who: list[tuple[str, str, int] | None] = [None] * world
    dist.all_gather_object(who, (socket.gethostname(), device, os.getpid()))
    if rank == 0:
        hosts, devices, pids = zip(*[w for w in who if w is not None])
        text = format_log(list(hosts), list(devices), list(pids), rows, dist.get_backend())
        args.out.parent.mkdir(parents=True, exist_ok=True)  # check_writable_dir let it be made
        args.out.write_text(text)
        print(text, end="")
        print(f"wrote {args.out}: {len(rows)} sizes on {world} ranks; fit it with flexmoe fit-a2a")
    dist.destroy_process_group()
    return 0
