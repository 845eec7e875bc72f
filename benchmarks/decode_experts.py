"""The experts' compute without autograd (decoding), path by path, side by side (issue 14).

    .venv/bin/python benchmarks/decode_experts.py [--tokens 1,2,4,8,16,32,64] [--steps 15]

For each number of tokens T per call it routes T tokens to k experts each (random distinct experts per token)
and times the same rows through every kernel of :mod:`flexmoe.experts.kernels` that runs the case ("loop", the
bench's floor; "joined_unit"; "embedding_bag"; "grouped_mm" where it runs), round-robin, and prints each
kernel's median time per call and its ratio to the better of the two loops, with the rows per active expert.
Two shapes: the fine-grained E=64 k=8 H=256 (gelu with biases, and GLU) and the coarse E=8 k=2 H=1024 (gelu),
M=512, float32. The results are checked against the loop before timing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.experts.kernels import KERNELS, KernelCase, supported_kernels
from flexmoe.experts.weights import ExpertWeights

SHAPES = {  # name: (experts, k, hidden, glu)
    "E=64 k=8 H=256 gelu": (64, 8, 256, False),
    "E=64 k=8 H=256 GLU": (64, 8, 256, True),
    "E=8 k=2 H=1024 gelu": (8, 2, 1024, False),
}
MODEL_DIM = 512


def _weights(experts: int, hidden: int, glu: bool, gen: torch.Generator) -> tuple:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    if glu:  # SwiGLU without biases, as the open MoE models
        return r(experts, MODEL_DIM, hidden), None, r(experts, hidden, MODEL_DIM), None, \
            r(experts, MODEL_DIM, hidden), None, F.silu
    return r(experts, MODEL_DIM, hidden), r(experts, hidden), r(experts, hidden, MODEL_DIM), r(experts, MODEL_DIM), \
        None, None, F.gelu


def _counts(tokens: int, experts: int, k: int, gen: torch.Generator) -> list[int]:
    counts = [0] * experts
    for _ in range(tokens):
        for e in torch.randperm(experts, generator=gen)[:k].tolist():
            counts[e] += 1
    return counts


def _repeat(path: Callable[..., torch.Tensor], call: tuple, times: int) -> None:
    for _ in range(times):
        path(*call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64", help="comma-separated tokens per call")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (each path once per round)")
    parser.add_argument("--calls", type=int, default=10, help="calls per timed round")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"no autograd, M={MODEL_DIM}, float32, {torch.get_num_threads()} threads; us per call, and x the "
          f"better loop")
    for shape, (experts, k, hidden, glu) in SHAPES.items():
        weights = ExpertWeights(*_weights(experts, hidden, glu, gen))
        for tokens in (int(t) for t in args.tokens.split(",")):
            counts = _counts(tokens, experts, k, gen)
            rows = torch.randn(sum(counts), MODEL_DIM, generator=gen)
            with torch.no_grad():
                case = KernelCase.of(rows, counts, weights)
                paths: dict[str, Callable[..., torch.Tensor]] = {k.name: k.run for k in supported_kernels(case)}
                want = KERNELS["loop"].run(rows, counts, weights)
                for name, path in paths.items():
                    got = path(rows, counts, weights)
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)

                call = (rows, counts, weights)
                times = time_side_by_side({n: partial(_repeat, p, call, args.calls) for n, p in paths.items()},
                                          args.steps, 2)
            us = {n: statistics.median(v) / args.calls * 1e6 for n, v in times.items()}
            best_loop = min(us["joined_unit"], us["loop"])
            active = sum(1 for n in counts if n)
            cells = "  ".join(f"{n} {t:7.0f} {t / best_loop:5.2f}x" for n, t in us.items())
            print(f"{shape:20s} T={tokens:<3d} {sum(counts) / active:4.1f} rows/expert  {cells}", flush=True)


if __name__ == "__main__":
    main()
