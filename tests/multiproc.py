"""Running a test worker script as W real processes (gloo on 127.0.0.1, a free port per launch).

A worker is ``python WORKER SCENARIO RANK WORLD PORT OUT_JSON``: it joins the group, runs the scenario and
writes its report (``{"rank": r, "failures": [...], ...}``) to OUT_JSON. Many cases run inside one launch,
because starting a process (importing torch) costs seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Path | str, scenario: str, world: int, tmp_path: Path, timeout: float = 150) -> list[dict]:
    """Run ``scenario`` of ``worker`` on ``world`` ranks; each rank's report. A rank that wrote none (it
    crashed or was killed at the timeout) gets ``{"rank": r, "missing": True, "failures": [its log]}``."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    name = Path(worker).stem
    outs = [tmp_path / f"{name}-{scenario}{world}_rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(worker), scenario, str(r), str(world), port, str(outs[r])],
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
    reports = []
    for r, path in enumerate(outs):
        if path.exists():
            reports.append(json.loads(path.read_text()))
        else:
            log = logs[r][-3000:] if r < len(logs) else ""
            reports.append({"rank": r, "missing": True, "failures": [f"wrote no report:\n{log}"]})
    return reports


def failures_of(reports: list[dict], ranks: list[int] | None = None) -> list[str]:
    """Every failure line of the reports (of ``ranks`` only, if given), prefixed with its rank."""
    return [f"rank {rep['rank']}: {f}" for rep in reports if ranks is None or rep["rank"] in ranks
            for f in rep.get("failures", [])]
