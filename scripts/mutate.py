#!/usr/bin/env python3
"""Mutation testing by hand-written mutants: does the suite notice a plausible one-line bug?

Each mutant in ``scripts/mutants.json`` names a file, a snippet of it (which must occur exactly once) and its
replacement, the tests that cover it (pytest arguments: node ids, files, ``-k`` expressions) and a one-line
description. For each mutant this script changes a COPY of the repository (the files git tracks or would track,
copied into a temporary folder per worker; the working tree is never touched), runs the covering tests there
with ``PYTHONPATH`` pointing at the copy's ``src``, and puts the file back. A mutant is

* ``killed`` when its tests fail (or cannot even be collected, or run past ``--timeout``);
* ``SURVIVED`` when they pass: a missing test, unless the mutant carries an ``equivalent`` field saying why no
  test can tell it from the original (then it is reported as ``equivalent``);
* ``STALE`` when its snippet is not in the file (or is there more than once): the code moved and the list must
  follow, so it cannot rot silently;
* ``ERROR`` when pytest could not run its selection (no test collected, a usage error), or with ``--baseline``,
  when the selection fails without the mutant too.

The last line reads ``N killed, M survived`` (and the equivalent, stale and error counts); the exit code is 0
only when no mutant survived (equivalent ones apart) and none was stale or an error.

    python scripts/mutate.py                 # every mutant (make mutate)
    python scripts/mutate.py --only NAME -v  # one (repeatable), with the tests' output
    python scripts/mutate.py --list          # names and descriptions
    python scripts/mutate.py -j 2            # two copies, two mutants at a time
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIST = ROOT / "scripts" / "mutants.json"
_FIELDS = {"name": str, "file": str, "original": str, "replacement": str, "tests": list, "description": str}
_OPTIONAL = {"equivalent": str, "note": str}


@dataclass(frozen=True)
class Mutant:
    """One mutant: ``original`` (a snippet occurring once in ``file``, relative to the repository root) becomes
    ``replacement``; ``tests`` are the pytest arguments that should notice."""

    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str
    equivalent: str | None = None  # why no test can tell it apart (a survivor that is no missing test)
    note: str | None = None


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    status: str  # killed, SURVIVED, equivalent, STALE, ERROR
    seconds: float
    detail: str = ""


def load_mutants(path: Path) -> list[Mutant]:
    """The mutants of the JSON list at ``path``; ``ValueError`` naming the entry and the field that is wrong."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of mutants, got {type(entries).__name__}")
    mutants: list[Mutant] = []
    for i, entry in enumerate(entries):
        where = f"{path.name} entry {i} ({entry.get('name', '?') if isinstance(entry, dict) else '?'})"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = set(entry) - set(_FIELDS) - set(_OPTIONAL)
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        for field, kind in {**_FIELDS, **_OPTIONAL}.items():
            if field not in entry:
                if field in _FIELDS:
                    raise ValueError(f"{where}: field {field!r} is missing")
                continue
            if not isinstance(entry[field], kind) or (kind is str and not entry[field] and field != "replacement"):
                raise ValueError(f"{where}: field {field!r} must be a non-empty {kind.__name__}")
        if not entry["tests"] or not all(isinstance(t, str) and t for t in entry["tests"]):
            raise ValueError(f"{where}: field 'tests' must be a non-empty list of pytest arguments")
        if entry["original"] == entry["replacement"]:
            raise ValueError(f"{where}: the replacement equals the original")
        mutants.append(Mutant(entry["name"], entry["file"], entry["original"], entry["replacement"],
                              tuple(entry["tests"]), entry["description"], entry.get("equivalent"),
                              entry.get("note")))
    names = [m.name for m in mutants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path.name}: mutant names must be unique, repeated: {repeated}")
    return mutants


