"""Muon over 2 real gloo ranks (tests/test_muon.py runs them): DTensor parameters in each layout Muon meets,
stepped exactly as torch.optim.Muon steps each whole matrix in one process; and the GPT laid out by
flexmoe.sharding.parallelize (expert parallelism, FSDP2) training with MuonWithAdamW as one process does."""

from __future__ import annotations

import datetime
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def rank_main(case: str) -> dict:
    """Join the gloo group, run ``CASES[case](rank, world)`` (its failures, or its traceback), leave the group."""
    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        failures = CASES[case](rank, world)
    except Exception:
        failures = [traceback.format_exc()]
    dist.destroy_process_group()
    return {"rank": rank, "failures": failures}


# ---------------------------------------------------------------------------------- DTensor layouts


# (global shape, the dim FSDP2 shards, last_dim_parts, the path Muon takes)
LAYOUTS = [
    ((4, 16, 24), 0, 1, "local: whole experts per rank"),
    ((4, 8, 24), 0, 2, "local: gate_up, whole experts per rank"),
    ((24, 16), 0, 1, "gathered: a matrix's rows split"),
    ((1, 16, 24), 1, 1, "gathered: one expert split inside its matrix"),
    ((1, 8, 24), 2, 2, "gathered: a gate_up split along its pair's dim"),
]


def per_matrix(t: Tensor, parts: int) -> list[Tensor]:
    """The matrices torch.optim.Muon would see as parameters of their own: each expert, each half."""
    stacks = t.chunk(parts, dim=-1) if parts > 1 else (t,)
    return [m for s in stacks for m in (s if s.dim() == 3 else [s])]


def dtensor_layouts(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from flexmoe.optim import Muon

    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for shape, dim, parts, what in LAYOUTS:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(11))
        param = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(dim)]))
        ours = Muon([{"params": [param], "last_dim_parts": parts}], lr=0.02)
        singles = [nn.Parameter(m.clone()) for m in per_matrix(full, parts)]
        theirs = torch.optim.Muon(singles, lr=0.02)
        for step in range(3):
            grad = torch.randn(shape, generator=torch.Generator().manual_seed(50 + step))
            param.grad = distribute_tensor(grad, mesh, [Shard(dim)])
            for p, g in zip(singles, per_matrix(grad, parts)):
                p.grad = g.clone()
            ours.step()
            theirs.step()
        got = param.detach().full_tensor()
        want = per_matrix_inverse([p.detach() for p in singles], shape, parts)
        if not torch.equal(got, want):
            failures.append(f"{what} {shape} Shard({dim}): differs from torch.optim.Muon per matrix by "
                            f"{(got - want).abs().max().item():.3g}")
        buf = ours.state[param]["momentum_buffer"]
        if not (isinstance(buf, DTensor) and buf.placements == param.placements):
            failures.append(f"{what}: the momentum buffer is not sharded as its parameter: {type(buf).__name__}")
    failures += hidden_shards_refused()
    return failures


def hidden_shards_refused() -> list[str]:
    """One expert over 2 ranks (each a half of its hidden units): no rank holds a matrix to orthogonalise."""
    from flexmoe import MoELayer
    from flexmoe.optim import muon_param_groups

    layer = MoELayer(8, 1, 16, k=1, capacity_factor=0.0)  # expert parallelism over the world
    try:
        muon_param_groups(layer)
    except ValueError as e:
        return [] if "2 hidden shards" in str(e) else [f"hidden shards: the error does not say why: {e}"]
    return ["hidden shards: muon_param_groups took experts split inside their matrices"]


def per_matrix_inverse(matrices: list[Tensor], shape: tuple[int, ...], parts: int) -> Tensor:
    """:func:`per_matrix`'s list back into one tensor of ``shape``."""
    if len(shape) == 2:
        return matrices[0]
    per_part = [torch.stack(matrices[i * shape[0]:(i + 1) * shape[0]]) for i in range(parts)]
    return torch.cat(per_part, dim=-1)


# ---------------------------------------------------------------------------------- parallelize + training


LR = 1e-2
STEPS = 4
# bf16 Newton-Schulz of gradients summed in another order than one process's: an element may round to the next
# bf16 value (measured: 6.3e-4 at most after 4 steps); the steps change the weights by ~1e-2 per element.
TOL = 2e-3


def train(model: nn.Module, batches: Callable[[int], list[tuple[Tensor, Tensor]]]) -> list[float]:
    from flexmoe import update_expert_biases
    from flexmoe.optim import MuonWithAdamW, muon_param_groups
    from flexmoe.sharding import split_expert_groups

    opt = MuonWithAdamW(split_expert_groups(model, muon_param_groups(model, head=model.head)), lr=LR,
                        adjust_lr_fn="match_rms_adamw", adamw_eps=1e-4, foreach=True)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        parts = batches(step)
        total = torch.zeros(())
        for x, y in parts:
            _, loss = model(x, y)
            total = total + (loss + model.regularization_loss()) / len(parts)
        total.backward()
        update_expert_biases(model)
        opt.step()
        losses.append(total.item())
    return losses


def parallelized_gpt(rank: int, world: int) -> list[str]:
    from torch.distributed.tensor import DTensor

    from flexmoe.sharding import make_mesh, parallelize
    from fsdp_worker import batch, expected_shard, gpt

    failures = []
    ref = gpt()
    ref_losses = train(ref, lambda step: [batch(step, r) for r in range(world)])
    for sizes in (dict(ep=2), dict(ep=1, dp_shard=2)):
        tag = "x".join(f"{k}={v}" for k, v in sizes.items())
        model = parallelize(gpt(), make_mesh(**sizes))
        mine = train(model, lambda step: [batch(step, rank)])
        want = torch.tensor(ref_losses)
        mean = torch.tensor(mine)  # each rank's loss is its own batch's; their mean is the reference's
        dist.all_reduce(mean)
        mean /= world
        if not torch.allclose(mean, want, rtol=TOL, atol=TOL):
            failures.append(f"{tag}: mean losses {mean} differ from one process's {want}")
        for name, p in model.named_parameters():
            full = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            expected = expected_shard(ref, name, sizes["ep"], rank % sizes["ep"])
            if not torch.allclose(full, expected, rtol=TOL, atol=TOL):
                failures.append(f"{tag}: {name} differs by {(full - expected).abs().max().item():.3g}")
    return failures


CASES: dict[str, Callable[[int, int], list[str]]] = {"dtensor_layouts": dtensor_layouts,
                                                      "parallelized_gpt": parallelized_gpt}
