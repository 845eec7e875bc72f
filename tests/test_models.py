"""The MoE GPT and its dense twin."""

from __future__ import annotations

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.apps.models import GPT, GPTConfig
from flexmoe.apps.models.moe_model import DenseMLP

TINY = dict(n_layer=4, n_head=2, n_embd=32, block_size=16, num_experts=4, expert_hidden=24, k=2)


def test_moe_every_and_dense_twin() -> None:
    cfg = GPTConfig(**TINY)
    model = GPT(cfg)
    kinds = [type(b.mlp) for b in model.blocks]
    assert kinds == [DenseMLP, MoELayer, DenseMLP, MoELayer]  # every 2nd layer, as in GShard
    assert GPT(GPTConfig(**TINY, moe_every=1)).moe_layers.__len__() == 4
    twin = GPT(cfg.dense_twin())
    assert twin.moe_layers == [] and all(isinstance(b.mlp, DenseMLP) for b in twin.blocks)
    # Equal active compute: every dense MLP has hidden k * expert_hidden, the width a token uses in an MoE layer.
    for b in twin.blocks:
        assert b.mlp.fc.weight.shape == (cfg.k * cfg.expert_hidden, cfg.n_embd)
    moe = model.moe_layers[0]
    assert moe.experts.w1.shape == (4, 32, 24) and moe.k == 2
    assert model.num_params() > twin.num_params()


def test_forward_losses_and_load() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    aux = model.aux_loss()
    assert aux.requires_grad
    assert aux.item() == pytest.approx(sum(m.aux_loss.item() for m in model.moe_layers))
    expected = 0.01 * aux + 0.001 * model.z_loss()
    assert model.regularization_loss().item() == pytest.approx(expected.item())
    load = model.expert_load()
    assert len(load) == 2 and all(len(layer) == 4 for layer in load)
    assert all(sum(layer) <= 3 * 16 * 2 for layer in load)  # at most T * k rows per layer
    assert 0.0 <= model.drop_rate() < 1.0
    (loss + model.regularization_loss()).backward()
    assert all(p.grad is not None for p in model.moe_layers[0].router.parameters())  # the router learns
    twin = GPT(GPTConfig(**TINY, dense=True))
    twin(idx)
    assert twin.aux_loss().item() == 0.0 and twin.expert_load() == []


def test_generate_and_config_round_trip() -> None:
    cfg = GPTConfig(**TINY)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        GPTConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="must divide by n_head"):
        GPTConfig(n_embd=30, n_head=4)
    model = GPT(cfg).eval()
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 21)


def test_saved_config_fields_and_defaults_stay_those_of_saved_runs() -> None:
    """config.json's "model" entry of a default run, written out by hand: the shared MoEModelConfig fields keep
    each model's own defaults, and the runtime group is not saved."""
    from flexmoe.apps.models.vit import ViTConfig

    moe = dict(n_layer=4, n_head=4, dense=False, moe_every=2, num_experts=8, k=2, capacity_factor=1.25,
               aux_loss_coef=0.01, z_loss_coef=0.001)
    assert GPTConfig().to_dict() == dict(
        moe, vocab_size=256, block_size=128, n_embd=128, dropout=0.0, expert_hidden=256, router="topk",
        aux_loss_type="switch", a2a="flat", cross_node_share=None, redundant_experts=0)
    assert ViTConfig().to_dict() == dict(
        moe, image_size=8, patch_size=2, channels=1, num_classes=10, n_embd=64, dropout=0.1, pool="mean",
        expert_hidden=128, router="cosine")


def test_the_process_group_goes_beside_the_config_never_in_it() -> None:
    """The configs are plain data: no group field (a saved config naming one is refused as unknown); the group is
    the models' own argument, and a model built over one refuses to upcycle (that builds one process's model)."""
    from flexmoe.apps.hf_job import HFJobConfig
    from flexmoe.apps.models.vit import ViT, ViTConfig

    with pytest.raises(TypeError, match="group"):
        GPTConfig(group="single")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="group"):
        HFJobConfig(hf_config={}, group="single")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="unknown GPTConfig fields \\['group'\\]"):
        GPTConfig.from_dict({**GPTConfig().to_dict(), "group": None})
    # One process holding every expert, named explicitly: the same layers as without a group.
    model = GPT(GPTConfig(**TINY), group="single")
    assert model.group == "single" and [m.experts.w1.shape for m in model.moe_layers] == [(4, 32, 24)] * 2
    vit = ViT(ViTConfig(n_layer=2, num_experts=4, expert_hidden=8), group="single")
    assert vit.group == "single" and [m.experts.w1.shape for m in vit.moe_layers] == [(4, 64, 8)]
    assert GPT(GPTConfig(**TINY)).group is None
    sentinel = object()  # a dense model builds no MoE layer, so any object stands for a group here
    with pytest.raises(ValueError, match="without a group"):
        GPT(GPTConfig(**TINY, dense=True), group=sentinel).upcycle_mlps(num_experts=4, k=2)
