"""Ctrl-C (SIGINT) and SIGTERM during training: finish the step, save a checkpoint, leave with one line.

:class:`StopSignals` replaces the two signals' handlers while a training loop runs: a signal only records itself,
and the loop asks :meth:`StopSignals.received` once per step, at its end. Across ranks the answer is the same
on every rank (an all-reduce of the signal numbers), so all of them stop after the same step and save one
consistent checkpoint, whichever rank the signal reached. The loop then raises :class:`Interrupted`, which
:func:`flexmoe.apps.cli.main` prints as one line and turns into the shell's exit code for the signal (128 + its
number: 130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from flexmoe.apps.ranks import all_reduce_host

__all__ = ["StopSignals", "Interrupted", "signal_name"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped on a signal after saving; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum

    @classmethod
    def after_step(cls, label: str, signum: int, step: int, steps: int, saved: Path | None) -> Interrupted:
        """The error of a training loop that saved ``saved`` (None on ranks other than 0) after ``step``."""
        return cls(f"[{label}] {signal_name(signum)}: stopped after step {step} of {steps} and saved {saved}; "
                   f"`--resume` continues it", signum)


class StopSignals:
    """SIGINT and SIGTERM, between :meth:`install` and :meth:`restore`, are recorded instead of ending the process.

    Outside the main thread (where Python cannot set handlers) it records nothing and the signals keep their
    handlers."""

    def __init__(self) -> None:
        self.signum = 0  # the last signal received (0: none)
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in _SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:  # one the process was told to ignore stays ignored
                self._previous[s] = signal.signal(s, self._record)

    def restore(self) -> None:
        """The handlers of before :meth:`install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]  # what signal.signal returned before
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def received(self, world: int) -> int:
        """The signal any rank received so far (0: none), the same on every rank (a collective when
        ``world > 1``: every rank calls it at the same point of the step)."""
        if world == 1:
            return self.signum
        return int(all_reduce_host(torch.tensor([self.signum], dtype=torch.int64), op=dist.ReduceOp.MAX))


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``, ..."""
    return signal.Signals(signum).name
