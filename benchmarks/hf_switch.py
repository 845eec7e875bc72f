"""Switch Transformers' sparse MLP: HF's block against its flexmoe conversion, side by side (issue 28).

    PYTHONPATH=src .venv/bin/python benchmarks/hf_switch.py [--batch 4] [--seq 256] [--steps 7]

One ``SwitchTransformersSparseMLP`` at switch-base-8's shape (d_model 768, d_ff 3072, 8 experts, ReLU,
``expert_capacity`` 64 per sequence), float32, one thread, the input ``[batch, seq, 768]``. The same block is
converted with ``flexmoe.hf.convert``; both run an evaluation forward and a training step (forward and backward
of the output's sum), round-robin, and the median time per call and the ratio flexmoe / HF are printed. Before
timing, the outputs are checked equal to float32 rounding.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable

import torch
from torch import nn

from flexmoe.apps.bench.timing import time_side_by_side


def _block() -> nn.Module:
    from transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersSparseMLP

    config = SwitchTransformersConfig(d_model=768, d_ff=3072, num_experts=8, expert_capacity=64, dropout_rate=0.0,
                                      router_jitter_noise=0.0)
    torch.manual_seed(0)
    block = SwitchTransformersSparseMLP(config)
    with torch.no_grad():
        block.router.classifier.weight.normal_(0, 768 ** -0.5)
        for expert in block.experts.values():
            expert.wi.weight.normal_(0, 768 ** -0.5)
            expert.wo.weight.normal_(0, 3072 ** -0.5)
    return block


def _calls(block: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], None]]:
    def evaluate() -> None:
        with torch.no_grad():
            block.eval()(x)

    def train_step() -> None:
        block.train()
        block(x).sum().backward()

    return {"eval": evaluate, "train step": train_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    import flexmoe.hf as fh

    torch.set_num_threads(1)
    hf = _block()
    flexmoe_block = fh.convert(copy.deepcopy(hf), group="single")
    x = torch.randn(args.batch, args.seq, 768, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(flexmoe_block.eval()(x), hf.eval()(x), rtol=1e-5, atol=1e-5)
    print(f"Switch sparse MLP, x [{args.batch}, {args.seq}, 768], E=8, d_ff=3072, capacity 64 per sequence, "
          f"float32, 1 thread (dropped pairs: {int(flexmoe_block.moe.last_plan.num_dropped)})")
    ours, theirs = _calls(flexmoe_block, x), _calls(hf, x)
    for name in ours:
        times = time_side_by_side({"hf": theirs[name], "flexmoe": ours[name]}, steps=args.steps, warmup=2)
        hf_s, fx_s = statistics.median(times["hf"]), statistics.median(times["flexmoe"])
        print(f"  {name:10s}  HF {hf_s * 1e3:8.1f} ms  flexmoe {fx_s * 1e3:8.1f} ms  flexmoe / HF {fx_s / hf_s:.2f}")


if __name__ == "__main__":
    main()
