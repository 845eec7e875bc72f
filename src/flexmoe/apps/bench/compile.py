"""The suite's "compile" group: ``torch.compile(MoELayer)`` against the eager layer (docs/architecture.md,
"Compiling the layer").

Each timing check builds one layer, compiles it (inductor; ``fullgraph=True`` in capacity mode on the CPU), times the
eager and the compiled forward + backward side by side, steps interleaved (:func:`flexmoe.apps.bench.timing.
time_side_by_side`); the value is the compiled median over the eager one. The first compiled call (tracing and
code generation, tens of seconds on CPU) is timed apart and reported in the note. A check times the training
job's model the same way (``flexmoe train --compile``), and a last one counts the graph breaks of dropless
mode, none since its per-expert counts stay on the device.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch._dynamo
from torch import Tensor

from flexmoe.apps.bench.config import BenchConfig, build_layer, fwd_bwd, make_inputs
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings
from flexmoe.apps.bench.timing import time_side_by_side, wait_for

__all__ = ["compiled_vs_eager", "compiled_model_vs_eager", "dropless_graph_breaks", "compile_checks"]

# torch._dynamo.explain's count in dropless mode: none, the counts stay on the device (tests/test_compile.py
# asserts the same number).
DROPLESS_GRAPH_BREAKS = 0


def _eager_and_compiled(eager_step: Callable[[], None], compiled_step: Callable[[], None], steps: int, warmup: int,
                        show: str | None, device: str = "cpu") -> tuple[float, float, float]:
    """The median seconds of each step on ``device`` timed side by side, after one compiled call (tracing and code
    generation) timed apart: ``(eager, compiled, first compiled call)``. ``show``: what is compiled, to print
    progress."""
    if show is not None:
        print(f"compiling {show} ...", flush=True)
    start = time.perf_counter()
    compiled_step()
    wait_for(device)
    first_call = time.perf_counter() - start
    times = time_side_by_side({"eager": eager_step, "compiled": compiled_step}, steps, warmup,
                              desc="eager vs compiled" if show is not None else None, device=device)
    return statistics.median(times["eager"]), statistics.median(times["compiled"]), first_call


def compiled_vs_eager(cfg: BenchConfig, show: bool = False) -> Measurement:
    """The compiled layer's forward + backward time over the eager layer's, at ``cfg`` (same layer, same input)."""
    torch._dynamo.reset()  # every layer shares forward's code object: start its recompilation budget afresh
    layer = build_layer(cfg)
    x, grad = make_inputs(cfg, cfg.seed + 1)
    # One graph where capacity mode pads (the CPU: ExpertStage.plan_layout); elsewhere the compiled call
    # breaks the graph where the counts reach the host, and adaptive capacity (< 0) breaks everywhere.
    fullgraph = cfg.capacity_factor >= 0 and torch.device(cfg.device).type == "cpu"
    compiled = torch.compile(layer, fullgraph=fullgraph)
    eager_step = fwd_bwd(lambda: layer(x), grad, layer)
    compiled_step = fwd_bwd(lambda: compiled(x), grad, layer)
    eager, comp, first_call = _eager_and_compiled(eager_step, compiled_step, cfg.steps, cfg.warmup,
                                                  cfg.describe() if show else None, cfg.device)
    return Measurement(comp / eager, "x eager", {"config": cfg.describe(), "eager_s": eager, "compiled_s": comp,
                                                 "first_compiled_call_s": first_call},
                       f"eager {eager:.3f} s, compiled {comp:.3f} s, first compiled call {first_call:.0f} s")


def compiled_model_vs_eager(steps: int, warmup: int, seed: int, show: bool = False,
                            device: str = "cpu") -> Measurement:
    """The training job's MoE GPT (its defaults: :class:`flexmoe.apps.models.gpt.GPTConfig`, a batch of
    :class:`flexmoe.apps.train.TrainConfig`'s size) on ``device`` compiled by inductor, forward + backward of the
    loss with the router's regularization, over the eager model's time (one model, two forwards)."""
    from flexmoe.apps.models.gpt import GPTConfig
    from flexmoe.apps.train import TrainConfig, build_model

    torch._dynamo.reset()
    cfg, batch = GPTConfig(), TrainConfig().batch_size
    model = build_model(cfg, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=gen).to(device) for _ in range(2))
    compiled = torch.compile(model)

    def step(forward: Callable[[Tensor, Tensor], tuple[Any, Tensor]]) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            _, loss = forward(x, y)
            (loss + model.regularization_loss()).backward()
        return run

    eager, comp, first_call = _eager_and_compiled(step(model), step(compiled), steps, warmup,
                                                  "the training job's GPT" if show else None, device)
    shape = (f"{cfg.n_layer} layers, D={cfg.n_embd}, E={cfg.num_experts} k={cfg.k} H={cfg.expert_hidden} "
             f"cf={cfg.capacity_factor}, {batch}x{cfg.block_size} tokens")
    return Measurement(comp / eager, "x eager", {"model": shape, "eager_s": eager, "compiled_s": comp,
                                                 "first_compiled_call_s": first_call},
                       f"eager {eager * 1e3:.1f} ms, compiled {comp * 1e3:.1f} ms, first compiled call "
                       f"{first_call:.0f} s")


def dropless_graph_breaks(cfg: BenchConfig) -> Measurement:
    """torch._dynamo.explain's graph breaks of one dropless forward at ``cfg`` (shapes do not change them)."""
    torch._dynamo.reset()
    layer = build_layer(replace(cfg, capacity_factor=0.0))
    x, _ = make_inputs(cfg, cfg.seed + 1)
    explained = torch._dynamo.explain(layer)(x)
    return Measurement(float(explained.graph_break_count), "breaks", {"graphs": explained.graph_count},
                       f"{explained.graph_count} graphs")


def _ratio_check(label: str, cfg: BenchConfig) -> SuiteCheck:
    def measure(settings: SuiteSettings) -> Measurement:
        run_cfg = replace(cfg, steps=min(cfg.steps, settings.steps), warmup=min(cfg.warmup, settings.warmup),
                          seed=settings.seed, device=settings.device)
        return compiled_vs_eager(run_cfg, show=settings.show)
    return SuiteCheck("compile", label, 1.0, measure)


def compile_checks() -> list[SuiteCheck]:
    """The "compile" group: T=4096 M=512 fp32, capacity mode cf=1.25, forward + backward."""
    small = BenchConfig(tokens=256, model_dim=64, hidden_dim=128, steps=1, warmup=0)
    return [
        _ratio_check("compiled / eager E=8 H=1024 k=2 cf=1.25", BenchConfig(steps=5, warmup=1)),
        _ratio_check("compiled / eager E=64 H=256 k=8 cf=1.25",
                     BenchConfig(experts=64, hidden_dim=256, k=8, steps=5, warmup=1)),
        SuiteCheck("compile", "compiled / eager, the training job's GPT (flexmoe train --compile)", 1.0,
                   lambda settings: compiled_model_vs_eager(min(10, settings.steps), min(1, settings.warmup),
                                                            settings.seed, settings.show, settings.device)),
        SuiteCheck("compile", "dropless graph breaks (counts stay on the device)", DROPLESS_GRAPH_BREAKS,
                   lambda settings: dropless_graph_breaks(replace(small, seed=settings.seed,
                                                                  device=settings.device))),
    ]
