"""``flexmoe reshard``: rewrite a checkpoint for another number of expert-parallel ranks, offline.

``--world-size 1`` gives the global form (what ``flexmoe train`` writes); ``--world-size N`` splits every expert
tensor (and its optimizer moments) into one file per rank of the N-rank layout of
:mod:`flexmoe.parallel.layout`. Either form loads at any world size the layout allows.
"""

from __future__ import annotations

import argparse
import sys

from flexmoe.checkpoint import CheckpointError, latest_checkpoint, reshard_checkpoint

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    a("--world-size", type=int, required=True, help="expert-parallel ranks of the output layout (1: global form)")
    a("--out", required=True, help="output checkpoint directory (must not exist or be empty)")


def run(args: argparse.Namespace) -> int:
    src = latest_checkpoint(args.checkpoint)
    if src is None:
        print(f"error: {args.checkpoint}: no checkpoint found", file=sys.stderr)
        return 2
    try:
        dst = reshard_checkpoint(src, args.out, args.world_size)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{src} -> {dst} ({args.world_size} rank{'s' if args.world_size > 1 else ''})")
    return 0
