"""The ``flexmoe train`` command: the MoE GPT's flags and the Hugging Face job's, and which of the two jobs runs.

The two jobs share the training loop (:mod:`flexmoe.apps.train_loop`) and the flags and resume rules
(:mod:`flexmoe.apps.train_flags`); this module, above both, reads the flags, checks them, and hands the run to
one (``--hf-arch`` / ``--hf-model``: the Hugging Face model; otherwise the MoE GPT). ``--nproc N`` relaunches
the same command line on N local ranks, and ``--max-restarts R`` starts them again (resuming) when one fails.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch.distributed as dist

from flexmoe.apps import hf_job, sharded_job, train
from flexmoe.apps.data import TokenData
from flexmoe.apps.errors import UsageError
from flexmoe.apps.ranks import restart_attempt
from flexmoe.apps.train_flags import check_run_dir, check_world_size
from flexmoe.launch import relaunch, under_torchrun

__all__ = ["add_arguments", "run"]

# The parser's actions, recorded by add_arguments: what --nproc's relaunch forwards.
_ACTIONS: list[argparse.Action] = []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train.add_arguments(parser)
    hf_job.add_hf_flags(parser)
    _ACTIONS[:] = list(parser._actions)


def forward_argv(args: argparse.Namespace) -> list[str]:
    """The command-line flags of ``args`` (without --nproc), to hand to the launched processes."""
    argv: list[str] = []
    for action in _ACTIONS:
        if not action.option_strings or action.dest in ("help", "nproc", "max_restarts"):
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(flag)
        elif value is not None and value != action.default:
            argv += [flag, str(value)]
    if "--out" not in argv:
        argv += ["--out", args.out]
    return argv


def run(args: argparse.Namespace) -> int:
    # Every check of the user's input happens here, before any process is launched or any file written.
    if args.max_restarts and (args.nproc < 2 or under_torchrun()):
        raise UsageError(f"--max-restarts {args.max_restarts} restarts the ranks of --nproc N (N >= 2); under "
                         f"torchrun give torchrun's own --max-restarts")
    restarted = restart_attempt() > 0
    if restarted:
        # A restarted worker (torchrun --max-restarts, --nproc's --max-restarts) continues the run its first start
        # began: --overwrite applied to that start only, and --resume is implied.
        args.resume, args.overwrite = True, False
    hf = hf_job.job_config(args)  # None: the MoE GPT
    if hf is None:
        job = train.gpt_job(args)
        tcfg = job.train
        check_run_dir(Path(args.out), resume=args.resume, overwrite=args.overwrite, restarted=restarted)
        TokenData.from_file(tcfg.data, block_size=job.model.block_size)  # a missing, empty or too small --data
        check_world_size(job.model, int(os.environ.get("WORLD_SIZE", args.nproc)))
    else:
        hf_cfg, tcfg = hf
        check_run_dir(Path(args.out), resume=args.resume, overwrite=args.overwrite, restarted=restarted)
        hf_job.check_inputs(hf_cfg, tcfg, args)
    sharded_job.check_mesh_flags(args, int(os.environ.get("WORLD_SIZE", args.nproc)))
    if args.nproc > 1 and not under_torchrun():
        return relaunch(args.nproc, "train", forward_argv(args), max_restarts=args.max_restarts)
    try:
        return train.run_gpt_job(args, job) if hf is None else hf_job.run_job(args, hf_cfg, tcfg)
    finally:
        if dist.is_available() and dist.is_initialized():
            # Free what is left of the model and its DDP wrapper first (reference cycles included), so that
            # destroying the groups frees them and joins gloo's worker threads before the interpreter exits.
            gc.collect()
            dist.destroy_process_group()
