"""Balance metrics (flexmoe.balance_metrics, flexmoe.routing.balance_metrics) against hand computations on plans
whose choices and logits are written here, and the training job's log and plot of them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import flexmoe
from flexmoe import MoELayer
from flexmoe.routing import make_plan
from flexmoe.routing.balance_metrics import load_cv, load_entropy, max_over_mean, plan_balance_metrics

# 6 tokens, k = 1, 4 experts: loads 3, 2, 1, 0.
CHOICES = torch.tensor([[0], [0], [0], [1], [1], [2]])
# Token 0's router distribution is (0.4, 0.3, 0.2, 0.1), every other token's uniform.
P0 = [0.4, 0.3, 0.2, 0.1]
LOGITS = torch.zeros(6, 4, dtype=torch.float64)
LOGITS[0] = torch.tensor(P0, dtype=torch.float64).log()


def _hand_metrics() -> dict[str, float]:
    """The module docstring's definitions, worked by hand for loads (3, 2, 1, 0) and the distributions above."""
    mean = 6 / 4
    std = math.sqrt(((3 - mean) ** 2 + (2 - mean) ** 2 + (1 - mean) ** 2 + (0 - mean) ** 2) / 4)
    q = [3 / 6, 2 / 6, 1 / 6]  # the empty expert adds 0 log 0 = 0
    token0 = -sum(p * math.log(p) for p in P0)
    return {
        "max_over_mean": 3 / mean,
        "cv": std / mean,
        "load_entropy": -sum(p * math.log(p) for p in q),
        "router_entropy": (token0 + 5 * math.log(4)) / 6,
        "dropped_share": 1 / 6,  # capacity 2: expert 0's 3rd token is dropped
    }


def test_plan_metrics_equal_hand_computations():
    plan = make_plan(LOGITS, 1, capacity=2, expert_index=CHOICES)
    assert plan.load.tolist() == [3, 2, 1, 0] and int(plan.num_dropped) == 1
    got = plan_balance_metrics(plan)
    want = _hand_metrics()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_sigmoid_scores_are_normalised_for_the_router_entropy():
    # sigmoid(0) = 0.5 for every expert: normalised, the uniform distribution, entropy log 4.
    plan = make_plan(torch.zeros(3, 4), 2, capacity_factor=0.0, score_func="sigmoid")
    assert plan_balance_metrics(plan)["router_entropy"] == pytest.approx(math.log(4), rel=1e-6)


def test_even_load_and_empty_load():
    even = torch.tensor([5, 5, 5, 5])
    assert (max_over_mean(even), load_cv(even), load_entropy(even)) == (1.0, 0.0, pytest.approx(math.log(4)))
    one = torch.tensor([0, 8, 0, 0])
    assert (max_over_mean(one), load_entropy(one)) == (4.0, 0.0)
    assert math.isnan(max_over_mean(torch.zeros(4, dtype=torch.long)))  # nothing routed: undefined, not 0


def test_model_hook_gives_flat_keys_per_layer():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": MoELayer(8, 4, 8, k=1, group="single", capacity=2),
                           "b": MoELayer(8, 4, 8, k=1, group="single")})
    with pytest.raises(ValueError, match="no flexmoe MoE layer"):
        flexmoe.balance_metrics(nn.Linear(2, 2))
    assert flexmoe.balance_metrics(model) == {}  # nothing has run yet
    x = torch.randn(6, 8)
    # Layer a takes the hand-written choices (routing replay gives them); zero logits: uniform distributions.
    with torch.no_grad():
        model["a"].router.weight.zero_()
        with flexmoe.replay_routing(model["a"], flexmoe.RoutingRecord({"": [CHOICES]}, {"": [1]})):
            model["a"](x)
    got = flexmoe.balance_metrics(model)
    want = {**_hand_metrics(), "router_entropy": math.log(4)}
    assert set(got) == {f"a/{name}" for name in want}
    for name, value in want.items():
        assert got[f"a/{name}"] == pytest.approx(value, rel=1e-6), name
    model["b"](x)
    assert {key.split("/")[0] for key in flexmoe.balance_metrics(model)} == {"a", "b"}


@pytest.mark.usefixtures("one_thread")
def test_training_job_logs_balance_and_plots_it(tmp_path: Path):
    from flexmoe.apps import train_command
    from flexmoe.apps.plots import balance_curves
    from test_train import TINY_FLAGS, _run

    out = tmp_path / "run"
    assert _run(train_command, ["--out", str(out), "--steps", "4", "--log-every", "2", "--eval-every", "4",
                        "--ckpt-every", "4", "--eval-batches", "1", *TINY_FLAGS]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    names = {"max_over_mean", "cv", "load_entropy", "router_entropy", "dropped_share"}
    for r in records:
        assert set(r["balance"]) == {f"blocks.1.mlp/{n}" for n in names}  # 2 blocks, the 2nd one MoE
        b = r["balance"]
        assert 1.0 <= b["blocks.1.mlp/max_over_mean"] <= 4.0
        assert 0.0 <= b["blocks.1.mlp/router_entropy"] <= math.log(4) + 1e-9
        assert b["blocks.1.mlp/dropped_share"] == pytest.approx(r["drop_rate"])  # one MoE layer, one rank
    steps, values = balance_curves(records, "cv")["blocks.1.mlp"]
    assert steps == [2, 4] and values == [r["balance"]["blocks.1.mlp/cv"] for r in records]
    assert (out / "balance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
