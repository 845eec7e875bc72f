"""flexmoe.sharding.expert_parameters: which parameters of a model are MoE experts (the search fsdp, ddp, dcp, optim
and materialize share); and the moved names still reached from flexmoe.parallel for one release."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import flexmoe.parallel
import flexmoe.sharding
from flexmoe import MoELayer
from flexmoe.sharding import expert_parameters, named_moe_layers

SRC = Path(__file__).resolve().parents[1] / "src"


class OwnExperts(nn.Module):
    """A custom experts module: a Linear per local expert, nested one level (``lin.0.weight``)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([lin(p) for lin, p in zip(self.lin, x.split(counts))]) * self.scale


class Block(nn.Module):
    def __init__(self, moe: MoELayer) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.moe = moe


class Model(nn.Module):
    """Two MoE blocks in a list (one with a shared expert, one with custom experts), a dense projection, and an
    MoE layer nested deeper in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(MoELayer(8, 4, 16, k=2, shared_experts=1)),
                                     Block(MoELayer(8, 2, 16, k=1, experts=OwnExperts(2, 8)))])
        self.heads = nn.ModuleDict({"aux": nn.Sequential(nn.Linear(8, 8), MoELayer(8, 4, 8, k=1, glu=True))})


def plain_expert_names(model: nn.Module) -> dict[str, MoELayer]:
    """The reference: the model's own parameter names that lie under some MoE layer's ``experts`` child."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    found = {}
    for name, _ in model.named_parameters():
        for prefix, layer in layers.items():
            if name.startswith(f"{prefix}.experts." if prefix else "experts."):
                found[name] = layer
    return found


def test_every_expert_parameter_once_with_its_layer_against_a_plain_loop() -> None:
    model = Model()
    found = list(expert_parameters(model))
    expected = plain_expert_names(model)
    params = dict(model.named_parameters())
    assert [name for name, _, _ in found] == list(expected)  # the same names, in named_parameters() order
    assert {id(layer) for _, _, layer in found} == {id(m) for m in model.modules() if isinstance(m, MoELayer)}
    for name, param, layer in found:
        assert param is params[name] and layer is expected[name]
    names = {name for name, _, _ in found}
    # the router, the shared expert, the norms and the dense layers are not experts
    assert not any(".router." in n or ".shared." in n or "norm" in n or n.startswith("embed") for n in names)
    assert "blocks.1.moe.experts.lin.1.weight" in names and "blocks.1.moe.experts.scale" in names
    assert "heads.aux.1.experts.w1" in names


def test_a_model_that_is_one_layer_names_its_experts_from_the_root() -> None:
    layer = MoELayer(8, 4, 16, k=2)
    found = list(expert_parameters(layer))
    assert [n for n, _, _ in found] == [f"experts.{n}" for n, _ in layer.experts.named_parameters()] \
        == list(plain_expert_names(layer))
    assert all(p is dict(layer.named_parameters())[n] and owner is layer for n, p, owner in found)


def test_a_model_without_moe_layers_has_no_experts_and_a_non_module_is_refused() -> None:
    assert list(expert_parameters(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))) == []
    with pytest.raises(TypeError, match="model must be a nn.Module"):
        list(expert_parameters([nn.Linear(4, 4)]))  # type: ignore[arg-type]


def test_named_moe_layers_lists_the_layers_in_module_order() -> None:
    model = Model()
    assert [(n, type(m)) for n, m in named_moe_layers(model)] == [
        ("blocks.0.moe", MoELayer), ("blocks.1.moe", MoELayer), ("heads.aux.1", MoELayer)]
    assert all(m is model.get_submodule(n) for n, m in named_moe_layers(model))


def test_the_sharding_modules_find_experts_as_the_helper_does() -> None:
    """split_expert_groups (optim) and dcp's name -> layer map agree with the plain loop on the same model."""
    from flexmoe.sharding.dcp import _expert_params

    model = Model()
    expected = plain_expert_names(model)
    assert _expert_params(model) == expected
    groups = flexmoe.sharding.split_expert_groups(model, [{"params": list(model.parameters())}])
    experts = {id(p) for n, p in model.named_parameters() if n in expected}
    assert {id(p) for p in groups[0]["params"]} == experts
    assert not experts & {id(p) for p in groups[1]["params"]}


# What flexmoe.parallel exported before the model-level modules moved to flexmoe.sharding.
MOVED = ["MESH_DIMS", "make_mesh", "parallelize", "place_experts", "default_blocks", "expert_parameter_names",
         "wrap_ddp", "materialize", "allocate", "reset_module", "save_sharded", "load_sharded", "split_expert_groups",
         "local_state_bytes"]


def test_the_moved_names_are_still_flexmoe_parallel_names() -> None:
    assert set(MOVED) <= set(flexmoe.parallel.__all__)
    for name in MOVED:
        assert getattr(flexmoe.parallel, name) is getattr(flexmoe.sharding, name), name
    from flexmoe.parallel.ddp import divide_gradients, wrap_ddp
    from flexmoe.parallel.fsdp_overlap import DeferredReduceScatter
    from flexmoe.sharding import ddp, fsdp_overlap

    assert wrap_ddp is ddp.wrap_ddp and divide_gradients is ddp.divide_gradients
    assert DeferredReduceScatter is fsdp_overlap.DeferredReduceScatter
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        flexmoe.parallel.not_a_name  # noqa: B018


# A fresh interpreter: which modules load depends on what was imported before. `materialize` is a function and a
# module of flexmoe.parallel: importing the module first (as flexmoe.apps.models.gpt does) must not turn the
# package's `materialize` into that module.
_FRESH = """
import sys
sys.path.insert(0, {src!r})
import flexmoe, flexmoe.layer, flexmoe.parallel
assert not [m for m in sys.modules if m.startswith("flexmoe.sharding")], "the layer's level loaded flexmoe.sharding"
from flexmoe.parallel.materialize import reset_module
from flexmoe.parallel import materialize
import flexmoe.sharding
assert materialize is flexmoe.sharding.materialize and callable(materialize), materialize
assert flexmoe.parallel.materialize is materialize
assert reset_module is flexmoe.sharding.reset_module
assert flexmoe.parallel.fsdp.parallelize is flexmoe.sharding.parallelize
from flexmoe.parallel import *
assert parallelize is flexmoe.sharding.parallelize
print("ok")
"""


def test_importing_the_layer_leaves_sharding_unloaded_and_old_paths_resolve_in_a_fresh_process() -> None:
    done = subprocess.run([sys.executable, "-c", _FRESH.format(src=str(SRC))], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
