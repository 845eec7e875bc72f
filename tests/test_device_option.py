"""The GPU check's plumbing, testable on any machine: ``--device`` of pytest and of ``flexmoe bench``,
``make test-gpu``'s script on a machine without a GPU, and the benchmark suite run on the device named."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexmoe.apps.bench.config import BenchConfig
from flexmoe.apps.bench.layer import floor_ratio_check
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings, format_suite_table, run_suite_checks
from flexmoe_cli import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]


def _without_gpus() -> dict[str, str]:
    """This environment with every CUDA device hidden from torch (CUDA's own variable), flexmoe importable."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": child_pythonpath(ROOT / "src")}


def test_gpu_script_without_a_gpu_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test_gpu.sh"), str(results)],
                          env={**_without_gpus(), "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"test-gpu: skipped: no CUDA device here (torch.cuda.is_available() is False for {sys.executable})"]
    assert not results.exists()


@pytest.mark.parametrize("name,message", [
    ("cuda", "--device cuda: this machine has no CUDA device that torch"),
    ("tpu:x", "--device 'tpu:x': not a torch device"),
])
def test_pytest_device_option_refuses_a_device_this_machine_lacks(name: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "--device", name, "tests/test_grouped_linear_op.py"],
                          cwd=ROOT, env=_without_gpus(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert message in proc.stderr


@pytest.mark.parametrize("name,message", [
    ("cuda", "argument --device: cuda: this machine has no CUDA device that torch"),
    ("tpu", "argument --device: expected cpu or cuda[:index], got 'tpu'"),
])
def test_bench_device_flag_refuses_a_device_this_machine_lacks(name: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "flexmoe", "bench", "--suite", "--device", name],
                          env=_without_gpus(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_suite_gives_checks_the_device_and_skips_cpu_only_ones_elsewhere() -> None:
    seen: list[str] = []

    def measure(settings: SuiteSettings) -> Measurement:
        seen.append(settings.device)
        return Measurement(1.0)

    def must_not_run(settings: SuiteSettings) -> Measurement:
        raise AssertionError("a CPU-only check was measured on cuda")

    checks = [SuiteCheck("g", "anywhere", 1.1, measure),
              SuiteCheck("g", "gloo ranks", 1.1, must_not_run, cpu_only="CPU ranks over gloo")]
    results = run_suite_checks(checks, SuiteSettings(show=False, device="cuda:0"))
    assert seen == ["cuda:0"]
    assert results[0]["met"] and not results[1]["met"] and results[1]["skipped"]
    assert results[1]["note"] == "skipped on cuda:0: CPU ranks over gloo"
    table = format_suite_table(results)
    assert "1 of 1 targets met (1 skipped)" in table and "NOT met" not in table
    assert run_suite_checks(checks[1:], SuiteSettings(show=False))[0]["note"].startswith("error: AssertionError")


def test_layer_suite_check_runs_on_the_device(device: torch.device) -> None:
    """A small floor-ratio check measured on ``device``: the layer, its inputs and the floor all live there."""
    check = floor_ratio_check("tiny", BenchConfig(tokens=64, model_dim=16, hidden_dim=32, experts=4), 100.0)
    m = check.measure(SuiteSettings(steps=2, warmup=1, peers=device.type != "cpu", show=False,
                                    device=str(device)))
    report = m.details["report"]
    assert report["config"]["device"] == str(device)
    assert math.isfinite(m.value) and m.value > 0
    if device.type != "cpu":
        assert report["skipped"] == [f"peers: skipped on {device} (DeepSpeed, fairscale and Tutel are compared "
                                     f"on the CPU)"]
