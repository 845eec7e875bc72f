"""One rank of the FasterMoE tests (run by tests/test_fastermoe.py as W real processes, gloo on 127.0.0.1).

``python tests/fastermoe_worker.py SCENARIO RANK WORLD PORT OUT_JSON``: joins a gloo group, runs the scenario
and writes ``{"failures": [...], ...}`` to OUT_JSON. The reference is one process holding all experts with the
same global weights, running each rank's tokens as its own batch (as in tests/ep_worker.py).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

from flexmoe import MoELayer
from flexmoe.parallel import (
    ExpertLayout,
    ShadowExperts,
    ShadowTopExperts,
    rows_per_rank,
    shard_expert_state,
    unshard_expert_states,
)

M, H, T = 8, 8, 16  # tiny: model dim, expert hidden (global), tokens per rank
TIMEOUT_S = 6.0
HOT = (0, 1)  # with skewed routing these two experts get about half of the (token, choice) pairs


def make_pair(E: int, k: int, cf: float, world: int, rank: int, skewed: bool, **kw):
    """A single-process reference holding all experts and the distributed layer with the same weights."""
    torch.manual_seed(1234)
    ref = MoELayer(M, E, H, k=k, capacity_factor=cf, group="single", dtype=torch.float64)
    if skewed:
        with torch.no_grad():  # inputs get +1 on feature 0 (see inputs()); the hot experts read it
            ref.router.weight[:, 0] = 0.0
            ref.router.weight[list(HOT), 0] = 0.5
    ep = MoELayer(M, E, H, k=k, capacity_factor=cf, dtype=torch.float64, **kw)
    ep.router.load_state_dict(ref.router.state_dict())
    layout = ExpertLayout(E, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()}, layout, rank)
    with torch.no_grad():
        for n, p in ep.experts.named_parameters():
            p.copy_(local[n])
    return ref, ep, layout


def inputs(world: int, skewed: bool, cold: bool = False):
    """Each rank's tokens and output weights. skewed: feature 0 shifted by +1; cold: feature 0 >= 1."""
    xs, ws = [], []
    for j in range(world):
        g = torch.Generator().manual_seed(100 + j)
        x = torch.randn(T, M, generator=g, dtype=torch.float64)
        if skewed:
            x[:, 0] += 1.0
        if cold:
            x[:, 0] = x[:, 0].abs() + 1.0
        xs.append(x)
        ws.append(torch.randn(T, M, generator=g, dtype=torch.float64))
    return xs, ws


def reference(ref: MoELayer, xs, ws, rank: int):
    """This rank's output, input and router grads; expert grads summed over every rank's batch (global)."""
    total: dict[str, torch.Tensor] = {}
    mine = {}
    counts = []
    for j, (x, w) in enumerate(zip(xs, ws)):
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        y = ref(x)
        (y * w).sum().backward()
        counts.append(list(ref.last_plan.counts))
        for n, p in ref.experts.named_parameters():
            total[n] = total.get(n, 0) + p.grad
        if j == rank:
            mine = {"y": y.detach(), "x.grad": x.grad, "router": [p.grad.clone() for p in ref.router.parameters()]}
    return mine, total, counts


def compare(tag: str, got: torch.Tensor, want: torch.Tensor, failures: list[str], tol: float = 1e-9) -> None:
    if got is None:
        failures.append(f"{tag}: no gradient")
    elif got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol / 10):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{tag}: mismatch (max err {err}, shapes {tuple(got.shape)} vs {tuple(want.shape)})")


def gathered_grads(ep: MoELayer, layout: ExpertLayout, world: int) -> dict[str, torch.Tensor]:
    """Every rank's expert gradients, put back into global ``[E, ...]`` form."""
    # A rank whose experts got no rows may have no gradient at all (None): that is zero.
    mine = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach()))
            for n, p in ep.experts.named_parameters()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return unshard_expert_states(every, layout)


def check_case(tag, ref, ep, layout, rank, world, skewed, failures, x_grad=True, cold=False, **call) -> dict:
    xs, ws = inputs(world, skewed, cold)
    want, total, counts = reference(ref, xs, ws, rank)
    ep.zero_grad(set_to_none=True)
    x = xs[rank].clone().requires_grad_(x_grad)
    y = ep(x, **call)
    (y * ws[rank]).sum().backward()
    compare(f"{tag} output", y.detach(), want["y"], failures)
    if x_grad:
        compare(f"{tag} x.grad", x.grad, want["x.grad"], failures)
    for got, w in zip(ep.router.parameters(), want["router"]):
        compare(f"{tag} router.grad", got.grad, w, failures)
    for n, g in gathered_grads(ep, layout, world).items():
        compare(f"{tag} experts.{n}.grad (global)", g, total[n], failures)
    with torch.no_grad():  # the inference path (no autograd Functions) gives the same output
        compare(f"{tag} no_grad output", ep(xs[rank], **call), want["y"], failures)
    return {"counts": counts, "shadowed": list(ep.last_shadowed)}


