"""One rank of the 2-rank LoRA-on-experts case in tests/test_hf_peft.py (run by flexmoe.launch.spawn_ranks).

Every rank holds half of the experts and the matching slice of one single-process adapter's LoRA factors; its
outputs and LoRA gradients must be the single-process layer's (the gradients summed over both ranks' losses).
"""

from __future__ import annotations

import copy
import datetime
import traceback


def rank_main() -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    failures: list[str] = []
    try:
        failures += _check_bare_layer(rank, world)
        failures += _check_converted_model(rank, world)
    except Exception:
        failures.append(traceback.format_exc())
    dist.destroy_process_group()
    return {"rank": rank, "failures": failures}


def _lora(model, targets):
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=targets,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _copy_factor_slices(single, sharded, mine) -> None:
    """Give the expert-parallel adapter ``sharded`` this rank's experts ``mine`` of adapter ``single``'s factors:
    ``lora_A [r*E, in]`` is ``[E, r, in]`` by rows, ``lora_B [out, r*E]`` is ``[out, r, E]``."""
    import torch

    full = dict(single.named_parameters())
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            if "lora_A" in name:
                a = full[name]
                p.copy_(a.reshape(-1, 2, a.shape[-1])[mine].reshape(p.shape))
            elif "lora_B" in name:
                b = full[name]
                p.copy_(b.reshape(b.shape[0], 2, -1)[:, :, mine].reshape(p.shape))


def _lora_grads_match(single, sharded, mine, what: str) -> list[str]:
    import torch

    full = {name: p.grad for name, p in single.named_parameters() if "lora_" in name}
    failures = []
    for name, p in sharded.named_parameters():
        if "lora_" not in name:
            continue
        g = full[name]
        want = g.reshape(-1, 2, g.shape[-1])[mine] if "lora_A" in name else g.reshape(g.shape[0], 2, -1)[:, :, mine]
        if p.grad is None or not torch.allclose(p.grad, want.reshape(p.shape), rtol=1e-4, atol=1e-6):
            failures.append(f"{what}: {name} gradient differs from the single-process adapter's")
    return failures


def _check_bare_layer(rank: int, world: int) -> list[str]:
    import torch
    from torch import nn

    from flexmoe import MoELayer
    from flexmoe.parallel import ShadowExperts

    class TowardsRankZero(nn.Module):
        """Logits preferring experts 0 and 1 (rank 0's) for every token: rank 1's experts get no rows."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.new_tensor([5.0, 4.0, 0.0, 0.0]).expand(x.shape[0], 4)

    failures: list[str] = []
    experts_per_rank = 4 // world
    mine = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    xs = torch.randn(world, 12, 8, generator=torch.Generator().manual_seed(3))
    cases = [("token exchange", None, {}), ("pairwise", None, {"schedule": "pairwise"}), ("gathered", None, {"r": 0}),
             ("shadowed expert 1", None, {"shadow": ShadowExperts([1])}), ("a rank without rows", TowardsRankZero, {})]
    for what, router, call in cases:
        torch.manual_seed(0)
        options = dict(k=2, glu=True, activation="silu", bias=False, capacity_factor=0.0)
        if router is not None:
            options["router"] = router()
        single = MoELayer(8, 4, 16, group="single", **options)
        sharded = MoELayer(8, 4, 16, **copy.deepcopy(options))
        with torch.no_grad():
            for name, p in sharded.named_parameters():
                full = single.get_parameter(name)
                p.copy_(full[mine] if name.startswith("experts.") else full)
        torch.manual_seed(1)
        single_lora = _lora(single, ["experts.w1", "experts.w2", "experts.w3"])
        sharded_lora = _lora(sharded, ["experts.w1", "experts.w2", "experts.w3"])
        _copy_factor_slices(single_lora, sharded_lora, mine)
        y = sharded_lora(xs[rank], **call)  # the input needs no gradient: only LoRA's factors do
        if "shadow" in call and sharded.last_shadowed != [1]:
            failures.append(f"{what}: shadowed {sharded.last_shadowed}, not expert 1")
        y.square().sum().backward()
        want = [single_lora(xs[r], **call) for r in range(world)]
        sum(w.square().sum() for w in want).backward()
        if not torch.allclose(y, want[rank], rtol=1e-5, atol=1e-5):
            failures.append(f"{what}: output differs from the single-process layer's by "
                            f"{float((y - want[rank]).abs().max())}")
        failures += _lora_grads_match(single_lora, sharded_lora, mine, what)
    return failures


def _check_converted_model(rank: int, world: int) -> list[str]:
    """Mixtral converted over the ranks, LoRA on its experts: the single-process adapter's logits; merged and
    exported (to_hf gathers the experts), the single-process merged model's HF tensors."""
    import torch

    import flexmoe.hf as fh
    from test_hf_convert import batches, tiny_model

    failures: list[str] = []
    ref = tiny_model("mixtral")
    experts_per_rank = 4 // world
    mine = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
    torch.manual_seed(2)
    single = _lora(fh.convert(copy.deepcopy(ref), group="single"), ["experts.gate_up", "experts.w2"])
    sharded = _lora(fh.convert(copy.deepcopy(ref)), ["experts.gate_up", "experts.w2"])
    _copy_factor_slices(single, sharded, mine)
    ids = batches(world, seed=14)[rank]
    with torch.no_grad():
        got, want = sharded(ids).logits, single(ids).logits
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        failures.append(f"converted mixtral: logits differ by {float((got - want).abs().max())}")
    exported = fh.to_hf(sharded.merge_and_unload()).state_dict()
    for name, tensor in fh.to_hf(single.merge_and_unload()).state_dict().items():
        if not torch.allclose(exported[name], tensor, rtol=1e-6, atol=1e-6):
            failures.append(f"converted mixtral: merged and exported {name} differs from the single process's")
    return failures
