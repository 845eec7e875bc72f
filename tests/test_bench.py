"""The benchmark's references and measurements: the dense-einsum layer and the floor compute what the layer
computes, the activation-memory probe counts what autograd keeps, and the command runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.apps.baselines import expert_floor, gshard_einsum_forward
from flexmoe.apps.bench.distributed import paired_ratio
from flexmoe.apps.bench.timing import saved_activation_bytes, time_side_by_side
from flexmoe_cli import check_usage_error, run_flexmoe


@pytest.mark.parametrize("cf", [2.0, 0.5, 0.0])
def test_gshard_einsum_reference_equals_layer(cf: float) -> None:
    torch.manual_seed(0)
    moe = MoELayer(16, 6, 24, k=2, capacity_factor=cf, dtype=torch.float64, glu=cf == 0.5)
    x = torch.randn(40, 16, dtype=torch.float64)
    y = moe(x)
    assert (moe.last_plan.num_dropped > 0) == (cf == 0.5)
    torch.testing.assert_close(gshard_einsum_forward(moe, x), y, rtol=1e-12, atol=1e-12)


def test_floor_is_each_expert_on_its_rows() -> None:
    torch.manual_seed(1)
    moe = MoELayer(8, 3, 12, k=1, dtype=torch.float64)
    counts = [4, 0, 5]
    rows = torch.randn(9, 8, dtype=torch.float64)
    e = moe.experts
    expected = []
    for expert, n in enumerate(counts):
        for row in rows[sum(counts[:expert]): sum(counts[:expert]) + n]:
            h = torch.nn.functional.gelu(row @ e.w1[expert] + e.b1[expert])
            expected.append(h @ e.w2[expert] + e.b2[expert])
    torch.testing.assert_close(expert_floor(e, rows, counts), torch.stack(expected))


def test_saved_activation_bytes_counts_saved_tensors_once_without_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(32, 32))
    x = torch.randn(100, 32, requires_grad=True)
    # x @ w saves x (and w, a parameter: not counted); tanh saves its output (100 x 32 floats).
    nbytes = saved_activation_bytes(lambda: torch.tanh(x @ w), [w])
    assert nbytes == 2 * 100 * 32 * 4


def test_time_side_by_side_takes_turns() -> None:
    calls: list[str] = []
    times = time_side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, steps=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(v) for v in times.values()] == [3, 3]


def test_bench_command_json() -> None:
    out = run_flexmoe(
        "bench", "--tokens", "64", "--model-dim", "16", "--hidden-dim", "32", "--steps", "2", "--warmup", "0",
        "--capacity-factor", "0", "--memory", "--no-peers", "--json", check=True)
    report = json.loads(out.stdout)
    cases = {row["case"]: row for row in report["rows"]}
    assert set(cases) == {"floor", "grouped floor", "flexmoe", "gshard-einsum"}
    assert cases["floor"]["x_floor"] == 1.0
    floors = report["floors"]
    assert floors["loop_seconds"] == cases["floor"]["seconds"] and floors["grouped_seconds"] > 0
    assert all(row["seconds"] > 0 for row in report["rows"])
    assert report["plan"]["rows_computed"] == sum(report["plan"]["tokens_per_expert"]) == 128
    assert report["memory"]["flexmoe_bytes"] > 0


@pytest.mark.parametrize("flags,says", [
    (("--tokens", "0"), "argument --tokens: must be an integer >= 1, got 0"),
    (("--suite-groups", "nope"), "unknown suite group"),
    (("--hf", "switch"), "--hf must be one of"),  # refused before transformers is imported
], ids=["tokens", "suite-groups", "hf-family"])
def test_bench_rejects_bad_flags(flags: tuple[str, ...], says: str) -> None:
    check_usage_error("bench", *flags, says=says)


@pytest.mark.slow
def test_distributed_bench_two_ranks() -> None:
    out = run_flexmoe(
        "bench", "--nproc", "2", "--tokens", "128", "--model-dim", "32", "--hidden-dim", "64", "--experts", "4",
        "--steps", "2", "--warmup", "1", "--profile", "a100-ndv4", "--json", timeout=300, check=True)
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert report["world_size"] == 2
    names = [row["setting"] for row in report["settings"]]
    assert "r=1 d=1 a2a=flat" in names and "r=0 d=1 a2a=flat" in names
    assert len(report["auto"]) == 2  # measuring every candidate, and steered by the cost model
    assert all(auto["choice"] in names for auto in report["auto"])
    assert all(0 <= row["comm_share"] <= 1 for row in report["settings"])
    # CPU accounting: every setting and the floor cost some CPU per rank; the idle share is a share.
    rows = [*report["settings"], report["floor_cpu"]]
    assert all(row["cpu_seconds"] > 0 and (row["idle"] is None or 0 <= row["idle"] <= 1) for row in rows), rows
    from flexmoe.apps.bench.distributed import format_distributed

    table = format_distributed(report)
    assert "cpu ms/rank" in table and "floor (per-rank rows)" in table


@pytest.mark.slow
def test_stalling_experts_have_their_stall_as_the_floor() -> None:
    """--sleep-ms: the floor is the experts' stall alone (no exchange), so every setting has its x floor; the stall
    is sleep_ms per pass, forward and backward, scaled by the rows a rank computes over the even share."""
    sleep_ms, tokens, k = 40, 128, 2
    out = run_flexmoe(
        "bench", "--nproc", "2", "--tokens", str(tokens), "--model-dim", "32", "--hidden-dim", "64",
        "--num-experts", "4", "--k", str(k), "--capacity-factor", "0", "--steps", "3", "--warmup", "1",
        "--degrees", "1,2", "--sleep-ms", str(sleep_ms), "--auto-trials", "1", "--json", timeout=300, check=True)
    report = json.loads(out.stdout[out.stdout.index("{"):])
    # Dropless: the two ranks compute all 2 x tokens x k rows between them, and the slowest rank's share is at
    # least half, so its stall is at least 2 passes x sleep_ms (and the rows of one rank at most all of them).
    assert 2 * sleep_ms / 1e3 <= report["floor_seconds"] <= 2 * 2 * sleep_ms / 1e3 * 1.5
    assert all(row["x_floor"] == pytest.approx(row["seconds"] / report["floor_seconds"])
               for row in report["settings"])


def test_idle_share_weighs_spans_by_their_ticks() -> None:
    from flexmoe.apps.bench.distributed import idle_share

    assert idle_share([(10, 100), (30, 100)]) == pytest.approx(0.2)
    assert idle_share([(0, 50), (50, 50)]) == pytest.approx(0.5)  # (0 + 50) / 100, not the mean of 0 and 1
    assert idle_share([]) is None and idle_share([(0, 0)]) is None


def test_cpu_account_counts_busy_work_and_node_ticks() -> None:
    from flexmoe.apps.bench.distributed import CpuAccount, node_cpu_jiffies

    def busy() -> None:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass

    counted, account = CpuAccount.wrap(busy)
    counted()
    counted()
    assert len(account.seconds) == 2 and all(0.05 <= s < 1.0 for s in account.seconds), account.seconds
    if node_cpu_jiffies() is not None:  # Linux: /proc/stat
        assert len(account.ticks) == 2 and all(0 <= idle <= total for idle, total in account.ticks)
        assert sum(total for _, total in account.ticks) > 0  # 0.1 s of work spans at least one tick


def test_bench_prints_its_header_before_the_timing_ends() -> None:
    """The configuration and plan come out at once, then a progress bar; not everything at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexmoe", "bench", "--tokens", "64", "--model-dim", "16", "--hidden-dim", "32",
         "--steps", "100000", "--warmup", "0", "--no-peers"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = proc.stdout.readline()
        second = proc.stdout.readline()
        assert proc.poll() is None, "the benchmark ended: the header was not printed ahead of the timing"
        assert first.startswith("flexmoe bench: T=64 M=16 H=32 E=8 k=2")
        assert second.startswith("plan: capacity")
        bar = proc.stderr.read(200)  # tqdm's bar, on stderr while the rounds run
        assert "timing 4 cases" in bar
    finally:
        proc.kill()
        proc.wait()


