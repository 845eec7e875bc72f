"""``flexmoe train``: train the MoE GPT (or its dense twin) on the embedded corpus or any text file.

This module is the GPT's job: its flags (:data:`GPT_MODEL_FLAGS` beside the shared ones of
:mod:`flexmoe.apps.train_flags`), its configuration (:func:`gpt_job`: built once from the flags, upcycled once with
``--upcycle-from``), its model (:func:`build_model`: built once) and its runs (:func:`run_gpt_job`). The loop is
:func:`flexmoe.apps.train_loop.train_model`, shared with the Hugging Face job (``--hf-arch NAME`` /
``--hf-model DIR``, :mod:`flexmoe.apps.hf_job`) and ``flexmoe train-vision``.

The run directory (``--out``) holds ``config.json``, ``metrics.jsonl`` (one JSON object per logged step:
``step``, ``train_loss``, ``val_loss`` where evaluated, and ``balance``: :func:`flexmoe.balance_metrics` of the
step's last micro-batch, the mean over ranks), ``checkpoints/``, ``summary.json`` and PNG plots
(:mod:`flexmoe.apps.run_files`). With ``--compare-dense`` the dense twin trains on the same batches into
``OUT/dense`` and ``OUT`` also gets ``compare.png``, ``compare.md`` and ``compare.json``. An existing run directory
is only touched with ``--resume`` (continue it; a finished run is left as it is) or ``--overwrite`` (remove its
run files first).

Distributed (``torchrun`` or ``--nproc N``): experts are spread over the ranks and every other parameter is
data-parallel (under ``--fsdp``: sharded, :mod:`flexmoe.apps.sharded_job`). Each rank takes its own rows of the
global batch; rank 0 logs.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexmoe.apps import sharded_job
from flexmoe.apps.data import TokenData
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, NON_NEGATIVE, NON_NEGATIVE_REAL, SEED, SHARE, Choice
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.apps.models.moe_model import build_moe_mlp
from flexmoe.apps.ranks import start_ranks
from flexmoe.apps.run_files import RunResult, write_comparison
from flexmoe.apps.train_config import TrainConfig
from flexmoe.apps.train_flags import (
    MOE_MODEL_FLAGS,
    FlagTable,
    add_compile_flag,
    add_model_flags,
    add_run_flags,
    check_device,
    check_resumed_flags,
    model_flag_values,
    saved_model_flags,
    train_config,
)
from flexmoe.apps.train_loop import TokenTask, train_model
from flexmoe.apps.train_step import build_optimizer
from flexmoe.apps.upcycle_job import UPCYCLE_MODEL_FIELDS, UpcycleStart, upcycle_start
from flexmoe.checkpoint import load_global_state_dict
from flexmoe.routing.losses import AUX_LOSS_TYPES

# TrainConfig, build_optimizer and check_device are re-exported: their users import them from here.
__all__ = ["TrainConfig", "GPT_MODEL_FLAGS", "GPTJob", "add_arguments", "gpt_job", "gpt_configs", "run_gpt_job",
           "train", "build_model", "spread_experts", "build_optimizer", "check_device"]

# The MoE GPT's model flags (those of every MoE model, and the GPT's own).
GPT_MODEL_FLAGS: FlagTable = {  # GPTConfig's fields
    "--block-size": ("block_size", COUNT),
    **MOE_MODEL_FLAGS,
    "--a2a": ("a2a", Choice(("flat", "2dh"))),
    "--cross-node-share": ("cross_node_share", SHARE),
    "--aux-loss-type": ("aux_loss_type", Choice(AUX_LOSS_TYPES)),
    "--redundant-experts": ("redundant_experts", NON_NEGATIVE),
}


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
    a("--max-restarts", type=NON_NEGATIVE, default=0,
      help="with --nproc N: when a rank fails, start all N again up to this many times, each resuming from the "
           "newest complete checkpoint (as torchrun --max-restarts; under torchrun, give torchrun's)")
    sharded_job.add_mesh_flags(parser)
    add_model_flags(parser, GPT_MODEL_FLAGS, m)



@dataclass
class GPTJob:
    """What the flags ask the GPT job to train: the model's and the loop's configurations and, with
    ``--upcycle-from``, where the run starts (the dense run upcycled, once)."""

    model: GPTConfig
    train: TrainConfig
    upcycled: UpcycleStart | None = None


def gpt_job(args: argparse.Namespace) -> GPTJob:
    """The job from the flags (a resumed run: from its config.json); :class:`UsageError` for flags that do not fit
    together or differ from the resumed run's."""
    tcfg, saved = train_config(args)
    if saved is not None:
        check_resumed_flags(args, saved_model_flags(saved["model"], GPT_MODEL_FLAGS), Path(args.out))
        mcfg = GPTConfig.from_dict(saved["model"])
        # The same start as the run's first command line had (its model flags are the saved model's).
        upcycled = None if tcfg.upcycle_from is None else upcycle_start(
            tcfg.upcycle_from, tcfg.granularity, {name: saved["model"][name] for name in UPCYCLE_MODEL_FIELDS})
        return GPTJob(mcfg, tcfg, upcycled)
    if args.granularity is not None and tcfg.upcycle_from is None:
        raise UsageError("--granularity slices the dense MLPs of --upcycle-from RUN; give that run too")
    if tcfg.upcycle_from is not None:
        if args.dense:
            raise UsageError("--upcycle-from makes an MoE model; --dense excludes it (--compare-dense continues "
                             "the dense run beside it)")
        upcycled = upcycle_start(tcfg.upcycle_from, tcfg.granularity, model_flag_values(args, GPT_MODEL_FLAGS))
        return GPTJob(upcycled.moe_config, tcfg, upcycled)
    try:
        mcfg = GPTConfig(**{**model_flag_values(args, GPT_MODEL_FLAGS), "dense": args.dense})
    except ValueError as exc:
        raise UsageError(f"model flags: {exc}") from None
    return GPTJob(mcfg, tcfg)


