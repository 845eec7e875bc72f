"""flexmoe.sharding.split_expert_groups: each optimizer group's expert parameters apart from the rest."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexmoe import MoELayer
from flexmoe.sharding import split_expert_groups


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.moe = MoELayer(8, 4, 16, k=2, shared_experts=1)


def test_each_group_splits_into_its_experts_and_the_rest_with_its_hyperparameters() -> None:
    model = TwoLayers()
    experts = list(model.moe.experts.parameters())
    others = [p for p in model.parameters() if all(p is not e for e in experts)]
    assert experts and len(others) > 2  # the shared expert and router stay with the rest
    groups = [{"params": [experts[0], *others[:2]], "weight_decay": 0.1},
              {"params": [*experts[1:], *others[2:]], "weight_decay": 0.0, "lr": 5e-4}]
    split = split_expert_groups(model, groups)
    assert [len(g["params"]) for g in split] == [1, 2, len(experts) - 1, len(others) - 2]
    assert split[0]["params"][0] is experts[0] and all(p is q for p, q in zip(split[1]["params"], others[:2]))
    assert [g["weight_decay"] for g in split] == [0.1, 0.1, 0.0, 0.0] and split[3]["lr"] == 5e-4
    torch.optim.AdamW(split, foreach=True)  # a valid set of groups


def test_a_model_without_moe_layers_keeps_its_groups_and_empty_parts_are_left_out() -> None:
    model = nn.Linear(4, 4)
    assert split_expert_groups(model, [{"params": list(model.parameters())}]) == \
        [{"params": list(model.parameters())}]


def test_a_group_that_is_not_a_dict_of_params_is_named() -> None:
    model = TwoLayers()
    with pytest.raises(TypeError, match=r"groups\[0\].*'params'"):
        split_expert_groups(model, [list(model.parameters())])  # type: ignore[list-item]
