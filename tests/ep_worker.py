"""One rank of the expert-parallel tests (run by tests/test_expert_parallel.py as W real processes).

``python tests/ep_worker.py SCENARIO RANK WORLD PORT OUT_JSON``: joins a gloo group on 127.0.0.1, runs the
scenario and writes ``{"failures": [...], ...}`` to OUT_JSON. Many cases run inside one group, because
starting processes (importing torch) costs seconds.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from flexmoe import MoELayer
from flexmoe.parallel import (
    CollectiveError,
    ConfigMismatchError,
    ExpertLayout,
    shard_expert_state,
    wrap_ddp,
)

M, H, T = 8, 8, 12  # tiny: model dim, expert hidden (global), tokens per rank
TIMEOUT_S = 6.0


def make_pair(E: int, k: int, cf: float, world: int, rank: int, **kw):
    """A single-process reference holding all experts and the distributed layer with the same weights."""
    torch.manual_seed(1234)
    ref = MoELayer(M, E, H, k=k, capacity_factor=cf, group="single", dtype=torch.float64)
    ep = MoELayer(M, E, H, k=k, capacity_factor=cf, dtype=torch.float64, **kw)
    ep.router.load_state_dict(ref.router.state_dict())
    layout = ExpertLayout(E, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()}, layout, rank)
    with torch.no_grad():
        for n, p in ep.experts.named_parameters():
            p.copy_(local[n])
    return ref, ep, layout


def inputs(rank: int, world: int):
    xs, ws = [], []
    for j in range(world):
        g = torch.Generator().manual_seed(100 + j)
        xs.append(torch.randn(T, M, generator=g, dtype=torch.float64))
        ws.append(torch.randn(T, M, generator=g, dtype=torch.float64))
    return xs, ws


def reference(ref: MoELayer, xs, ws, rank: int):
    """Each rank's tokens as their own batch: this rank's output, input and router grads; expert grads
    summed over every rank's batch (what the distributed experts receive through the all-to-all)."""
    total: dict[str, torch.Tensor] = {}
    mine = {}
    for j, (x, w) in enumerate(zip(xs, ws)):
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        y = ref(x)
        (y * w).sum().backward()
        for n, p in ref.experts.named_parameters():
            total[n] = total.get(n, 0) + p.grad
        if j == rank:
            mine = {"y": y.detach(), "x.grad": x.grad, "router": [p.grad.clone() for p in ref.router.parameters()]}
    return mine, total


def compare(tag: str, got: torch.Tensor, want: torch.Tensor, failures: list[str], tol: float = 1e-9) -> None:
    # float64 experts; the routing math runs in float32 (router_dtype), whose gradients sum in another order.
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol / 10):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{tag}: mismatch (max err {err}, shapes {tuple(got.shape)} vs {tuple(want.shape)})")


def check_case(tag, ref, ep, layout, rank, world, failures, **call):
    xs, ws = inputs(rank, world)
    want, total = reference(ref, xs, ws, rank)
    ep.zero_grad(set_to_none=True)
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x, **call)
    (y * ws[rank]).sum().backward()
    compare(f"{tag} output", y.detach(), want["y"], failures)
    compare(f"{tag} x.grad", x.grad, want["x.grad"], failures)
    for got, w in zip(ep.router.parameters(), want["router"]):
        compare(f"{tag} router.grad", got.grad, w, failures)
    local = shard_expert_state(total, layout, rank)
    for n, p in ep.experts.named_parameters():
        compare(f"{tag} experts.{n}.grad", p.grad, local[n], failures)


