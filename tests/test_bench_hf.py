"""``flexmoe bench --hf`` and the suite groups hf, decode-hf and expert-parallel, end to end at tiny sizes.

No speed is asserted (the machine is shared): the reports' structure, and that the bench refuses to time a case
whose output differs from HF eager's (it compares every case before timing).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the HF bench needs transformers (CI installs it via .[test])")

from flexmoe.apps.bench.config import BenchConfig  # noqa: E402
from flexmoe.apps.bench.hf import (  # noqa: E402
    FAMILY_NAMES,
    HFShape,
    bench_decode,
    bench_hf_block,
    bench_train_step,
    build_hf_block,
    format_hf,
    set_experts_implementation,
    shapes_of,
)
from flexmoe.apps.bench.suite import suite_checks  # noqa: E402
from flexmoe_cli import run_flexmoe  # noqa: E402

TINY = HFShape("tiny", tokens=48, model_dim=16, experts=8, k=2, hidden_dim=12)
TINY_GROUPED = HFShape("tiny-deepseek", tokens=48, model_dim=16, experts=8, k=2, hidden_dim=12, groups=4,
                       limited_groups=2)
CASES = {"floor", "hf eager", "hf grouped_mm", "hf batched_mm", "flexmoe impl", "converted"}


def _check_block_report(report: dict, family: str) -> None:
    rows = {r["case"]: r for r in report["rows"]}
    assert set(rows) == CASES and report["family"] == family
    assert report["hf_best"] in {"hf eager", "hf grouped_mm", "hf batched_mm"}
    assert rows[report["hf_best"]]["x_hf_best"] == 1.0 and rows["floor"]["x_floor"] == 1.0
    assert all(r["seconds"] > 0 for r in rows.values())
    best = rows[report["hf_best"]]["seconds"]
    assert report["met"] == (rows["converted"]["seconds"] < best and rows["flexmoe impl"]["seconds"] < best)


@pytest.mark.parametrize("family,shape", [("qwen3_moe", TINY), ("deepseek_v3", TINY_GROUPED)])
def test_block_bench_times_every_implementation(family: str, shape: HFShape, one_thread: None) -> None:
    _check_block_report(bench_hf_block(family, shape, steps=1, warmup=0), family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f not in ("qwen3_moe", "deepseek_v3")])
def test_block_bench_every_family(family: str, one_thread: None) -> None:
    _check_block_report(bench_hf_block(family, TINY, steps=1, warmup=0), family)


def test_the_equality_check_sees_hf_eager_function(one_thread: None) -> None:
    """The reference the bench compares with is HF eager's block: written out here as plain loops over tokens."""
    block = build_hf_block("qwen3_moe", TINY, seed=3)
    x = torch.randn(1, 5, TINY.model_dim)
    with torch.no_grad():
        got = set_experts_implementation(block, "eager")(x)[0]
        tokens = x[0]
        probs = torch.softmax(tokens @ block.gate.weight.T, dim=-1)
        for t in range(5):
            top = probs[t].topk(TINY.k)
            weights = top.values / top.values.sum()
            want = torch.zeros(TINY.model_dim)
            for w, e in zip(weights, top.indices.tolist()):
                gate, up = (block.experts.gate_up_proj[e] @ tokens[t]).chunk(2)
                want += w * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_block_bench_refuses_a_case_that_computes_something_else(monkeypatch, one_thread: None) -> None:
    from transformers.integrations.moe import ExpertsInterface

    import flexmoe.hf

    def off_by_a_bit(self, hidden_states, top_k_index, top_k_weights):
        return flexmoe.hf.flexmoe_experts_forward(self, hidden_states, top_k_index, top_k_weights) * 1.01

    monkeypatch.setattr(flexmoe.hf, "register", lambda: ExpertsInterface.register("flexmoe", off_by_a_bit))
    try:
        with pytest.raises(RuntimeError, match="flexmoe impl computed another output than HF eager"):
            bench_hf_block("qwen3_moe", TINY, steps=1, warmup=0)
    finally:
        monkeypatch.undo()
        flexmoe.hf.register()


