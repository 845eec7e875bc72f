"""The distributed test harness: a multi-rank scenario of tests/scenario_worker.py run as W real processes
(gloo on 127.0.0.1, a free port per run, started by :func:`flexmoe.launch.spawn_ranks`; NCCL with one GPU per
rank for a scenario run on CUDA).

Every rank runs :func:`rank_main`, the one worker entry point: it joins the group, runs the scenario and returns
its report (``{"rank": r, "failures": [...], ...}``). The named pytest cases are in tests/test_expert_parallel.py.
"""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from flexmoe.launch import RankResult, spawn_ranks


@dataclass(frozen=True)
class Scenario:
    """One multi-rank case: ``scenario_worker.SCENARIOS[name]`` on ``world`` ranks.

    collective_timeout: seconds a collective may wait for a peer (short, so a broken group fails fast).
    teardown: destroy the process group at the end (not when a peer is gone on purpose: that would wait).
    ranks: whose failures count (None: every rank's).
    device_type: "cpu" or "cuda" (rank r on GPU r modulo the GPUs there are; the scenario reads it from its
    report's ``device_type``).
    backend: the group's, None: NCCL on CUDA, gloo on the CPU ("gloo" with "cuda": CUDA tensors over gloo, so
    that several ranks may share one GPU).
    """

    name: str
    world: int
    claim: str  # what the case shows, the start of its assertion message
    collective_timeout: float = 6.0
    timeout: float = 150.0
    teardown: bool = True
    ranks: tuple[int, ...] | None = None
    device_type: str = "cpu"
    backend: str | None = None

    @property
    def id(self) -> str:
        return f"{self.name}-w{self.world}"


def kernels_by_rule() -> None:
    """In a spawned rank, what tests/conftest.py does in the test process: the experts' kernels by the rule (the
    loop), nothing timed, no cache file read or written."""
    from flexmoe.experts.chooser import KernelChooser

    KernelChooser.default_timer = None
    KernelChooser.default_cache_dir = None


def rank_main(name: str, collective_timeout: float, teardown: bool, device_type: str = "cpu",
              backend: str | None = None) -> dict:
    """One rank of a scenario (run by spawn_ranks, rendezvous in the environment); its report."""
    import os

    import torch
    import torch.distributed as dist

    kernels_by_rule()

    from scenario_worker import SCENARIOS

    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["RANK"]) % torch.cuda.device_count())
    backend = backend or ("nccl" if device_type == "cuda" else "gloo")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank, "device_type": device_type}
    t0 = time.perf_counter()
    try:
        SCENARIOS[name](rank, world, out)
    except Exception:
        out["failures"] = [*out.get("failures", []), traceback.format_exc()]
    out.setdefault("seconds", time.perf_counter() - t0)
    if teardown:
        dist.destroy_process_group()
    return out


def run_scenario(case: Scenario) -> list[dict]:
    """Every rank's report. A rank that returned none (it crashed, exited early or was killed at the timeout)
    gets ``{"rank": r, "missing": True, "failures": [its exit code and stderr]}``."""
    ranks = spawn_ranks(case.world, rank_main, [case.name, case.collective_timeout, case.teardown, case.device_type,
                                                    case.backend],
                        timeout=case.timeout, check=False, what=f"scenario {case.id}")
    return [r.value if r.value is not None else {"rank": r.rank, "missing": True, "failures": [_no_report(r, case)]}
            for r in ranks]


def _no_report(rank: RankResult, case: Scenario) -> str:
    how = (f"exited with {rank.exit_code}" if rank.exit_code is not None else
           f"was killed (the case's {case.timeout:.0f} s were up, or a peer had failed)")
    return f"returned no report: it {how}; its output:\n{rank.stdout[-1500:]}{rank.stderr[-3000:]}"


def failures_of(reports: list[dict], ranks: tuple[int, ...] | None = None) -> list[str]:
    """Every failure line of the reports (of ``ranks`` only, if given), prefixed with its rank."""
    return [f"rank {rep['rank']}: {f}" for rep in reports if ranks is None or rep["rank"] in ranks
            for f in rep.get("failures", [])]


def check_ranks_pass(world: int, main: Callable[..., dict], args: list, what: str, timeout: float = 240.0) -> None:
    """Run ``main(*args)`` on ``world`` gloo ranks (each returns ``{"rank": r, "failures": [...]}``); fail with
    every rank's failure lines unless all ranks report none and each reported its own rank."""
    reports = [r.value for r in spawn_ranks(world, main, args, timeout=timeout, check=True, what=what)]
    failures = failures_of(reports)
    assert not failures, "\n".join(failures)
    assert [rep["rank"] for rep in reports] == list(range(world))
