"""One rank of the flexmoe.compat.tutel multi-process tests (run by tests/test_tutel_compat.py).

``python tests/tutel_worker.py SCENARIO OUT_PREFIX``, started by ``flexmoe.launch.spawn_ranks`` (the rendezvous
in torchrun's environment variables); writes ``OUT_PREFIX.RANK.json``. The rank joins through
``system.init_data_model_parallel(backend='gloo')``, as Tutel's examples do, and checks the distributed Tutel
layer against one process holding every expert (built on a group of this rank alone) that runs each rank's
tokens as its own batch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

M, H, T = 8, 12, 12  # model dim, expert hidden, tokens per rank


def tokens(j: int) -> torch.Tensor:
    return torch.randn(T, M, generator=torch.Generator().manual_seed(100 + j), dtype=torch.float64)


def check_layer(rank: int, world: int, standalone, failures: list[str], **case) -> None:
    from flexmoe.compat.tutel import convert, moe

    k, cf, degree, local = case["k"], case["cf"], case.get("degree", 1), case.get("local", 2)
    num_experts = local * world if local > 0 else world // -local
    experts = {"type": "ffn", "num_experts_per_device": local, "hidden_size_per_expert": H,
               "activation_fn": lambda x: F.relu(x)}
    gate = {"type": "top", "k": k, "capacity_factor": cf}
    layer = moe.moe_layer(gate_type=gate, model_dim=M, experts=dict(experts), seeds=(1, rank + 1, 1),
                          a2a_ffn_overlap_degree=degree).double()
    states: list = [None] * world
    dist.all_gather_object(states, {n: t.clone() for n, t in layer.state_dict().items()})
    ref = moe.moe_layer(gate_type=gate, model_dim=M, experts=dict(experts, num_experts_per_device=num_experts),
                        group=standalone, a2a_ffn_overlap_degree=degree).double()
    ref.load_state_dict(convert.flexmoe_to_tutel(convert.tutel_to_flexmoe(states))[0])

    weights = torch.linspace(-1, 1, M, dtype=torch.float64)
    y = layer(tokens(rank))
    ((y * weights).sum() + 0.1 * y.l_aux).backward()

    expert_grads = {n: torch.zeros_like(p) for n, p in ref.experts.named_parameters()}
    for j in range(world):
        ref.zero_grad()
        yj = ref(tokens(j))
        ((yj * weights).sum() + 0.1 * yj.l_aux).backward()
        for n, p in ref.experts.named_parameters():
            expert_grads[n] += p.grad
        if j == rank:
            want_y, want_aux = yj.detach(), yj.l_aux.detach()
            want_gate_grad = ref.gates[0].wg.weight.grad.clone()

    def differs(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = float((got.detach() - want).abs().max())
        if got.shape != want.shape or err > 1e-10:
            failures.append(f"{case}: {what} differs by {err:.3g}")

    differs("output", y, want_y)
    differs("l_aux", y.l_aux, want_aux)
    differs("gate grad", layer.gates[0].wg.weight.grad, want_gate_grad)
    # This rank's piece of the summed gradients, cut as Tutel lays the experts out (whole or hidden slices).
    as_state = {"experts." + n: g for n, g in expert_grads.items()}
    as_state.update({"gates.0.wg.weight": ref.gates[0].wg.weight, "_num_global_experts": torch.tensor(num_experts)})
    mine = convert.flexmoe_to_tutel(convert.tutel_to_flexmoe(as_state), world)[rank]
    for n, p in layer.experts.named_parameters():
        differs(f"expert grad {n}", p.grad, mine["experts." + n])


def check_net(rank: int, world: int, failures: list[str]) -> None:
    from flexmoe.compat.tutel import net

    total = net.simple_all_reduce(torch.tensor([float(rank + 1)]))
    if float(total) != world * (world + 1) / 2:
        failures.append(f"simple_all_reduce gave {float(total)}")
    # all_to_all(x, 1, 0): dim 0 split over ranks, received pieces glued along dim 1 in rank order.
    x = torch.arange(world * 3, dtype=torch.float64).view(world, 3) + 100 * rank
    got = net.all_to_all(x, 1, 0)
    want = torch.cat([torch.arange(world * 3, dtype=torch.float64).view(world, 3)[rank:rank + 1] + 100 * j
                      for j in range(world)], dim=1)
    if not torch.equal(got, want):
        failures.append(f"all_to_all gave {got.tolist()}, expected {want.tolist()}")
    if not torch.equal(net.all_to_all(got, 0, 1), x):
        failures.append("all_to_all(., 0, 1) does not undo all_to_all(., 1, 0)")
    # zero_gather: the full parameter from flat shards; its gradient sums over ranks, then is cut per rank.
    shard = (torch.arange(3, dtype=torch.float64) + 3 * rank).requires_grad_(True)
    full = net.zero_gather(shard, full_shape=[world * 3 - 1])
    if not torch.equal(full.detach(), torch.arange(world * 3 - 1, dtype=torch.float64)):
        failures.append(f"zero_gather gave {full.tolist()}")
    (full * (rank + 1)).sum().backward()
    want_grad = torch.full((3,), world * (world + 1) / 2, dtype=torch.float64)
    if rank == world - 1:
        want_grad[-1] = 0.0  # the padding element is cut away
    if not torch.equal(shard.grad, want_grad):
        failures.append(f"zero_gather grad {shard.grad.tolist()}, expected {want_grad.tolist()}")
    gathered = net.all_gather(torch.full((2, 1), float(rank)), dim=1)
    if gathered.tolist() != [[float(j) for j in range(world)]] * 2:
        failures.append(f"all_gather(dim=1) gave {gathered.tolist()}")
    if not torch.equal(net.spatial_split(gathered, dim=1), torch.full((2, 1), float(rank))):
        failures.append("spatial_split does not undo all_gather")


def main() -> None:
    scenario, prefix = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = f"{prefix}.{rank}.json"
    failures: list[str] = []
    checked = 0
    try:
        from flexmoe.compat.tutel import system

        env = system.init_data_model_parallel(backend="gloo")
        if (env.global_rank, env.global_size, env.is_distributed) != (rank, world, True):
            failures.append(f"init_data_model_parallel gave rank {env.global_rank} of {env.global_size}")
        standalone = system.create_standalone_group()
        if scenario == "layer":
            for case in (dict(k=2, cf=1.0), dict(k=2, cf=0.5), dict(k=1, cf=0.0), dict(k=2, cf=-0.5, degree=2),
                         dict(k=1, cf=1.0, local=-world), dict(k=2, cf=0.5, local=-1), dict(k=1, cf=1.0, local=-1)):
                check_layer(rank, world, standalone, failures, **case)
                checked += 1
            check_net(rank, world, failures)
        else:
            failures.append(f"unknown scenario {scenario!r}")
    except Exception:
        failures.append(traceback.format_exc())
    with open(out, "w") as f:
        json.dump({"rank": rank, "failures": failures, "checked": checked}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