def test_train_step_and_decode_reports(one_thread: None) -> None:
    train = bench_train_step("qwen3_moe", steps=1, warmup=0, shape=HFShape("t", tokens=32, model_dim=32,
                                                                             experts=4, k=2, hidden_dim=16))
    assert set(train["seconds"]) == {f"hf {train['hf_default']}", "converted"}
    assert train["met"] == (train["converted_over_hf"] < 1.0) and train["converted_over_hf"] > 0
    decode = bench_decode((1, 3), steps=1, warmup=0, calls=2, model_dim=16)
    assert [r["tokens"] for r in decode["rows"]] == [1, 3]
    for row in decode["rows"]:
        assert row["x_hf_grouped_mm"]["hf grouped_mm"] == 1.0 and row["x_floor"]["floor"] == 1.0
        assert set(row["seconds"]) == {"floor", "hf grouped_mm", "flexmoe impl", "converted"}
    text = format_hf({"blocks": [], "threads": 1, "train": [train], "decode": decode, "met": False})
    assert "training step" in text and "decoding" in text


def test_deepseek_v3_train_step_builds_and_matches_hf(one_thread: None) -> None:
    """DeepSeek-V3's causal LM (latent attention: its rotary head_dim is qk_rope_head_dim) trains one step; the
    bench first checks the converted loss and gradients against HF's (a mismatch raises)."""
    train = bench_train_step("deepseek_v3", steps=1, warmup=0, shape=HFShape("t", tokens=32, model_dim=256,
                                                                               experts=8, k=2, hidden_dim=16))
    assert train["family"] == "deepseek_v3" and train["converted_over_hf"] > 0


def test_suite_groups_list_every_family_and_shape() -> None:
    hf = suite_checks(["hf"])
    assert len(hf) == sum(len(shapes_of(f)) for f in FAMILY_NAMES) + 1 == 14
    assert all(c.group == "hf" and c.target < 1 for c in hf)
    assert [c.label.split()[1] for c in suite_checks(["decode-hf"])] == ["T=1", "T=8", "T=64"]
    ep = suite_checks(["expert-parallel"])
    assert [c.target for c in ep] == [1.15, 1.05, 1.15]  # labels: tests/test_bench_fine.py


@pytest.mark.slow
def test_bench_hf_command_json() -> None:
    out = run_flexmoe(
        "bench", "--hf", "olmoe", "--tokens", "32", "--model-dim", "16", "--steps", "1", "--warmup", "0",
        "--threads", "1", "--json", timeout=600, check=True)
    report = json.loads(out.stdout)
    assert [(b["family"], b["shape"]["name"]) for b in report["blocks"]] == [("olmoe", "fine"), ("olmoe", "coarse")]
    assert [b["shape"]["tokens"] for b in report["blocks"]] == [32, 32]
    assert report["train"][0]["family"] == "olmoe" and len(report["decode"]["rows"]) == 3


@pytest.mark.slow
def test_expert_parallel_bench_four_ranks() -> None:
    from flexmoe.apps.bench.ep import EPBench, run_ep_bench

    bench = EPBench(config=BenchConfig(tokens=16, model_dim=8, hidden_dim=8, experts=8, k=2, capacity_factor=0.0,
                                       steps=1, warmup=0), auto_trials=1, auto_runs=2, degrees=(1, 2), timeout=300)
    report = run_ep_bench(bench)
    assert report["world_size"] == 4 and report["threads_per_rank"] == 1
    settings = [row["setting"] for row in report["settings"]]
    assert settings == ["r=0 d=1 a2a=flat", "r=1 d=1 a2a=flat", "r=1 d=1 a2a=flat rows", "r=1 d=2 a2a=flat"]
    assert report["best_static"] in settings and report["best_static_with_auto"] in settings
    assert report["floor_ratio"] > 0
    assert len(report["auto"]) == len(report["auto_ratios"]) == 2
    assert all(a["name"].startswith("auto (run ") for a in report["auto"])
