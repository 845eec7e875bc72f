"""One rank of the 2-rank flexmoe.hf case in tests/test_hf_convert.py (run by flexmoe.launch.spawn_ranks)."""

from __future__ import annotations

import copy
import datetime
import traceback
from collections.abc import Callable


def rank_main(families: list[str]) -> dict:
    """Convert the same tiny HF model on every rank with the world as expert-parallel group; report failures."""
    return _in_world(lambda rank, world: [f for family in families for f in _check_family(family, rank, world)])


def _in_world(check: Callable[[int, int], list[str]]) -> dict:
    """Join the gloo group, run ``check(rank, world)`` (its failures, or its traceback), leave the group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        failures = check(rank, world)
    except Exception:
        failures = [traceback.format_exc()]
    dist.destroy_process_group()
    return {"rank": rank, "failures": failures}


def _output_failures(label: str, got, want) -> list[str]:
    """A model output's logits and loss against HF's, to float32 rounding."""
    import torch

    failures = []
    if not torch.allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5):
        failures.append(f"{label}: logits differ by {float((got.logits - want.logits).abs().max())}")
    if not torch.allclose(got.loss, want.loss, rtol=1e-5, atol=1e-6):
        failures.append(f"{label}: loss {float(got.loss)} != {float(want.loss)}")
    return failures


def _check_family(family: str, rank: int, world: int) -> list[str]:
    import torch

    import flexmoe.hf as fh
    from flexmoe.hf.block import ConvertedMoeBlock
    from flexmoe.hf.families import expert_weights
    from test_hf_convert import batches, tiny_model

    failures: list[str] = []
    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref))  # group=None: the world
    blocks = [m for m in model.modules() if isinstance(m, ConvertedMoeBlock)]
    for b in blocks:
        e = b.moe.num_experts
        if b.moe.experts.w1.shape[0] != e // world or not b.moe.ep_group.distributed:
            failures.append(f"{family}: rank {rank} holds {b.moe.experts.w1.shape[0]} of {e} experts")
        # This rank's slice is global experts rank*E/W ..: compare with HF's own weights.
        mine = slice(rank * e // world, (rank + 1) * e // world)
        hf_layer = _hf_block_of(ref, b, model)
        for name, full in expert_weights(hf_layer.experts).items():
            if not torch.equal(getattr(b.moe.experts, name), full[mine]):
                failures.append(f"{family}: rank {rank} {name} is not global experts {mine}")
    ids = batches(world, seed=13)[rank]  # each rank its own tokens
    got = model(ids, labels=ids, output_router_logits=True)
    want = ref(ids, labels=ids, output_router_logits=True)
    failures += _output_failures(family, got, want)
    got.loss.backward()  # the all-to-all runs backward too
    # Mark each rank's experts, export: the gathered HF tensors put every rank's experts in place.
    with torch.no_grad():
        for b in blocks:
            b.moe.experts.w2.add_(rank + 1)
    fh.to_hf(model)
    exported, original = dict(model.named_parameters()), dict(ref.named_parameters())
    for name, p in exported.items():
        if name.endswith(".mlp.experts.down_proj"):
            e = p.shape[0]
            shift = torch.arange(e).div(e // world, rounding_mode="floor").add(1).view(-1, 1, 1).to(p.dtype)
            if not torch.allclose(p, original[name] + shift):
                failures.append(f"{family}: exported {name} is not every rank's experts in order")
        elif not torch.equal(p, original[name]):
            failures.append(f"{family}: exported {name} differs from the original")
    return failures


def _hf_block_of(ref, converted_block, model):
    for name, module in model.named_modules():
        if module is converted_block:
            return ref.get_submodule(name)
    raise LookupError("converted block not found")


def switch_rank_main() -> dict:
    """Switch Transformers converted over the world: each rank holds E / W experts (HF's own, per expert), computes
    HF's logits and losses on its own tokens, and ``to_hf`` gathers every rank's experts back in order."""
    return _in_world(_check_switch)


def _check_switch(rank: int, world: int) -> list[str]:
    import torch

    import flexmoe.hf as fh
    from flexmoe.hf.block import ConvertedMoeBlock
    from test_hf_convert import batches, tiny_switch

    failures: list[str] = []
    ref = tiny_switch(seed=3).eval()
    model = fh.convert(copy.deepcopy(ref))  # group=None: the world
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, ConvertedMoeBlock)]
    for name, b in blocks:
        per_rank = b.moe.num_experts // world
        for local in range(per_rank):
            hf_expert = ref.get_submodule(name).experts[f"expert_{rank * per_rank + local}"]
            if not (torch.equal(b.moe.experts.w1[local], hf_expert.wi.weight.T)
                    and torch.equal(b.moe.experts.w2[local], hf_expert.wo.weight.T)):
                failures.append(f"switch: rank {rank} local expert {local} is not HF's expert "
                                f"{rank * per_rank + local} of {name}")
    ids = batches(world, seed=13)[rank]  # each rank its own tokens
    got = model(input_ids=ids, labels=ids.flip(-1), output_router_logits=True)
    want = ref(input_ids=ids, labels=ids.flip(-1), output_router_logits=True)
    if not all(int(b.moe.last_plan.num_dropped) > 0 for _, b in blocks):
        failures.append("switch: the capacity dropped nothing on some rank, so the case does not test it")
    failures += _output_failures("switch", got, want)
    got.loss.backward()  # the all-to-all runs backward too
    with torch.no_grad():
        for _, b in blocks:
            b.moe.experts.w2.add_(rank + 1)  # mark each rank's experts
    fh.to_hf(model)
    for name, _ in blocks:
        exported, original = model.get_submodule(name).experts, ref.get_submodule(name).experts
        for e in range(len(original)):
            shift = e // (len(original) // world) + 1
            if not torch.allclose(exported[f"expert_{e}"].wo.weight, original[f"expert_{e}"].wo.weight + shift):
                failures.append(f"switch: exported {name}.experts.expert_{e} is not rank {shift - 1}'s")
    return failures


def save_rank_main(families: list[str], directory: str) -> dict:
    """Train each family's converted model with experts over the ranks, save it with ``save_pretrained``
    midway (no ``to_hf``), load it back, train on: checked against HF's model trained in one process on the
    whole batch (each rank gets its rows, ``wrap_ddp`` averages the rest); report failures."""
    return _in_world(lambda rank, world: [f for family in families
                                          for f in _save_and_continue(family, rank, world, f"{directory}/{family}")])


def _save_and_continue(family: str, rank: int, world: int, directory: str) -> list[str]:
    import torch
    import torch.distributed as dist

    import flexmoe.hf as fh
    from flexmoe.sharding import wrap_ddp
    from test_hf_convert import batches
    from test_hf_save import hf_model, plain_from_pretrained

    failures: list[str] = []

    def differ(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            failures.append(f"{family}: {what} differs by {float((got - want).abs().max())}")

    ref = hf_model(family)  # HF's model, one process, every expert, the whole batch
    model = fh.convert(copy.deepcopy(ref))  # group=None: the world
    # HF's Switch model (tie_word_embeddings=False) keeps a `shared.weight` that no forward uses: DDP must know.
    ddp = wrap_ddp(model, find_unused_parameters=family == "switch_transformers")
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    data = batches(6, seed=21, batch=2 * world)
    mine = slice(rank * 2, rank * 2 + 2)

    nets = [(ddp, opt, mine), (ref, ref_opt, slice(None))]

    def step(ids: torch.Tensor) -> None:
        for net, optimizer, rows in nets:
            x = ids[rows]
            net(x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    for ids in data[:3]:
        step(ids)
    # Every rank saves (the state dict gathers the experts), rank 0 writes.
    model.save_pretrained(directory, is_main_process=rank == 0)
    dist.barrier()
    probe = batches(1, seed=8)[0]
    plain = plain_from_pretrained(family, directory).eval()
    ref.eval()
    with torch.no_grad():  # the labels give Switch's decoder its input; a causal LM's logits ignore them
        want = ref(probe, labels=probe).logits
        differ("plain from_pretrained's logits", plain(probe, labels=probe).logits, want)
    ref_state = ref.state_dict()
    for name, tensor in plain.state_dict().items():
        differ(f"saved {name}", tensor, ref_state[name])
    # HF's full state dict loads into a model converted over the ranks: each rank takes its slice.
    other = fh.convert(hf_model(family, seed=9))
    other.load_state_dict(plain.state_dict(), strict=True)
    other.eval()
    with torch.no_grad():
        differ("reloaded converted model's logits", other(probe, labels=probe).logits, want)
    # Training goes on with the same optimizer: the saved model's parameters were the live ones.
    model.train()
    ref.train()
    for ids in data[3:]:
        step(ids)
    final = model.state_dict()  # every rank: gathered, in HF's names
    for name, tensor in ref.state_dict().items():
        differ(f"trained on after the save: {name}", final[name], tensor)
    nets.clear()
    del ddp  # DDP holds the process group: free it before the group is destroyed
    return failures