def gpt_configs(args: argparse.Namespace) -> tuple[GPTConfig, TrainConfig]:
    """The model's and the loop's configurations of :func:`gpt_job`."""
    job = gpt_job(args)
    return job.model, job.train


def run_gpt_job(args: argparse.Namespace, job: GPTJob) -> int:
    """The MoE GPT's run (this rank's part under torchrun), and its dense twin's with ``--compare-dense``: build,
    train, write the run directories."""
    out = Path(args.out)
    rank, _, device = start_ranks(args.backend, job.train.device, job.train.collective_timeout)
    if args.resume and not (out / "config.json").is_file() and rank == 0:
        print(f"--resume: no run in {out} yet, starting a new one", flush=True)
    mcfg, upcycled = job.model, job.upcycled
    tcfg = dataclasses.replace(job.train, device=device)  # this rank's own GPU under --device cuda
    results = {}
    # --upcycle-from: both runs start from the dense run's weights (a resumed one then from its checkpoint).
    init = None if upcycled is None else upcycled.moe_state
    results["dense" if mcfg.dense else "moe"] = train(mcfg, tcfg, out, resume=args.resume, init=init)
    if args.compare_dense and not mcfg.dense:
        dense_cfg, dense_init = ((mcfg.dense_twin(), None) if upcycled is None else
                                 (upcycled.dense_config, upcycled.dense_state))
        results["dense"] = train(dense_cfg, tcfg, out / "dense", resume=args.resume, init=dense_init)
        if rank == 0 and not all(r.already_complete for r in results.values()):
            write_comparison(out, results)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The model.


def build_model(cfg: GPTConfig, seed: int, group: Any = None) -> GPT:
    """The model, initialised from ``seed`` identically at every world size; with ``group`` (an expert-parallel
    process group) holding this rank's experts only (:func:`spread_experts`)."""
    torch.manual_seed(seed)
    model = GPT(cfg)  # one process holding every expert
    if group is not None and not cfg.dense:
        spread_experts(model, group)
    return model


def spread_experts(model: GPT, group: Any) -> None:
    """Keep only this rank's experts of ``model`` (built holding every expert): each MoE layer is replaced by one of
    the same configuration over ``group`` and loaded with its share of the global weights, so a run's initial
    weights do not depend on the number of ranks."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for block in model.blocks:
        if block.is_moe:
            block.mlp = build_moe_mlp(model.cfg, group=group)
    # The replica placements and load windows (buffers of the layers with replicas) start as the layers' own.
    state.update({k: v for k, v in model.state_dict().items() if ".replicas." in k})
    load_global_state_dict(model, state, source="init")


def train(mcfg: GPTConfig, tcfg: TrainConfig, out: str | Path, *, resume: bool = False,
          init: dict[str, torch.Tensor] | None = None) -> RunResult:
    """Train one model into run directory ``out``; returns its final numbers (on every rank). ``init``: the
    model's initial weights in global form (an upcycled dense run), instead of the seed's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    # The experts spread over every rank; under --fsdp, parallelize spreads them (over --ep ranks) instead.
    group = dist.group.WORLD if world > 1 and not mcfg.dense and not tcfg.fsdp else None
    if tcfg.batch_size % (world * tcfg.micro_batches):
        raise UsageError(f"--batch-size {tcfg.batch_size} must divide by ranks x micro-batches "
                         f"({world} x {tcfg.micro_batches})")
    if mcfg.redundant_experts and (group is None or tcfg.fsdp):
        raise UsageError(f"--redundant-experts {mcfg.redundant_experts} copies experts between expert-parallel "
                         f"ranks: it needs --nproc 2 or more, without --fsdp and --dense")
    data = TokenData.from_file(tcfg.data, block_size=mcfg.block_size)
    model = build_model(mcfg, tcfg.seed)
    param_counts = model.num_params(), model.num_params(active=True)  # the whole model's, before any spreading
    if init is not None:
        load_global_state_dict(model, init, source="--upcycle-from")
    if group is not None:
        spread_experts(model, group)
    model.to(tcfg.device)
    laid: nn.Module = model
    mesh = None
    if tcfg.fsdp:
        laid, mesh = sharded_job.lay_out(model, tcfg.ep, tcfg.activation_checkpointing, tcfg.param_dtype)
    assert isinstance(laid, GPT)  # parallelize lays the model out in place
    return train_model(laid, TokenTask(data, tcfg, mcfg.block_size), tcfg, out, label="dense" if mcfg.dense else "moe",
                       model_config=mcfg.to_dict(), param_counts=param_counts, resume=resume, mesh=mesh)
