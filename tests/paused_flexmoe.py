"""``python tests/paused_flexmoe.py STEP ARGV...``: the ``flexmoe`` command (``python -m flexmoe ARGV...``) whose
training loop, at the end of step STEP, waits until a stop signal (SIGINT / SIGTERM) has arrived.

The signal tests (tests/test_cli.py) send their signal once the run has logged STEP steps; a run that kept going
could finish all its steps first on a fast or idle machine (it did: 60 steps in 0.5 s). Here the run cannot: it
stops after step STEP whatever the scheduler does. The wait sits in
:meth:`flexmoe.apps.interrupt.StopSignals.received`, which every training loop (GPT, Hugging Face, vision) asks
once per step, after the step's metrics are written; with ``--nproc N`` every rank runs this script too (the
launcher is patched to start it instead of ``-m flexmoe``), and each rank waits for the signal the launcher
passes on to it.

A test that kills the run (SIGKILL) uses the same wait: the run stands still in step STEP, its checkpoints of the
steps before it written.
A run that got no signal within :data:`WAIT_S` seconds exits with code 3 and says so: a broken test fails, it does
not hang.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence

import flexmoe.launch
from flexmoe.apps import cli
from flexmoe.apps.interrupt import StopSignals

WAIT_S = 300.0


def pause_at(step: int) -> None:
    """Make the ``step``-th call of every :class:`StopSignals`' ``received`` wait for a signal first."""
    received = StopSignals.received
    calls = 0

    def waiting_received(self: StopSignals, world: int) -> int:
        nonlocal calls
        calls += 1
        if calls == step:
            deadline = time.monotonic() + WAIT_S
            while self.signum == 0:  # the handler (main thread, between two sleeps) sets it
                if time.monotonic() > deadline:
                    print(f"paused_flexmoe: no signal within {WAIT_S:g} s of step {step}", file=sys.stderr,
                          flush=True)
                    raise SystemExit(3)
                time.sleep(0.01)
        return received(self, world)

    StopSignals.received = waiting_received  # type: ignore[method-assign]


def pass_pause_to_ranks(step: int) -> None:
    """``--nproc N``: start each rank as this script with the same pause, not as ``python -m flexmoe``."""
    launch_ranks = flexmoe.launch.launch_ranks

    def paused_ranks(nproc: int, python_args: Sequence[str], **kwargs: float) -> int:
        assert list(python_args[:2]) == ["-m", "flexmoe"], python_args
        return launch_ranks(nproc, [__file__, str(step), *python_args[2:]], **kwargs)

    flexmoe.launch.launch_ranks = paused_ranks


def start_with_default_stop_signals() -> None:
    """SIGINT and SIGTERM as a Python started from a terminal has them. A suite run as a background job inherits
    SIGINT ignored (a non-interactive shell ignores it for its ``&`` jobs), and flexmoe rightly leaves an ignored
    signal ignored: the victim would never stop, and its test would measure how the suite was launched."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    start_with_default_stop_signals()
    pause_step = int(sys.argv[1])
    pause_at(pause_step)
    pass_pause_to_ranks(pause_step)
    raise SystemExit(cli.main(sys.argv[2:]))
