#!/usr/bin/env python3
"""The lock file of the README's commands: what `make setup` installs, one exact version per package.

``requirements.lock`` is a pip constraints file (``name==version`` lines): `make setup` installs with
``pip install -c requirements.lock``, so every package that the project's ranges admit is held at the version the
last green CI had, and a package the lock does not name (a CUDA runtime that a GPU build of torch pulls in) is left
to torch's own exact pins. pip reads it and ``pip freeze`` writes it, so the lock needs no tool beyond the one that
installs; its pins name releases, not files: torch's local label (``+cpu``, ``+cu126``) is dropped, so the same
lock gives the CPU build on a CPU machine and the CUDA build where that is what pip finds.

    python scripts/lock.py write VENV_PYTHON > requirements.lock   # make lock: freeze a fresh environment
    python scripts/lock.py check VENV_PYTHON requirements.lock     # make setup: the environment equals the lock
    python scripts/lock.py oldest pyproject.toml                   # make test-oldest: every lower bound, pinned

"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

HEADER = """\
# requirements.lock: the exact versions `make setup` installs (pip constraints, `pip install -c`).
# Written by `make lock` (scripts/lock.py write); checked after every `make setup` (scripts/lock.py check).
# The package's own dependency ranges stay in pyproject.toml; this file only pins what our commands install.
# torch's pin names the release: the CPU or CUDA build is whichever pip finds for it (README, "Torch builds").
"""

# Lines of a freeze that name no installable release: the editable project itself.
_EDITABLE = re.compile(r"^(-e |# Editable install)")


def parse_pins(lines: Iterable[str]) -> dict[str, str]:
    """``{normalized name: version}`` of ``name==version`` lines; comments, blanks and editables are skipped,
    any other line (a URL, a range) is a ValueError naming it: a lock pins exact releases only."""
    pins: dict[str, str] = {}
    for raw in lines:
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or _EDITABLE.match(line):
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip() or any(c in version for c in "<>=!~*,; "):
            raise ValueError(f"lock line {raw.strip()!r}: expected 'name==version'")
        pins[normalize(name)] = release(version.strip())
    return pins


def normalize(name: str) -> str:
    """PEP 503's normal form of a project name (``Scikit_Learn`` -> ``scikit-learn``)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def release(version: str) -> str:
    """A version without its local label (``2.13.0+cpu`` -> ``2.13.0``): the lock names releases, not builds."""
    return version.split("+", 1)[0]


def freeze(python: str) -> list[str]:
    """``pip freeze --all`` of the environment of interpreter ``python`` (pip, setuptools and wheel included: the
    lock holds the installer too), the editable project left out."""
    done = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"],
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def lock_text(frozen: Iterable[str]) -> str:
    """The lock file's text for a freeze: the header, then ``name==release`` sorted by name."""
    pins = parse_pins(frozen)
    pins.pop("flexmoe", None)
    return HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def differences(installed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """What differs between an environment's pins and the lock's, one readable line each (empty: equal)."""
    installed = {k: v for k, v in installed.items() if k != "flexmoe"}
    lines = []
    for name in sorted(set(installed) | set(locked)):
        have, want = installed.get(name), locked.get(name)
        if have == want:
            continue
        if want is None:
            lines.append(f"{name}=={have} is installed but not in the lock")
        elif have is None:
            lines.append(f"{name}=={want} is locked but not installed")
        else:
            lines.append(f"{name}: installed {have}, locked {want}")
    return lines


_LOWER_BOUND = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*$")


def lower_bounds(requirements: Iterable[str]) -> dict[str, str]:
    """``{name: lowest version}`` of requirement strings of the form ``name>=X`` (``name[extra]>=X``); the
    project's own extras (``flexmoe[hf]``) name no version and are skipped; any other form is a ValueError: each
    declared dependency must have a lower bound that `make test-oldest` can try."""
    bounds: dict[str, str] = {}
    for req in requirements:
        req = req.split(";", 1)[0].strip()
        if normalize(req.split("[", 1)[0]) == "flexmoe":
            continue
        match = _LOWER_BOUND.match(req)
        if match is None:
            raise ValueError(f"dependency {req!r}: expected 'name>=version' (a lower bound, no upper one, no other "
                             "clause), so that make test-oldest can pin it")
        bounds[normalize(match.group(1))] = match.group(3)
    return bounds


def oldest_constraints(pyproject: Path) -> str:
    """Constraints that pin every dependency declared in ``pyproject`` (the package's and every extra's) to its
    lower bound; what those pull in themselves is left to the resolver."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements.extend(extra)
    bounds = lower_bounds(requirements)
    return "".join(f"{name}=={version}\n" for name, version in sorted(bounds.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="print the lock of the environment of PYTHON")
    write.add_argument("python")
    check = sub.add_parser("check", help="exit 1 unless the environment of PYTHON equals LOCK")
    check.add_argument("python")
    check.add_argument("lock", type=Path)
    oldest = sub.add_parser("oldest", help="print constraints at every declared lower bound")
    oldest.add_argument("pyproject", type=Path)
    args = parser.parse_args(argv)
    if args.command == "write":
        sys.stdout.write(lock_text(freeze(args.python)))
    elif args.command == "check":
        diff = differences(parse_pins(freeze(args.python)), parse_pins(args.lock.read_text().splitlines()))
        if diff:
            print(f"the environment of {args.python} differs from {args.lock}:", *diff, sep="\n  ", file=sys.stderr)
            return 1
        print(f"{args.python}: every package at its version in {args.lock}")
    else:
        sys.stdout.write(oldest_constraints(args.pyproject))
    return 0


if __name__ == "__main__":
    sys.exit(main())
