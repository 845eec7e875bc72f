"""What reading an inference engine's routing costs: ``flexmoe.RoutingRecord.from_routed_experts`` on an array the
size a rollout batch of a large MoE gives (vLLM's / SGLang's ``routed_experts``, int32, padded into ``[B, S, L, k]``).

    python benchmarks/routed_experts.py [--batch 16] [--seq 2048] [--layers 48] [--top-k 8] [--experts 128]

The model is ``--layers`` MoE layers of ``--experts`` experts (tiny widths: only their count and k are read). Each
sequence's last eighth is padding (mask 0, -1 there, as an engine leaves it). Prints the median of ``--repeats``
and the ids read per second, at one CPU thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

import flexmoe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = nn.Sequential(*[flexmoe.MoELayer(8, args.experts, 8, k=args.top_k, group="single")
                            for _ in range(args.layers)])
    rng = np.random.default_rng(0)
    routed = rng.integers(0, args.experts, (args.batch, args.seq, args.layers, args.top_k), dtype=np.int32)
    mask = np.ones((args.batch, args.seq), dtype=np.int64)
    mask[:, -args.seq // 8:] = 0
    routed[mask == 0] = -1
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        flexmoe.RoutingRecord.from_routed_experts(routed, model, attention_mask=mask)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"routed [{args.batch}, {args.seq}, {args.layers}, {args.top_k}] int32, E={args.experts}: "
          f"{median * 1e3:.0f} ms, {routed.size / median / 1e6:.0f} M ids/s (median of {args.repeats}, 1 thread)")


if __name__ == "__main__":
    main()