def scenario_equivalence(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    shares = {}
    for E in (8, world):  # 8: the benchmark shape; world: one expert per rank
        modes = {
            "shadow hot": dict(shadow=ShadowExperts(HOT)),
            "shadow top3": dict(shadow=ShadowTopExperts(3)),
            "shadow last": dict(shadow=ShadowExperts([E - 1])),
            "shadow all": dict(shadow=ShadowTopExperts(E)),
            "shadow default": dict(shadow=True),
            "pairwise": dict(schedule="pairwise"),
            "pairwise+shadow": dict(schedule="pairwise", shadow=ShadowExperts(HOT)),
        }
        if world == 4:
            modes["shadow d=2 2dh"] = dict(shadow=ShadowExperts(HOT), overlap_degree=2, a2a="2dh",
                                           ranks_per_node=2)
        for k, cf in ((2, 0.0), (2, 1.0), (1, 0.0)):
            for skewed in (True, False):
                ref, ep, layout = make_pair(E, k, cf, world, rank, skewed)
                for name, call in modes.items():
                    tag = f"[W={world} E={E} k={k} cf={cf} {'skewed' if skewed else 'uniform'} {name}]"
                    try:
                        a2a_before = ep._ep.stats.exchanges
                        info = check_case(tag, ref, ep, layout, rank, world, skewed, failures, **call)
                        if call.get("schedule") == "pairwise" and ep._ep.stats.exchanges != a2a_before:
                            failures.append(f"{tag}: the all-to-all ran under schedule='pairwise'")
                        forced = call.get("shadow")
                        if isinstance(forced, ShadowExperts) and ep.last_shadowed != sorted(forced.experts):
                            failures.append(f"{tag} last_shadowed={ep.last_shadowed}")
                        if skewed and k == 2 and cf == 0.0 and E == 8:
                            g = [sum(c) for c in zip(*info["counts"])]
                            shares[f"E={E}"] = sum(g[e] for e in HOT) / sum(g)
                            if name == "shadow hot":
                                out.setdefault("load", {})[f"E={E}"] = {
                                    "before": rows_per_rank(info["counts"], layout),
                                    "after": rows_per_rank(info["counts"], layout, info["shadowed"])}
                    except Exception:
                        failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                    cases += 1
    # The last rank's experts get no rows and the input needs no gradient: that rank's backward reaches the
    # exchanges only through the other ranks' expert weights, and must still join them.
    ref, ep, layout = make_pair(8, 2, 0.0, world, rank, True)
    with torch.no_grad():
        for model in (ref, ep):
            model.router.weight[list(layout.experts_of_rank(world - 1)), 0] = -50.0
    for name, call in (("plain", {}), ("shadow hot", dict(shadow=ShadowExperts(HOT))),
                       ("shadow all of rank 0", dict(shadow=ShadowExperts(layout.experts_of_rank(0)))),
                       ("pairwise", dict(schedule="pairwise"))):
        tag = f"[W={world} cold last rank, x without grad, {name}]"
        try:
            info = check_case(tag, ref, ep, layout, rank, world, True, failures, x_grad=False, cold=True, **call)
            if any(c[e] for c in info["counts"] for e in layout.experts_of_rank(world - 1)):
                failures.append(f"{tag}: the last rank's experts got rows")
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
        cases += 1
    # Constructor-level options (not per call).
    ref, ep, layout = make_pair(2 * world, 2, 0.0, world, rank, True, shadow=ShadowExperts([0]),
                                schedule="pairwise")
    check_case("[constructor shadow+pairwise]", ref, ep, layout, rank, world, True, failures)
    if ep.last_shadowed != [0]:
        failures.append(f"constructor shadow: last_shadowed={ep.last_shadowed}")
    cases += 1
    out["failures"], out["cases"], out["hot_share"] = failures, cases, shares


def expect_error(tag: str, failures: list[str], fn, words: tuple[str, ...]) -> None:
    try:
        fn()
        failures.append(f"{tag}: did not raise")
    except ValueError as e:
        if not all(w in str(e) for w in words):
            failures.append(f"{tag}: unclear message: {e}")


class Custom(nn.Module):
    """A custom expert module (one linear per local expert)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(M, M, dtype=torch.float64) for _ in range(n))

    def forward(self, x, counts):
        return torch.cat([lin(p) for lin, p in zip(self.lin, x.split(counts))])


def scenario_errors(rank: int, world: int, out: dict) -> None:
    """Unsupported combinations fail at construction (on every rank) or at the call, with clear messages."""
    failures: list[str] = []
    E = 2 * world
    expect_error("sharded + shadow", failures, lambda: MoELayer(M, world // 2, H, k=1, shadow=True),
                 ("shadow", "whole experts"))
    expect_error("custom + shadow", failures, lambda: MoELayer(M, E, H, experts=Custom(2), shadow=True),
                 ("shadow", "FeedForwardExperts"))
    expect_error("sharded + pairwise", failures, lambda: MoELayer(M, world // 2, H, k=1, schedule="pairwise"),
                 ("pairwise", "whole experts"))
    expect_error("d=2 + pairwise", failures, lambda: MoELayer(M, E, H, overlap_degree=2, schedule="pairwise"),
                 ("pairwise", "overlap_degree"))
    expect_error("bad schedule", failures, lambda: MoELayer(M, E, H, schedule="ring"), ("schedule",))
    moe = MoELayer(M, E, H, k=2)
    x = torch.randn(T, M)
    expect_error("auto + pairwise", failures, lambda: moe(x, parallel="auto", schedule="pairwise"),
                 ("pairwise", "parallel='static'"))
    # A custom expert module works with the pairwise schedule (it only needs the expert protocol).
    moe = MoELayer(M, E, H, k=2, experts=Custom(2), dtype=torch.float64, schedule="pairwise")
    moe(torch.randn(T, M, dtype=torch.float64)).sum().backward()
    if any(p.grad is None for p in moe.experts.parameters()):
        failures.append("custom experts + pairwise: a parameter got no gradient")
    out["failures"] = failures


SCENARIOS = {"equivalence": scenario_equivalence, "errors": scenario_errors}


def main() -> None:
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict = {"rank": rank}
    try:
        for name in scenario.split(","):
            part: dict = {}
            SCENARIOS[name](rank, world, part)
            out.setdefault("failures", []).extend(f"{name}: {f}" for f in part.pop("failures", []))
            out[name] = part
    except Exception:
        out.setdefault("failures", []).append(traceback.format_exc())
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
