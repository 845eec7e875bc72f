"""``flexmoe train-vision``: train a small vision MoE (a ViT whose every other MLP is an MoELayer with the cosine
router, as in SwinV2-MoE) or its dense twin on scikit-learn's 8x8 handwritten digits, and report accuracy on a
fixed held-out split.

The job trains in ``flexmoe train``'s loop (:func:`flexmoe.apps.train_loop.train_model`: its optimizer,
learning-rate schedule, gradient clipping, per-step updates of the MoE layers such as the selection biases of
``balance="bias"``, checkpoints and plots) under its flags and run-directory rules
(:mod:`flexmoe.apps.train_flags`); this module holds the data (:class:`DigitsTask`) and the model. The run
directory is laid out as ``flexmoe train``'s: ``config.json``, ``metrics.jsonl`` (``step``, ``train_loss``, and
``val_loss`` / ``val_accuracy`` where evaluated), ``checkpoints/``, ``summary.json``, ``loss.png``,
``expert_load.png``; with ``--compare-dense`` the twin trains on the same batches into ``OUT/dense`` and ``OUT``
gets ``compare.{png,md,json}``.

The data: 1,797 grey 8x8 images (pixel values 0..16, scaled to [0, 1]) that ship inside scikit-learn, so
nothing is downloaded. The held-out split (360 images) is drawn once from a fixed seed, the same for every run
and every ``--seed``. The batch of step s is a function of (seed, s) only, so --resume continues exactly.
Single process only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, SEED, Choice
from flexmoe.apps.models.moe_model import MoEModel
from flexmoe.apps.models.vit import ViT, ViTConfig
from flexmoe.apps.run_files import RunResult
from flexmoe.apps.train_config import TrainConfig
from flexmoe.apps.train_flags import (
    MOE_MODEL_FLAGS,
    FlagTable,
    add_compile_flag,
    add_model_flags,
    add_run_flags,
    check_resumed_flags,
    check_run_dir,
    model_flag_values,
    saved_model_flags,
    train_config,
)
from flexmoe.apps.train_loop import Task, train_model

__all__ = ["Digits", "load_digits_split", "default_train_config", "add_arguments", "vision_configs", "DigitsTask",
           "run", "build_vit", "train_vision", "evaluate"]

SPLIT_SEED = 0  # the held-out split is the same for every run, whatever --seed says
HELD_OUT = 360  # images (a fifth of the 1,797)


def default_train_config() -> TrainConfig:
    """The optimisation settings of the vision job (``flexmoe train``'s :class:`TrainConfig`, other defaults)."""
    return TrainConfig(steps=600, batch_size=64, lr=2e-3, min_lr=2e-4, warmup=50, weight_decay=0.05,
                       log_every=10, eval_every=100, ckpt_every=200, data="sklearn.datasets.load_digits")


# ----------------------------------------------------------------------------------------------------------
# Data.


@dataclass
class Digits:
    """One split of the digits: ``images [N, 1, 8, 8]`` float in [0, 1], ``labels [N]`` long in 0..9."""

    images: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, batch_size: int, *, seed: int, step: int) -> tuple[Tensor, Tensor]:
        """``batch_size`` distinct images drawn at random, a function of (seed, step) only."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randperm(len(self), generator=g)[:batch_size]
        return self.images[idx], self.labels[idx]


def load_digits_split() -> tuple[Digits, Digits]:
    """(train, held-out) splits of scikit-learn's 8x8 digits; the held-out split is fixed (seed SPLIT_SEED)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError("train-vision needs scikit-learn (its 8x8 digits): pip install 'flexmoe[train]'") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8]
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    held, kept = order[:HELD_OUT], order[HELD_OUT:]
    return Digits(images[kept], labels[kept]), Digits(images[held], labels[held])


# ----------------------------------------------------------------------------------------------------------
# Command line.

_MODEL_FLAGS: FlagTable = {  # ViTConfig's
    "--patch-size": ("patch_size", COUNT),
    **MOE_MODEL_FLAGS,
    "--pool": ("pool", Choice(("mean", "cls"))),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t = default_train_config()
    m = ViTConfig()
    add_run_flags(parser, t, "runs/vision")
    a = parser.add_argument
    a("--seed", type=SEED, default=t.seed, help="seed of the initialisation and batch order (not of the split)")
    a("--batch-size", type=COUNT, default=t.batch_size, help="images per step")
    a("--eval-every", type=COUNT, default=t.eval_every, help="steps between held-out evaluations")
    add_compile_flag(parser)
    add_model_flags(parser, _MODEL_FLAGS, m)


def vision_configs(args: argparse.Namespace) -> tuple[ViTConfig, TrainConfig]:
    """The model and training configuration from the flags (a resumed run: from its config.json)."""
    for flag in ("upcycle_from", "granularity"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag.replace('_', '-')} upcycles a dense GPT run: a flag of flexmoe train, not of "
                             f"train-vision")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("train-vision runs in one process; start it without torchrun")
    tcfg, saved = train_config(args, default_train_config())
    if saved is not None:
        # A resumed run keeps its configuration (a flag set to another value is an error).
        check_resumed_flags(args, saved_model_flags(saved["model"], _MODEL_FLAGS), Path(args.out))
        return ViTConfig.from_dict(saved["model"]), tcfg
    tcfg = dataclasses.replace(tcfg, min_lr=tcfg.lr / 10)
    try:
        mcfg = ViTConfig(**model_flag_values(args, _MODEL_FLAGS), dense=args.dense)
    except ValueError as exc:
        raise UsageError(f"model flags: {exc}") from None
    train_size = 1797 - HELD_OUT
    if tcfg.batch_size > train_size:
        raise UsageError(f"--batch-size {tcfg.batch_size} exceeds the {train_size} training images")
    return mcfg, tcfg


