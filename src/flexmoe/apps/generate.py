"""``flexmoe generate --run DIR``: sample text from a trained run's newest checkpoint (or a given one)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flexmoe.apps.data import decode, encode
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, NON_NEGATIVE, POSITIVE, SEED
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_checkpoint

__all__ = ["add_arguments", "run", "load_model"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--run", required=True, help="run directory (its newest checkpoint) or a checkpoint directory")
    a("--prompt", default="\n", help="text to continue (default: a newline)")
    a("--tokens", type=NON_NEGATIVE, default=500, help="bytes to generate")
    a("--temperature", type=POSITIVE, default=0.8, help="softmax temperature")
    a("--top-k", type=COUNT, default=None, help="sample among the k most likely bytes only (default: all 256)")
    a("--seed", type=SEED, default=0, help="sampling seed")


def load_model(run_dir: str | Path) -> tuple[GPT, Path]:
    """The model of the newest checkpoint under ``run_dir`` (single process, all experts), in eval mode."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no checkpoint found (expected {Path(run_dir) / 'checkpoints'})")
    meta = read_checkpoint(ckpt).meta
    if "hf_config" in meta["config"]:
        family = meta["config"]["hf_config"]["model_type"]
        raise UsageError(f"--run {run_dir}: trained a Hugging Face model ({family}), "
                         f"not the MoE GPT; export it (flexmoe train --out {run_dir} --resume --export-hf DIR) and "
                         f"sample with transformers' generate()")
    model = GPT(GPTConfig.from_dict(meta["config"]))
    load_checkpoint(ckpt, model=model, restore_rng=False)
    return model.eval(), ckpt


def run(args: argparse.Namespace) -> int:
    if not Path(args.run).is_dir():
        raise UsageError(f"--run {args.run}: no such directory; give a training run's --out directory")
    model, ckpt = load_model(args.run)
    prompt = encode(args.prompt or "\n")[None, :]
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k, generator=gen)
    print(f"# {ckpt}", file=sys.stderr)
    sys.stdout.write(decode(out[0]) + "\n")
    return 0
