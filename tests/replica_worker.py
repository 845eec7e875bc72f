"""One rank of the replicated-expert cases in tests/test_replicas.py (run by flexmoe.launch.spawn_ranks).

The reference is one process holding every expert, running each rank's batch in turn (so its expert gradients
are the sums over the ranks' batches, as the distributed owners' are) with the same starting weights.
"""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from flexmoe import MoELayer
from flexmoe.parallel import ExpertLayout, shard_expert_state, unshard_expert_states
from flexmoe.parallel.placement import ReplicaPlacement, replica_rows_per_rank
from flexmoe.parallel.replicas import replace_experts

M, H, E = 8, 16, 8
HOT = (1, 2, 5)  # the router is biased toward these three experts
ROUTINGS = {
    "topk": dict(k=2),
    "deepseek": dict(k=2, score_func="sigmoid", num_expert_groups=4, num_limited_groups=2, balance="bias",
                     bias_update_rate=0.05),
}


def in_world(check) -> dict:
    """Join the gloo group, run ``check(rank, world)`` (its report), leave the group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        report = check(rank, world)
    except Exception:
        report = {"failures": [traceback.format_exc()]}
    dist.destroy_process_group()
    return {"rank": rank, **report}


def make_pair(routing: str, world: int, rank: int, redundant: int, dtype: torch.dtype):
    """The one-process reference and this rank's layer with ``redundant`` replica slots, same weights."""
    torch.manual_seed(7)
    # router_dtype None: the routing math in the layer's dtype too, so float64 runs compare to float64 rounding.
    opts = dict(capacity_factor=0.0, dtype=dtype, router_dtype=None, **ROUTINGS[routing])
    ref = MoELayer(M, E, H, group="single", **opts)
    with torch.no_grad():
        ref.router.weight[:, 0] = 0.0
        ref.router.weight[list(HOT), 0] = 2.0
    ep = MoELayer(M, E, H, redundant_experts=redundant, **opts)
    ep.router.load_state_dict(ref.router.state_dict())
    local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()},
                               ExpertLayout(E, world, H), rank)
    with torch.no_grad():
        for n, p in ep.experts.named_parameters():
            p.copy_(local[n])
    return ref, ep


