"""What the expert-kernel chooser measures and picks at the benchmark suite's shapes, and what its timing costs
on a cold cache (docs/performance.md, "Expert kernels chosen by measurement").

    PYTHONPATH=src python benchmarks/kernel_choice.py [--threads 2] [--device cuda]

For each shape it builds a fresh MoELayer (M=512, fp32, dropless; the chooser's cache in memory only, its real
timer) and runs two calls: the first times every supported kernel (and, in training, the fused route against the
three stages) on the call's own rows, the second runs the choice. It prints the first call's extra seconds over
the second (the cost of timing on a cold cache), each candidate's measured seconds over the loop's and the
choice per bucket.
"""

from __future__ import annotations

import argparse
import time

import torch

from flexmoe import MoELayer
from flexmoe.device_clock import synchronize
from flexmoe.experts.chooser import KernelChooser

# name: (tokens, experts, hidden, k, training)
SHAPES = {
    "layer E=8 H=1024 k=2 T=4096": (4096, 8, 1024, 2, True),
    "fine E=64 H=256 k=8 T=4096": (4096, 64, 256, 8, True),
    "fine E=128 H=128 k=8 T=4096": (4096, 128, 128, 8, True),
    "fine E=256 H=64 k=8 T=4096": (4096, 256, 64, 8, True),
    "fine E=64 H=256 k=8 T=8192": (8192, 64, 256, 8, True),
    "decode T=1 E=64 H=256 k=8": (1, 64, 256, 8, False),
    "decode T=8 E=64 H=256 k=8": (8, 64, 256, 8, False),
    "decode T=64 E=64 H=256 k=8": (64, 64, 256, 8, False),
}


def _call(layer: MoELayer, x: torch.Tensor, training: bool) -> float:
    synchronize(x.device)
    start = time.perf_counter()
    if training:
        layer(x).sum().backward()
    else:
        with torch.no_grad():
            layer(x)
    synchronize(x.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--device", default="cpu", help="where the layer runs (cpu, cuda, ...)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    KernelChooser.default_cache_dir = None  # a cold cache for every layer, nothing written
    for name in args.shapes.split(","):
        tokens, experts, hidden, k, training = SHAPES[name]
        torch.manual_seed(0)
        layer = MoELayer(512, experts, hidden, k=k, capacity_factor=0.0, device=args.device).train(training)
        x = torch.randn(tokens, 512, device=args.device, requires_grad=training)
        first = _call(layer, x, training)
        second = _call(layer, x, training)
        chooser = layer.experts.kernels
        print(f"{name}: first call {first:.2f} s, second {second:.2f} s, timing cost {first - second:.2f} s")
        for bucket, seconds in chooser.timings.items():
            base = seconds.get("loop", seconds.get("rows"))
            cells = "  ".join(f"{n} {t * 1e3:.1f} ms ({t / base:.2f})" for n, t in sorted(seconds.items()))
            print(f"    {bucket}: {cells} -> {chooser.decisions[bucket]}", flush=True)


if __name__ == "__main__":
    main()
