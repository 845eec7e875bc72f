"""``flexmoe bench --families``: DeepSeek-style routing against plain top-k at the same shapes.

Both layers have E=64 experts (DeepSeek-V3's shape: 8 groups of 8), k=8 and the bench's T, M, H, capacity
factor and dtype (``--experts`` and ``--k`` are overridden). "deepseek" adds sigmoid scores, the group limit (the
best 4 of 8 groups), the selection bias (``balance="bias"``), ``route_scale=2.5`` and one shared expert of hidden
size H. Each layer is timed (forward + backward) side by side with its own floor: the routed experts alone on that
layer's rows, plus for "deepseek" the shared expert on all T tokens. The ratios to the floor say what the routing
costs on top of the expert math; the extra routing steps should keep the DeepSeek layer's ratio close to plain top-k's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from flexmoe.apps.baselines import expert_floor
from flexmoe.apps.bench.config import BenchConfig, build_layer, fwd_bwd, make_inputs, random_rows
from flexmoe.apps.bench.timing import time_side_by_side

__all__ = ["bench_families", "format_families", "DEEPSEEK_OPTIONS"]

DEEPSEEK_OPTIONS = dict(score_func="sigmoid", num_expert_groups=8, num_limited_groups=4, balance="bias",
                        route_scale=2.5, shared_experts=1)


def floor_with_shared(layer, counts: list[int], cfg: BenchConfig) -> Callable[[], None]:
    """The experts' math alone: the routed experts on rows of ``counts`` (+ the shared experts on T tokens)."""
    gen = torch.Generator().manual_seed(cfg.seed + 7)
    rows = random_rows(cfg, sum(counts), gen).requires_grad_()
    grad = random_rows(cfg, sum(counts), gen)
    if layer.shared is None:
        return fwd_bwd(lambda: expert_floor(layer.experts, rows, counts), grad, layer)
    tokens = random_rows(cfg, cfg.tokens, gen).requires_grad_()
    tokens_grad = random_rows(cfg, cfg.tokens, gen)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        routed = expert_floor(layer.experts, rows, counts)
        shared = expert_floor(layer.shared, tokens, [cfg.tokens])
        torch.autograd.backward([routed, shared], [grad, tokens_grad])
    return step


def bench_families(cfg: BenchConfig) -> dict[str, Any]:
    """Time plain top-k and DeepSeek-style routing, each with its floor, all four cases interleaved."""
    cfg = replace(cfg, experts=64, k=8)  # DeepSeek's shape, whatever --experts / --k say
    x, grad = make_inputs(cfg, cfg.seed + 1)
    layers = {"topk": build_layer(cfg), "deepseek": build_layer(cfg, **DEEPSEEK_OPTIONS)}
    cases: dict[str, Callable[[], None]] = {}
    plans = {}
    for name, layer in layers.items():
        with torch.no_grad():
            layer(x)
        plan = layer.last_plan
        assert plan is not None  # set by the forward above
        plans[name] = plan
        cases[f"{name} floor"] = floor_with_shared(layer, plan.counts, cfg)
        cases[name] = fwd_bwd(partial(layer, x), grad, layer)
    times = {n: statistics.median(s) for n, s in time_side_by_side(cases, cfg.steps, cfg.warmup,
                                                               device=cfg.device).items()}
    x_floor = {name: times[name] / times[f"{name} floor"] for name in layers}
    rows = [{"routing": name, "ms_per_step": times[name] * 1e3, "floor_ms": times[f"{name} floor"] * 1e3,
             "x_floor": x_floor[name], "rows_computed": sum(plans[name].counts),
             "dropped_fraction": plans[name].dropped_fraction} for name in layers]
    return {"config": cfg.describe(), "threads": torch.get_num_threads(), "options": DEEPSEEK_OPTIONS,
            "rows": rows, "deepseek_over_topk": x_floor["deepseek"] / x_floor["topk"]}


def format_families(report: dict[str, Any]) -> str:
    lines = [f"flexmoe bench --families: {report['config']}, {report['threads']} threads; deepseek = "
             f"{report['options']}",
             f"{'routing':<10}{'ms/step':>10}{'floor ms':>10}{'x floor':>9}{'rows':>8}{'dropped':>9}"]
    for r in report["rows"]:
        lines.append(f"{r['routing']:<10}{r['ms_per_step']:>10.1f}{r['floor_ms']:>10.1f}{r['x_floor']:>9.3f}"
                     f"{r['rows_computed']:>8}{r['dropped_fraction']:>9.2%}")
    lines.append(f"deepseek x floor / topk x floor: {report['deepseek_over_topk']:.3f}")
    return "\n".join(lines)
