"""``flexmoe simulate --load-trace``: static, shadowed and replicated expert placement priced on a real load.

The load comes from a training run's ``metrics.jsonl`` (each record's ``expert_load``: ``[layers][E]`` rows per
expert) or any JSON file holding ``{"expert_load": [[...], ...]}``. For each E in ``experts`` (k = 8 by default)
and each GPU count, the cost model (:func:`flexmoe.tuning.cost_model.price_placements`) predicts one layer's
forward + backward under each placement, with the assumptions of :data:`ASSUMPTIONS` printed under the table.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from flexmoe.parallel.placement import ReplicaPlacement
from flexmoe.parallel.replicas import busiest_share
from flexmoe.tuning.cost_model import PLACEMENTS, LayerConfig, price_placements
from flexmoe.tuning.profile import load_profile

__all__ = ["read_load_trace", "stretch_load", "simulate_placements", "format_placements", "ASSUMPTIONS"]

ASSUMPTIONS = """\
* the trace's per-expert shares, sorted, are stretched to E experts along their cumulative curve (the heaviest
  fraction f of the experts carries the same share of the rows as in the trace), then dealt to expert ids in
  a fixed random order (seed 0): hot experts sit on random ranks;
* expert parallelism spans EP = min(W, E) GPUs; above E GPUs, W / E such groups run side by side (data
  parallel), and the expert gradients' all-reduce across them is left out (the same for every placement);
* every rank routes the same share to each expert; the load is the trace's skew curve (each layer's and
  record's shares sorted, then averaged);
* shadowing: the cost model's choice of experts (FasterMoE's rule), broadcast each step to every rank;
* replicated: R slots per rank by EPLB (owners fixed); each copy's weights are fetched from its owner every
  step and its gradient sent back (an all-to-all as large as the busiest owner's copies); a re-placement
  moves nothing more."""


def read_load_trace(path: Path) -> list[float]:
    """The skew curve of ``path`` (metrics.jsonl or one JSON object with ``expert_load``): each layer's and
    record's shares sorted heaviest first, then averaged (which expert is hot differs between layers; how hot
    the hottest is is the load's shape): ``[E]`` summing to 1. A ValueError naming the file if it holds none."""
    text = path.read_text()
    try:
        whole = json.loads(text) if text.count("\n{") == 0 else None  # one object, or JSON lines
        records = [whole] if whole is not None else [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON lines or a JSON object ({exc})") from None
    layers = [layer for r in records if isinstance(r, dict) for layer in r.get("expert_load") or []]
    if not layers or len({len(layer) for layer in layers}) != 1 or len(layers[0]) < 2:
        raise ValueError(f"{path}: no expert_load records of one expert count (>= 2 experts) to read")
    shares = [sorted((x / sum(layer) for x in layer), reverse=True) for layer in layers if sum(layer) > 0]
    if not shares:
        raise ValueError(f"{path}: every expert_load record is empty")
    return [sum(col) / len(shares) for col in zip(*shares)]


def stretch_load(shares: list[float], experts: int) -> list[float]:
    """``[E']`` shares -> ``[experts]`` shares, heaviest first, with the trace's cumulative curve: the share of
    the heaviest fraction f of the experts is the same as in the trace (linear between its points)."""
    ordered = sorted(shares, reverse=True)
    total = sum(ordered)
    cumulative = [0.0]
    for x in ordered:
        cumulative.append(cumulative[-1] + x / total)

    def curve(f: float) -> float:  # share of the heaviest fraction f of the experts
        pos = f * len(ordered)
        i = min(int(pos), len(ordered) - 1)
        return cumulative[i] + (pos - i) * (cumulative[i + 1] - cumulative[i])

    return [curve((j + 1) / experts) - curve(j / experts) for j in range(experts)]


def _busiest_share(load: list[float], placement: ReplicaPlacement) -> float:
    return busiest_share([round(x * 1e6) for x in load], placement)  # shares as integer rows


def simulate_placements(profile_name: str, gpus: list[int], shares: list[float],
                        experts: tuple[int, ...] = (64, 128, 256), k: int = 8, tokens: int = 4096,
                        model_dim: int = 2048, hidden_dim: int = 768,
                        dtype: str = "bfloat16", redundant: int = 2) -> list[dict[str, Any]]:
    """One row per (E, GPU count): each placement's predicted seconds, the model's choice, how many experts
    shadowing picks, and the busiest rank's share of the rows, static and replicated."""
    profile = load_profile(profile_name)
    rows = []
    for e in experts:
        load = stretch_load(shares, e)
        random.Random(0).shuffle(load)
        for w in gpus:
            ep = min(w, e)
            if e % ep:
                continue
            config = LayerConfig(tokens=tokens, model_dim=model_dim, hidden_dim=hidden_dim, experts=e, k=k,
                                 capacity_factor=0.0, dtype=dtype, ranks=ep, token_exchange=False)
            prices = price_placements(profile, config, load, redundant) if ep > 1 else \
                {name: (0.0, ()) for name in PLACEMENTS}
            seconds = {name: prices[name][0] for name in PLACEMENTS}
            replicated = ReplicaPlacement(e, prices["replicated"][1]) if ep > 1 else None
            rows.append({
                "experts": e, "gpus": w, "ep": ep, "seconds": seconds,
                "choice": min(PLACEMENTS, key=lambda n: (seconds[n], PLACEMENTS.index(n))),
                "shadowed": len(prices["shadowing"][1]),
                "busiest_static": _busiest_share(load, ReplicaPlacement.unreplicated(e, ep)),
                "busiest_replicated": _busiest_share(load, replicated) if replicated else 1.0,
            })
    return rows


def format_placements(rows: list[dict[str, Any]], profile: str, source: str, redundant: int, shape: str) -> str:
    """The table of :func:`simulate_placements`; ``shape``: the layer's sizes, as the caller states them."""
    lines = [f"predicted layer forward + backward (ms) by expert placement, {shape}, redundant_experts={redundant}, "
             f"profile {profile}, load from {source}",
             f"{'E':>4s} {'GPUs':>5s} {'EP':>4s} {'static':>9s} {'shadowing':>10s} {'replicated':>11s} "
             f"{'choice':>11s} {'shadowed':>9s} {'busiest static':>15s} {'busiest repl.':>14s}"]
    for r in rows:
        s = r["seconds"]
        lines.append(f"{r['experts']:>4d} {r['gpus']:>5d} {r['ep']:>4d} {s['static'] * 1e3:>9.2f} "
                     f"{s['shadowing'] * 1e3:>10.2f} {s['replicated'] * 1e3:>11.2f} {r['choice']:>11s} "
                     f"{r['shadowed']:>9d} {r['busiest_static']:>15.3f} {r['busiest_replicated']:>14.3f}")
    lines += ["", "assumptions:", *ASSUMPTIONS.splitlines()]
    return "\n".join(lines)
