"""The flags every training job shares and the rules of ``--resume`` and ``--out``: what ``flexmoe train`` (the MoE
GPT and the Hugging Face models) and ``flexmoe train-vision`` read from the command line before anything is
built, written or launched.

A job adds :func:`add_run_flags` (run directory, length, learning rate, bookkeeping, the dense twin) and its own
model flags (a :data:`FlagTable`, :func:`add_model_flags`); :func:`train_config` turns the flags into the loop's
:class:`~flexmoe.apps.train_config.TrainConfig` once, and on ``--resume`` into the saved run's, refusing a flag that
differs from it (:func:`check_resumed_flags`). :func:`check_run_dir` says which run directories may be touched.
Every error is a :class:`~flexmoe.apps.errors.UsageError` naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flexmoe.apps import sharded_job
from flexmoe.apps.errors import UsageError
from flexmoe.apps.faults import FAULT
from flexmoe.apps.flags import (
    COUNT,
    FINITE,
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_REAL,
    POSITIVE,
    check_writable_dir,
)
from flexmoe.apps.ranks import BACKENDS, resolve_backend
from flexmoe.apps.train_config import OPTIMIZERS, TrainConfig
from flexmoe.checkpoint import latest_checkpoint

__all__ = ["FlagTable", "MOE_MODEL_FLAGS", "RESUME_MAY_CHANGE", "KEPT_TRAIN_FLAGS", "add_run_flags",
           "check_run_flags", "check_device", "add_model_flags", "model_flag_values", "check_world_size",
           "given_dests", "check_resumed_flags", "train_config", "saved_train_flags", "resumed_train_config",
           "add_compile_flag", "check_compile_backend", "saved_run_config", "saved_model_flags", "check_run_dir",
           "check_resumable"]

# ----------------------------------------------------------------------------------------------------------
# Command line.

# flag -> (config field, value type of flexmoe.apps.flags)
FlagTable = dict[str, tuple[str, Callable[[str], Any]]]
# The model flags of every job training an MoEModel.
MOE_MODEL_FLAGS: FlagTable = {
    "--n-layer": ("n_layer", COUNT),
    "--n-head": ("n_head", COUNT),
    "--n-embd": ("n_embd", COUNT),
    "--num-experts": ("num_experts", COUNT),
    "--expert-hidden": ("expert_hidden", COUNT),
    "--k": ("k", COUNT),
    "--moe-every": ("moe_every", COUNT),
    "--capacity-factor": ("capacity_factor", FINITE),
    "--aux-loss-coef": ("aux_loss_coef", NON_NEGATIVE_REAL),
    "--dropout": ("dropout", FRACTION),
}

def add_run_flags(parser: argparse.ArgumentParser, t: TrainConfig, out: str) -> None:
    """The flags every training job has: its run directory (default ``out``), length, learning rate, bookkeeping
    and the dense twin."""
    a = parser.add_argument
    a("--out", default=out, help="run directory; an existing one needs --resume or --overwrite")
    a("--steps", type=COUNT, default=None, help=f"optimizer steps (default: {t.steps}; on --resume: the saved value)")
    a("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    a("--overwrite", action="store_true", help="delete the run in --out (metrics, checkpoints, plots) and start anew")
    a("--lr", type=POSITIVE, default=t.lr, help="peak learning rate (cosine decay to a tenth of it)")
    a("--optimizer", default=t.optimizer, choices=OPTIMIZERS,
      help="adamw (default), or muon: Muon on the hidden matrices and expert stacks, AdamW on embeddings, head, "
           "norms and biases, one --lr for both (Muon's update scaled to AdamW's RMS)")
    a("--warmup", type=NON_NEGATIVE, default=t.warmup, help="linear warm-up steps")
    a("--log-every", type=COUNT, default=t.log_every, help="steps between metrics records")
    a("--ckpt-every", type=COUNT, default=t.ckpt_every, help="steps between checkpoints")
    a("--dense", action="store_true", help="train the dense twin instead of the MoE model")
    a("--upcycle-from", default=None, metavar="RUN",
      help="start the MoE model from the finished dense run RUN (flexmoe train --dense), its MLPs upcycled into "
           "--num-experts experts, --k per token, of 1/--granularity of the MLP each: every block MoE, the same "
           "function at step 0 (default: off)")
    a("--granularity", type=COUNT, default=None,
      help="with --upcycle-from: each expert is 1/G of the dense MLP's hidden units (default: 1)")
    a("--compare-dense", action="store_true",
      help="also train the dense twin (equal active compute) on the same batches; write compare.{png,md,json}")
    a("--device", default=t.device,
      help="where the model trains: cpu, cuda, cuda:N, or any torch device type this torch has (with --nproc N "
           "or torchrun, --device cuda puts each rank on its local GPU, cuda:LOCAL_RANK)")
    a("--backend", default="auto", choices=BACKENDS,
      help="the collectives' backend with several ranks: nccl (CUDA), gloo (CPU, or CUDA tensors: several ranks "
           "may share one GPU), auto (default: nccl on cuda, else gloo)")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--collective-timeout", type=POSITIVE, default=None, metavar="SECONDS",
      help="with several ranks: a collective that waits longer for a rank ends this one with an error naming the "
           "ranks that do not answer (default: torch's, 30 minutes)")
    a("--inject-fault", type=FAULT, default=None, metavar="KIND:RANK:STEP",
      help="for fault tests: rank RANK is killed at step STEP (kill), while that step's checkpoint is written "
           "(kill-in-save), or hangs inside it (hang); on the workers' first start only (flexmoe.apps.faults) "
           "(default: none)")
    parser.set_defaults(flag_parser=parser)  # given_dests reads the defaults where cli.main did not run


def check_run_flags(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for both ``--resume`` and ``--overwrite`` (each value's range is checked as the
    command line is parsed, :mod:`flexmoe.apps.flags`)."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                         "--overwrite deletes it")
    device = check_device(args.device)
    resolve_backend(getattr(args, "backend", "auto"), device)


def check_device(name: str) -> torch.device:
    """``--device``'s value as a torch device; :class:`UsageError` for a name torch does not know, or a device this
    machine lacks (with several ranks, which backend carries it: :func:`flexmoe.apps.ranks.resolve_backend`)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device: torch knows no device {name!r} ({e})") from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise UsageError(f"--device {name}: this machine's torch {torch.__version__} has no {device.type} device")
        count = getattr(module, "device_count", lambda: 1)()
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {name}: this machine has {count} {device.type} device(s)")
    return device


