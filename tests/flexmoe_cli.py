"""Running the ``flexmoe`` command as a user does: ``python -m flexmoe ...`` in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys


def run_flexmoe(*argv: str, timeout: float = 120, check: bool = False,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m flexmoe ARGV`` with this interpreter; its exit code and text output. ``check``: raise on a
    non-zero exit; ``env``: the child's whole environment (None: this process's)."""
    return subprocess.run([sys.executable, "-m", "flexmoe", *argv], capture_output=True, text=True,
                          timeout=timeout, check=check, env=env)


def check_usage_error(*argv: str, says: str) -> subprocess.CompletedProcess:
    """Run ``flexmoe ARGV`` and assert that it stops with a usage error (exit code 2) whose stderr contains
    ``says``; returns the finished process for further checks."""
    out = run_flexmoe(*argv)
    assert out.returncode == 2 and says in out.stderr, out.stderr[-3000:]
    return out


def child_pythonpath(first: object) -> str:
    """PYTHONPATH for a child process: ``first`` (e.g. the repository's src), then what the tests set
    (tests/conftest.py: the children's sitecustomize, which picks the experts' kernels by rule)."""
    return os.pathsep.join(p for p in (str(first), os.environ.get("PYTHONPATH", "")) if p)
