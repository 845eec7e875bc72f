"""Expert parallelism with real processes (gloo on 127.0.0.1, a free port per test).

Each test starts W processes of tests/ep_worker.py, which run many cases inside one process group (starting
processes costs seconds) and report their failures. The reference is one process holding all experts with
the same global weights, running each rank's tokens as its own batch (DESIGN.md section 3).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ep_worker.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(scenario: str, world: int, tmp_path: Path, timeout: float = 150) -> tuple[list[dict], float]:
    """Run ``scenario`` on ``world`` ranks; returns each rank's report and the wall time."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"{scenario}{world}_rank{r}.json" for r in range(world)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(world), port, str(outs[r])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.perf_counter() - t0
    reports = []
    for r, path in enumerate(outs):
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:
            reports.append({"rank": r, "missing": True, "log": logs[r][-3000:] if r < len(logs) else ""})
    return reports, elapsed


def _failures(reports: list[dict], ranks=None) -> list[str]:
    out = []
    for rep in reports:
        if ranks is not None and rep["rank"] not in ranks:
            continue
        if rep.get("missing"):
            out.append(f"rank {rep['rank']} wrote no report:\n{rep['log']}")
        out += [f"rank {rep['rank']}: {f}" for f in rep.get("failures", [])]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_and_gradients_equal_single_process(world: int, tmp_path: Path) -> None:
    """k=1,2; capacity and dropless; E>W and E<W (sharded); every valid r; d in {1,2,4}; flat and 2dh."""
    reports, _ = run_group("equivalence", world, tmp_path)
    failures = _failures(reports)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    assert all(rep["cases"] > 20 for rep in reports)


def test_auto_chooses_and_stays_exact(tmp_path: Path) -> None:
    reports, _ = run_group("auto", 2, tmp_path)
    failures = _failures(reports)
    assert not failures, "\n".join(failures[:30])
    assert len({rep["choice"] for rep in reports}) == 1, "ranks chose different settings"
    assert reports[0]["decisions"]


def test_ddp_step_equals_single_process_step(tmp_path: Path) -> None:
    reports, _ = run_group("ddp", 2, tmp_path)
    failures = _failures(reports)
    assert not failures, "\n".join(failures[:30])


def test_mismatched_config_fails_on_every_rank(tmp_path: Path) -> None:
    reports, _ = run_group("mismatch", 2, tmp_path)
    failures = _failures(reports)
    assert not failures, "\n".join(failures)


def test_rank_that_exits_early_gives_clear_error(tmp_path: Path) -> None:
    reports, elapsed = run_group("dead_rank", 2, tmp_path, timeout=60)
    failures = _failures(reports, ranks=[0])
    assert not failures, "\n".join(failures)
    assert reports[0]["seconds"] < 6.0 + 5.0, reports[0]


def test_stalled_rank_times_out_with_clear_error(tmp_path: Path) -> None:
    reports, elapsed = run_group("stalled_rank", 2, tmp_path, timeout=60)
    failures = _failures(reports, ranks=[0])
    assert not failures, "\n".join(failures)
    assert reports[0]["seconds"] < 6.0 + 5.0, reports[0]