def test_bench_table_follows_the_progress(capsys) -> None:
    from flexmoe.apps.bench.config import BenchConfig
    from flexmoe.apps.bench.layer import bench_single

    cfg = BenchConfig(tokens=32, model_dim=8, hidden_dim=16, experts=4, steps=2, warmup=1)
    report = bench_single(cfg, peers=False, show=True)
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("flexmoe bench: T=32") and lines[2].split() == ["case", "ms/step", "tokens/s", "x",
                                                                                 "floor"]
    table = lines[3:3 + len(report["rows"])]
    assert [line.split()[0] for line in table] == [row["case"].split()[0] for row in report["rows"]]
    assert lines[3 + len(report["rows"])].startswith("floors: loop")
    assert "3/3" in captured.err  # the progress bar counted the warm-up and the timed rounds


def test_step_bar_counts_announced_steps(capsys) -> None:
    from flexmoe.apps.progress import StepBar

    with StepBar(3, "measuring") as bar:
        bar("measuring a")
        bar("measuring b")
        assert bar._bar.n == 1  # a is done once b is announced
        bar("measuring c")
    assert bar._bar.n == 3
    err = capsys.readouterr().err
    assert err.index("measuring a") < err.index("measuring b") < err.index("measuring c")
    quiet = StepBar(3, "quiet", enabled=False)
    quiet("nothing")
    quiet.close()
    assert "nothing" not in capsys.readouterr().err


