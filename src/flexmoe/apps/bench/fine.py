"""The suite's fine-grained and decoding targets (``flexmoe bench --suite-groups fine-grained,decode``).

* ``fine-grained``: today's many-small-experts shapes (DeepSeek-V3: 256 experts, Qwen3-MoE: 128, both k=8) at
  T=4096, M=512, float32, forward + backward: flexmoe over the per-expert loop floor, with the grouped-GEMM
  floor (``torch._grouped_mm``) in each note; and the activation memory at E=256 over E=8 at the same
  ``T * k * M``.
* ``decode``: serving one call at a time, no grad, E=64 k=8 H=256 M=512, T = 1, 8, 64 tokens per call: the
  whole layer (router, plan, dispatch, experts, combine, Python) over the floor's latency on the routed rows.

Both floors and flexmoe take turns call by call (:func:`flexmoe.apps.bench.timing.time_side_by_side`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from flexmoe.apps.baselines import expert_floor, grouped_floor, grouped_floor_kind
from flexmoe.apps.bench.config import BenchConfig, build_layer, random_rows
from flexmoe.apps.bench.layer import floor_ratio_check, memory_check
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings
from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.experts import FeedForwardExperts

__all__ = ["fine_grained_checks", "decode_checks", "measure_decode", "DECODE_CONFIG"]

# The three fine-grained shapes: (experts, hidden size), k=8, equal FLOPs per token.
FINE_SHAPES = ((64, 256), (128, 128), (256, 64))

# Decoding: E=64, k=8, H=256, M=512; T comes per check.
DECODE_CONFIG = BenchConfig(tokens=1, model_dim=512, hidden_dim=256, experts=64, k=8, capacity_factor=0.0)


def fine_grained_checks() -> list[SuiteCheck]:
    """T=4096 M=512 fp32, k=8, forward + backward, x the loop floor (grouped floor in the note); E=64 also at
    T=8192."""
    checks = []
    for experts, hidden in FINE_SHAPES:
        cfg = BenchConfig(experts=experts, hidden_dim=hidden, k=8, capacity_factor=0.0)
        checks.append(floor_ratio_check(f"E={experts} H={hidden} k=8 dropless", cfg, 1.10, "fine-grained"))
    checks.append(floor_ratio_check("E=64 H=256 k=8 cf=1.25", BenchConfig(experts=64, hidden_dim=256, k=8),
                                    1.10, "fine-grained"))
    # Twice the tokens: 1024 rows per expert, where the layer kept the three stages until the rule went by the
    # block's size alone (0.755 of their time fused; flexmoe.experts.fused, the rule's comment).
    checks.append(floor_ratio_check("E=64 H=256 k=8 dropless T=8192",
                                    BenchConfig(tokens=8192, experts=64, hidden_dim=256, k=8, capacity_factor=0.0),
                                    1.10, "fine-grained"))
    checks.append(memory_check("activation memory E=256 / E=8, k=8 H=256",
                               BenchConfig(experts=8, hidden_dim=256, k=8), 256, 1.10, "fine-grained"))
    return checks


def decode_checks() -> list[SuiteCheck]:
    """No-grad latency per call of the whole layer over the floor's, at T = 1, 8, 64 tokens per call."""
    return [_decode_check(1, 1.5), _decode_check(8, 1.10), _decode_check(64, 1.10)]


def _decode_check(tokens: int, target: float) -> SuiteCheck:
    def measure(settings: SuiteSettings) -> Measurement:
        cfg = replace(DECODE_CONFIG, tokens=tokens, seed=settings.seed, device=settings.device)
        report = measure_decode(cfg, steps=settings.steps, warmup=settings.warmup)
        note = (f"{report['flexmoe_us']:.0f} us per call; {report['flexmoe_x_grouped_floor']:.3f}x the grouped "
                f"floor ({report['grouped_kind']})")
        return Measurement(report["flexmoe_x_floor"], "x floor", report, note)
    return SuiteCheck("decode", f"T={tokens} E=64 H=256 k=8, no grad", target, measure)


def measure_decode(cfg: BenchConfig, *, steps: int, warmup: int, calls_per_step: int | None = None,
                   ) -> dict[str, Any]:
    """Median seconds per no-grad call of the layer (eval mode, ``cfg.tokens`` tokens per call) and of the two
    floors on the same routed counts, interleaved; each step runs ``calls_per_step`` calls of a case
    (default ``max(1, 128 // tokens)``, so that one step is long enough to time)."""
    calls = calls_per_step or max(1, 128 // cfg.tokens)
    layer = build_layer(cfg).eval()
    experts = layer.experts
    assert isinstance(experts, FeedForwardExperts), "the floor times the built-in FFN experts"
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x = random_rows(cfg, cfg.tokens, gen)
    with torch.no_grad():
        layer(x)
    plan = layer.last_plan
    assert plan is not None  # set by the forward above
    counts = plan.counts
    rows = random_rows(cfg, sum(counts), gen)

    def repeated(call: Callable[[], object]) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad():
                for _ in range(calls):
                    call()
        return step

    cases = {"floor": repeated(partial(expert_floor, experts, rows, counts)),
             "grouped floor": repeated(partial(grouped_floor, experts, rows, counts)),
             "flexmoe": repeated(partial(layer, x))}
    times = time_side_by_side(cases, steps, warmup, device=cfg.device)
    per_call = {name: statistics.median(v) / calls for name, v in times.items()}
    kind = grouped_floor_kind(experts, rows)
    grouped = per_call["grouped floor"] if kind == "torch._grouped_mm" else min(per_call["grouped floor"],
                                                                                per_call["floor"])
    return {"tokens": cfg.tokens, "calls_per_step": calls, "counts": counts,
            "floor_us": per_call["floor"] * 1e6, "grouped_floor_us": grouped * 1e6, "grouped_kind": kind,
            "flexmoe_us": per_call["flexmoe"] * 1e6, "flexmoe_x_floor": per_call["flexmoe"] / per_call["floor"],
            "flexmoe_x_grouped_floor": per_call["flexmoe"] / grouped}