def add_model_flags(parser: argparse.ArgumentParser, flags: FlagTable, defaults: object) -> None:
    """One optional flag per model field of ``flags``; the help shows the field's value in ``defaults``."""
    for flag, (name, typ) in flags.items():
        parser.add_argument(flag, type=typ, default=None, help=f"model: {name} (default: {getattr(defaults, name)})")


def model_flag_values(args: argparse.Namespace, flags: FlagTable) -> dict[str, Any]:
    """The model fields the command line set (flags left out are absent)."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in flags.items()}
    return {name: value for name, value in values.items() if value is not None}


def check_world_size(mcfg: Any, nproc: int) -> None:
    """The world size (``--nproc``) against the experts of ``mcfg`` (a GPT config): every rank must hold whole
    experts or an equal share of one expert's hidden units, or the ranks would fail at start, each with its own
    traceback."""
    if nproc == 1 or mcfg.dense:
        return
    from flexmoe.apps.reshard import valid_world_sizes

    sizes = valid_world_sizes(mcfg.num_experts, mcfg.expert_hidden)
    if nproc not in sizes:
        raise UsageError(f"--nproc {nproc} does not fit --num-experts {mcfg.num_experts} (of --expert-hidden "
                         f"{mcfg.expert_hidden}): each rank holds whole experts or an equal share of one; "
                         f"--nproc values that work: {', '.join(map(str, sizes[:12]))}")


# What a resumed run may set anew: these flags change no number the run computes (its weights, losses, or
# where it is evaluated; --eval-every only moves the evaluations, whose val loss --target-loss is checked on).
# Every other flag given with --resume must equal the saved run's. --nproc may differ too: the checkpoint is
# cut for the new world size (whose sums round differently: the losses then match to rounding, not bit for bit);
# so may --device (another device's kernels round differently too).
RESUME_MAY_CHANGE = ("steps", "log_every", "eval_every", "ckpt_every", "no_plots", "no_progress", "compile",
                     "device", "backend", "nproc", "out", "resume", "overwrite", "compare_dense", "export_hf",
                     "collective_timeout", "inject_fault", "max_restarts")
# The training flags (TrainConfig fields) that a resumed run must keep.
# The mesh flags too: a sharded run's checkpoints are DCP directories, a replicated run's flexmoe's own.
KEPT_TRAIN_FLAGS = ("lr", "warmup", "seed", "data", "batch_size", "micro_batches", "eval_batches", "target_loss",
                     "stop_at_target", "fsdp", "ep", "activation_checkpointing", "param_dtype", "upcycle_from",
                     "granularity", "replace_every", "optimizer")


def given_dests(args: argparse.Namespace) -> frozenset[str]:
    """The flags (as argparse destinations) the command line set: what :func:`flexmoe.apps.cli.main` recorded
    in ``args.given``; for a namespace parsed elsewhere, the flags whose value is not their default (read from
    ``args.flag_parser``, :func:`add_run_flags`)."""
    given = getattr(args, "given", None)
    if given is not None:
        return frozenset(given)
    defaults = {a.dest: a.default for a in args.flag_parser._actions if a.option_strings}
    return frozenset(dest for dest, value in vars(args).items() if dest in defaults and value != defaults[dest])


def check_resumed_flags(args: argparse.Namespace, saved: dict[str, Any], out: Path) -> None:
    """Raise :class:`UsageError` for the first flag of ``saved`` (destination -> the saved run's value) that the
    command line sets to another value: a resumed run continues exactly the saved one, or not at all."""
    for dest in sorted(given_dests(args) & saved.keys()):
        value = getattr(args, dest)
        if value != saved[dest]:
            flag = "--" + dest.replace("_", "-")
            shown = "given" if value is True else value
            raise UsageError(
                f"--resume: {flag} {shown} differs from the run in {out}, which has {_saved_value(dest, saved[dest])} "
                f"({out / 'config.json'}); a resumed run keeps its configuration (only --steps, --log-every, "
                f"--eval-every, --ckpt-every, --nproc, --compile and the output flags may change): leave {flag} out, "
                f"or start a new run (--overwrite, or another --out)")


def _saved_value(dest: str, value: Any) -> str:
    if dest == "data" and value is None:
        return "the embedded tiny Shakespeare"
    return "it off" if value is False or value is None else f"{value}"


# The TrainConfig fields set by a flag of the same name, where the job has that flag (train-vision has fewer).
_TRAIN_FIELD_FLAGS = ("batch_size", "micro_batches", "lr", "warmup", "seed", "data", "log_every", "eval_every",
                      "eval_batches", "ckpt_every", "target_loss", "stop_at_target", "fsdp", "ep",
                      "collective_timeout", "inject_fault",
                      "activation_checkpointing", "param_dtype", "upcycle_from", "optimizer")


def train_config(args: argparse.Namespace,
                 defaults: TrainConfig | None = None) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The training configuration from the flags (the job's ``defaults`` where it has no flag for a field), and
    the saved ``config.json`` of a run being resumed (else None): a resumed run keeps its configuration (a flag
    set to another value is an error, :func:`check_resumed_flags`); the flags of :data:`RESUME_MAY_CHANGE` are
    taken from the command line."""
    check_run_flags(args)
    base = TrainConfig() if defaults is None else defaults
    given = {name: getattr(args, name) for name in _TRAIN_FIELD_FLAGS if hasattr(args, name)}
    granularity, replace_every = getattr(args, "granularity", None), getattr(args, "replace_every", None)
    tcfg = dataclasses.replace(
        base, **given, steps=args.steps if args.steps is not None else base.steps, plots=not args.no_plots,
        progress=not args.no_progress, compile=check_compile_backend(args.compile), device=args.device,
        granularity=1 if granularity is None else granularity, replace_every=replace_every or 0,
    )
    if tcfg.replace_every and not getattr(args, "redundant_experts", None):
        raise UsageError("--replace-every re-places replica experts: it needs --redundant-experts R (R >= 1)")
    saved = saved_run_config(Path(args.out)) if args.resume else None
    if saved is not None:
        check_resumed_flags(args, saved_train_flags(saved["train"]), Path(args.out))
        tcfg = resumed_train_config(saved["train"], tcfg, given_dests(args))
    world = int(os.environ.get("WORLD_SIZE", getattr(args, "nproc", 1)))
    if tcfg.batch_size % (world * tcfg.micro_batches):
        raise UsageError(f"--batch-size {tcfg.batch_size} must divide by ranks x micro-batches "
                         f"({world} x {tcfg.micro_batches}); e.g. --batch-size {world * tcfg.micro_batches * 8}")
    return tcfg, saved


def saved_train_flags(train: dict[str, Any]) -> dict[str, Any]:
    """The training flags' values of a saved run that a resumed run must keep (destination -> value)."""
    return {name: train.get(name) for name in KEPT_TRAIN_FLAGS}


def resumed_train_config(saved: dict[str, Any], asked: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """The saved run's training configuration, with what this command line may change (:data:`RESUME_MAY_CHANGE`)
    taken from ``asked``: how the run executes (compiled or not, device, progress, plots, collective timeout, injected
    fault) always, the cadences and
    ``--steps`` where given."""
    cadences: dict[str, Any] = {name: getattr(asked, name) for name in ("steps", "log_every", "eval_every",
                                                                         "ckpt_every") if name in given}
    return TrainConfig(**{**saved, **cadences, "progress": asked.progress, "plots": asked.plots,
                          "compile": asked.compile, "device": asked.device,
                          "collective_timeout": asked.collective_timeout, "inject_fault": asked.inject_fault})


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile [BACKEND]`` (:func:`check_compile_backend`, :func:`compile_model`)."""
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train the model under torch.compile (default backend: inductor; the first steps "
                             "compile it)")


def check_compile_backend(backend: str | None) -> str | None:
    """``--compile``'s backend if torch.compile has it (None: eager), else :class:`UsageError` listing them."""
    if backend is None:
        return None
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UsageError(f"--compile: torch.compile has no backend {backend!r}; it has {known}")
    return backend


def saved_run_config(out: Path) -> dict[str, Any] | None:
    """The ``config.json`` of the run in ``out`` (None if there is none)."""
    path = out / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def saved_model_flags(model: dict[str, Any], flags: FlagTable) -> dict[str, Any]:
    """The model flags' values of a saved run (destination -> value), ``--dense`` included."""
    values = {flag[2:].replace("-", "_"): model.get(name) for flag, (name, _) in flags.items()}
    return {**values, "dense": bool(model.get("dense", False))}


def check_run_dir(out: Path, *, resume: bool, overwrite: bool, restarted: bool = False) -> None:
    """An existing run directory is touched only with --resume (continue it) or --overwrite (replace it); a run
    that --resume cannot continue exactly (no usable checkpoint) is refused, unless this is a ``restarted`` worker
    (:func:`flexmoe.apps.ranks.restart_attempt` > 0) of a run that died before its first checkpoint, which starts
    it again from step 0; a new one needs a writable place."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a directory; give a new or existing run directory")
    existing = out.is_dir() and any(out.iterdir())
    if existing and resume and not (out / "config.json").is_file():
        raise UsageError(f"--out {out}: not a flexmoe run directory (no config.json) and not empty, so there is "
                         f"nothing to --resume; give a new directory")
    if existing and not (resume or overwrite):
        raise UsageError(f"--out {out} already exists: add --resume to continue that run or --overwrite to "
                         f"replace it (or give another --out)")
    if resume and not restarted:
        for run_dir in (out, out / "dense"):  # the dense twin of --compare-dense has its own checkpoints
            if (run_dir / "config.json").is_file():
                check_resumable(run_dir)
    check_writable_dir(out, "--out")


def check_resumable(run_dir: Path) -> None:
    """A run directory with a config.json but no checkpoint to continue from (stopped before its first one, or
    its checkpoints deleted) is an error saying what the directory holds, before anything in it is rewritten.
    A checkpoint is flexmoe's own (a replicated run) or a finished DCP directory (a sharded run, ``--fsdp``);
    which one the run takes is fixed by its saved ``--fsdp``, which a resumed run must keep."""
    if latest_checkpoint(run_dir) is not None or sharded_job.latest_dcp_checkpoint(run_dir) is not None:
        return
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    logged = f"metrics.jsonl up to step {steps[-1]}" if steps else "no metrics"
    pointer = run_dir / "checkpoints" / "latest.json"
    if pointer.is_file():
        try:
            named = json.loads(pointer.read_text()).get("path", "?")
        except ValueError:
            named = "?"
        found = f"checkpoints/latest.json names {named}, which is missing or incomplete, and no other checkpoint is"
    elif (run_dir / "checkpoints").is_dir():
        found = "checkpoints/ holds no complete checkpoint"
    else:
        found = "no checkpoints/ (stopped before its first checkpoint)"
    raise UsageError(f"--resume: {run_dir} holds a run (config.json, {logged}) but {found}; there is nothing to "
                     f"continue from: add --overwrite (instead of --resume) to start it again from step 0")


