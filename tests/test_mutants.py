"""scripts/mutants.json follows the code: every mutant's snippet occurs exactly once in the file it names, so that
``make mutate`` (not part of CI: minutes) still applies each one. Three had gone stale unnoticed before this test;
it runs the script's own ``--check``, which reads the files and runs no tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_still_applies_to_the_code_it_names() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutate.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "STALE" not in result.stdout, result.stdout
