"""FasterMoE's shadowing and smart schedule, side by side (issue 5).

    .venv/bin/python benchmarks/fastermoe.py [--world 4] [--tokens 4096] [--steps 5]

Launches ``--world`` ranks itself (gloo on 127.0.0.1) and builds one MoE layer per rank (T tokens per rank,
M=512, H=1024, E=8, k=2, fp32, dropless so the hot experts really get all their rows) with a router skewed
so that two experts (0 and 1, both on rank 0) get about half of the (token, choice) pairs. It times one
forward + backward per step for each mode, round-robin so that load from other processes hits every mode
alike, and prints per mode the median step time (the slowest rank's, each step) and its ratio to plain
expert parallelism, plus the busiest rank's expert rows before and after shadowing.

Modes: plain (all-to-all), shadow=True (the cost-model policy), shadow of the two hot experts (forced),
schedule="pairwise", and pairwise with the forced shadowing.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import statistics
import time
from collections.abc import Callable
from contextlib import redirect_stdout

import torch
import torch.distributed as dist

from flexmoe import MoELayer
from flexmoe.launch import spawn_ranks
from flexmoe.parallel import ShadowExperts, rows_per_rank
from flexmoe.tuning import CostModelShadowPolicy

HOT = (0, 1)


def skew_parser(doc: str, world: int, steps: int) -> argparse.ArgumentParser:
    """The flags of a skewed-router benchmark (this one, replicas_skew.py): the ranks, the layer's sizes and the
    timed steps; ``doc``: the script's docstring, whose first paragraph describes it."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--world", type=int, default=world, help="ranks to launch")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--hidden-dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("-k", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per mode (after one warm-up step)")
    return p


def parse_args() -> argparse.Namespace:
    p = skew_parser(__doc__, world=4, steps=5)
    p.add_argument("--hot-share", type=float, default=0.5, help="share of (token, choice) pairs of experts 0, 1")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args()


def hot_bias(logits: torch.Tensor, k: int, share: float, hot: tuple[int, ...] = HOT) -> float:
    """The logit bonus for the ``hot`` experts that gives them ``share`` of the top-k picks (bisection).
    logits: ``[T, E]`` without the bonus."""
    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        boosted = logits.clone()
        boosted[:, list(hot)] += mid
        picks = boosted.topk(k, dim=-1).indices
        got = sum((picks == e).sum().item() for e in hot) / picks.numel()
        lo, hi = (mid, hi) if got < share else (lo, mid)
    return (lo + hi) / 2


def skewed_layer(args: argparse.Namespace, rank: int, hot: tuple[int, ...] = HOT,
                 **kw) -> tuple[MoELayer, torch.Tensor, torch.Tensor]:
    """A layer (same weights on every rank for the same expert) and this rank's batch ``[T, M]`` and output
    weights ``[T, M]``.

    Feature 0 of every token is 1 and the router reads a per-expert bonus from it: the ``hot`` experts get
    ``--hot-share`` of the pairs, the rest is spread by the random part of the router.
    """
    M, E = args.model_dim, args.experts
    torch.manual_seed(0)
    moe = MoELayer(M, E, args.hidden_dim, k=args.k, capacity_factor=0.0, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, M, generator=g)
    x[:, 0] = 1.0
    calib = torch.randn(4096, M, generator=torch.Generator().manual_seed(7))  # the same on every rank
    calib[:, 0] = 0.0
    with torch.no_grad():
        moe.router.weight[:, 0] = 0.0
        bonus = hot_bias(calib @ moe.router.weight.t(), args.k, args.hot_share, hot)
        moe.router.weight[list(hot), 0] = bonus
    return moe, x, torch.randn(args.tokens, M, generator=g)


