"""The `flexmoe` command without the train extra (tqdm, matplotlib, scikit-learn): a subcommand that needs a module
of it answers with one line naming ``pip install 'flexmoe[train]'`` and exit 2, before doing any work; one that
does not (or whose flags turn that use off) runs as before.

The extra is made unimportable in a fresh interpreter by a finder placed first on ``sys.meta_path`` that refuses
the blocked names, as a missing package would be refused; flexmoe itself is not told.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmoe.apps import cli
from flexmoe_cli import child_pythonpath

ROOT = Path(__file__).resolve().parents[1]

RUN_WITHOUT = (
    "import importlib.abc, sys\n"
    "BLOCKED = set(sys.argv[1].split(','))\n"
    "class Uninstalled(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in BLOCKED:\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "        return None\n"
    "sys.meta_path.insert(0, Uninstalled())\n"
    "from flexmoe.apps import cli\n"
    "sys.exit(cli.main(sys.argv[2:]))\n"
)


def _flexmoe_without(blocked: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT, blocked, *argv], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


@pytest.mark.parametrize("blocked,argv,missing", [
    ("matplotlib", ["train", "--out", "run", "--steps", "1", "--no-progress"], "matplotlib"),
    ("matplotlib,tqdm", ["train", "--out", "run", "--steps", "1"], "tqdm and matplotlib"),
    ("matplotlib", ["simulate", "--gpus", "8", "--plot", "sim.png"], "matplotlib"),
])
def test_a_command_that_needs_the_extra_says_so_in_one_line(tmp_path: Path, blocked: str, argv: list[str],
                                                            missing: str) -> None:
    proc = _flexmoe_without(blocked, *argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"error: flexmoe {argv[0]} needs {missing}, which this environment lacks: pip install 'flexmoe[train]'"]
    assert list(tmp_path.iterdir()) == []  # refused before any work: no run directory, no plot


def test_without_the_extra_help_and_flags_that_turn_its_use_off_still_work(tmp_path: Path) -> None:
    assert _flexmoe_without("matplotlib,tqdm", "train", "--help", cwd=tmp_path).returncode == 0
    proc = _flexmoe_without("matplotlib", "simulate", "--gpus", "8", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GPUs" in proc.stdout


def test_every_flag_that_turns_the_extra_off_is_a_flag_of_its_command() -> None:
    for command, needs in cli.TRAIN_EXTRA_NEEDS.items():
        parser = cli.build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        dests = {a.dest for a in sub._actions}
        for module, off in needs:
            assert off is None or off in dests, f"{command}: {module} is turned off by {off!r}, not a flag"
