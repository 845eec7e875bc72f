"""``make test-gpu``'s script (scripts/test_gpu.sh) checked on the CPU: it parses, its dry run finds every part of
issue 41 among the device tests and every bench group it names, its options are checked, and the parts' report
(scripts/gpu_parts.py) passes a part only when its tests ran and all passed. Its run without a GPU is
tests/test_device_option.py's."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test_gpu.sh"


def _gpu_parts():
    spec = importlib.util.spec_from_file_location("gpu_parts", ROOT / "scripts" / "gpu_parts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # 21 s: it collects the whole suite
def test_dry_run_collects_every_part_and_names_the_commands(tmp_path: Path) -> None:
    done = _script("--dry-run", "--budget", "480", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    counts = dict(re.findall(r"^  (.+): (\d+) test\(s\) collected$", done.stdout, re.M))
    assert set(counts) == set(_gpu_parts().PARTS)
    assert all(int(n) >= 1 for n in counts.values()), counts
    assert "-m pytest -q -m device --device cuda" in done.stdout
    assert "1. device tests (at most 240s)" in done.stdout
    assert "-m flexmoe bench --suite --suite-one-process --suite-groups layer," in done.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args, says", [
    (["--budget", "60"], "test-gpu: --budget takes a whole number of seconds, at least 240 (got '60')"),
    (["--budget"], "test-gpu: --budget takes a whole number of seconds, at least 240 (got '')"),
    (["--fast"], "test-gpu: unknown option --fast (expected --dry-run, --budget SECONDS, RESULTS_DIR)"),
])
def test_bad_options_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    done = _script(*args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [says]


def _junit(path: Path, cases: list[tuple[str, str, str]]) -> Path:
    """A JUnit report as pytest writes it: (node id, outcome) -> <testcase classname= name=> with the outcome's
    child element."""
    children = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='x'/>",
                "skipped": "<skipped type='pytest.skip' message='x'/>",
                "xfailed": "<skipped type='pytest.xfail' message='x'/>"}
    rows = []
    for file, name, outcome in cases:
        classname = file.removesuffix(".py").replace("/", ".")
        rows.append(f"<testcase classname='{classname}' name='{name}' time='1'>{children[outcome]}</testcase>")
    path.write_text(f"<testsuites><testsuite name='pytest'>{''.join(rows)}</testsuite></testsuites>")
    return path


ALL_PASS = [
    ("tests/test_gpu_sync.py", "test_layer_training_and_decoding_calls_read_nothing[sigmoid]", "passed"),
    ("tests/test_cuda_graphs.py", "test_compiled_generate_captures_once_and_gives_eager_tokens", "passed"),
    ("tests/test_train_device.py", "test_two_gloo_ranks_train_as_one_process", "passed"),
    ("tests/test_expert_parallel.py", "test_expert_parallel_on_one_device[2 ranks over gloo]", "passed"),
    ("tests/test_expert_parallel.py", "test_expert_parallel_on_one_device[1 rank]", "passed"),
    ("tests/test_layer.py", "test_something_else", "failed"),  # not a part: the pytest run's own verdict
]


def _report(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_parts.py"), "report", str(path)],
                          capture_output=True, text=True)


def test_parts_report_passes_every_part_that_ran_and_passed(tmp_path: Path) -> None:
    done = _report(_junit(tmp_path / "t.xml", ALL_PASS))
    assert done.returncode == 0, done.stdout
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("passed: ") for line in lines), lines
    assert "passed: gloo-ranks (two ranks on one GPU equal one process): 2 passed" in lines


@pytest.mark.parametrize("outcome", ["failed", "error", "skipped", "xfailed", "missing"])
def test_parts_report_fails_a_part_that_did_not_pass(tmp_path: Path, outcome: str) -> None:
    nccl = ("tests/test_expert_parallel.py", "test_expert_parallel_on_one_device[1 rank]")
    cases = [c for c in ALL_PASS if c[:2] != nccl] + ([] if outcome == "missing" else [(*nccl, outcome)])
    done = _report(_junit(tmp_path / "t.xml", cases))
    assert done.returncode == 1
    part = "nccl-world-1 (one rank on the device's own backend)"
    counted = {"missing": "no test ran", "error": "1 failed"}.get(outcome, f"1 {outcome}")  # an error is a failure
    want = f"NOT passed: {part}: {counted}"
    assert want in done.stdout.splitlines(), done.stdout
    assert sum(line.startswith("passed: ") for line in done.stdout.splitlines()) == 3


def test_parts_report_usage(tmp_path: Path) -> None:
    assert _report(tmp_path / "absent.xml").returncode == 2
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_parts.py")], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
