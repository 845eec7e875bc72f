"""The library's structure (docs/architecture.md): which package imports which, the options dataclasses and
their keyword front end, and the one rule for the valid r of a layout."""

from __future__ import annotations

import ast
import dataclasses
import math
import struct
from pathlib import Path

import pytest
import torch

from flexmoe import ExpertOptions, MoELayer, ParallelOptions, RoutingOptions
from flexmoe.validation import constant_float

SRC = Path(__file__).resolve().parents[1] / "src" / "flexmoe"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (absolute names)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("room, forbidden", [
    ("parallel", ("flexmoe.tuning", "flexmoe.apps", "flexmoe.routing")),
    ("routing", ("flexmoe.parallel", "flexmoe.tuning", "flexmoe.apps", "flexmoe.layer")),
    ("tuning", ("flexmoe.apps", "flexmoe.layer")),
])
def test_rooms_import_only_what_the_architecture_allows(room: str, forbidden: tuple[str, ...]) -> None:
    bad = []
    for path in sorted((SRC / room).glob("*.py")):
        for name in imported_modules(path):
            if name.startswith(forbidden):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, bad


def test_the_library_never_imports_the_applications() -> None:
    library = [p for p in SRC.rglob("*.py") if "apps" not in p.relative_to(SRC).parts and p.name != "__main__.py"]
    bad = [f"{p.relative_to(SRC)} imports {n}" for p in library for n in imported_modules(p)
           if n.startswith("flexmoe.apps")]
    assert not bad, bad


def test_only_flexmoe_hf_imports_transformers() -> None:
    """transformers is the optional extra of flexmoe.hf: no other library module imports it or flexmoe.hf."""
    library = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("apps", "hf")]
    bad = [f"{p.relative_to(SRC)} imports {n}" for p in library for n in imported_modules(p)
           if n.split(".")[0] == "transformers" or n.startswith("flexmoe.hf")]
    assert not bad, bad


def test_option_field_names_are_unique_across_the_dataclasses() -> None:
    names = [f.name for cls in (RoutingOptions, ExpertOptions, ParallelOptions) for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_keywords_and_dataclasses_build_the_same_layer() -> None:
    """The keyword front end and the dataclasses give the same options and the same outputs."""
    keywords = dict(k=1, capacity_factor=0.5, normalize_weights=False, activation="silu", glu=True,
                    shared_experts=1, r=1, overlap_degree=2)
    torch.manual_seed(0)
    by_keyword = MoELayer(8, 4, 16, **keywords)
    torch.manual_seed(0)
    by_options = MoELayer(8, 4, 16,
                          routing_options=RoutingOptions(k=1, capacity_factor=0.5, normalize_weights=False),
                          expert_options=ExpertOptions(activation="silu", glu=True, shared_experts=1),
                          parallel_options=ParallelOptions(overlap_degree=2))
    assert by_keyword.routing_options == by_options.routing_options
    assert by_keyword.expert_options == by_options.expert_options
    x = torch.randn(10, 8)
    assert torch.equal(by_keyword(x), by_options(x))
    # Layer attributes read the options; keywords given with an options object are applied on top.
    assert (by_keyword.k, by_keyword.capacity_factor, by_keyword.glu, by_keyword.overlap_degree) == (1, 0.5, True, 2)
    on_top = MoELayer(8, 4, 16, routing_options=RoutingOptions(k=1, capacity_factor=0.5), capacity_factor=2.0)
    assert (on_top.k, on_top.capacity_factor) == (1, 2.0)


def test_options_validate_themselves_and_unknown_keywords_fail() -> None:
    with pytest.raises(ValueError, match="capacity_factor must be finite"):
        RoutingOptions(capacity_factor=float("nan"))
    with pytest.raises(TypeError, match="shared_experts must be an int"):
        ExpertOptions(shared_experts=1.0)
    with pytest.raises(ValueError, match="overlap_degree must be an int >= 1"):
        ParallelOptions(overlap_degree=0)
    with pytest.raises(TypeError, match="token_exchange must be a bool, got 'rows'"):
        ParallelOptions(token_exchange="rows")
    with pytest.raises(TypeError, match="token_exchange must be a bool"):
        MoELayer(8, 4, 16)(torch.randn(3, 8), token_exchange=1)  # per call, validated the same way
    with pytest.raises(TypeError, match="unexpected keyword argument 'kk'"):
        MoELayer(8, 4, 16, kk=2)
    with pytest.raises(TypeError, match="routing_options must be a RoutingOptions"):
        MoELayer(8, 4, 16, routing_options=ExpertOptions())
    moe = MoELayer(8, 4, 16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        moe(torch.randn(3, 8), k=1)  # k is not a per-call option
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.routing_options.k = 3  # type: ignore[misc]


@pytest.mark.parametrize("value", [0.1, 1.25, 3, -2.5, 1e-300, 5e-324, 1.7976931348623157e308, 2.0 ** 60 + 1])
def test_constant_float_gives_back_the_same_float(value: float) -> None:
    """The options take each float through its exact integer ratio (so that torch.compile specializes a
    symbolic one): in eager it must change nothing, down to the last bit."""
    got = constant_float(value)
    assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", float(value))


def test_constant_float_leaves_inf_and_nan_to_the_check() -> None:
    assert constant_float(float("inf")) == float("inf") and math.isnan(constant_float(float("nan")))
    with pytest.raises(ValueError, match="bias_update_rate must be finite"):
        RoutingOptions(balance="bias", bias_update_rate=float("inf"))
    with pytest.raises(ValueError, match="cross_node_share must be in"):
        RoutingOptions(cross_node_share=float("nan"))


def test_a_call_override_is_validated_and_changes_only_that_call() -> None:
    moe = MoELayer(8, 4, 16, k=2, capacity_factor=1.0)
    x = torch.randn(12, 8)
    moe(x, capacity=1)
    assert moe.last_plan.capacity == 1
    moe(x)
    assert moe.last_plan.capacity == 6  # ceil(2 * 1.0 * 12 / 4)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        moe(x, capacity=-1)


@pytest.mark.parametrize("num_experts, world, builtin, want", [
    (4, 1, True, [1]),            # one process: nothing to gather from
    (4, 2, True, [0, 1]),         # whole experts
    (4, 2, False, [1]),           # a custom module's weights cannot be gathered
    (2, 4, True, [0, 1, 2]),      # s = 2 shards per expert
    (1, 4, True, [0, 1, 2, 4]),   # s = 4
    (1, 4, False, [1, 2, 4]),
])
def test_valid_r_is_one_rule_for_the_layer_and_the_cost_model(num_experts: int, world: int, builtin: bool,
                                                              want: list[int]) -> None:
    from flexmoe.parallel import ExpertLayout
    from flexmoe.tuning.cost_model import LayerConfig, valid_r

    layout = ExpertLayout(num_experts, world, 16)
    assert layout.valid_r(builtin) == want
    if builtin:  # the cost model models the built-in experts
        config = LayerConfig(tokens=8, model_dim=8, hidden_dim=16, experts=num_experts, k=1, ranks=world)
        assert valid_r(config) == want
