"""``flexmoe bench --suite``: every target the project has set, each measured side by side and checked.

The suite is a list of :class:`SuiteCheck` s in groups. A check measures one number (usually a ratio of two
timings taken in the same run, the cases interleaved step by step) and compares it with its target. Each group
lives in the module that owns its measurement and is named in :data:`SUITE_GROUPS` as ``"module:function"``;
the function returns the group's checks. Only the groups asked for are imported, so a group whose extra is not
installed (``hf`` needs transformers) costs nothing until run, and then fails on its own line instead of
stopping the suite.

Adding a target is one :class:`SuiteCheck` in the owning module's group function.

``--device cuda`` runs every check on that device (:attr:`SuiteSettings.device`); a check whose measurement
only means something on the CPU names why in :attr:`SuiteCheck.cpu_only`, and is reported as skipped there.

``flexmoe bench --suite`` measures each check in a fresh Python process (:func:`run_suite_isolated`): in one
process a check inherits what the checks before it left in the allocator (glibc maps a block afresh, and
page-faults it on every call, or reuses it from the heap, depending on the sizes freed before), which moved the
same HF block from 0.91x to 1.09x HF's time in one full run.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Measurement", "SuiteCheck", "SuiteSettings", "SUITE_GROUPS", "suite_checks", "run_suite_checks",
           "process_units", "run_suite_isolated", "format_suite_table"]


@dataclass(frozen=True)
class SuiteSettings:
    """What every check may scale by: ``steps`` / ``warmup`` cap the timed and untimed steps per case (a
    check may use fewer), ``seed`` seeds weights and inputs, ``peers`` allows DeepSpeed / fairscale / Tutel,
    ``show`` lets a check print its progress and tables (off for ``--json``), ``device`` is where the layers and
    inputs live (``"cpu"``, ``"cuda"``, ``"cuda:1"``)."""

    steps: int = 10
    warmup: int = 3
    seed: int = 0
    peers: bool = True
    show: bool = True
    device: str = "cpu"


@dataclass
class Measurement:
    """One measured value: ``value`` in ``unit`` (e.g. ``"x floor"``), ``details`` anything the JSON report
    should keep (the full table it came from, the counts, ...), ``note`` one line for the printed table."""

    value: float
    unit: str = "x floor"
    details: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class SuiteCheck:
    """``measure(settings)`` must give a value ``<= target`` (``higher_is_better=False``) or ``>= target``.
    ``shares_previous``: the check reads what the check before it measured (one launch, two targets), so an
    isolated run measures both in the same process. ``cpu_only``: why the check means nothing off the CPU (empty:
    it runs on any device)."""

    group: str
    label: str
    target: float
    measure: Callable[[SuiteSettings], Measurement]
    higher_is_better: bool = False
    shares_previous: bool = False
    cpu_only: str = ""

    def met(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target

    def describe_target(self) -> str:
        return f"{'>=' if self.higher_is_better else '<='} {self.target:g}"


# Group name -> "module:function" returning that group's checks, in the order the suite runs them.
SUITE_GROUPS: dict[str, str] = {
    "layer": "flexmoe.apps.bench.layer:layer_checks",
    "fine-grained": "flexmoe.apps.bench.fine:fine_grained_checks",
    "decode": "flexmoe.apps.bench.fine:decode_checks",
    "compile": "flexmoe.apps.bench.compile:compile_checks",
    "hf": "flexmoe.apps.bench.hf_checks:hf_checks",
    "decode-hf": "flexmoe.apps.bench.hf_checks:decode_checks",
    "expert-parallel": "flexmoe.apps.bench.ep:ep_checks",
}


def suite_checks(groups: Sequence[str] | None = None) -> list[SuiteCheck]:
    """The checks of ``groups`` (default: all, in :data:`SUITE_GROUPS` order). Unknown names: ValueError."""
    names = list(SUITE_GROUPS) if groups is None else list(groups)
    unknown = [g for g in names if g not in SUITE_GROUPS]
    if unknown:
        raise ValueError(f"unknown suite group(s) {unknown}; the groups are {list(SUITE_GROUPS)}")
    checks: list[SuiteCheck] = []
    for name in names:
        module_name, function_name = SUITE_GROUPS[name].split(":")
        checks.extend(getattr(importlib.import_module(module_name), function_name)())
    return checks


def run_suite_checks(checks: Sequence[SuiteCheck], settings: SuiteSettings, first: int = 0,
                     total: int | None = None) -> list[dict[str, Any]]:
    """Measure each check in turn, in this process; a check that raises is reported as failed with its error,
    and the suite goes on. With ``settings.show`` each result is printed as soon as it is measured, numbered
    from ``first + 1`` of ``total`` (default: of ``len(checks)``)."""
    show = settings.show
    results = []
    for i, check in enumerate(checks):
        if show:
            print(f"[{first + i + 1}/{total or len(checks)}] {check.group}: {check.label}", flush=True)
        try:
            if check.cpu_only and settings.device != "cpu":
                result = _skipped(check, f"skipped on {settings.device}: {check.cpu_only}")
            else:
                m = check.measure(settings)
                result = _result(check, m.value, m.unit, m.note, m.details)
        except Exception as exc:  # one broken measurement must not hide the others' results
            result = _failed(check, f"error: {type(exc).__name__}: {exc}", traceback.format_exc())
        results.append(result)
        if show:
            print(f"=> {_row(result)}\n", flush=True)
    return results


def _result(check: SuiteCheck, value: float, unit: str, note: str, details: dict[str, Any]) -> dict[str, Any]:
    """One check's line of the report (what ``--json`` prints and :func:`format_suite_table` reads)."""
    return {"group": check.group, "label": check.label, "value": value, "unit": unit, "target": check.target,
            "target_text": check.describe_target(), "met": check.met(value), "note": note, "details": details}


