"""``flexmoe bench --hf``'s block timing: one family's block at one shape on every experts implementation, forward
+ backward, side by side, after every case has been checked to compute HF eager's output and input gradient
(:mod:`flexmoe.apps.bench.hf` describes the cases and the target).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.apps.bench import hf_blocks
from flexmoe.apps.bench.config import BenchConfig
from flexmoe.apps.bench.families import floor_with_shared
from flexmoe.apps.bench.hf_blocks import SHAPES, HFShape
from flexmoe.apps.bench.timing import time_side_by_side

__all__ = ["bench_hf_block", "bench_hf", "format_block"]


def _batched_mm_bytes(shape: HFShape) -> int:
    """What HF's batched_mm keeps per call: a copy of each pair's gate_up and down matrices (float32)."""
    return shape.tokens * shape.k * 3 * shape.hidden_dim * shape.model_dim * 4


def bench_hf_block(family: str, shape: HFShape, *, steps: int = 5, warmup: int = 1, seed: int = 0,
                   memory_gib: float = 1.0, show: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Time ``family``'s block at ``shape`` on every implementation, forward + backward, side by side, on
    ``device``.

    Returns ``{"family", "shape", "rows": [{"case", "seconds", "x_hf_best", "x_floor"}], "hf_best", "skipped",
    "met"}``; ``met``: the converted block and the flexmoe implementation both beat HF's best built-in one.
    Raises ``RuntimeError`` when a case's output or input gradient differs from HF eager's.
    """
    import flexmoe.hf

    flexmoe.hf.register()
    reference = hf_blocks.build_hf_block(family, shape, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, shape.tokens, shape.model_dim, generator=gen).to(device).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device)
    modules: dict[str, nn.Module] = {}
    skipped: list[str] = []
    for impl in hf_blocks.BUILT_IN:
        need = _batched_mm_bytes(shape) / 2**30
        if impl == "batched_mm" and need > memory_gib:
            skipped.append(f"hf batched_mm: skipped (its per-pair weight copies need {need:.0f} GiB, "
                           f"over --hf-memory-gib {memory_gib:g})")
            continue
        modules[f"hf {impl}"] = hf_blocks.set_experts_implementation(copy.deepcopy(reference), impl)
    modules["flexmoe impl"] = hf_blocks.set_experts_implementation(copy.deepcopy(reference), "flexmoe")
    converted = flexmoe.hf.convert(copy.deepcopy(reference))
    modules["converted"] = converted

    def forward(module: nn.Module) -> Tensor:
        return hf_blocks.block_output(module(x))

    # Every case must compute HF eager's function before its time means anything.
    want_out, want_grad = _run_once(modules["hf eager"], forward, x, grad)
    for name, module in modules.items():
        out, x_grad = _run_once(module, forward, x, grad)
        hf_blocks.assert_same(name, out, want_out, "output")
        hf_blocks.assert_same(name, x_grad, want_grad, "input gradient")
    plan = hf_blocks.converted_layer(converted).last_plan
    assert plan is not None  # set by the forward above
    floor_cfg = BenchConfig(**shape.sizes(), seed=seed, device=device)

    floor = floor_with_shared(hf_blocks.converted_layer(converted), plan.counts, floor_cfg)
    cases: dict[str, Callable[[], None]] = {"floor": floor}
    for name, module in modules.items():
        cases[name] = partial(_step, module, forward, x, grad)
    if show:
        print(f"{family} {shape.name}: {shape.describe()}, all cases equal HF eager; timing ...", flush=True)
    times = time_side_by_side(cases, steps, warmup, desc=f"{family} {shape.name}" if show else None,
                              device=device)
    medians = {name: statistics.median(v) for name, v in times.items()}
    hf_best = min((n for n in medians if n.startswith("hf ")), key=medians.__getitem__)
    rows = [{"case": name, "seconds": medians[name], "x_hf_best": medians[name] / medians[hf_best],
             "x_floor": medians[name] / medians["floor"]} for name in medians]
    met = all(medians[n] < medians[hf_best] for n in ("converted", "flexmoe impl"))
    report = {"family": family, "shape": asdict(shape), "rows": rows, "hf_best": hf_best, "skipped": skipped,
              "met": met, "threads": torch.get_num_threads(), "steps": steps}
    if show:
        print(format_block(report), flush=True)
    return report


def _run_once(module: nn.Module, forward: Callable[[nn.Module], Tensor], x: Tensor,
              grad: Tensor) -> tuple[Tensor, Tensor]:
    x.grad = None
    module.zero_grad(set_to_none=True)
    out = forward(module)
    out.backward(grad)
    assert x.grad is not None
    x_grad, x.grad = x.grad, None
    return out.detach(), x_grad


def _step(module: nn.Module, forward: Callable[[nn.Module], Tensor], x: Tensor, grad: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    forward(module).backward(grad)


def bench_hf(families: list[str], *, steps: int = 5, warmup: int = 1, seed: int = 0, memory_gib: float = 1.0,
             tokens: int = 4096, model_dim: int = 512, show: bool = False, device: str = "cpu") -> dict[str, Any]:
    """:func:`bench_hf_block` for every family at each of its shapes, with ``tokens`` and ``model_dim``."""
    blocks = []
    for family in families:
        for name in hf_blocks.shapes_of(family):
            shape = replace(SHAPES[name], tokens=tokens, model_dim=model_dim)
            blocks.append(bench_hf_block(family, shape, steps=steps, warmup=warmup, seed=seed,
                                         memory_gib=memory_gib, show=show, device=device))
    return {"blocks": blocks, "met": all(b["met"] for b in blocks), "threads": torch.get_num_threads()}


def format_block(report: dict[str, Any]) -> str:
    shape = HFShape(**report["shape"])
    lines = [f"{report['family']} {shape.name} ({shape.describe()}), forward + backward, median of "
             f"{report['steps']} steps, {report['threads']} threads",
             f"  {'case':<16}{'ms/step':>10}{'x hf best':>11}{'x floor':>9}"]
    for row in report["rows"]:
        best = "  <- hf best" if row["case"] == report["hf_best"] else ""
        lines.append(f"  {row['case']:<16}{row['seconds'] * 1e3:>10.1f}{row['x_hf_best']:>11.3f}"
                     f"{row['x_floor']:>9.3f}{best}")
    lines += [f"  {s}" for s in report["skipped"]]
    lines.append(f"  target (converted and flexmoe impl faster than {report['hf_best']}): "
                 f"{'pass' if report['met'] else 'FAIL'}")
    return "\n".join(lines)

