"""The family routing options under expert parallelism, with real processes (gloo on 127.0.0.1).

2 and 4 ranks equal one process (each rank's tokens as its own batch, expert gradients summed over the
ranks) for sigmoid scores, group-limited selection with the selection bias and route_scale, the shared
experts' own hidden size and sigmoid gate, per-sequence capacity with the sequence-wise loss and a router
bias, and GPT-OSS's clamped unit on hidden-dim shards; with ``balance="bias"`` every rank moves the bias by
the global load (tests/routing_families_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from multiproc import failures_of, run_ranks

WORKER = Path(__file__).with_name("routing_families_worker.py")


@pytest.mark.parametrize("world", [2, 4])
def test_family_options_equal_single_process(world: int, tmp_path: Path) -> None:
    reports = run_ranks(WORKER, "families", world, tmp_path)
    failures = failures_of(reports)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    assert all(rep["cases"] == 12 for rep in reports)