def test_suite_reports_each_check_and_survives_a_broken_one(capsys) -> None:
    from flexmoe.apps.bench.suite import (
        Measurement,
        SuiteCheck,
        SuiteSettings,
        format_suite_table,
        run_suite_checks,
        suite_checks,
    )

    def broken(settings: SuiteSettings) -> Measurement:
        raise RuntimeError("no such device")

    checks = [SuiteCheck("g", "low", 1.10, lambda s: Measurement(1.05)),
              SuiteCheck("g", "broken", 1.10, broken),
              SuiteCheck("g", "high", 2.0, lambda s: Measurement(1.5), higher_is_better=True)]
    results = run_suite_checks(checks, SuiteSettings(show=False))
    assert [r["met"] for r in results] == [True, False, False]
    assert "RuntimeError: no such device" in results[1]["note"]
    table = format_suite_table(results)
    assert "1 of 3 targets met" in table and table.count("NOT met") == 2
    with pytest.raises(ValueError, match="unknown suite group"):
        suite_checks(["no-such-group"])
    assert all(c.group == "layer" for c in suite_checks(["layer"]))


def test_suite_units_keep_a_shared_launch_together() -> None:
    from flexmoe.apps.bench.ep import ep_checks
    from flexmoe.apps.bench.suite import Measurement, SuiteCheck, process_units

    def check(shares: bool) -> SuiteCheck:
        return SuiteCheck("g", "c", 1.0, lambda s: Measurement(1.0), shares_previous=shares)

    assert process_units([check(False), check(True), check(False), check(False), check(True), check(True)]) == [
        [0, 1], [2], [3, 4, 5]]
    assert process_units([check(True)]) == [[0]]
    # The expert-parallel group's first launch measures two targets, the second launch one.
    assert process_units(ep_checks()) == [[0, 1], [2]]


@pytest.mark.slow  # 12 s
def test_isolated_suite_measures_in_a_fresh_process_and_reports_a_dead_one() -> None:
    from flexmoe.apps.bench.compile import DROPLESS_GRAPH_BREAKS
    from flexmoe.apps.bench.suite import SuiteSettings, run_suite_isolated

    settings = SuiteSettings(show=False)
    (result,) = run_suite_isolated(["compile"], settings, threads=1, only=[3])  # the graph-break count
    assert result["label"] == "dropless graph breaks (counts stay on the device)"
    assert result["value"] == DROPLESS_GRAPH_BREAKS and result["met"]
    (stopped,) = run_suite_isolated(["compile"], settings, threads=1, only=[3], timeout=0.01)
    assert not stopped["met"] and "ran over 0.01 s" in stopped["note"]


def test_paired_ratio_is_the_median_of_the_per_round_ratios() -> None:
    # Per round: 1.0, 1.0 (a round slow for both), 1.1, 2.1; their median is 1.05.
    times, reference = [2.0, 9.0, 2.2, 2.1], [2.0, 9.0, 2.0, 1.0]
    assert paired_ratio(times, reference) == pytest.approx((1.0 + 1.1) / 2)
    assert paired_ratio([3.0], [2.0]) == 1.5
