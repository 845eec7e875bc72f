"""One rank of tests/test_routing_families_ep.py: the family routing options under expert parallelism.

``python tests/routing_families_worker.py SCENARIO RANK WORLD PORT OUT_JSON`` (run by tests/multiproc.py):
joins a gloo group on 127.0.0.1 and checks, for each case, that this rank's output and gradients equal one
process holding all experts that runs this rank's tokens as its own batch, the expert gradients summed over
every rank's batch; with ``balance="bias"`` the bias moves by the load summed over the ranks, each step.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from flexmoe import MoELayer
from flexmoe.parallel import ExpertLayout, shard_expert_state

M, H, B, S = 8, 8, 2, 6  # model dim, expert hidden (global), sequences and tokens per sequence on each rank
TIMEOUT_S = 20.0
TOL = 1e-9

CASES = {
    "sigmoid": dict(E="many", k=2, score_func="sigmoid"),
    "sigmoid groups + bias balance + scale": dict(E="many", k=3, score_func="sigmoid", num_expert_groups=4,
                                                  num_limited_groups=2, route_scale=2.5, balance="bias",
                                                  bias_update_rate=0.01, shared_experts=1, shared_hidden_dim=6),
    "softmax bias balance": dict(E="many", k=2, balance="bias", bias_update_rate=0.02),
    "shared gate + hidden": dict(E="many", k=2, shared_experts=2, shared_hidden_dim=5, shared_gate=True, glu=True),
    "per-sequence capacity": dict(E="many", k=2, capacity_factor=0.75, capacity_per="sequence",
                                  aux_loss_type="sequence", router_bias=True),
    "glu_limit, sharded experts": dict(E="few", k=1, glu=True, glu_limit=0.4, score_func="sigmoid",
                                       capacity_factor=0.0),
}


def _build(world: int, opts: dict) -> tuple[MoELayer, MoELayer, ExpertLayout]:
    opts = dict(opts)
    E = 8 if opts.pop("E") == "many" else max(world // 2, 1)  # "few": E < W, hidden-dim shards
    opts.setdefault("capacity_factor", 0.0)
    torch.manual_seed(1234)
    ref = MoELayer(M, E, H, group="single", dtype=torch.float64, router_dtype=torch.float64,
                   **{**opts, "bias_update_rate": 0.0})
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.7)
        if ref.expert_bias is not None:
            ref.expert_bias.copy_(torch.linspace(-0.1, 0.1, E, dtype=torch.float64))
    ep = MoELayer(M, E, H, dtype=torch.float64, router_dtype=torch.float64, **opts)
    layout = ExpertLayout(E, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()}, layout,
                               dist.get_rank())
    ref_state = ref.state_dict()
    with torch.no_grad():
        for n, p in ep.named_parameters():
            p.copy_(local[n.split(".", 1)[1]] if n.startswith("experts.") else ref_state[n])
        if ep.expert_bias is not None:
            ep.expert_bias.copy_(ref.expert_bias)
    return ref, ep, layout


def _inputs(world: int, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs, ws = [], []
    for j in range(world):
        g = torch.Generator().manual_seed(100 * step + j)
        xs.append(torch.randn(B, S, M, generator=g, dtype=torch.float64))
        ws.append(torch.randn(B, S, M, generator=g, dtype=torch.float64))
    return xs, ws


def _compare(tag: str, got: torch.Tensor | None, want: torch.Tensor | None, failures: list[str]) -> None:
    if got is None or want is None:
        if not (got is None and want is None):
            failures.append(f"{tag}: one gradient is missing")
        return
    if got.shape != want.shape or not torch.allclose(got, want, rtol=TOL, atol=TOL / 10):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{tag}: mismatch (max err {err})")


def _check_step(tag: str, ref: MoELayer, ep: MoELayer, layout: ExpertLayout, rank: int, world: int, step: int,
                failures: list[str]) -> None:
    xs, ws = _inputs(world, step)
    total: dict[str, torch.Tensor] = {}
    total_load = torch.zeros(ref.num_experts, dtype=torch.float64)
    mine: dict = {}
    for j in range(world):  # one process, each rank's tokens as their own batch
        ref.zero_grad(set_to_none=True)
        x = xs[j].clone().requires_grad_(True)
        y = ref(x)
        ((y * ws[j]).sum() + 0.3 * ref.aux_loss).backward()
        total_load += ref.last_plan.load.double()
        for n, p in ref.experts.named_parameters():
            total[n] = total.get(n, 0) + p.grad
        if j == rank:
            mine = {"y": y.detach(), "x": x.grad, "aux": ref.aux_loss.detach(),
                    "grads": {n: p.grad.clone() for n, p in ref.named_parameters() if not n.startswith("experts.")}}
    bias_before = None if ep.expert_bias is None else ep.expert_bias.clone()
    ep.zero_grad(set_to_none=True)
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    ((y * ws[rank]).sum() + 0.3 * ep.aux_loss).backward()
    _compare(f"{tag} output", y.detach(), mine["y"], failures)
    _compare(f"{tag} aux_loss", ep.aux_loss.detach(), mine["aux"], failures)
    _compare(f"{tag} x.grad", x.grad, mine["x"], failures)
    for n, p in ep.named_parameters():
        if not n.startswith("experts."):
            _compare(f"{tag} {n}.grad", p.grad, mine["grads"][n], failures)
    local = shard_expert_state(total, layout, rank)
    for n, p in ep.experts.named_parameters():
        _compare(f"{tag} experts.{n}.grad", p.grad, local[n], failures)
    if bias_before is not None:
        # The rule written out: b += rate * sign(mean load - load), the load summed over every rank's batch.
        want = bias_before + ep.bias_update_rate * torch.sign(total_load.mean() - total_load)
        if not torch.equal(ep.expert_bias, want):
            failures.append(f"{tag} expert_bias: {ep.expert_bias.tolist()} != {want.tolist()}")
        if torch.equal(want, bias_before):
            failures.append(f"{tag} expert_bias did not move: the case does not test the update")
        with torch.no_grad():
            ref.expert_bias.copy_(want)  # the next step's reference starts from the updated bias


def scenario_families(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    for name, opts in CASES.items():
        try:
            ref, ep, layout = _build(world, opts)
            for step in range(2):
                _check_step(f"[W={world} {name} step {step}]", ref, ep, layout, rank, world, step, failures)
                cases += 1
        except Exception:
            failures.append(f"[{name}] raised:\n{traceback.format_exc()}")
    out["failures"], out["cases"] = failures, cases


SCENARIOS = {"families": scenario_families}


def main() -> None:
    scenario, rank, world, port, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    out: dict = {"rank": rank}
    try:
        SCENARIOS[scenario](rank, world, out)
    except Exception:
        out["failures"] = [traceback.format_exc()]
    with open(path, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
