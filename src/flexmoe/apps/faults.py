"""Faults injected on purpose (``flexmoe train --inject-fault KIND:RANK:STEP``): how the tests and the restart
benchmark make one rank of a running job die or hang at a known point, with no person in the loop.

``KIND`` is one of :data:`FAULT_KINDS`:

* ``kill``: rank ``RANK`` sends itself SIGKILL as step ``STEP`` begins (as ``kill -9`` from outside would);
* ``kill-in-save``: rank ``RANK`` sends itself SIGKILL while the checkpoint of step ``STEP`` is being written,
  after its files are written and before the checkpoint is complete (renamed into place, or its ``meta.json``
  written);
* ``hang``: rank ``RANK`` sleeps inside step ``STEP`` (before its forward pass, so the others wait for it in a
  collective) until a signal ends it; ``--collective-timeout`` bounds how long the others wait.

A fault fires on the workers' first start only (:func:`flexmoe.apps.ranks.restart_attempt` is 0): the restarted
workers (``torchrun --max-restarts``, ``flexmoe train --nproc N --max-restarts R``) run the same command line and
pass the same step unharmed, so the finished run can be compared with one that was never interrupted. Before
dying, the rank prints one line ``fault: ...`` with the time (what the benchmark measures the restart from).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass

from flexmoe.apps.ranks import restart_attempt

__all__ = ["FAULT_KINDS", "Fault", "parse_fault", "FAULT", "fault_at"]

FAULT_KINDS = ("kill", "kill-in-save", "hang")


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` meets fault ``kind`` at 1-based step ``step``."""

    kind: str
    rank: int
    step: int

    def fire(self, stop_requested: object = None) -> None:
        """Meet the fault now: SIGKILL this process, or (``hang``) sleep until SIGINT / SIGTERM, then exit with the
        shell's code for it. ``stop_requested``: an object whose ``signum`` attribute a signal handler sets
        (:class:`flexmoe.apps.interrupt.StopSignals`), so that the launcher's SIGTERM ends the hang at once."""
        print(f"fault: rank {self.rank} {'hangs' if self.kind == 'hang' else 'is killed (SIGKILL)'} at step "
              f"{self.step} ({self.kind}, time {time.time():.3f})", flush=True)
        if self.kind != "hang":
            os.kill(os.getpid(), signal.SIGKILL)
        while not getattr(stop_requested, "signum", 0):
            time.sleep(0.05)
        os._exit(128 + int(getattr(stop_requested, "signum", signal.SIGTERM)))


def parse_fault(text: str) -> Fault:
    """``KIND:RANK:STEP`` as a :class:`Fault`; :class:`ValueError` naming ``--inject-fault`` and what it takes."""
    parts = text.split(":")
    usage = (f"--inject-fault takes KIND:RANK:STEP with KIND one of {', '.join(FAULT_KINDS)}, RANK >= 0 and "
             f"STEP >= 1, got {text!r}")
    if len(parts) != 3 or parts[0] not in FAULT_KINDS:
        raise ValueError(usage)
    try:
        rank, step = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(usage) from None
    if rank < 0 or step < 1:
        raise ValueError(usage)
    return Fault(parts[0], rank, step)


def FAULT(text: str) -> str:  # noqa: N802  (named as the other flag value kinds of flexmoe.apps.flags)
    """``--inject-fault``'s value kind: the text, checked (:func:`parse_fault`)."""
    try:
        parse_fault(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def fault_at(spec: str | None, kind: str, rank: int, step: int) -> Fault | None:
    """The fault of ``spec`` (``--inject-fault``'s value, None: none) if it is of ``kind`` and meets ``rank`` at
    ``step`` on the workers' first start; else None."""
    if spec is None:
        return None
    fault = parse_fault(spec)
    if (fault.kind, fault.rank, fault.step) != (kind, rank, step) or restart_attempt() != 0:
        return None
    return fault
