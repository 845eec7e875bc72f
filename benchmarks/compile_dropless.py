"""Dropless ``MoELayer`` under ``torch.compile``: recompilations, first call, and time against eager (issue 14).

    .venv/bin/python benchmarks/compile_dropless.py [--calls 10] [--steps 7] [--backend aot_eager]

Part 1, recompilations: one compiled dropless layer (E=64, k=8, M=32, H=64, float32) called on ``--calls``
different batches of 16 tokens, forward + backward. With so few tokens per expert, which experts get 0 or 1 rows
changes from call to call; the line per call gives dynamo's graph count so far and those experts, and the total
time of the calls (compiling included). Part 2, speed: forward + backward of the compiled layer over the eager
one at T=4096, M=512 (E=64 H=256 k=8 and E=8 H=1024 k=2), side by side (``flexmoe.apps.bench.compile.
compiled_vs_eager``), with the first compiled call's time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from flexmoe import MoELayer
from flexmoe.apps.bench.compile import compiled_vs_eager
from flexmoe.apps.bench.config import BenchConfig


def recompilations(calls: int, backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoELayer(32, 64, 64, k=8, capacity_factor=0.0)
    compiled = torch.compile(layer, backend=backend)
    graphs_before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    for call in range(calls):
        x = torch.randn(16, 32, requires_grad=True)
        compiled(x).square().sum().backward()
        plan = layer.last_plan
        assert plan is not None
        few = sum(n <= 1 for n in plan.counts)
        print(f"call {call}: {counters['stats']['unique_graphs'] - graphs_before} graphs so far, "
              f"{few} of 64 experts with 0 or 1 rows")
    print(f"{calls} calls in {time.perf_counter() - start:.1f} s (compiling included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--backend", default="aot_eager", help="backend of part 1 (part 2: inductor)")
    args = parser.parse_args()
    recompilations(args.calls, args.backend)
    for experts, hidden, k in ((64, 256, 8), (8, 1024, 2)):
        cfg = BenchConfig(experts=experts, hidden_dim=hidden, k=k, capacity_factor=0.0, steps=args.steps, warmup=1)
        m = compiled_vs_eager(cfg)
        print(f"dropless E={experts} H={hidden} k={k}: compiled / eager {m.value:.3f} ({m.note})")


if __name__ == "__main__":
    main()