def batch(step: int, rank: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens ``[T, M]`` (feature 0 shifted up: the hot experts win) and loss weights."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(tokens, M, generator=g, dtype=torch.float64)
    x[:, 0] += 1.5
    return x.to(dtype), torch.randn(tokens, M, generator=g, dtype=torch.float64).to(dtype)


def global_experts(ep: MoELayer, world: int, grads: bool) -> dict[str, torch.Tensor]:
    """Every rank's expert parameters (or gradients; None is zero), in global ``[E, ...]`` form."""
    mine = {n: (p.grad if grads else p).detach().clone() if (p.grad is not None or not grads)
            else torch.zeros_like(p.detach()) for n, p in ep.experts.named_parameters()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return unshard_expert_states(every, ExpertLayout(E, world, H))


def differ(tag: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> list[str]:
    if got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=atol):
        return []
    err = (got - want).abs().max().item() if got.shape == want.shape else f"shapes {got.shape} {want.shape}"
    return [f"{tag}: max error {err}"]


def gathered_counts(ep: MoELayer, world: int) -> list[list[int]]:
    """Every rank's rows per expert in the layer's last call, ``[W][E]``."""
    counts = [torch.zeros(E, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, torch.tensor(ep.last_plan.counts, dtype=torch.long))
    return [c.tolist() for c in counts]


def hot_placement(world: int) -> ReplicaPlacement:
    """Each rank copies the first two of the hot experts, then the others, that it does not own."""
    per_rank = E // world
    order = list(HOT) + [e for e in range(E) if e not in HOT]
    return ReplicaPlacement(E, tuple(tuple([e for e in order if e // per_rank != r][:2]) for r in range(world)))


def one_call(routing: str, rank: int, world: int, placement: ReplicaPlacement | None) -> dict:
    """One forward and backward in float64 (every rank's batch through the reference): output, input, router
    and global expert gradients; the rows each rank computed against the static layout's."""
    ref, ep = make_pair(routing, world, rank, redundant=2, dtype=torch.float64)
    if placement is not None:
        ep.replicas.slots.copy_(torch.tensor(placement.replicas))
    expert_grads: dict[str, torch.Tensor] = {}
    for j in range(world):
        ref.zero_grad()
        x, w = batch(0, j, 24, torch.float64)
        x.requires_grad_(True)
        y = ref(x)
        (y * w).sum().backward()
        for n, p in ref.experts.named_parameters():
            expert_grads[n] = expert_grads.get(n, 0) + p.grad
        if j == rank:
            want_y, want_x, want_router = y.detach(), x.grad, ref.router.weight.grad.clone()
    x, w = batch(0, rank, 24, torch.float64)
    x.requires_grad_(True)
    y = ep(x)
    (y * w).sum().backward()
    failures: list[str] = []
    failures += differ("output", y.detach(), want_y, 1e-10, 1e-12)
    failures += differ("input gradient", x.grad, want_x, 1e-10, 1e-12)
    failures += differ("router gradient", ep.router.weight.grad, want_router, 1e-10, 1e-12)
    grads = global_experts(ep, world, grads=True)
    for n, want in expert_grads.items():
        failures += differ(f"expert gradient {n}", grads[n], want, 1e-10, 1e-12)
    all_counts = gathered_counts(ep, world)
    used = ep.replicas.placement
    return {"failures": failures, "rows": ep.strategy.last_rows, "slots": [list(s) for s in used.replicas],
            "static_rows": replica_rows_per_rank(all_counts, ReplicaPlacement.unreplicated(E, world)),
            "predicted_rows": replica_rows_per_rank(all_counts, used)}


def check_calls(rank: int, world: int) -> dict:
    """:func:`one_call` for both routings, with the starting placement and with :func:`hot_placement`."""
    failures: list[str] = []
    rows = {}
    for routing in ROUTINGS:
        for name, placement in (("start", None), ("hot", hot_placement(world))):
            report = one_call(routing, rank, world, placement)
            failures += [f"{routing}/{name}: {f}" for f in report.pop("failures")]
            rows[f"{routing}/{name}"] = report
    return {"failures": failures, "rows": rows}


def train(routing: str, rank: int, world: int, steps: int = 20, replace_every: int = 5) -> dict:
    """``steps`` AdamW steps in float64, re-placing every ``replace_every``: every step's loss (summed over
    ranks) and the final weights against the reference's."""
    # float64: AdamW's normalisation and the top-k choice amplify float32 rounding differences over 20 steps
    # beyond any fixed tolerance; in float64 a wrong gradient still shows, a rounding difference does not.
    ref, ep = make_pair(routing, world, rank, redundant=2, dtype=torch.float64)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ep.parameters(), lr=1e-2)
    failures: list[str] = []
    placements, busiest, static_busiest = [], [], []
    start = [list(s) for s in ep.replicas.placement.replicas]
    for step in range(steps):
        ref_opt.zero_grad()
        ref_loss = torch.zeros((), dtype=torch.float64)
        for j in range(world):
            x, w = batch(step + 1, j, 32, torch.float64)
            loss = (ref(x) * w).sum()
            loss.backward()
            ref_loss += loss.detach().double()
        ref_opt.step()
        ref.update_expert_bias()
        opt.zero_grad()
        x, w = batch(step + 1, rank, 32, torch.float64)
        loss = (ep(x) * w).sum()
        loss.backward()
        dist.all_reduce(ep.router.weight.grad)  # the replicated router's gradient over the ranks' batches
        total = loss.detach().double()
        dist.all_reduce(total)
        opt.step()
        ep.update_expert_bias()
        failures += differ(f"step {step} loss", total, ref_loss, 1e-10, 1e-10)
        busiest.append(max(ep.strategy.last_rows))
        static = ReplicaPlacement.unreplicated(E, world)
        static_busiest.append(max(replica_rows_per_rank(gathered_counts(ep, world), static)))
        if (step + 1) % replace_every == 0:
            placements.append([list(s) for s in replace_experts(ep)[0].replicas])
    final = global_experts(ep, world, grads=False)
    for n, p in ref.experts.named_parameters():
        failures += differ(f"final {n}", final[n], p.detach(), 1e-9, 1e-11)
    failures += differ("final router", ep.router.weight.detach(), ref.router.weight.detach(), 1e-9, 1e-11)
    if ep.expert_bias is not None:
        failures += differ("final expert_bias", ep.expert_bias, ref.expert_bias, 1e-9, 1e-11)
    return {"failures": [f"{routing}: {f}" for f in failures], "placements": placements, "busiest": busiest,
            "static_busiest": static_busiest, "start": start}


def calls_main() -> dict:
    return in_world(check_calls)


def train_main() -> dict:
    """:func:`train` with both routings in one group (starting the processes costs more than the steps)."""
    def both(rank: int, world: int) -> dict:
        reports = {routing: train(routing, rank, world) for routing in ROUTINGS}
        return {"failures": [f for rep in reports.values() for f in rep.pop("failures")], **reports}
    return in_world(both)


def distributed_steps(ep: MoELayer, opt: torch.optim.Optimizer, rank: int, steps: range,
                      replace_every: int) -> list[float]:
    """The distributed half of :func:`train` alone: each step's loss summed over the ranks."""
    losses = []
    for step in steps:
        opt.zero_grad()
        x, w = batch(step + 1, rank, 32, torch.float32)
        loss = (ep(x) * w).sum()
        loss.backward()
        dist.all_reduce(ep.router.weight.grad)
        opt.step()
        ep.update_expert_bias()
        total = loss.detach().double()
        dist.all_reduce(total)
        losses.append(float(total))
        if (step + 1) % replace_every == 0:
            replace_experts(ep)
    return losses


class _Saved(torch.nn.Module):
    """A layer as the checkpoint's model: it wants a ``cfg`` with ``to_dict()`` (the apps' models have one)."""

    class cfg:  # noqa: N801 - the attribute name the checkpoint reads
        @staticmethod
        def to_dict() -> dict:
            return {"replica test layer": [M, E, H]}

    def __init__(self, layer: MoELayer) -> None:
        super().__init__()
        self.layer = layer


def resume(rank: int, world: int, run_dir: str) -> dict:
    """12 float32 steps re-placing every 5, against 7 steps, a checkpoint, a fresh model and optimizer loading it
    and 5 more steps (the re-placement at step 10 reads the load window the checkpoint carried): the losses,
    placement and final weights must be bit-identical."""
    from flexmoe.checkpoint import load_checkpoint, save_checkpoint

    _, ep = make_pair("deepseek", world, rank, redundant=2, dtype=torch.float32)
    opt = torch.optim.AdamW(ep.parameters(), lr=1e-2)
    distributed_steps(ep, opt, rank, range(7), 5)
    save_checkpoint(run_dir, model=_Saved(ep), optimizer=opt, step=7)
    dist.barrier()
    window = ep.replicas.load.clone()
    straight = distributed_steps(ep, opt, rank, range(7, 12), 5)

    _, again = make_pair("deepseek", world, rank, redundant=2, dtype=torch.float32)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    checkpoints = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    load_checkpoint(checkpoints[-1], model=_Saved(again), optimizer=again_opt)
    failures = []
    if not torch.equal(again.replicas.load, window) or not window.any():
        failures.append(f"load window {again.replicas.load.tolist()} restored, {window.tolist()} saved")
    resumed = distributed_steps(again, again_opt, rank, range(7, 12), 5)
    if resumed != straight:
        failures.append(f"losses after resuming {resumed} != {straight}")
    if not torch.equal(again.replicas.slots, ep.replicas.slots):
        failures.append(f"placement {again.replicas.slots.tolist()} != {ep.replicas.slots.tolist()}")
    for (n, p), q in zip(ep.named_parameters(), again.parameters()):
        if not torch.equal(p, q):
            failures.append(f"{n} differs after resuming by {(p - q).abs().max().item()}")
    return {"failures": failures, "slots": ep.replicas.slots.tolist()}


def resume_main(run_dir: str) -> dict:
    return in_world(lambda rank, world: resume(rank, world, run_dir))
