"""Static placement, shadowing and replicated experts side by side under a skewed router (issue 32).

    .venv/bin/python benchmarks/replicas_skew.py [--world 2] [--tokens 4096] [--steps 7] [--redundant 2]

Launches ``--world`` ranks (gloo on 127.0.0.1, one torch thread each) and builds per rank one MoE layer (T tokens
per rank, M=512, H=1024, E=8, k=2, fp32, dropless) whose router sends ``--hot-share`` of the (token, choice)
pairs to three experts (``--hot``: 1 and 2 on rank 0, 5 on rank 1 at 2 ranks), and a twin with the same weights and
``redundant_experts=R``. The twin trains a few warm-up steps, then re-places its replicas from that load
(:func:`flexmoe.parallel.replicas.replace_experts`). It times one forward + backward per step for each mode,
round-robin (load from other processes hits every mode alike), and prints per mode the median step time (the
slowest rank's) and its ratio to the static layout, and the busiest rank's expert rows in the last step.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import statistics
from contextlib import redirect_stdout

import torch
import torch.distributed as dist
from fastermoe import gather_counts, launch, skew_parser, skewed_layer, step

from flexmoe import MoELayer
from flexmoe.parallel import ShadowExperts, rows_per_rank
from flexmoe.parallel.replicas import replace_experts
from flexmoe.tuning import CostModelShadowPolicy


def parse_args() -> argparse.Namespace:
    p = skew_parser(__doc__, world=2, steps=7)
    p.add_argument("--hot", default="1,2,5", help="the hot experts (default: 1, 2 on rank 0, 5 on rank 1 at 2 ranks)")
    p.add_argument("--hot-share", type=float, default=0.6, help="share of (token, choice) pairs of the hot experts")
    p.add_argument("--redundant", type=int, default=2, help="replica slots per rank of the replicated twin")
    return p.parse_args()


def hot_experts(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(int(e) for e in args.hot.split(","))


def layers(args: argparse.Namespace, rank: int) -> tuple[MoELayer, MoELayer, torch.Tensor, torch.Tensor]:
    """The static layer, its replicated twin (same weights), this rank's batch ``[T, M]`` and output weights."""
    moe, x, w = skewed_layer(args, rank, hot_experts(args))
    torch.manual_seed(0)
    twin = MoELayer(args.model_dim, args.experts, args.hidden_dim, k=args.k, capacity_factor=0.0,
                    dtype=torch.float32, redundant_experts=args.redundant)
    with torch.no_grad():
        twin.router.load_state_dict(moe.router.state_dict())
        for name, p in twin.experts.named_parameters():
            p.copy_(getattr(moe.experts, name))
    return moe, twin, x, w


def worker(options: dict) -> str | None:
    """One rank (started by flexmoe.launch.spawn_ranks); rank 0 returns the report."""
    args = argparse.Namespace(**options)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    moe, twin, x, w = layers(args, rank)
    for _ in range(3):  # the load window the replicas are placed from
        step(twin, x, w, {})
    replace_experts(twin)
    modes = {
        "static (tokens exchanged)": (moe, {}),
        "static (rows exchanged)": (moe, {"token_exchange": False}),
        "shadow=True (cost model)": (moe, {"shadow": CostModelShadowPolicy()}),
        "shadow the hot (forced)": (moe, {"shadow": ShadowExperts(hot_experts(args))}),
        f"replicated, R={args.redundant}": (twin, {}),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    busiest: dict[str, int] = {}
    for i in range(args.steps + 1):
        for name, (layer, call) in modes.items():
            seconds = step(layer, x, w, call)
            if i > 0:
                times[name].append(seconds)
            if layer is twin:
                busiest[name] = max(twin.strategy.last_rows)
            else:
                all_counts = gather_counts(layer, args.world)
                busiest[name] = max(rows_per_rank(all_counts, layer.layout, layer.last_shadowed))
    text = None
    if rank == 0:
        glob = [sum(col) for col in zip(*all_counts)]
        with redirect_stdout(io.StringIO()) as out:
            print(f"replicated experts benchmark: {args.world} ranks (gloo, 127.0.0.1, 1 thread each), "
                  f"T={args.tokens} per rank, M={args.model_dim}, H={args.hidden_dim}, E={args.experts}, k={args.k}, "
                  f"fp32, dropless; machine: {os.cpu_count()} CPU cores shared with other processes")
            hot = hot_experts(args)
            print(f"routing: experts {list(hot)} get {sum(glob[e] for e in hot) / sum(glob):.1%} of the pairs; "
                  f"rows per expert {glob}; mean rows per rank {sum(glob) // args.world}")
            print(f"replica slots after re-placement: {twin.replicas.slots.tolist()}")
            base = statistics.median(times["static (tokens exchanged)"])
            print(f"{'mode':28s} {'median s':>9s} {'vs static':>10s} {'min s':>7s} {'max s':>7s} {'busiest rows':>13s}")
            for name, ts in times.items():
                med = statistics.median(ts)
                print(f"{name:28s} {med:9.3f} {med / base:9.2f}x {min(ts):7.3f} {max(ts):7.3f} {busiest[name]:>13d}")
        text = out.getvalue()
    dist.barrier()
    dist.destroy_process_group()
    return text


def main() -> None:
    launch(worker, parse_args(), 1, "replicated experts benchmark")


if __name__ == "__main__":
    main()
