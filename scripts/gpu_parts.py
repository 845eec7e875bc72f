"""The parts of `make test-gpu` (scripts/test_gpu.sh) that issue 41 names, found among the device tests.

    python scripts/gpu_parts.py check            every part's tests are collected (`pytest --collect-only`)
    python scripts/gpu_parts.py report FILE.xml  each part's verdict from the device run's JUnit report

The device run is one `pytest -m device --device cuda` over every device test; these parts are read out of its
report so that a part whose tests were renamed away, skipped or expected to fail does not pass unseen. A part
passes when at least one of its tests ran and every one of them passed. Exit status: 0 when every part passes
(``check``: is collected), 1 otherwise, 2 for a usage error. Standard library only, besides pytest for ``check``.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Part -> its pytest node ids (a file: every test in it). The parametrisation ids are the tests' own.
PARTS: dict[str, list[str]] = {
    "sync-check (no host read in the layer's calls)": ["tests/test_gpu_sync.py"],
    "cuda-graphs (captured layer call, compiled generate)": ["tests/test_cuda_graphs.py"],
    "gloo-ranks (two ranks on one GPU equal one process)": [
        "tests/test_train_device.py::test_two_gloo_ranks_train_as_one_process",
        "tests/test_expert_parallel.py::test_expert_parallel_on_one_device[2 ranks over gloo]",
    ],
    "nccl-world-1 (one rank on the device's own backend)": [
        "tests/test_expert_parallel.py::test_expert_parallel_on_one_device[1 rank]",
    ],
}


def _matches(node_id: str, file: str, name: str) -> bool:
    """Whether the test ``name`` of ``file`` (a path below the root) is the node id ``node_id`` or in it."""
    path, _, test = node_id.partition("::")
    return path == file and (not test or test == name)


def part_of(file: str, name: str) -> str | None:
    for part, ids in PARTS.items():
        if any(_matches(node_id, file, name) for node_id in ids):
            return part
    return None


def check(python: str) -> int:
    """Collect every part's node ids as the device run would (``-m device``); print the count per part."""
    ids = [node_id for node_ids in PARTS.values() for node_id in node_ids]
    done = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-m", "device", "-p", "no:cacheprovider",
                           *ids], cwd=ROOT, capture_output=True, text=True)
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    counts = dict.fromkeys(PARTS, 0)
    for line in collected:
        file, _, name = line.partition("::")
        part = part_of(file, name)
        if part is not None:
            counts[part] += 1
    for part, n in counts.items():
        print(f"  {part}: {n} test(s) collected")
    missing = [part for part, n in counts.items() if n == 0]
    if done.returncode != 0 or missing:
        print(f"gpu-parts: not collected: {missing or 'see pytest'}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return 1
    return 0


def report(junit_xml: Path) -> int:
    """Each part's tests in the JUnit report: counts by outcome and the verdict; 1 if any part did not pass."""
    outcomes: dict[str, dict[str, int]] = {part: {} for part in PARTS}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # pytest writes the classname of tests/x.py's test as "tests.x"
        file = case.get("classname", "").replace(".", "/") + ".py"
        part = part_of(file, case.get("name", ""))
        if part is None:
            continue
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        outcomes[part][outcome] = outcomes[part].get(outcome, 0) + 1
    failed = 0
    for part, counts in outcomes.items():
        passed = bool(counts) and set(counts) == {"passed"}
        failed += not passed
        what = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ran"
        print(f"{'passed' if passed else 'NOT passed'}: {part}: {what}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        return check(sys.executable)
    if argv[:1] == ["report"] and len(argv) == 2:
        if not Path(argv[1]).is_file():
            print(f"gpu-parts: report: no JUnit file {argv[1]}", file=sys.stderr)
            return 2
        return report(Path(argv[1]))
    print("usage: gpu_parts.py check | report JUNIT_XML", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