def scenario_equivalence(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    if world == 2:
        experts = [4, 2, 1]
        a2as = [("flat", None), ("2dh", 1), ("2dh", 2)]
    else:
        experts = [8, 2, 1]
        a2as = [("flat", None), ("2dh", 2)]
    for E in experts:
        for k in (1, 2):
            if k > E:
                continue
            for cf in (1.0, 0.0):
                ref, ep, layout = make_pair(E, k, cf, world, rank)
                valid_r = ep._ep.valid_r()
                for r in valid_r:
                    for d in ((1,) if r == 0 else (1, 2, 4)):
                        for a2a, g in (a2as[:1] if r == 0 else a2as):
                            tag = f"[W={world} E={E} k={k} cf={cf} r={r} d={d} a2a={a2a}/{g}]"
                            try:
                                check_case(tag, ref, ep, layout, rank, world, failures,
                                           r=r, overlap_degree=d, a2a=a2a, ranks_per_node=g)
                            except Exception:
                                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                            cases += 1
    # Constructor-level settings (not per call), and an invalid r with a clear error.
    ref, ep, layout = make_pair(world // 2, 1, 0.0, world, rank, r=2, overlap_degree=2, a2a="2dh",
                                ranks_per_node=2)  # experts sharded in 2
    check_case("[constructor r=2 d=2 2dh]", ref, ep, layout, rank, world, failures)
    cases += 1
    try:
        ep(torch.randn(T, M, dtype=torch.float64), r=3)
        failures.append("r=3 did not raise")
    except ValueError as e:
        if "valid r" not in str(e):
            failures.append(f"r=3 error unclear: {e}")
    out["failures"], out["cases"] = failures, cases


def scenario_auto(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    ref, ep, layout = make_pair(2 * world, 2, 0.0, world, rank, parallel="auto")
    for step in range(12):
        try:
            check_case(f"[auto step {step}]", ref, ep, layout, rank, world, failures)
        except Exception:
            failures.append(f"auto step {step} raised:\n{traceback.format_exc()}")
    if not ep.auto_decisions:
        failures.append("auto made no decision in 12 steps")
    out["failures"] = failures
    out["choice"] = str(ep.last_choice)
    out["decisions"] = [d.describe() for d in ep.auto_decisions]


def scenario_ddp(rank: int, world: int, out: dict) -> None:
    """A 2-rank DDP step equals the single-process step on the same global batch (dropless routing)."""
    failures: list[str] = []

    def build(group):
        torch.manual_seed(7)
        return torch.nn.Sequential(
            torch.nn.Linear(M, M, dtype=torch.float64),
            MoELayer(M, 4, H, k=2, capacity_factor=0.0, group=group, dtype=torch.float64),
            torch.nn.Linear(M, 1, dtype=torch.float64),
        )

    ref = build("single")
    model = build(None)
    layout = ExpertLayout(4, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref[1].experts.named_parameters()}, layout, rank)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            p.copy_(local[n.rsplit(".", 1)[1]] if ".experts." in n else ref_params[n])
    ddp = wrap_ddp(model)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(world * T, M, generator=g, dtype=torch.float64)
    ts = torch.randn(world * T, 1, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        mine = slice(rank * T, (rank + 1) * T)
        loss = torch.nn.functional.mse_loss(ddp(xs[mine]), ts[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = torch.nn.functional.mse_loss(ref(xs), ts)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    want = shard_expert_state({n: p.detach() for n, p in ref[1].experts.named_parameters()}, layout, rank)
    for n, p in model[1].experts.named_parameters():
        compare(f"ddp experts.{n}", p.detach(), want[n], failures, tol=1e-7)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if ".experts." not in n:
            compare(f"ddp {n}", p.detach(), q.detach(), failures, tol=1e-7)
    out["failures"] = failures


def scenario_mismatch(rank: int, world: int, out: dict) -> None:
    t0 = time.perf_counter()
    try:
        MoELayer(M, 2 * world, H + 8 * rank, k=2)
        out["failures"] = ["mismatched hidden_dim did not raise"]
    except ConfigMismatchError as e:
        msg = str(e)
        out["failures"] = [] if "hidden_dim" in msg and "rank 1" in msg else [f"unclear message: {msg}"]
    out["seconds"] = time.perf_counter() - t0


def scenario_dead_rank(rank: int, world: int, out: dict) -> None:
    moe = MoELayer(M, 2 * world, H, k=2)
    if rank == world - 1:
        os._exit(0)  # exits early, without a word
    t0 = time.perf_counter()
    try:
        moe(torch.randn(T, M)).sum().backward()
        out["failures"] = ["forward with a dead rank did not raise"]
    except CollectiveError as e:
        out["failures"] = [] if "timeout" in str(e) else [f"unclear message: {e}"]
        out["message"] = str(e)[:300]
    out["seconds"] = time.perf_counter() - t0


def scenario_stalled_rank(rank: int, world: int, out: dict) -> None:
    moe = MoELayer(M, 2 * world, H, k=2)
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 1)  # alive but never joins the collective
        out["failures"] = []
        return
    t0 = time.perf_counter()
    try:
        moe(torch.randn(T, M))
        out["failures"] = ["forward with a stalled rank did not raise"]
    except CollectiveError as e:
        out["failures"] = []
        out["message"] = str(e)[:300]
    out["seconds"] = time.perf_counter() - t0


def scenario_no_leak(rank: int, world: int, out: dict) -> None:
    """After forward+backward steps nothing of an exchange stays alive (an exchange that referenced its own
    autograd node's output formed a cycle through C++ that no collector frees: ~20 MB per step leaked)."""
    import gc

    from flexmoe.parallel.alltoall import PendingExchange

    failures: list[str] = []
    moe = MoELayer(M, 2 * world, H, k=2, dtype=torch.float64)
    x = torch.randn(T, M, dtype=torch.float64, requires_grad=True)
    for d, a2a, g in ((1, "flat", None), (2, "flat", None), (2, "2dh", 2 if world == 4 else 1)):
        for _ in range(3):
            moe(x, overlap_degree=d, a2a=a2a, ranks_per_node=g).sum().backward()
        gc.collect()
        alive = sum(isinstance(o, PendingExchange) for o in gc.get_objects())
        if alive:
            failures.append(f"d={d} a2a={a2a}: {alive} exchanges still alive after the steps")
    out["failures"] = failures


SCENARIOS = {
    "no_leak": scenario_no_leak,
    "equivalence": scenario_equivalence,
    "auto": scenario_auto,
    "ddp": scenario_ddp,
    "mismatch": scenario_mismatch,
    "dead_rank": scenario_dead_rank,
    "stalled_rank": scenario_stalled_rank,
}


def main() -> None:
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict = {"rank": rank}
    try:
        SCENARIOS[scenario](rank, world, out)
    except Exception:
        out["failures"] = [traceback.format_exc()]
    with open(path, "w") as f:
        json.dump(out, f)
    if scenario not in ("dead_rank", "stalled_rank"):
        dist.destroy_process_group()
    os._exit(0)  # skip teardown (a dead peer would make it wait)


if __name__ == "__main__":
    main()