def copy_repository(dest: Path) -> None:
    """The files git tracks or would track (not ignored: no .venv, no runs, no caches) into ``dest``, as they are
    in the working tree now (uncommitted edits included)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _pytest(copy: Path, tests: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """pytest on ``tests`` in ``copy`` with the copy's src first on the path; (exit code or None on timeout,
    its output)."""
    # The copy's src only: a PYTHONPATH of the caller's would point back at the unmutated tree. No bytecode
    # files: a mutant of the same size written within the same second as the original could be served the
    # original's cached bytecode.
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", *tests]
    try:
        done = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out
    return done.returncode, done.stdout + done.stderr


def _stale(mutant: Mutant, root: Path) -> str | None:
    """Why ``mutant`` does not apply to the tree at ``root`` (None: its original text occurs once)."""
    path = root / mutant.file
    if not path.is_file():
        return f"{mutant.file} does not exist"
    count = path.read_text().count(mutant.original)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times (it must be unique)"
        return f"its original text is {where} in {mutant.file}"
    return None


def run_mutant(mutant: Mutant, copy: Path, timeout: float, baseline: bool) -> tuple[Outcome, str]:
    """Apply ``mutant`` in ``copy``, run its tests, restore the file; its outcome and the tests' output."""
    t0 = time.monotonic()
    why = _stale(mutant, copy)
    if why:
        return Outcome(mutant, "STALE", 0.0, why), ""
    path = copy / mutant.file
    text = path.read_text()
    if baseline:
        code, out = _pytest(copy, mutant.tests, timeout)
        if code != 0:
            return Outcome(mutant, "ERROR", time.monotonic() - t0,
                           f"its tests fail without the mutant (pytest exit {code})"), out
    path.write_text(text.replace(mutant.original, mutant.replacement))
    try:
        code, out = _pytest(copy, mutant.tests, timeout)
    finally:
        path.write_text(text)
    seconds = time.monotonic() - t0
    if code is None:
        return Outcome(mutant, "killed", seconds, f"the tests ran past {timeout:g} s"), out
    if code == 0:
        status = "equivalent" if mutant.equivalent else "SURVIVED"
        return Outcome(mutant, status, seconds, mutant.equivalent or mutant.note or ""), out
    if code in (1, 2):  # tests failed, or collection broke (the mutant made an import fail)
        return Outcome(mutant, "killed", seconds, "" if code == 1 else "collection failed"), out
    # 3 internal error, 4 usage error (a test path that does not exist), 5 no test collected
    return Outcome(mutant, "ERROR", seconds, f"pytest exit {code}: the selection {list(mutant.tests)} did not run"), out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mutants", type=Path, default=DEFAULT_LIST, help="the JSON list (default: %(default)s)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run this mutant only (repeatable)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="mutants at a time, one copy each (default: 1)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one mutant's tests may run; past it the mutant counts as killed (default: 900)")
    parser.add_argument("--baseline", action="store_true",
                        help="run each selection without its mutant first: it must pass (twice the time)")
    parser.add_argument("--list", action="store_true", help="print the mutants' names and descriptions, run nothing")
    parser.add_argument("--check", action="store_true",
                        help="only check that every mutant's original text occurs once in its file (no tests run)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the tests' output of each mutant")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"-j/--jobs must be >= 1, got {args.jobs}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        mutants = load_mutants(args.mutants)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutants})
        if unknown:
            print(f"error: --only: no mutant named {unknown} in {args.mutants}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:34} {m.file}: {m.description}")
        return 0

    if args.check:
        stale = [(m, _stale(m, ROOT)) for m in mutants]
        for m, why in stale:
            if why:
                print(f"STALE      {m.name:34} ({why})")
        print(f"{sum(why is None for _, why in stale)} of {len(stale)} mutants apply")
        return 1 if any(why for _, why in stale) else 0

    jobs = min(args.jobs, len(mutants)) or 1
    print(f"{len(mutants)} mutants, {jobs} at a time, each in a copy of {ROOT}", flush=True)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="flexmoe-mutate-") as tmp:
        copies: queue.Queue[Path] = queue.Queue()
        for i in range(jobs):
            copy = Path(tmp) / f"copy{i}"
            copy_repository(copy)
            copies.put(copy)

        def one(mutant: Mutant) -> None:
            copy = copies.get()
            try:
                outcome, output = run_mutant(mutant, copy, args.timeout, args.baseline)
            finally:
                copies.put(copy)
            with lock:
                outcomes.append(outcome)
                detail = f"  ({outcome.detail})" if outcome.detail else ""
                print(f"{outcome.status:10} {mutant.name:34} {outcome.seconds:6.1f} s  {mutant.description}{detail}",
                      flush=True)
                if args.verbose or outcome.status == "ERROR":
                    print(output[-6000:], flush=True)

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, mutants))

    counts = {s: sum(o.status == s for o in outcomes) for s in ("killed", "SURVIVED", "equivalent", "STALE", "ERROR")}
    summary = f"{counts['killed']} killed, {counts['SURVIVED']} survived"
    extra = [f"{counts[s]} {s.lower()}" for s in ("equivalent", "STALE", "ERROR") if counts[s]]
    print(", ".join([summary, *extra]))
    return 1 if counts["SURVIVED"] or counts["STALE"] or counts["ERROR"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
