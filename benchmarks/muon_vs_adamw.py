"""Muon against AdamW on the main job (``flexmoe train``: the default MoE GPT on tiny Shakespeare), equal steps,
each optimizer at a few peak learning rates.

    .venv/bin/python benchmarks/muon_vs_adamw.py [--steps 100] [--adamw-lr 1e-3 2e-3 4e-3]
        [--muon-lr 1e-3 2e-3 4e-3] [--jobs 2] [--out DIR]

Each run is ``flexmoe train --optimizer O --lr LR --steps S --warmup S/10 --eval-every S/4`` (everything else the
job's defaults) on one thread (``--jobs`` runs side by side); a run whose ``summary.json`` is already in ``--out``
is read, not run again. Prints one table row per run: the last and the best validation loss, the drop rate of the
last step, and the seconds per step (the run's wall time over its steps, evaluations included). Then the
optimizer step alone on the job's model, the two interleaved in one process (random gradients, one thread): what
``step()`` costs apart from the forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default: 100)")
    p.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3], help="AdamW's peak lrs")
    p.add_argument("--muon-lr", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3], help="Muon's peak lrs")
    p.add_argument("--jobs", type=int, default=2, help="runs side by side, one thread each (default: 2)")
    p.add_argument("--out", default="runs/muon_vs_adamw", help="where the runs go (default: runs/muon_vs_adamw)")
    return p.parse_args()


def run_dir(out: Path, optimizer: str, lr: float) -> Path:
    return out / f"{optimizer}_{lr:g}"


def train(out: Path, steps: int, optimizer: str, lr: float) -> None:
    """One ``flexmoe train`` run, unless its summary is there already."""
    where = run_dir(out, optimizer, lr)
    if (where / "summary.json").is_file():
        return
    argv = [sys.executable, "-m", "flexmoe", "train", "--optimizer", optimizer, "--lr", f"{lr:g}", "--steps",
            str(steps), "--warmup", str(max(steps // 10, 1)), "--eval-every", str(max(steps // 4, 1)), "--out",
            str(where), "--overwrite", "--no-plots", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")


def row(out: Path, optimizer: str, lr: float) -> str:
    where = run_dir(out, optimizer, lr)
    summary = json.loads((where / "summary.json").read_text())
    records = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    per_step = summary["wall_time_s"] / summary["steps"]
    return (f"| {optimizer} | {lr:g} | {summary['final_val_loss']:.4f} | {min(vals):.4f} | "
            f"{records[-1]['drop_rate']:.3f} | {per_step:.2f} |")


def optimizer_step_times(repeats: int = 10) -> dict[str, float]:
    """Seconds per ``step()`` of each optimizer on the job's default model, interleaved, one thread."""
    import torch

    from flexmoe.apps.models.gpt import GPT, GPTConfig
    from flexmoe.apps.train_config import TrainConfig
    from flexmoe.apps.train_step import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig())  # the job's defaults
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {name: build_optimizer(model, TrainConfig(optimizer=name)) for name in ("adamw", "muon")}
    times = {name: [] for name in opts}
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first round warms up (state allocation)
            for name, opt in opts.items():
                t = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t)
    return {name: sorted(ts[1:])[len(ts[1:]) // 2] for name, ts in times.items()}


def main() -> None:
    args = parse_args()
    out = Path(args.out).resolve()
    runs = [("adamw", lr) for lr in args.adamw_lr] + [("muon", lr) for lr in args.muon_lr]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda r: train(out, args.steps, *r), runs))
    print(f"flexmoe train, {args.steps} steps (warm-up {max(args.steps // 10, 1)}), one thread per run\n")
    print("| optimizer | peak lr | val loss (last) | val loss (best) | drop rate (last step) | s/step |")
    print("|---|---|---|---|---|---|")
    for optimizer, lr in runs:
        print(row(out, optimizer, lr))
    times = optimizer_step_times()
    print(f"\noptimizer.step() alone on the job's model (median of 10, one thread): AdamW {times['adamw'] * 1e3:.1f} "
          f"ms, Muon + AdamW {times['muon'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
