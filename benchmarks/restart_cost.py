"""What a dead or hung rank costs the main job: the time from the fault to training again, and the work lost.

    .venv/bin/python benchmarks/restart_cost.py [--nproc 2] [--fault-at 75] [--ckpt-every 50] [--timeout 10]

Runs ``flexmoe train`` (the main job: the default MoE GPT on tiny Shakespeare, ``--log-every 1``) three times at
``--nproc`` ranks, each with one fault injected at step ``--fault-at`` (``--inject-fault``, on the first start
only) and one restart allowed:

* ``torchrun --max-restarts 1``, rank 1 killed (SIGKILL);
* ``flexmoe train --nproc N --max-restarts 1`` (flexmoe's own launcher), rank 1 killed;
* ``torchrun --max-restarts 1`` with ``--collective-timeout``, rank 1 hung inside the step.

For each it prints: the seconds from the fault (the time the rank printed as it died or began to hang) to the
"resumed from" line (the restarted ranks loaded the checkpoint), and to the first step trained after the restart
(its metrics record appearing in ``metrics.jsonl``); the steps lost (the fault's step less the checkpoint's) and
the seconds it took to train them again. Wall clock on whatever machine it runs on; a fresh interpreter that
imports torch is most of the restart.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--fault-at", type=int, default=75, help="the step the fault meets (default: 75)")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (default: 50)")
    p.add_argument("--after", type=int, default=10,
                   help="steps trained past the fault's step before the run ends (default: 10)")
    p.add_argument("--timeout", type=float, default=10.0, help="--collective-timeout of the hang (default: 10)")
    args = p.parse_args()
    if not 1 <= args.ckpt_every < args.fault_at:
        p.error("--ckpt-every must be >= 1 and below --fault-at (a checkpoint before the fault)")
    return args


class MetricsWatch(threading.Thread):
    """Polls ``metrics.jsonl`` and stamps when each step's record first appears after :attr:`since`; when the
    file goes back to fewer steps (the resumed run keeps the records up to its checkpoint), the stamps start
    over, so a step trained again is stamped when its new record appears."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.since, self.seen = path, float("inf"), {}  # step -> time its record appeared
        self.done = threading.Event()

    def run(self) -> None:
        last = 0
        while not self.done.is_set():
            now = time.time()
            if now >= self.since and self.path.is_file():
                steps = []
                for line in self.path.read_text().splitlines():
                    try:
                        steps.append(json.loads(line)["step"])
                    except (ValueError, KeyError):
                        continue  # a line being written
                if steps and max(steps) < last:
                    self.seen.clear()
                last = max(steps, default=last)
                for step in steps:
                    self.seen.setdefault(step, now)
            time.sleep(0.02)


def run_case(name: str, cmd: list[str], out: Path, fault_at: int) -> dict[str, float]:
    """Run ``cmd`` (a training command with one injected fault and one restart), timing the restart."""
    watch = MetricsWatch(out / "metrics.jsonl")
    watch.start()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    fault_time = resumed_time = None
    resumed_step = None
    tail: list[str] = []
    for line in proc.stdout:
        now = time.time()
        tail = (tail + [line])[-40:]
        if (m := re.search(r"^fault: .* time ([0-9.]+)\)", line)) and fault_time is None:
            fault_time = float(m.group(1))
            watch.since = fault_time
            watch.seen.clear()
        if (m := re.search(r"resumed from \S+ at step (\d+)", line)) and fault_time is not None:
            resumed_time, resumed_step = now, int(m.group(1))
    code = proc.wait()
    watch.done.set()
    watch.join()
    if code != 0 or fault_time is None or resumed_time is None or resumed_step is None:
        raise SystemExit(f"{name}: exit {code}, fault seen: {fault_time is not None}, resume seen: "
                         f"{resumed_time is not None}\n{''.join(tail)}")
    first = watch.seen[resumed_step + 1]
    redone = watch.seen[fault_at]
    return {"resumed_s": resumed_time - fault_time, "training_s": first - fault_time,
            "lost_steps": fault_at - resumed_step, "redo_s": redone - first}


def main() -> None:
    args = parse_args()
    steps = args.fault_at + args.after
    train = ["--steps", str(steps), "--ckpt-every", str(args.ckpt_every), "--log-every", "1",
             "--eval-every", str(steps), "--no-plots", "--no-progress", "--resume"]
    exe = Path(sys.executable).with_name("torchrun")
    torchrun = ([str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]) + [
        "--nproc-per-node", str(args.nproc), "--max-restarts", "1", "--standalone", "-m", "flexmoe", "train"]
    flexmoe = [sys.executable, "-m", "flexmoe", "train", "--nproc", str(args.nproc), "--max-restarts", "1"]
    kill = ["--inject-fault", f"kill:1:{args.fault_at}"]
    hang = ["--inject-fault", f"hang:1:{args.fault_at}", "--collective-timeout", f"{args.timeout:g}"]
    cases = {
        "torchrun, rank 1 killed (SIGKILL)": (torchrun, kill),
        "flexmoe --nproc, rank 1 killed (SIGKILL)": (flexmoe, kill),
        f"torchrun, rank 1 hung (--collective-timeout {args.timeout:g})": (torchrun, hang),
    }
    print(f"main job at {args.nproc} ranks, fault at step {args.fault_at}, checkpoints every {args.ckpt_every} "
          f"steps, one restart")
    print("| launcher and fault | fault -> checkpoint loaded (s) | fault -> first step trained (s) | "
          "steps lost | time to train them again (s) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as tmp:
        for i, (name, (launcher, fault)) in enumerate(cases.items()):
            out = Path(tmp) / f"run{i}"
            r = run_case(name, [*launcher, "--out", str(out), *train, *fault], out, args.fault_at)
            print(f"| {name} | {r['resumed_s']:.1f} | {r['training_s']:.1f} | {r['lost_steps']:.0f} | "
                  f"{r['redo_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
