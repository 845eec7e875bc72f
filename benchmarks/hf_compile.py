"""Converted Hugging Face models under ``torch.compile(fullgraph=True)``: one training step, compiled against eager,
beside HF's own ``grouped_mm`` experts compiled the same way (issue 28, "Compiles whole").

    PYTHONPATH=src .venv/bin/python benchmarks/hf_compile.py [--archs qwen3_moe deepseek_v3] [--steps 7]

For each family, the ``flexmoe train --hf-arch`` model (:mod:`flexmoe.apps.hf_configs`: 4 layers of width 64,
8 experts top-2, byte vocabulary) is built from its config under a seed, and four copies take AdamW steps on
the same batch (16 sequences of 128 tokens, the job's defaults), the loss with HF's auxiliary loss where the
config asks for it (``output_router_logits``): the converted model (:func:`flexmoe.hf.convert`, dropless) eager
and compiled, and HF's model with ``experts_implementation="grouped_mm"`` eager and compiled (inductor,
``fullgraph=True``, the model's forward; the optimizer runs eagerly). Before timing, every case's loss must be
HF eager's (float32 rounding). The first compiled step (tracing and code generation) is timed apart; then the
four cases take turns, step by step (:func:`flexmoe.apps.bench.timing.time_side_by_side`), and the medians are
compared: compiled / eager for each model (the target: the converted model's at most 1) and converted / HF.
One thread, as every timing in docs/performance.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from torch import Tensor, nn

import flexmoe.hf
from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.apps.hf_configs import small_config

BATCH, SEQ = 16, 128  # flexmoe train's batch_size and the --hf-arch job's block_size


def build_models(arch: str, seed: int) -> dict[str, nn.Module]:
    """HF's ``arch`` model (``grouped_mm`` experts) and its converted copy, same weights, in training mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf: Any = AutoModelForCausalLM.from_config(small_config(arch))
    converted = flexmoe.hf.convert(copy.deepcopy(hf))
    hf.set_experts_implementation("grouped_mm")
    return {"converted": converted.train(), "hf grouped_mm": hf.train()}


def train_step(forward: Callable[..., Any], model: nn.Module, opt: torch.optim.Optimizer, ids: Tensor,
               router_logits: bool) -> Tensor:
    opt.zero_grad(set_to_none=True)
    loss: Tensor = forward(input_ids=ids, labels=ids, output_router_logits=router_logits).loss
    loss.backward()
    opt.step()
    return loss.detach()


def bench_arch(arch: str, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Median seconds per training step of the four cases, and the first compiled steps' seconds."""
    torch._dynamo.reset()
    models = build_models(arch, seed)
    router_logits = bool(getattr(small_config(arch), "output_router_logits", False))
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    cases: dict[str, Callable[[], Tensor]] = {}
    first_call: dict[str, float] = {}
    for name, model in models.items():
        opt_eager = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
        eager_case = f"{name} eager"
        cases[eager_case] = lambda m=model, o=opt_eager: train_step(m, m, o, ids, router_logits)
        loss = cases[eager_case]()  # also installs HF's output recorders, outside the compiled region
        compiled = torch.compile(model, fullgraph=True)
        compiled_case = f"{name} compiled"
        cases[compiled_case] = lambda c=compiled, m=model, o=opt_eager: train_step(c, m, o, ids, router_logits)
        start = time.perf_counter()
        compiled_loss = cases[compiled_case]()
        first_call[compiled_case] = time.perf_counter() - start
        torch.testing.assert_close(compiled_loss, loss, rtol=1e-4, atol=1e-5)
        if name == "hf grouped_mm":
            torch.testing.assert_close(loss, cases["converted eager"](), rtol=1e-4, atol=1e-5)
    times = time_side_by_side({n: _discard(f) for n, f in cases.items()}, steps, warmup,
                              desc=f"{arch} training step")
    medians = {n: statistics.median(v) for n, v in times.items()}
    return {"arch": arch, "seconds": medians, "first_compiled_call_s": first_call}


def _discard(step: Callable[[], Tensor]) -> Callable[[], None]:
    def run() -> None:
        step()
    return run


def format_report(r: dict[str, Any]) -> str:
    s = r["seconds"]
    lines = [f"{r['arch']}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in s.items())]
    ratios = {
        "converted compiled / converted eager": s["converted compiled"] / s["converted eager"],
        "hf grouped_mm compiled / hf grouped_mm eager": s["hf grouped_mm compiled"] / s["hf grouped_mm eager"],
        "converted eager / hf grouped_mm eager": s["converted eager"] / s["hf grouped_mm eager"],
        "converted compiled / hf grouped_mm compiled": s["converted compiled"] / s["hf grouped_mm compiled"],
    }
    lines += [f"  {name}: {value:.3f}" for name, value in ratios.items()]
    met = ratios["converted compiled / converted eager"] <= 1.0
    lines.append(f"  target converted compiled <= converted eager: {'met' if met else 'NOT met'}; first compiled "
                 "steps " + ", ".join(f"{n} {t:.0f} s" for n, t in r["first_compiled_call_s"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["qwen3_moe", "deepseek_v3"])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for arch in args.archs:
        print(format_report(bench_arch(arch, args.steps, args.warmup, args.seed)), flush=True)


if __name__ == "__main__":
    main()
