"""``flexmoe reshard``: rewrite a checkpoint for another number of expert-parallel ranks, offline.

``--world-size 1`` gives the global form (what ``flexmoe train`` writes); ``--world-size N`` splits every expert
tensor (and its optimizer moments) into one file per rank of the N-rank layout of
:mod:`flexmoe.parallel.layout`. Either form loads at any world size the layout allows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, check_writable_dir
from flexmoe.checkpoint import latest_checkpoint, reshard_checkpoint
from flexmoe.parallel.layout import ExpertLayout

__all__ = ["add_arguments", "run", "valid_world_sizes"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    a("--world-size", type=COUNT, required=True, help="expert-parallel ranks of the output layout (1: global form)")
    a("--out", required=True, help="output checkpoint directory (must not exist or be empty)")


def valid_world_sizes(num_experts: int, hidden_dim: int) -> list[int]:
    """Every world size the expert layout allows for these experts: the divisors of ``num_experts`` (whole
    experts per rank) and ``num_experts * s`` for every ``s`` dividing ``hidden_dim`` (experts sharded ``s``
    ways along the hidden dimension)."""
    candidates = {w for w in range(1, num_experts + 1) if num_experts % w == 0}
    candidates |= {num_experts * s for s in range(1, hidden_dim + 1) if hidden_dim % s == 0}
    sizes = []
    for w in sorted(candidates):
        try:
            ExpertLayout(num_experts, w, hidden_dim)
        except ValueError:
            continue
        sizes.append(w)
    return sizes


def _check_world_size(checkpoint: Path, world_size: int) -> None:
    """A world size the checkpoint's expert layout cannot take fails here, naming the ones it can."""
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    try:
        layout = json.loads((checkpoint / "meta.json").read_text()).get("layout")
    except (OSError, ValueError):
        return  # a damaged checkpoint: reshard_checkpoint names the file and what is wrong with it
    if layout is None:
        if world_size != 1:
            raise UsageError(f"--world-size {world_size}: {checkpoint} is a dense model, with no experts to "
                             f"reshard; only --world-size 1 works")
        return
    sizes = valid_world_sizes(layout["num_experts"], layout["hidden_dim"])
    if world_size not in sizes:
        raise UsageError(
            f"--world-size {world_size} does not fit {checkpoint} ({layout['num_experts']} experts of hidden size "
            f"{layout['hidden_dim']}); world sizes that work: {', '.join(map(str, sizes))}")


def run(args: argparse.Namespace) -> int:
    src = latest_checkpoint(args.checkpoint)
    if src is None:
        raise UsageError(f"{args.checkpoint}: no checkpoint found; give a run directory (with checkpoints/) or a "
                         f"checkpoint directory (with meta.json)")
    _check_world_size(src, args.world_size)
    check_writable_dir(Path(args.out), "--out")
    dst = reshard_checkpoint(src, args.out, args.world_size)
    print(f"{src} -> {dst} ({args.world_size} rank{'s' if args.world_size > 1 else ''})")
    return 0
