"""One rank of tests/test_routing_replay.py's 2-rank case (run by flexmoe.launch.spawn_ranks): routing replay under
expert parallelism equals one process.

Every rank builds the single-process reference holding all experts and its expert-parallel layer with the same
global weights (scenario_worker.make_pair), both in training mode with exploration noise and a selection bias.
The reference runs each rank's tokens as its own batch while recording, under one bias; the expert-parallel layer
then replays this rank's record (after a torch.save / torch.load round trip) under another bias, with the same
noise: where its own router would choose otherwise, its output and gradients are the recording forward's.
"""

from __future__ import annotations

import io

from hf_ep_worker import _in_world


def rank_main() -> dict:
    return _in_world(_check_replay)


def _check_replay(rank: int, world: int) -> list[str]:
    import torch

    from flexmoe import record_routing, replay_routing
    from scenario_worker import EP_TOKENS, compare, gathered_grads, inputs, make_pair

    failures: list[str] = []
    both = dict(gate_noise=0.3, jitter=0.05, balance="bias", bias_update_rate=0.0)
    ref, ep, layout = make_pair(4, 2, 1.0, world, rank, both=both)
    ref.train()
    ep.train()
    bias = torch.tensor([0.5, -0.2, 0.1, -0.4])
    with torch.no_grad():
        ref.expert_bias.copy_(bias)
        ep.expert_bias.copy_(-bias)
    xs, ws = inputs(world, EP_TOKENS)

    want_expert_grads: dict[str, torch.Tensor] = {}
    for j, (x, w) in enumerate(zip(xs, ws)):  # the recording forwards, one process, each rank's tokens
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        torch.manual_seed(50 + j)
        with record_routing(ref) as record:
            y = ref(x)
        (y * w).sum().backward()
        for n, p in ref.experts.named_parameters():
            want_expert_grads[n] = want_expert_grads.get(n, 0) + p.grad
        if j == rank:
            buffer = io.BytesIO()
            torch.save(record, buffer)
            mine = {"y": y.detach(), "x.grad": x.grad, "router": ref.router.weight.grad.clone(),
                    "record": buffer.getvalue()}
    record = torch.load(io.BytesIO(mine["record"]), weights_only=True)
    chosen = record.calls[""][0]

    x = xs[rank].clone().requires_grad_(True)
    torch.manual_seed(50 + rank)
    with torch.no_grad():
        ep(x)
    if torch.equal(ep.last_plan.expert_index, chosen):
        failures.append(f"rank {rank}: the other bias left the router's choice as recorded: the case tests nothing")

    torch.manual_seed(50 + rank)
    with replay_routing(ep, record):
        y = ep(x)
    (y * ws[rank]).sum().backward()
    if not torch.equal(ep.last_plan.expert_index, chosen):
        failures.append(f"rank {rank}: the replayed layer did not take the recorded experts")
    compare(f"rank {rank} output", y.detach(), mine["y"], failures)
    compare(f"rank {rank} input grad", x.grad, mine["x.grad"], failures)
    compare(f"rank {rank} router grad", ep.router.weight.grad, mine["router"], failures)
    for n, grad in gathered_grads(ep, layout, world).items():
        compare(f"rank {rank} expert grad {n}", grad, want_expert_grads[n], failures)
    return failures
