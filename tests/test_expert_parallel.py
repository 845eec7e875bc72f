"""Expert parallelism with real processes (gloo on 127.0.0.1, a free port per test).

Each test starts W processes of tests/ep_worker.py, which run many cases inside one process group (starting
processes costs seconds) and report their failures. The reference is one process holding all experts with
the same global weights, running each rank's tokens as its own batch (DESIGN.md section 3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multiproc import failures_of, run_ranks

WORKER = Path(__file__).with_name("ep_worker.py")


def run_group(scenario: str, world: int, tmp_path: Path, timeout: float = 150) -> list[dict]:
    return run_ranks(WORKER, scenario, world, tmp_path, timeout)


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_and_gradients_equal_single_process(world: int, tmp_path: Path) -> None:
    """k=1,2; capacity and dropless; E>W and E<W (sharded); every valid r; d in {1,2,4}; flat and 2dh."""
    reports = run_group("equivalence", world, tmp_path)
    failures = failures_of(reports)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    assert all(rep["cases"] > 20 for rep in reports)


def test_auto_chooses_and_stays_exact(tmp_path: Path) -> None:
    reports = run_group("auto", 2, tmp_path)
    failures = failures_of(reports)
    assert not failures, "\n".join(failures[:30])
    assert len({rep["choice"] for rep in reports}) == 1, "ranks chose different settings"
    assert reports[0]["decisions"]


def test_ddp_step_equals_single_process_step(tmp_path: Path) -> None:
    reports = run_group("ddp", 2, tmp_path)
    failures = failures_of(reports)
    assert not failures, "\n".join(failures[:30])


def test_mismatched_config_fails_on_every_rank(tmp_path: Path) -> None:
    reports = run_group("mismatch", 2, tmp_path)
    failures = failures_of(reports)
    assert not failures, "\n".join(failures)


def test_rank_that_exits_early_gives_clear_error(tmp_path: Path) -> None:
    reports = run_group("dead_rank", 2, tmp_path, timeout=60)
    failures = failures_of(reports, ranks=[0])
    assert not failures, "\n".join(failures)
    assert reports[0]["seconds"] < 6.0 + 5.0, reports[0]


def test_stalled_rank_times_out_with_clear_error(tmp_path: Path) -> None:
    reports = run_group("stalled_rank", 2, tmp_path, timeout=60)
    failures = failures_of(reports, ranks=[0])
    assert not failures, "\n".join(failures)
    assert reports[0]["seconds"] < 6.0 + 5.0, reports[0]


@pytest.mark.parametrize("world", [2, 4])
def test_exchanges_are_freed_after_backward(world: int, tmp_path: Path) -> None:
    reports = run_group("no_leak", world, tmp_path)
    failures = failures_of(reports)
    assert not failures, "\n".join(failures)
