"""What a training run writes into its run directory (``--out``), and reads back on ``--resume``.

``config.json`` (the model's and the loop's configuration, the world size, the data), ``metrics.jsonl`` (one JSON
object per logged step), ``checkpoints/`` (flexmoe's own checkpoints, or DCP directories under ``--fsdp``:
:mod:`flexmoe.apps.sharded_job`), ``summary.json`` (the final numbers, :class:`RunResult`), the PNG plots, and with
``--compare-dense`` the comparison with the dense twin (``compare.{png,md,json}``; the twin's own run in
``dense/``). An existing run directory is only touched with ``--resume`` or ``--overwrite``
(:func:`flexmoe.apps.train_flags.check_run_dir`); ``--overwrite`` removes exactly :data:`RUN_FILES` and
:data:`RUN_DIRS`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from flexmoe.apps import sharded_job
from flexmoe.apps.train_config import TrainConfig
from flexmoe.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["RunResult", "RUN_FILES", "RUN_DIRS", "remove_run_files", "finished_run", "rewrite_metrics",
           "latest_run_checkpoint", "load_run_checkpoint", "save_run_checkpoint", "write_plots", "write_comparison"]


@dataclass
class RunResult:
    """A run's final numbers, as its ``summary.json`` holds them (``summary``), on every rank."""

    final_val_loss: float
    final_train_loss: float
    steps: int
    wall_time_s: float
    tokens: int
    target: dict[str, Any] | None
    summary: dict[str, Any]
    already_complete: bool = False  # --resume found the run finished and changed nothing


# What a run writes into its directory (and --overwrite removes; nothing else in the directory is touched).
RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "expert_load.png", "balance.png",
             "compare.png", "compare.md", "compare.json")
RUN_DIRS = ("checkpoints", "dense")


def remove_run_files(out: Path, files: tuple[str, ...] = RUN_FILES, dirs: tuple[str, ...] = RUN_DIRS) -> None:
    """Delete a run's ``files`` and ``dirs`` from ``out`` (whatever else the directory holds stays)."""
    for name in files:
        (out / name).unlink(missing_ok=True)
    for name in dirs:
        shutil.rmtree(out / name, ignore_errors=True)


def finished_run(out: Path, step: int, tcfg: TrainConfig, target: dict[str, Any] | None) -> RunResult | None:
    """The result of the run in ``out`` if its checkpoint at ``step`` is its last and its summary was written."""
    summary_path = out / "summary.json"
    last = step >= tcfg.steps or (tcfg.stop_at_target and target is not None)
    if not last or not summary_path.is_file():
        return None
    s = json.loads(summary_path.read_text())
    if s.get("steps") != step:
        return None
    return RunResult(s["final_val_loss"], s["final_train_loss"], s["steps"], s["wall_time_s"], s["tokens"],
                     s.get("target"), s, already_complete=True)


def rewrite_metrics(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """Keep the records of steps <= ``upto_step`` (a resumed run re-logs the steps after its checkpoint)."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in records if r.get("step", 0) <= upto_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def latest_run_checkpoint(out: Path, sharded: bool) -> Path | None:
    """The newest checkpoint of the run in ``out`` to resume from: flexmoe's own, or with ``sharded`` (a model laid
    on a mesh, ``--fsdp``) a finished DCP directory; None if there is none."""
    if not (out / "checkpoints").is_dir():
        return None
    return sharded_job.latest_dcp_checkpoint(out) if sharded else latest_checkpoint(out)


def load_run_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        mesh: DeviceMesh | None) -> dict[str, Any]:
    """Load the checkpoint ``path`` (:func:`latest_run_checkpoint`) into ``model`` and ``optimizer``, with the RNG
    states; returns its metadata (``step``, ``elapsed_s``, ``target``, ...)."""
    if mesh is None:
        return load_checkpoint(path, model=model, optimizer=optimizer)
    return sharded_job.load_dcp_checkpoint(path, model, optimizer, mesh)


def save_run_checkpoint(out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh | None,
                        step: int, extra: dict[str, Any], keep: int,
                        before_commit: Callable[[], None] | None = None) -> Path | None:
    """Checkpoint step ``step`` into ``out/checkpoints`` (collective under torch.distributed), keeping the newest
    ``keep``; ``extra`` goes into its metadata. Returns its path (None on ranks other than 0 of a replicated
    run, whose rank 0 writes). ``before_commit``: called on the ranks that write, once their files are written
    and before the checkpoint is complete (a fault test kills the rank there)."""
    saved: Path | None
    if mesh is None:
        saved = save_checkpoint(out, model=model, optimizer=optimizer, step=step, keep=keep, extra=extra,
                                before_commit=before_commit)
    else:
        saved = sharded_job.save_dcp_checkpoint(out, model, optimizer, mesh, step, extra, keep, before_commit)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return saved


def write_plots(out: Path, label: str, loss_unit: str = "nats / byte") -> None:
    """loss.png, expert_load.png and balance.png from ``out/metrics.jsonl``."""
    from flexmoe.apps.plots import plot_balance, plot_expert_load, plot_losses, read_metrics

    records = read_metrics(out / "metrics.jsonl")
    plot_losses(records, out / "loss.png", title=f"{label}: loss", unit=loss_unit)
    plot_expert_load(records, out / "expert_load.png")
    plot_balance(records, out / "balance.png")


def write_comparison(out: Path, results: dict[str, RunResult]) -> None:
    """compare.png (both curves), compare.md (a table) and compare.json (each model's final numbers)."""
    from flexmoe.apps.plots import plot_compare, read_metrics

    runs = {"moe": read_metrics(out / "metrics.jsonl"), "dense": read_metrics(out / "dense" / "metrics.jsonl")}
    plot_compare(runs, out / "compare.png")
    table = ["| model | params | active params | steps | final val loss | wall time (s) | target reached |",
             "|---|---|---|---|---|---|---|"]
    payload: dict[str, Any] = {}
    for name, r in results.items():
        s = r.summary
        reached = "-" if r.target is None else f"step {r.target['step']}, {r.target['wall_time_s']:.1f} s, " \
                                               f"{r.target['tokens']:,} tokens"
        table.append(f"| {name} | {s['params']:,} | {s['active_params']:,} | {r.steps} | {r.final_val_loss:.4f} | "
                     f"{r.wall_time_s:.1f} | {reached} |")
        payload[name] = {"final_val_loss": r.final_val_loss, "final_train_loss": r.final_train_loss,
                         "steps": r.steps, "wall_time_s": r.wall_time_s, "tokens": r.tokens,
                         "params": s["params"], "active_params": s["active_params"], "target": r.target}
    better = "moe" if results["moe"].final_val_loss < results["dense"].final_val_loss else "dense"
    payload["lower_val_loss"] = better
    active = {name: r.summary["active_params"] for name, r in results.items()}
    # An upcycled model with k full copies per token (--upcycle-from, granularity < k) computes more per token.
    basis = ("equal steps and active compute" if abs(active["moe"] - active["dense"]) <= 0.05 * active["dense"]
             else f"equal steps (active parameters per token: moe {active['moe']:,}, dense {active['dense']:,})")
    text = "\n".join(table) + f"\n\nlower final validation loss at {basis}: {better}\n"
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(payload, indent=1))
    print(text, flush=True)
