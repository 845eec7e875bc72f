"""``flexmoe train``: train the MoE GPT (or its dense twin) on the embedded corpus or any text file.

The run directory (``--out``) holds ``config.json``, ``metrics.jsonl`` (one JSON object per logged step:
``step``, ``train_loss``, ``val_loss`` where evaluated, and ``balance``: :func:`flexmoe.balance_metrics` of the
step's last micro-batch, the mean over ranks), ``checkpoints/``, ``summary.json`` and PNG plots.
With ``--compare-dense`` the dense twin trains on the same batches into ``OUT/dense`` and ``OUT`` also gets
``compare.png``, ``compare.md`` and ``compare.json``. An existing run directory is only touched with
``--resume`` (continue it; a finished run is left as it is) or ``--overwrite`` (remove its run files first).

Reproducibility: the batch of step s is a function of (seed, s) only, the learning rate a function of s, and
checkpoints hold the optimizer and RNG states, so a resumed run continues exactly as an uninterrupted one.

Distributed (``torchrun`` or ``--nproc N``): experts are spread over the ranks (``MoELayer(group=...)``) and
every other parameter is data-parallel. Each rank takes its own rows of the global batch; rank 0 logs.

With ``--hf-arch NAME`` or ``--hf-model DIR`` the same loop (:func:`train_model`) trains a converted Hugging Face
model instead (:mod:`flexmoe.apps.hf_job`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from flexmoe.apps import sharded_job
from flexmoe.apps.data import TokenData
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import (
    COUNT,
    FINITE,
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_REAL,
    POSITIVE,
    SEED,
    SHARE,
    Choice,
    check_writable_dir,
)
from flexmoe.apps.interrupt import Interrupted, StopSignals
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.apps.models.moe_model import MoEModel
from flexmoe.apps.upcycle_job import upcycle_start
from flexmoe.checkpoint import (
    expert_param_names,
    expert_placement,
    latest_checkpoint,
    load_checkpoint,
    load_global_state_dict,
    save_checkpoint,
)
from flexmoe.layer import update_expert_biases
from flexmoe.model_routing import balance_metrics
from flexmoe.parallel.ddp import wrap_ddp
from flexmoe.parallel.groups import default_ranks_per_node
from flexmoe.parallel.optim import split_expert_groups
from flexmoe.parallel.replicas import placement_record, replace_experts, replica_slots
from flexmoe.routing.global_balance import reset_global_balance
from flexmoe.routing.losses import AUX_LOSS_TYPES

__all__ = ["TrainConfig", "add_arguments", "gpt_configs", "run_gpt_job", "train", "build_model"]


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping settings (the model's are in :class:`GPTConfig`)."""

    steps: int = 1000  # about 3.5 minutes for the MoE model on 2 cores
    batch_size: int = 16  # global rows per step, split over ranks and micro-batches
    micro_batches: int = 1  # gradient accumulation per rank
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337
    data: str | None = None
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    target_loss: float | None = None
    stop_at_target: bool = False
    plots: bool = True
    progress: bool = True
    compile: str | None = None  # a torch.compile backend ("inductor", "aot_eager", ...); None: eager
    device: str = "cpu"  # where the model and its batches live ("cpu", "cuda", "cuda:1", ...)
    # The mesh (flexmoe.apps.sharded_job): FSDP2 over all ranks, experts over ep ranks (None: all).
    fsdp: bool = False
    ep: int | None = None
    activation_checkpointing: bool = False
    param_dtype: str = "float32"  # under fsdp: the dtype blocks compute in (FSDP2's mixed precision)
    # --upcycle-from: the dense run this MoE run starts from (flexmoe.apps.upcycle_job), and each expert's share
    # of the dense MLP (1/granularity of its hidden units).
    upcycle_from: str | None = None
    granularity: int = 1
    # With the model's redundant_experts: re-place the replicas from the recent load every N steps (0: never).
    replace_every: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


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
_MODEL_FLAGS: FlagTable = {  # GPTConfig's
    "--block-size": ("block_size", COUNT),
    **MOE_MODEL_FLAGS,
    "--a2a": ("a2a", Choice(("flat", "2dh"))),
    "--cross-node-share": ("cross_node_share", SHARE),
    "--aux-loss-type": ("aux_loss_type", Choice(AUX_LOSS_TYPES)),
    "--redundant-experts": ("redundant_experts", NON_NEGATIVE),
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
      help="where the model trains: cpu, cuda, cuda:N, or any torch device type this torch has (one process; "
           "with --nproc N, cpu)")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    a("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(flag_parser=parser)  # given_dests reads the defaults where cli.main did not run


def check_run_flags(args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` for both ``--resume`` and ``--overwrite`` (each value's range is checked as the
    command line is parsed, :mod:`flexmoe.apps.flags`)."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                         "--overwrite deletes it")
    check_device(args.device, int(os.environ.get("WORLD_SIZE", getattr(args, "nproc", 1))))


def check_device(name: str, world: int) -> torch.device:
    """``--device``'s value as a torch device; :class:`UsageError` for a name torch does not know, a device this
    machine lacks, or an accelerator with several ranks (the job's own collectives, loss and load all-reduces,
    are written for gloo's CPU tensors: not built for NCCL yet)."""
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
        if world > 1:
            raise UsageError(f"--device {name} with {world} ranks is not built yet: the job's own collectives run "
                             f"on CPU tensors (gloo); train on {device.type} in one process, or on cpu with --nproc")
    return device


def add_model_flags(parser: argparse.ArgumentParser, flags: FlagTable, defaults: object) -> None:
    """One optional flag per model field of ``flags``; the help shows the field's value in ``defaults``."""
    for flag, (name, typ) in flags.items():
        parser.add_argument(flag, type=typ, default=None, help=f"model: {name} (default: {getattr(defaults, name)})")


def model_flag_values(args: argparse.Namespace, flags: FlagTable) -> dict[str, Any]:
    """The model fields the command line set (flags left out are absent)."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in flags.items()}
    return {name: value for name, value in values.items() if value is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The MoE GPT job's flags (``flexmoe train`` adds the Hugging Face job's: :mod:`flexmoe.apps.train_command`)."""
    t = TrainConfig()
    m = GPTConfig()
    add_run_flags(parser, t, "runs/default")
    a = parser.add_argument
    a("--data", default=None, help="train on this text file (bytes as tokens) (default: the embedded tiny Shakespeare)")
    a("--seed", type=SEED, default=t.seed, help="seed of the initialisation and data order")
    a("--batch-size", type=COUNT, default=t.batch_size, help="global sequences per step (split over ranks)")
    a("--micro-batches", type=COUNT, default=t.micro_batches, help="gradient accumulation steps per rank")
    a("--replace-every", type=COUNT, default=None,
      help="with --redundant-experts: re-place the replica experts from the load since the last re-placement every "
           "N steps (default: never)")
    a("--eval-every", type=COUNT, default=t.eval_every, help="steps between validation evaluations")
    a("--eval-batches", type=COUNT, default=t.eval_batches, help="validation batches per evaluation")
    a("--target-loss", type=NON_NEGATIVE_REAL, default=None,
      help="report wall time and tokens until the validation loss first reaches this value, checked at each "
           "evaluation (--eval-every) (default: none)")
    a("--stop-at-target", action="store_true", help="stop training once --target-loss is reached")
    add_compile_flag(parser)
    a("--nproc", type=COUNT, default=1,
      help="launch N local processes (experts spread over ranks, the rest data-parallel)")
    sharded_job.add_mesh_flags(parser)
    add_model_flags(parser, _MODEL_FLAGS, m)


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
                     "device", "nproc", "out", "resume", "overwrite", "compare_dense", "export_hf")
# The training flags (TrainConfig fields) that a resumed run must keep.
# The mesh flags too: a sharded run's checkpoints are DCP directories, a replicated run's flexmoe's own.
_KEPT_TRAIN_FLAGS = ("lr", "warmup", "seed", "data", "batch_size", "micro_batches", "eval_batches", "target_loss",
                     "stop_at_target", "fsdp", "ep", "activation_checkpointing", "param_dtype", "upcycle_from",
                     "granularity", "replace_every")


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


def train_config(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, Any] | None]:
    """The training configuration from the flags, and the saved ``config.json`` of a run being resumed (else
    None): a resumed run keeps its configuration (a flag set to another value is an error,
    :func:`check_resumed_flags`); the flags of :data:`RESUME_MAY_CHANGE` are taken from the command line."""
    check_run_flags(args)
    tcfg = TrainConfig(
        steps=args.steps if args.steps is not None else TrainConfig.steps,
        batch_size=args.batch_size, micro_batches=args.micro_batches, lr=args.lr, warmup=args.warmup,
        seed=args.seed, data=args.data, log_every=args.log_every, eval_every=args.eval_every,
        eval_batches=args.eval_batches, ckpt_every=args.ckpt_every, target_loss=args.target_loss,
        stop_at_target=args.stop_at_target, plots=not args.no_plots, progress=not args.no_progress,
        compile=check_compile_backend(args.compile), device=args.device,
        fsdp=args.fsdp, ep=args.ep, activation_checkpointing=args.activation_checkpointing,
        param_dtype=args.param_dtype,
        upcycle_from=args.upcycle_from, granularity=1 if args.granularity is None else args.granularity,
        replace_every=args.replace_every or 0,
    )
    if tcfg.replace_every and not args.redundant_experts:
        raise UsageError("--replace-every re-places replica experts: it needs --redundant-experts R (R >= 1)")
    saved = saved_run_config(Path(args.out)) if args.resume else None
    if saved is not None:
        check_resumed_flags(args, saved_train_flags(saved["train"]), Path(args.out))
        tcfg = resumed_train_config(saved["train"], tcfg, given_dests(args))
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if tcfg.batch_size % (world * tcfg.micro_batches):
        raise UsageError(f"--batch-size {tcfg.batch_size} must divide by ranks x micro-batches "
                         f"({world} x {tcfg.micro_batches}); e.g. --batch-size {world * tcfg.micro_batches * 8}")
    return tcfg, saved


def saved_train_flags(train: dict[str, Any]) -> dict[str, Any]:
    """The training flags' values of a saved run that a resumed run must keep (destination -> value)."""
    return {name: train.get(name) for name in _KEPT_TRAIN_FLAGS}


def resumed_train_config(saved: dict[str, Any], asked: TrainConfig, given: frozenset[str]) -> TrainConfig:
    """The saved run's training configuration, with what this command line may change (:data:`RESUME_MAY_CHANGE`)
    taken from ``asked``: how the run executes (compiled or not, device, progress, plots) always, the cadences and
    ``--steps`` where given."""
    cadences: dict[str, Any] = {name: getattr(asked, name) for name in ("steps", "log_every", "eval_every",
                                                                         "ckpt_every") if name in given}
    return TrainConfig(**{**saved, **cadences, "progress": asked.progress, "plots": asked.plots,
                          "compile": asked.compile, "device": asked.device})


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """``--compile [BACKEND]`` (:func:`check_compile_backend`, :func:`compile_model`)."""
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="train the model under torch.compile (default backend: inductor; the first steps "
                             "compile it)")


def compile_model(model: nn.Module, tcfg: TrainConfig, label: str, rank: int = 0, *,
                  blocks: Sequence[nn.Module] | None = None) -> None:
    """Compile ``model`` in place when ``tcfg.compile`` names a backend: ``nn.Module.compile``, so parameter
    names, and so checkpoints, stay those of the eager model. ``blocks``: compile each of these instead of the whole
    model (a model laid out by ``parallelize``: FSDP2's hooks between the blocks stay eager, as torchtitan does)."""
    if tcfg.compile is None:
        return
    for module in [model] if blocks is None else blocks:
        module.compile(backend=tcfg.compile)
    if rank == 0:
        what = "the model" if blocks is None else f"each of its {len(blocks)} blocks"
        print(f"[{label}] under torch.compile (backend {tcfg.compile}): the first step, and the first evaluation, "
              f"compile {what}", flush=True)


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


def gpt_configs(args: argparse.Namespace) -> tuple[GPTConfig, TrainConfig]:
    """The model and training configuration from the flags (a resumed run: from its config.json)."""
    tcfg, saved = train_config(args)
    if saved is not None:
        check_resumed_flags(args, saved_model_flags(saved["model"], _MODEL_FLAGS), Path(args.out))
        mcfg = GPTConfig.from_dict(saved["model"])
    elif args.granularity is not None and tcfg.upcycle_from is None:
        raise UsageError("--granularity slices the dense MLPs of --upcycle-from RUN; give that run too")
    elif tcfg.upcycle_from is not None:
        if args.dense:
            raise UsageError("--upcycle-from makes an MoE model; --dense excludes it (--compare-dense continues "
                             "the dense run beside it)")
        mcfg = upcycle_start(tcfg.upcycle_from, tcfg.granularity, model_flag_values(args, _MODEL_FLAGS)).moe_config
    else:
        try:
            mcfg = GPTConfig(**{**model_flag_values(args, _MODEL_FLAGS), "dense": args.dense})
        except ValueError as exc:
            raise UsageError(f"model flags: {exc}") from None
    return mcfg, tcfg


def saved_model_flags(model: dict[str, Any], flags: FlagTable) -> dict[str, Any]:
    """The model flags' values of a saved run (destination -> value), ``--dense`` included."""
    values = {flag[2:].replace("-", "_"): model.get(name) for flag, (name, _) in flags.items()}
    return {**values, "dense": bool(model.get("dense", False))}


def check_run_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """An existing run directory is touched only with --resume (continue it) or --overwrite (replace it); a run
    that --resume cannot continue exactly (no usable checkpoint) is refused; a new one needs a writable place."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, not a directory; give a new or existing run directory")
    existing = out.is_dir() and any(out.iterdir())
    if existing and resume and not (out / "config.json").is_file():
        raise UsageError(f"--out {out}: not a flexmoe run directory (no config.json) and not empty, so there is "
                         f"nothing to --resume; give a new directory")
    if existing and not (resume or overwrite):
        raise UsageError(f"--out {out} already exists: add --resume to continue that run or --overwrite to "
                         f"replace it (or give another --out)")
    if resume:
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


def run_gpt_job(args: argparse.Namespace, mcfg: GPTConfig, tcfg: TrainConfig) -> int:
    """The MoE GPT's run (this rank's part under torchrun): build, train, write the run directory."""
    out = Path(args.out)
    rank, world = _init_distributed()
    if args.resume and not (out / "config.json").is_file() and rank == 0:
        print(f"--resume: no run in {out} yet, starting a new one", flush=True)
    results = {}
    name = "dense" if mcfg.dense else "moe"
    # --upcycle-from: both runs start from the dense run's weights (a resumed one then from its checkpoint).
    start = None if tcfg.upcycle_from is None else upcycle_start(
        tcfg.upcycle_from, tcfg.granularity, model_flag_values(args, _MODEL_FLAGS))
    results[name] = train(mcfg, tcfg, out, resume=args.resume, init=None if start is None else start.moe_state)
    if args.compare_dense and not mcfg.dense:
        dense_cfg, dense_init = (mcfg.dense_twin(), None) if start is None else (start.dense_config, start.dense_state)
        results["dense"] = train(dense_cfg, tcfg, out / "dense", resume=args.resume, init=dense_init)
        if rank == 0 and not all(r.already_complete for r in results.values()):
            write_comparison(out, results)
    return 0


def _init_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------------------------------------
# Model, optimizer, gradients.


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The model, initialised from ``seed`` identically at every world size.

    The global model is built first (one process holding all experts); under expert parallelism each rank
    then keeps its own slice of it, so a run's initial weights do not depend on the number of ranks.
    """
    torch.manual_seed(seed)
    single = "single" if dist.is_initialized() else None  # one process holding all experts
    reference = GPT(GPTConfig.from_dict(cfg.to_dict(), group=single))
    if cfg.group is None or cfg.dense:
        return reference
    model = GPT(cfg)
    state = {k: v.detach() for k, v in reference.state_dict().items()}
    # The replica placements and load windows (buffers of the layers with replicas) start as the model's own.
    state.update({k: v for k, v in model.state_dict().items() if ".replicas." in k})
    load_global_state_dict(model, state, source="init")
    return model


def _spread_experts(model: MoEModel) -> dict[str, str]:
    """The expert parameters spread over ranks (name -> kind); empty when every rank holds all experts."""
    placement = expert_placement(model)
    if placement is None or placement.layout.world_size == 1:
        return {}
    return expert_param_names(model)


def build_optimizer(model: nn.Module, tcfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not biases, norms or expert biases). Multi-tensor (``foreach``), each
    group's experts apart from the rest (:func:`~flexmoe.parallel.split_expert_groups`: under ``--fsdp`` one kind
    of tensor per group)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        is_bias = p.dim() < 2 or name.rsplit(".", 1)[-1] in ("b1", "b2", "b3")
        (no_decay if is_bias else decay).append(p)
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(split_expert_groups(model, groups), lr=tcfg.lr, betas=(0.9, 0.95), foreach=True)


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at the last step (a function of step only)."""
    if step < tcfg.warmup:
        return tcfg.lr * (step + 1) / tcfg.warmup
    progress = (step - tcfg.warmup) / max(tcfg.steps - tcfg.warmup, 1)
    return tcfg.min_lr + 0.5 * (tcfg.lr - tcfg.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer: torch.optim.Optimizer, step: int, tcfg: TrainConfig) -> float:
    """Give every parameter group the scheduled learning rate of 1-based training step ``step``; returns it."""
    lr = lr_at(step - 1, tcfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def step_bar(tcfg: TrainConfig, start: int, label: str, show: bool = True) -> Any:
    """A tqdm bar over the run's steps, already at ``start``; None without ``tcfg.progress`` or ``show``."""
    if not (show and tcfg.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=tcfg.steps, initial=start, desc=label, unit="step", dynamic_ncols=True)


def clip_gradients(model: MoEModel, max_norm: float, world: int) -> float:
    """Scale all gradients so that their global L2 norm is at most ``max_norm``; returns the norm.

    Spread expert gradients differ per rank, so their squares are summed over ranks (a ``b2`` that every
    hidden shard of an expert holds a copy of is counted once, from shard 0); other gradients are equal on
    every rank after the all-reduce.
    """
    experts = _spread_experts(model)
    placement = expert_placement(model)
    # On the parameters' device (the job may train on an accelerator); the all-reduce is gloo's, one process there.
    device = next(model.parameters()).device
    dense_sq = torch.zeros((), dtype=torch.float64, device=device)
    expert_sq = torch.zeros((), dtype=torch.float64, device=device)
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.double().square().sum()
        if n in experts:
            assert placement is not None  # a model with spread experts has their placement
            if experts[n] == "b2" and placement.layout.shard_of_rank(placement.rank) != 0:
                continue
            expert_sq += sq
        else:
            dense_sq += sq
    if experts:
        assert placement is not None
        dist.all_reduce(expert_sq, group=placement.group)
    norm = float((dense_sq + expert_sq).sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


# ----------------------------------------------------------------------------------------------------------
# The loop.


@dataclass
class RunResult:
    final_val_loss: float
    final_train_loss: float
    steps: int
    wall_time_s: float
    tokens: int
    target: dict[str, Any] | None
    summary: dict[str, Any]
    already_complete: bool = False  # --resume found the run finished and changed nothing


def _mean_over_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


@torch.no_grad()
def evaluate(model: MoEModel, data: TokenData, tcfg: TrainConfig, rank: int, world: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches (the same at every evaluation and every seed)."""
    model.eval()
    rows = _rank_rows(tcfg.batch_size, rank, world)
    total = 0.0
    for i in range(tcfg.eval_batches):
        x, y = data.batch("val", tcfg.batch_size, model.cfg.block_size, seed=0, step=i, rows=rows)
        _, loss = model(x.to(tcfg.device), y.to(tcfg.device))
        total += loss.item()
    model.train()
    return _mean_over_ranks(total / tcfg.eval_batches, world)


def _rank_rows(batch_size: int, rank: int, world: int) -> slice:
    if batch_size % world:
        raise UsageError(f"--batch-size {batch_size} must divide by the number of ranks {world}")
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


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


def train(mcfg: GPTConfig, tcfg: TrainConfig, out: str | Path, *, resume: bool = False,
          init: dict[str, Tensor] | None = None) -> RunResult:
    """Train one model into run directory ``out``; returns its final numbers (on every rank). ``init``: the
    model's initial weights in global form (an upcycled dense run), instead of the seed's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and not mcfg.dense and not tcfg.fsdp:  # under --fsdp, parallelize spreads the experts
        mcfg = GPTConfig.from_dict(mcfg.to_dict(), group=dist.group.WORLD)
    if tcfg.batch_size % (world * tcfg.micro_batches):
        raise UsageError(f"--batch-size {tcfg.batch_size} must divide by ranks x micro-batches "
                         f"({world} x {tcfg.micro_batches})")
    if mcfg.redundant_experts and (mcfg.group is None or tcfg.fsdp):
        raise UsageError(f"--redundant-experts {mcfg.redundant_experts} copies experts between expert-parallel "
                         f"ranks: it needs --nproc 2 or more, without --fsdp and --dense")
    data = TokenData.from_file(tcfg.data, block_size=mcfg.block_size)
    model: nn.Module = build_model(mcfg, tcfg.seed)
    if init is not None:
        load_global_state_dict(model, init, source="--upcycle-from")
    model.to(tcfg.device)
    mesh = None
    if tcfg.fsdp:
        model, mesh = sharded_job.lay_out(model, tcfg.ep, tcfg.activation_checkpointing, tcfg.param_dtype)
    assert isinstance(model, MoEModel)
    return train_model(model, data, tcfg, out, label="dense" if mcfg.dense else "moe",
                       model_config=mcfg.to_dict(), param_counts=global_param_counts(mcfg), resume=resume, mesh=mesh)


def train_model(model: MoEModel, data: TokenData, tcfg: TrainConfig, out: str | Path, *, label: str,
                model_config: dict[str, Any], param_counts: tuple[int, int], resume: bool = False,
                mesh: DeviceMesh | None = None) -> RunResult:
    """The training loop shared by every language-model job: train ``model`` on ``data`` into run directory
    ``out`` (metrics, checkpoints, plots, summary); returns its final numbers (on every rank).

    ``model`` is built on this rank (under expert parallelism: holding its experts) and its ``forward(x, y)``
    returns ``(logits, loss)`` for tokens ``x, y: [B, L]`` with ``L = model.cfg.block_size``. ``model_config``
    goes into config.json, ``param_counts`` is (parameters, parameters active per token) of the whole model.
    ``mesh``: the model was laid on it by :func:`flexmoe.parallel.parallelize` (``--fsdp``): no DDP, and DCP
    checkpoints (:mod:`flexmoe.apps.sharded_job`).
    """
    out = Path(out)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    block_size = model.cfg.block_size
    device = torch.device(tcfg.device)
    optimizer = build_optimizer(model, tcfg)
    # Replicated parameters are all-reduced by DDP; spread experts are left out (their gradients already
    # hold every rank's tokens through the all-to-all).
    ddp = wrap_ddp(model) if world > 1 and mesh is None else None
    torch.manual_seed(tcfg.seed + 1)  # training-time randomness (dropout, router noise), same at any world size

    metrics_path = out / "metrics.jsonl"
    start, elapsed, target = 0, 0.0, None
    ckpt = None
    if resume and (out / "checkpoints").is_dir():
        ckpt = latest_checkpoint(out) if mesh is None else sharded_job.latest_dcp_checkpoint(out)
    if ckpt is not None:
        meta = (load_checkpoint(ckpt, model=model, optimizer=optimizer) if mesh is None else
                sharded_job.load_dcp_checkpoint(ckpt, model, optimizer, mesh))
        start, elapsed, target = meta["step"], meta.get("elapsed_s", 0.0), meta.get("target")
        finished = finished_run(out, start, tcfg, target)
        if finished is not None:
            if rank == 0:
                print(f"[{label}] {out} is already complete (step {start} of {tcfg.steps}); nothing to do "
                      f"(--steps N with a larger N extends it)", flush=True)
            return finished
        if rank == 0:
            print(f"[{label}] resumed from {ckpt} at step {start}", flush=True)
    # The nodes the MoE layers see: torchrun's LOCAL_WORLD_SIZE ranks per node (None: not under torchrun).
    ranks_per_node = (model.moe_layers[0].parallel_options.ranks_per_node if model.moe_layers
                      else default_ranks_per_node())
    params, active_params = param_counts
    records: list[dict[str, Any]] = []
    if rank == 0:
        if world > 1:
            nodes = f"{world // ranks_per_node} node(s) of {ranks_per_node}" if ranks_per_node else "one node"
            print(f"[{label}] {world} ranks on {nodes}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        if ckpt is None:
            # A new run in an existing directory (the command line allows it with --overwrite only) replaces
            # the old run's files, and only those.
            remove_run_files(out)
        (out / "config.json").write_text(json.dumps(
            {"model": model_config, "train": {k: v for k, v in asdict(tcfg).items()}, "world_size": world,
             "ranks_per_node": ranks_per_node, "data": data.source}, indent=1))
        records = rewrite_metrics(metrics_path, start) if ckpt is not None else []
        if ckpt is None:
            print(f"[{label}] {params:,} parameters, {active_params:,} active per "
                  f"token; {data.source}: {len(data.train):,} train / {len(data.val):,} validation bytes",
                  flush=True)
    compile_model(model, tcfg, label, rank, blocks=None if mesh is None else sharded_job.blocks(model))
    tokens_per_step = tcfg.batch_size * block_size
    rows = _rank_rows(tcfg.batch_size, rank, world)
    micro = tcfg.batch_size // world // tcfg.micro_batches

    bar = step_bar(tcfg, start, label, show=rank == 0)
    log_file = open(metrics_path, "a") if rank == 0 else None
    t0 = time.perf_counter() - elapsed
    t_last, step_last = time.perf_counter(), start
    val_loss = train_loss = float("nan")
    last_eval_step = -1
    step = start
    stop_signals = StopSignals()
    state_bytes: list[int] | None = None  # per rank, counted at the first step (parameters, gradients, AdamW)
    try:
        stop_signals.install()  # Ctrl-C / SIGTERM from here on: save at the end of the step, then leave
        for step in range(start + 1, tcfg.steps + 1):
            lr = set_lr(optimizer, step, tcfg)
            x, y = data.batch("train", tcfg.batch_size, block_size, seed=tcfg.seed, step=step, rows=rows)
            x, y = x.to(device), y.to(device)
            loss_sum = bal_sum = drop_sum = 0.0
            loads: list[Tensor] = []
            demands: list[Tensor] = []
            for i in range(tcfg.micro_batches):
                xs, ys = x[i * micro : (i + 1) * micro], y[i * micro : (i + 1) * micro]
                # DDP all-reduces in the last micro-batch's backward only.
                with ddp.no_sync() if ddp is not None and i < tcfg.micro_batches - 1 else nullcontext():
                    _, loss = (ddp or model)(xs, ys)
                    ((loss + model.regularization_loss()) / tcfg.micro_batches).backward()
                loss_sum += loss.item()
                bal_sum += model.balance_loss()
                drop_sum += model.drop_rate()
                loads.append(torch.tensor(model.expert_load(), dtype=torch.float64))
                demands.append(torch.tensor(model.expert_demand(), dtype=torch.float64))
            if mesh is None:
                clip_gradients(model, tcfg.grad_clip, world)
            else:
                sharded_job.clip_sharded_gradients(model, tcfg.grad_clip)
            update_expert_biases(model)  # balance="bias": once per optimizer step, from all micro-batches' load
            reset_global_balance(model)  # aux_loss_type="global": the next step counts its own choices
            optimizer.step()
            placement_before = replica_slots(model)
            if tcfg.replace_every and step % tcfg.replace_every == 0:
                replace_experts(model)  # from the load window since the last one; the same on every rank
            if state_bytes is None:
                state_bytes = sharded_job.state_bytes_per_rank(model, optimizer)
                if rank == 0:
                    msg = f"[{label}] state bytes per rank (parameters, gradients, AdamW): {state_bytes}"
                    if tcfg.param_dtype != "float32":
                        msg += (f"; blocks compute in {tcfg.param_dtype} (FSDP2 mixed precision), weights, "
                                f"gradient reduction and AdamW in float32")
                    (bar.write(msg) if bar else print(msg, flush=True))
            optimizer.zero_grad(set_to_none=True)

            is_eval = step % tcfg.eval_every == 0 or step == tcfg.steps
            is_log = is_eval or step % tcfg.log_every == 0
            if is_log:
                train_loss = _mean_over_ranks(loss_sum / tcfg.micro_batches, world)
                balance = _mean_over_ranks(bal_sum / tcfg.micro_batches, world)
                drop = _mean_over_ranks(drop_sum / tcfg.micro_batches, world)
                load = torch.stack(loads).sum(0) if loads and loads[0].numel() else torch.zeros(0)
                demand = torch.stack(demands).sum(0) if demands and demands[0].numel() else torch.zeros(0)
                if world > 1 and load.numel():
                    dist.all_reduce(load)
                    dist.all_reduce(demand)
                now = time.perf_counter()
                tok_s = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                t_last, step_last = now, step
                record: dict[str, Any] = {
                    "step": step, "train_loss": train_loss, "balance_loss": balance, "drop_rate": drop,
                    "lr": lr, "tokens": step * tokens_per_step, "elapsed_s": now - t0, "tokens_per_s": tok_s,
                }
                if load.numel():
                    record["expert_load"] = load.long().tolist()
                    record["expert_demand"] = demand.long().tolist()
                    # Before the evaluation below routes other tokens through the layers.
                    record["balance"] = {k: _mean_over_ranks(v, world) for k, v in balance_metrics(model).items()}
                    if placement_before:
                        record["placement"] = placement_record(placement_before, replica_slots(model),
                                                               record["expert_load"])
                if is_eval:
                    val_loss = evaluate(model, data, tcfg, rank, world)
                    last_eval_step = step
                    record["val_loss"] = val_loss
                    if tcfg.target_loss is not None and target is None and val_loss <= tcfg.target_loss:
                        target = {"target_loss": tcfg.target_loss, "step": step, "tokens": step * tokens_per_step,
                                  "wall_time_s": time.perf_counter() - t0, "val_loss": val_loss}
                        if rank == 0:
                            msg = (f"[{label}] reached val loss {val_loss:.4f} <= {tcfg.target_loss} at the evaluation "
                                   f"of step {step} (evaluated every {tcfg.eval_every} steps): "
                                   f"{target['wall_time_s']:.1f} s, {target['tokens']:,} tokens")
                            (bar.write(msg) if bar else print(msg, flush=True))
                        record["target_reached"] = True
                if log_file is not None:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                if bar is not None:
                    post = {"loss": f"{train_loss:.3f}", "tok/s": f"{tok_s:,.0f}"}
                    if label != "dense":
                        post.update(bal=f"{balance:.3f}", drop=f"{drop:.3f}")
                    if last_eval_step > 0:
                        post["val"] = f"{val_loss:.3f}"
                    bar.set_postfix(post, refresh=False)
            if bar is not None:
                bar.update(1)
            stop = tcfg.stop_at_target and target is not None
            signum = stop_signals.received(world)
            if step % tcfg.ckpt_every == 0 or step == tcfg.steps or stop or signum:
                extra = {"elapsed_s": time.perf_counter() - t0, "target": target, "train": asdict(tcfg)}
                if mesh is None:
                    saved = save_checkpoint(out, model=model, optimizer=optimizer, step=step,
                                            keep=tcfg.keep_checkpoints, extra=extra)
                else:
                    saved = sharded_job.save_dcp_checkpoint(out, model, optimizer, mesh, step, extra,
                                                            tcfg.keep_checkpoints)
                if world > 1:
                    dist.barrier()
            if signum:
                raise Interrupted.after_step(label, signum, step, tcfg.steps, saved)
            if stop:
                break
    finally:
        stop_signals.restore()
        if bar is not None:
            bar.close()
        if log_file is not None:
            log_file.close()

    if last_eval_step != step:  # resumed at the end, or nothing to do: evaluate the final weights once
        val_loss = evaluate(model, data, tcfg, rank, world)
        if rank == 0 and math.isnan(train_loss) and records:
            train_loss = records[-1]["train_loss"]
    wall = time.perf_counter() - t0
    summary = {
        "model": label, "steps": step, "final_val_loss": val_loss, "final_train_loss": train_loss,
        "wall_time_s": wall, "tokens": step * tokens_per_step, "params": params,
        "active_params": active_params, "world_size": world, "ranks_per_node": ranks_per_node,
        "target": target, "state_bytes_per_rank": state_bytes,
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        if tcfg.plots:
            write_plots(out, label)
        print(f"[{label}] done: step {step}, val loss {val_loss:.4f}, {wall:.1f} s"
              + (f"; target {tcfg.target_loss} reached at the evaluation of step {target['step']} after "
                 f"{target['wall_time_s']:.1f} s"
                 f" and {target['tokens']:,} tokens" if target else
                 (f"; target {tcfg.target_loss} not reached" if tcfg.target_loss is not None else "")), flush=True)
    return RunResult(val_loss, train_loss, step, wall, step * tokens_per_step, target, summary)


def global_param_counts(cfg: GPTConfig) -> tuple[int, int]:
    """(parameters, parameters active per token) of the whole model, whatever this rank holds of it.

    Counted on a weightless copy (the meta device) that holds every expert, as one process would.
    """
    with torch.device("meta"):
        whole = GPT(GPTConfig.from_dict(cfg.to_dict()))  # group None: one process holding all experts
    return whole.num_params(), whole.num_params(active=True)


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
