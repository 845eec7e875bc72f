"""One rank of the multi-process routing tests (tests/test_topology_gate.py, tests/test_routers.py).

``python tests/routing_worker.py SCENARIO RANK WORLD PORT OUT_JSON``: joins a gloo group on 127.0.0.1, runs the
scenario and writes ``{"failures": [...], ...}`` to OUT_JSON. :func:`run_group` starts the W processes.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from multiproc import failures_of, run_ranks  # noqa: F401  (failures_of: for the tests)

M, H = 8, 8
TIMEOUT_S = 20.0


def run_group(scenario: str, world: int, tmp_path: Path, timeout: float = 150) -> list[dict]:
    """Run ``scenario`` of this worker on ``world`` ranks (used by the tests); each rank's report."""
    return run_ranks(__file__, scenario, world, tmp_path, timeout)


# --- the scenarios (run inside each rank) --------------------------------------------------------------------

def scenario_topology(rank: int, world: int, out: dict) -> None:
    """4 ranks as 2 nodes x 2, 8 experts (experts 0-3 on node 0, 4-7 on node 1), k=2: the cross-node bound."""
    from flexmoe import MoELayer
    from flexmoe.routing.plan import top_k
    from test_topology_gate import reference_limit

    failures: list[str] = []
    num_tokens, k, num_experts, node = 40, 2, 8, rank // 2
    expert_node = torch.tensor([e // 4 for e in range(num_experts)])
    for share in (0.0, 0.25, 0.6):  # binding, binding, loose (about half the pairs want the other node)
        torch.manual_seed(0)  # the same router on every rank, as in data-parallel training
        moe = MoELayer(M, num_experts, H, k=k, capacity_factor=0.0, cross_node_share=share, ranks_per_node=2,
                       dtype=torch.float64, router_dtype=torch.float64)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(num_tokens, M, generator=g, dtype=torch.float64, requires_grad=True)
        y = moe(x)
        y.square().sum().backward()
        plan = moe.last_plan
        budget = int(share * num_tokens * k)
        remote = int((expert_node[plan.expert_index] != node).sum())
        # What plain top-k would have sent across, and the gate's choice by the plain loop of the gate test.
        probs = torch.softmax(x.detach() @ moe.router.weight.detach().t(), dim=-1)
        wanted = top_k(probs, k)[1]
        wanted_remote = int((expert_node[wanted] != node).sum())
        want = reference_limit(probs, wanted, expert_node, node, budget)
        tag = f"[share={share}]"
        if remote > budget:
            failures.append(f"{tag} {remote} pairs cross nodes, budget {budget}")
        if remote != min(budget, wanted_remote):
            failures.append(f"{tag} {remote} remote pairs, expected min(budget {budget}, wanted {wanted_remote})")
        if share < 0.5 and wanted_remote <= budget:
            failures.append(f"{tag} the input does not exceed the budget ({wanted_remote} <= {budget}): no test")
        if wanted_remote <= budget and not torch.equal(plan.expert_index, wanted):
            failures.append(f"{tag} within the budget the gate changed the top-k choice")
        if not torch.equal(plan.expert_index, want):
            failures.append(f"{tag} expert choices differ from the plain loop")
        if not (torch.isfinite(x.grad).all() and moe.router.weight.grad is not None):
            failures.append(f"{tag} gradients missing or not finite")
        out.setdefault("remote", {})[str(share)] = [remote, budget, wanted_remote]
    out["failures"] = failures


def scenario_ep(rank: int, world: int, out: dict) -> None:
    """balance="bias" uses the global load; expert choice, BASE and shared experts equal one process per batch."""
    from flexmoe import MoELayer
    from flexmoe.parallel import ExpertLayout, shard_expert_state

    failures: list[str] = []
    num_tokens, num_experts = 12, 4

    # Bias: every rank ends with the same bias, the update of the summed load.
    torch.manual_seed(3)
    moe = MoELayer(M, num_experts, H, k=2, capacity_factor=0.0, balance="bias", bias_update_rate=0.01).train()
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(num_tokens, M, generator=g)
    x[:, 0] += 3.0 * rank  # the ranks see differently skewed tokens
    moe(x)
    moe.update_expert_bias()  # once per optimizer step; the all-reduce of the load happens here
    loads = [torch.zeros(num_experts, dtype=torch.long) for _ in range(world)]
    dist.all_gather(loads, moe.last_plan.load.clone())
    total = torch.stack(loads).sum(0).double()
    want = 0.01 * torch.sign(total.mean() - total)
    if not torch.allclose(moe.expert_bias.double(), want, atol=1e-7):
        failures.append(f"bias {moe.expert_bias.tolist()} != update of the global load {want.tolist()}")
    biases = [torch.zeros(num_experts) for _ in range(world)]
    dist.all_gather(biases, moe.expert_bias.float())
    if any(not torch.equal(b, biases[0]) for b in biases):
        failures.append("ranks hold different biases")
    local_only = 0.01 * torch.sign(moe.last_plan.load.double().mean() - moe.last_plan.load.double())
    out["bias_differs_from_local_rule"] = not torch.allclose(want, local_only)

    # Each rank's output and gradients equal one process holding every expert running this rank's tokens.
    layout = ExpertLayout(num_experts, world, H)
    for kw in ({"router": "expert_choice", "capacity_factor": 1.0}, {"router": "base"},
               {"shared_experts": 2, "capacity_factor": 0.5}):
        tag = str(kw)
        try:
            torch.manual_seed(1234)
            ref = MoELayer(M, num_experts, H, k=2, group="single", dtype=torch.float64, **kw).train()
            ep = MoELayer(M, num_experts, H, k=2, dtype=torch.float64, **kw).train()
            ep.router.load_state_dict(ref.router.state_dict())
            if ref.shared is not None:
                ep.shared.load_state_dict(ref.shared.state_dict())
            local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()}, layout, rank)
            with torch.no_grad():
                for n, p in ep.experts.named_parameters():
                    p.copy_(local[n])
            x = torch.randn(num_tokens, M, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)
            xr, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            yr, ye = ref(xr), ep(xe)
            yr.square().sum().backward()
            ye.square().sum().backward()
            pairs = [("output", ye, yr), ("x.grad", xe.grad, xr.grad),
                     ("router.grad", ep.router.weight.grad, ref.router.weight.grad)]
            if ref.shared is not None:
                # Shared experts are replicated: each rank's gradient is that of its own tokens (DDP averages).
                pairs += [(f"shared.{n}.grad", p.grad, q.grad)
                          for (n, p), q in zip(ep.shared.named_parameters(), ref.shared.parameters())]
            for what, got, want_t in pairs:
                if not torch.allclose(got, want_t, rtol=1e-9, atol=1e-10):
                    failures.append(f"{tag} {what} differs by {(got - want_t).abs().max().item():.3g}")
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
    out["failures"] = failures


SCENARIOS = {"topology": scenario_topology, "ep": scenario_ep}


def main() -> None:
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict = {"rank": rank}
    t0 = time.perf_counter()
    try:
        SCENARIOS[scenario](rank, world, out)
    except Exception:
        out["failures"] = [traceback.format_exc()]
    out["seconds"] = time.perf_counter() - t0
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