def run(args: argparse.Namespace) -> int:
    mcfg, tcfg = vision_configs(args)
    out = Path(args.out)
    check_run_dir(out, resume=args.resume, overwrite=args.overwrite)
    if args.resume and not (out / "config.json").is_file():
        print(f"--resume: no run in {out} yet, starting a new one", flush=True)
    results = {}
    results["dense" if mcfg.dense else "moe"] = train_vision(mcfg, tcfg, out, resume=args.resume)
    if args.compare_dense and not mcfg.dense:
        results["dense"] = train_vision(mcfg.dense_twin(), tcfg, out / "dense", resume=args.resume)
        if not all(r.already_complete for r in results.values()):
            write_comparison(out, results)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The task and the model.


class DigitsTask(Task):
    """The digits for the shared loop: ``tcfg.batch_size`` training images a step (``x: [B, 1, 8, 8]``, labels
    ``y: [B]``), evaluated on the whole held-out split (loss and accuracy). One process."""

    unit = "images"
    rate_name = "img/s"
    loss_unit = "nats / image"

    def __init__(self, train: Digits, held_out: Digits, tcfg: TrainConfig, tokens_per_image: int) -> None:
        self.train, self.held_out, self.tcfg, self.tokens_per_image = train, held_out, tcfg, tokens_per_image
        self.source = str(tcfg.data)

    def describe(self) -> str:
        return f"digits: {len(self.train):,} train / {len(self.held_out):,} held-out images"

    def batch(self, step: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
        return self.train.batch(self.tcfg.batch_size, seed=self.tcfg.seed, step=step)

    def evaluate(self, model: MoEModel, rank: int, world: int) -> dict[str, float]:
        assert isinstance(model, ViT)
        loss, accuracy = evaluate(model, self.held_out)
        return {"val_loss": loss, "val_accuracy": accuracy}

    def units_per_step(self) -> int:
        return self.tcfg.batch_size

    def tokens_per_step(self) -> int:
        return self.tcfg.batch_size * self.tokens_per_image

    def eval_text(self, numbers: dict[str, float]) -> str:
        return f"held-out accuracy {numbers['val_accuracy']:.4f}, loss {numbers['val_loss']:.4f}"


@torch.no_grad()
def evaluate(model: ViT, data: Digits) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` over every image of ``data``, in eval mode."""
    model.eval()
    device = model.head.weight.device
    labels = data.labels.to(device)
    logits, loss = model(data.images.to(device), labels)
    accuracy = float((logits.argmax(dim=-1) == labels).float().mean())
    model.train()
    return float(loss), accuracy


def build_vit(cfg: ViTConfig, seed: int) -> ViT:
    """The model, initialised from ``seed``."""
    torch.manual_seed(seed)
    return ViT(cfg)


def train_vision(mcfg: ViTConfig, tcfg: TrainConfig, out: str | Path, *, resume: bool = False) -> RunResult:
    """Train one model into run directory ``out`` in the shared loop; ``summary["val_accuracy"]`` is its
    held-out accuracy."""
    train_set, held_out = load_digits_split()
    model = build_vit(mcfg, tcfg.seed).to(tcfg.device)
    return train_model(model, DigitsTask(train_set, held_out, tcfg, mcfg.num_tokens), tcfg, out,
                       label="dense" if mcfg.dense else "moe", model_config=mcfg.to_dict(),
                       param_counts=(model.num_params(), model.num_params(active=True)), resume=resume)


def write_comparison(out: Path, results: dict[str, RunResult]) -> None:
    """compare.png (both loss curves), compare.md (a table) and compare.json (each model's final numbers)."""
    from flexmoe.apps.plots import plot_compare, read_metrics

    runs = {"moe": read_metrics(out / "metrics.jsonl"), "dense": read_metrics(out / "dense" / "metrics.jsonl")}
    plot_compare(runs, out / "compare.png", unit="nats / image")
    table = ["| model | params | active params per token | steps | held-out accuracy | held-out loss | "
             "wall time (s) |", "|---|---|---|---|---|---|---|"]
    payload: dict[str, Any] = {}
    for name, r in results.items():
        s = r.summary
        table.append(f"| {name} | {s['params']:,} | {s['active_params']:,} | {r.steps} | {s['val_accuracy']:.4f} | "
                     f"{r.final_val_loss:.4f} | {r.wall_time_s:.1f} |")
        payload[name] = {"val_accuracy": s["val_accuracy"], "final_val_loss": r.final_val_loss,
                         "final_train_loss": r.final_train_loss, "steps": r.steps, "wall_time_s": r.wall_time_s,
                         "params": s["params"], "active_params": s["active_params"]}
    text = "\n".join(table) + f"\n\nheld-out split: {HELD_OUT} of the 1,797 digits (fixed)\n"
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(payload, indent=1))
    print(text, flush=True)
