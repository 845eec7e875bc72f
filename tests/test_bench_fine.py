"""The fine-grained and decode suite groups, and the grouped-GEMM floor: tiny sizes, run end to end; the floors
must compute what a plain per-expert loop computes."""

from __future__ import annotations

import math

import pytest
import torch

from flexmoe.apps.baselines import expert_floor, grouped_floor, grouped_floor_kind, padded_bmm_floor
from flexmoe.apps.bench.config import BenchConfig
from flexmoe.apps.bench.fine import measure_decode
from flexmoe.apps.bench.layer import floor_ratio_check, memory_check
from flexmoe.apps.bench.suite import SuiteSettings, suite_checks
from flexmoe.experts import FeedForwardExperts


def _dense_loop(experts: FeedForwardExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row through its own expert's weights, one row at a time."""
    out = []
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    for row, e in zip(rows, expert_of_row):
        h = experts.activation(row @ experts.w1[e] + experts.b1[e])
        if experts.w3 is not None:
            h = h * (row @ experts.w3[e] + experts.b3[e])
        out.append(h @ experts.w2[e] + experts.b2[e])
    return torch.stack(out)


@pytest.mark.parametrize("floor", [expert_floor, grouped_floor, padded_bmm_floor])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("glu", [False, True])
def test_floors_compute_the_experts_on_the_routed_rows(floor, dtype: torch.dtype, glu: bool) -> None:
    torch.manual_seed(0)
    experts = FeedForwardExperts(5, 8, 12, glu=glu, activation="silu" if glu else "gelu", dtype=dtype)
    counts = [3, 0, 6, 1, 0]
    rows = torch.randn(sum(counts), 8, dtype=dtype, requires_grad=True)
    grad = torch.randn(sum(counts), 8, dtype=dtype)
    expected = _dense_loop(experts, rows, counts)
    expected_grads = torch.autograd.grad(expected, [rows, experts.w1, experts.b2], grad)
    got = floor(experts, rows, counts)
    got_grads = torch.autograd.grad(got, [rows, experts.w1, experts.b2], grad)
    tol = {} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, expected, **tol)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.parametrize("floor", [expert_floor, grouped_floor, padded_bmm_floor])
@pytest.mark.parametrize("glu", [False, True])
def test_floors_without_autograd_compute_the_experts_on_the_routed_rows(floor, glu: bool) -> None:
    """Decoding times the floors under no_grad, where expert_floor runs its own per-expert loop."""
    torch.manual_seed(0)
    experts = FeedForwardExperts(5, 8, 12, glu=glu, activation="silu" if glu else "gelu", dtype=torch.float64)
    counts = [3, 0, 6, 1, 0]
    rows = torch.randn(sum(counts), 8, dtype=torch.float64)
    with torch.no_grad():
        expected = _dense_loop(experts, rows, counts)
        torch.testing.assert_close(floor(experts, rows, counts), expected)


def test_grouped_floor_kind_follows_the_dtype() -> None:
    experts = FeedForwardExperts(2, 8, 8)
    expected = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "padded bmm"
    assert grouped_floor_kind(experts, torch.zeros(3, 8)) == expected
    assert grouped_floor_kind(experts.double(), torch.zeros(3, 8, dtype=torch.float64)) == "padded bmm"


def test_suite_has_the_fine_grained_and_decode_groups() -> None:
    fine = suite_checks(["fine-grained"])
    assert [c.label for c in fine] == ["E=64 H=256 k=8 dropless", "E=128 H=128 k=8 dropless",
                                       "E=256 H=64 k=8 dropless", "E=64 H=256 k=8 cf=1.25",
                                       "E=64 H=256 k=8 dropless T=8192", "activation memory E=256 / E=8, k=8 H=256"]
    assert all(c.group == "fine-grained" and c.target == 1.10 for c in fine)
    decode = suite_checks(["decode"])
    assert [(c.label.split()[0], c.target) for c in decode] == [("T=1", 1.5), ("T=8", 1.10), ("T=64", 1.10)]
    assert not any("k=8" in c.label for c in suite_checks(["layer"]))  # E=64 k=8 moved to fine-grained


def test_suite_has_the_expert_parallel_launches() -> None:
    ep = suite_checks(["expert-parallel"])
    assert [(c.label, c.target) for c in ep] == [
        ("4 ranks x T=512 E=64 k=8 H=256: best static / floor", 1.15),
        ("4 ranks x T=512 E=64 k=8 H=256: auto / best static (worst of 3)", 1.05),
        ("4 ranks x T=4096 E=64 k=8 H=256: best static / floor", 1.15)]


def test_floor_ratio_check_reports_both_floors() -> None:
    cfg = BenchConfig(tokens=32, model_dim=8, hidden_dim=16, experts=16, k=4, capacity_factor=0.0)
    check = floor_ratio_check("tiny", cfg, 1.10, "fine-grained")
    m = check.measure(SuiteSettings(steps=2, warmup=0, peers=False, show=False))
    floors = m.details["report"]["floors"]
    rows = {r["case"]: r["seconds"] for r in m.details["report"]["rows"]}
    assert math.isclose(m.value, rows["flexmoe"] / rows["floor"])
    assert math.isclose(floors["flexmoe_x_grouped_floor"], rows["flexmoe"] / floors["grouped_seconds"])
    assert "the grouped floor" in m.note and check.group == "fine-grained"


def test_memory_check_compares_saved_bytes_at_equal_tokens() -> None:
    cfg = BenchConfig(tokens=64, model_dim=8, hidden_dim=16, experts=4, k=4, capacity_factor=0.0)
    m = memory_check("tiny", cfg, 32, 1.1, "fine-grained").measure(SuiteSettings(show=False))
    same, chosen = m.details["bytes"]["loop"], m.details["bytes"]["auto"]  # the rule's kernel at both E; the chooser's
    assert same[4] > 0 and m.value == same[32] / same[4]
    assert chosen[4] > 0 and chosen[32] > 0 and "chosen kernels" in m.note


def test_measure_decode_times_the_layer_and_both_floors() -> None:
    cfg = BenchConfig(tokens=2, model_dim=8, hidden_dim=16, experts=8, k=2, capacity_factor=0.0)
    report = measure_decode(cfg, steps=2, warmup=0, calls_per_step=2)
    assert sum(report["counts"]) == 4  # every token's 2 choices, dropless
    assert report["floor_us"] > 0 and report["flexmoe_us"] > 0
    assert math.isclose(report["flexmoe_x_floor"], report["flexmoe_us"] / report["floor_us"])