def step(moe: MoELayer, x: torch.Tensor, w: torch.Tensor, call: dict) -> float:
    """One forward + backward; seconds of the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    y = moe(x, **call)
    (y * w).sum().backward()
    moe.zero_grad(set_to_none=True)
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def gather_counts(moe: MoELayer, world: int) -> list[list[int]]:
    """``[world][E]``: every rank's routed (token, choice) pairs per expert in ``moe``'s last step."""
    counts = torch.tensor(moe.last_plan.counts, dtype=torch.long)
    every = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(every, counts)
    return [c.tolist() for c in every]


def worker(options: dict) -> str | None:
    """One rank (started by flexmoe.launch.spawn_ranks); rank 0 returns the report."""
    args = argparse.Namespace(**options)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    policy = CostModelShadowPolicy()  # this machine's calibrated profile if any, else the published default
    moe, x, w = skewed_layer(args, rank)
    modes = {
        "plain (all-to-all)": {},
        "shadow=True (cost model)": {"shadow": policy},
        "shadow hot experts (forced)": {"shadow": ShadowExperts(HOT)},
        "schedule='pairwise'": {"schedule": "pairwise"},
        "pairwise + shadow (forced)": {"schedule": "pairwise", "shadow": ShadowExperts(HOT)},
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    shadowed: dict[str, list[int]] = {}
    for i in range(args.steps + 1):
        for name, call in modes.items():
            seconds = step(moe, x, w, call)
            shadowed[name] = list(moe.last_shadowed)
            if i > 0:  # step 0 warms up
                times[name].append(seconds)
    all_counts = gather_counts(moe, args.world)  # expert rows per rank follow from the last step's counts
    text = None
    if rank == 0:
        with redirect_stdout(io.StringIO()) as out:
            report(args, policy, moe, times, shadowed, all_counts)
        text = out.getvalue()
    dist.barrier()
    dist.destroy_process_group()
    return text


def report(args, policy, moe, times, shadowed, all_counts) -> None:
    glob = [sum(col) for col in zip(*all_counts)]
    hot = sum(glob[e] for e in HOT) / sum(glob)
    print(f"FasterMoE benchmark: {args.world} ranks (gloo, 127.0.0.1, {args.threads} thread(s) each), "
          f"T={args.tokens} per rank, M={args.model_dim}, H={args.hidden_dim}, E={args.experts}, k={args.k}, "
          f"fp32, dropless")
    print(f"routing: experts {list(HOT)} get {hot:.1%} of the pairs; global rows per expert {glob}")
    print(f"default policy: {policy.describe()}")
    print(f"machine: {os.cpu_count()} CPU cores shared by all ranks (and other processes): times are noisy")
    print()
    base = statistics.median(times["plain (all-to-all)"])
    print(f"{'mode':32s} {'median s':>9s} {'vs plain':>9s}  {'min s':>7s} {'max s':>7s}  shadowed")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:32s} {med:9.3f} {med / base:8.2f}x  {min(ts):7.3f} {max(ts):7.3f}  {shadowed[name]}")
    print()
    before = rows_per_rank(all_counts, moe.layout)
    print("expert rows computed per rank (last step):")
    print(f"  without shadowing:                {before}  max {max(before)}")
    for name in ("shadow=True (cost model)", "shadow hot experts (forced)"):
        after = rows_per_rank(all_counts, moe.layout, shadowed[name])
        print(f"  {name + ':':33s} {after}  max {max(after)} ({max(after) / max(before):.2f}x)")


def launch(worker: Callable[[dict], str | None], args: argparse.Namespace, threads: int, what: str) -> None:
    """Run ``worker(vars(args))`` on ``--world`` spawned ranks of ``threads`` torch threads each; print rank 0's
    report and the wall time."""
    t0 = time.perf_counter()
    ranks = spawn_ranks(args.world, worker, [vars(args)], timeout=3600, threads=threads,
                        what=f"{what} with {args.world} ranks")
    print(ranks[0].value, end="")
    print(f"\n(wall time {time.perf_counter() - t0:.0f} s)")


def main() -> None:
    args = parse_args()
    launch(worker, args, args.threads, "FasterMoE benchmark")


if __name__ == "__main__":
    main()