def _failed(check: SuiteCheck, note: str, trace: str = "") -> dict[str, Any]:
    return {**_result(check, math.nan, "", note, {}), "traceback": trace}


def _skipped(check: SuiteCheck, note: str) -> dict[str, Any]:
    """Not measured on purpose (``note`` says why): neither met nor failed."""
    return {**_result(check, math.nan, "", note, {}), "skipped": True}


def process_units(checks: Sequence[SuiteCheck]) -> list[list[int]]:
    """The checks' indices cut into what each process of :func:`run_suite_isolated` measures: one check each,
    but a check with ``shares_previous`` joins the one before it."""
    units: list[list[int]] = []
    for i, check in enumerate(checks):
        if check.shares_previous and units:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def run_suite_isolated(groups: Sequence[str] | None, settings: SuiteSettings, threads: int,
                       only: Sequence[int] | None = None, timeout: float = 7200.0) -> list[dict[str, Any]]:
    """:func:`run_suite_checks` over :func:`suite_checks` ``(groups)``, each :func:`process_units` unit in a
    fresh ``python -m flexmoe.apps.bench.suite`` process of ``threads`` threads (module docstring), which
    prints its progress and writes its results as JSON. ``only``: these indices of the checks (tests). A
    process that dies or outlives ``timeout`` seconds fails its checks with the reason."""
    names = list(SUITE_GROUPS) if groups is None else list(groups)
    checks = suite_checks(names)
    wanted = set(range(len(checks)) if only is None else only)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flexmoe-suite-") as tmp:
        for unit in process_units(checks):
            unit = [i for i in unit if i in wanted]
            if not unit:
                continue
            out = Path(tmp) / f"checks-{unit[0]}.json"
            request = {"groups": names, "indices": unit, "settings": asdict(settings), "threads": threads,
                       "total": len(checks), "out": str(out)}
            try:
                proc = subprocess.run([sys.executable, "-m", "flexmoe.apps.bench.suite", json.dumps(request)],
                                      timeout=timeout)
                reason = f"error: the check's process exited with code {proc.returncode}"
            except subprocess.TimeoutExpired:
                reason = f"error: the check's process ran over {timeout:g} s and was stopped"
            if out.exists():
                results.extend(json.loads(out.read_text()))
            else:
                for i in unit:
                    results.append(_failed(checks[i], reason))
                    if settings.show:
                        print(f"=> {_row(results[-1])}\n", flush=True)
    return results


def _run_request(request: dict[str, Any]) -> None:
    """One process of :func:`run_suite_isolated`: measure the checks it names, write their results."""
    import torch

    torch.set_num_threads(request["threads"])
    checks = suite_checks(request["groups"])
    indices = request["indices"]
    results = run_suite_checks([checks[i] for i in indices], SuiteSettings(**request["settings"]),
                               first=indices[0], total=request["total"])
    Path(request["out"]).write_text(json.dumps(results))


def _row(r: dict[str, Any]) -> str:
    value = f"{r['value']:.3f} {r['unit']}" if math.isfinite(r["value"]) else "-"
    verdict = "skipped" if r.get("skipped") else "met" if r["met"] else "NOT met"
    note = f"  ({r['note']})" if r["note"] else ""
    return f"{r['group'] + ': ' + r['label']:<52} {value:>16}  target {r['target_text']:<8} {verdict}{note}"


def format_suite_table(results: Sequence[dict[str, Any]]) -> str:
    """One line per check (measured, target, met / NOT met / skipped), then how many of the measured ones were
    met."""
    met = sum(r["met"] for r in results)
    skipped = sum(bool(r.get("skipped")) for r in results)
    tail = f" ({skipped} skipped)" if skipped else ""
    return "\n".join([_row(r) for r in results] + [f"{met} of {len(results) - skipped} targets met{tail}"])


if __name__ == "__main__":
    _run_request(json.loads(sys.argv[1]))
