"""``flexmoe train-vision``: train a small vision MoE (a ViT whose every other MLP is an MoELayer with the cosine
router, as in SwinV2-MoE) or its dense twin on scikit-learn's 8x8 handwritten digits, and report accuracy on a
fixed held-out split.

The run directory is laid out as ``flexmoe train``'s (see :mod:`flexmoe.apps.train`, whose run-directory rules,
optimizer, learning-rate schedule, gradient clipping, checkpoints and plots this job reuses): ``config.json``,
``metrics.jsonl`` (``step``, ``train_loss``, and ``val_loss`` / ``val_accuracy`` where evaluated),
``checkpoints/``, ``summary.json``, ``loss.png``, ``expert_load.png``; with ``--compare-dense`` the twin trains
on the same batches into ``OUT/dense`` and ``OUT`` gets ``compare.{png,md,json}``.

The data: 1,797 grey 8x8 images (pixel values 0..16, scaled to [0, 1]) that ship inside scikit-learn, so
nothing is downloaded. The held-out split (360 images) is drawn once from a fixed seed, the same for every run
and every ``--seed``. The batch of step s is a function of (seed, s) only, so --resume continues exactly.
Single process only.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, SEED, Choice
from flexmoe.apps.interrupt import Interrupted, StopSignals
from flexmoe.apps.models.vit import ViT, ViTConfig
from flexmoe.apps.train import (
    MOE_MODEL_FLAGS,
    RUN_DIRS,
    RUN_FILES,
    FlagTable,
    RunResult,
    TrainConfig,
    add_compile_flag,
    add_model_flags,
    add_run_flags,
    build_optimizer,
    check_compile_backend,
    check_resumed_flags,
    check_run_dir,
    check_run_flags,
    clip_gradients,
    compile_model,
    finished_run,
    given_dests,
    model_flag_values,
    remove_run_files,
    resumed_train_config,
    rewrite_metrics,
    saved_model_flags,
    saved_train_flags,
    set_lr,
    step_bar,
    write_plots,
)
from flexmoe.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["Digits", "load_digits_split", "default_train_config", "add_arguments", "run", "train_vision",
           "evaluate"]

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


def _configs(args: argparse.Namespace) -> tuple[ViTConfig, TrainConfig]:
    """The model and training configuration from the flags (a resumed run: from its config.json)."""
    check_run_flags(args)
    compile_backend = check_compile_backend(args.compile)
    saved = Path(args.out) / "config.json"
    if args.resume and saved.is_file():
        # A resumed run keeps its configuration (a flag set to another value is an error).
        old = json.loads(saved.read_text())
        check_resumed_flags(args, {**saved_train_flags(old["train"]), **saved_model_flags(old["model"], _MODEL_FLAGS)},
                            Path(args.out))
        asked = TrainConfig(steps=args.steps or 1, log_every=args.log_every, eval_every=args.eval_every,
                            ckpt_every=args.ckpt_every, plots=not args.no_plots, progress=not args.no_progress,
                            compile=compile_backend)
        return ViTConfig.from_dict(old["model"]), resumed_train_config(old["train"], asked, given_dests(args))
    base = default_train_config()
    tcfg = TrainConfig(**{
        **asdict(base), "steps": args.steps if args.steps is not None else base.steps,
        "batch_size": args.batch_size, "lr": args.lr, "min_lr": args.lr / 10, "warmup": args.warmup,
        "seed": args.seed, "log_every": args.log_every, "eval_every": args.eval_every,
        "ckpt_every": args.ckpt_every, "plots": not args.no_plots, "progress": not args.no_progress,
        "compile": compile_backend,
    })
    overrides = model_flag_values(args, _MODEL_FLAGS)
    try:
        mcfg = ViTConfig(**overrides, dense=args.dense)
    except ValueError as exc:
        raise UsageError(f"model flags: {exc}") from None
    train_size = 1797 - HELD_OUT
    if tcfg.batch_size > train_size:
        raise UsageError(f"--batch-size {tcfg.batch_size} exceeds the {train_size} training images")
    return mcfg, tcfg


def run(args: argparse.Namespace) -> int:
    mcfg, tcfg = _configs(args)
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
# The loop.


@torch.no_grad()
def evaluate(model: ViT, data: Digits) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` over every image of ``data``, in eval mode."""
    model.eval()
    logits, loss = model(data.images, data.labels)
    accuracy = float((logits.argmax(dim=-1) == data.labels).float().mean())
    model.train()
    return float(loss), accuracy


def build_vit(cfg: ViTConfig, seed: int) -> ViT:
    """The model, initialised from ``seed``."""
    torch.manual_seed(seed)
    return ViT(cfg)


def train_vision(mcfg: ViTConfig, tcfg: TrainConfig, out: str | Path, *, resume: bool = False) -> RunResult:
    """Train one model into run directory ``out``; ``summary["val_accuracy"]`` is its held-out accuracy."""
    out = Path(out)
    label = "dense" if mcfg.dense else "moe"
    train_set, held_out = load_digits_split()
    model = build_vit(mcfg, tcfg.seed)
    optimizer = build_optimizer(model, tcfg)
    compile_model(model, tcfg, label)
    torch.manual_seed(tcfg.seed + 1)  # training-time randomness (dropout)

    metrics_path = out / "metrics.jsonl"
    start, elapsed = 0, 0.0
    ckpt = latest_checkpoint(out) if resume and (out / "checkpoints").is_dir() else None
    if ckpt is not None:
        meta = load_checkpoint(ckpt, model=model, optimizer=optimizer)
        start, elapsed = meta["step"], meta.get("elapsed_s", 0.0)
        finished = finished_run(out, start, tcfg, None)
        if finished is not None:
            print(f"[{label}] {out} is already complete (step {start} of {tcfg.steps}); nothing to do "
                  f"(--steps N with a larger N extends it)", flush=True)
            return finished
        print(f"[{label}] resumed from {ckpt} at step {start}", flush=True)
    params, active_params = model.num_params(), model.num_params(active=True)
    out.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        remove_run_files(out, RUN_FILES, RUN_DIRS)  # a new run in an existing directory (--overwrite) replaces it
        print(f"[{label}] {params:,} parameters, {active_params:,} active per token; digits: "
              f"{len(train_set):,} train / {len(held_out):,} held-out images", flush=True)
    (out / "config.json").write_text(json.dumps(
        {"model": mcfg.to_dict(), "train": asdict(tcfg), "world_size": 1, "data": tcfg.data}, indent=1))
    rewrite_metrics(metrics_path, start)

    bar = step_bar(tcfg, start, label)
    t0 = time.perf_counter() - elapsed
    val_loss = accuracy = train_loss = float("nan")
    last_eval_step = -1
    step = start
    stop_signals = StopSignals()
    with open(metrics_path, "a") as log_file:
        try:
            stop_signals.install()  # Ctrl-C / SIGTERM from here on: save at the end of the step, then leave
            for step in range(start + 1, tcfg.steps + 1):
                lr = set_lr(optimizer, step, tcfg)
                x, y = train_set.batch(tcfg.batch_size, seed=tcfg.seed, step=step)
                _, loss = model(x, y)
                (loss + model.regularization_loss()).backward()
                clip_gradients(model, tcfg.grad_clip, 1)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

                is_eval = step % tcfg.eval_every == 0 or step == tcfg.steps
                if is_eval or step % tcfg.log_every == 0:
                    train_loss = loss.item()
                    record: dict[str, Any] = {
                        "step": step, "train_loss": train_loss, "balance_loss": model.balance_loss(),
                        "drop_rate": model.drop_rate(), "lr": lr, "images": step * tcfg.batch_size,
                        "elapsed_s": time.perf_counter() - t0,
                    }
                    if model.moe_layers:
                        record["expert_load"] = model.expert_load()
                        record["expert_demand"] = model.expert_demand()
                    if is_eval:
                        val_loss, accuracy = evaluate(model, held_out)
                        last_eval_step = step
                        record.update(val_loss=val_loss, val_accuracy=accuracy)
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                    if bar is not None:
                        post = {"loss": f"{train_loss:.3f}"}
                        if last_eval_step > 0:
                            post["acc"] = f"{accuracy:.3f}"
                        bar.set_postfix(post, refresh=False)
                if bar is not None:
                    bar.update(1)
                signum = stop_signals.received(world=1)
                if step % tcfg.ckpt_every == 0 or step == tcfg.steps or signum:
                    saved = save_checkpoint(out, model=model, optimizer=optimizer, step=step,
                                            keep=tcfg.keep_checkpoints,
                                            extra={"elapsed_s": time.perf_counter() - t0, "train": asdict(tcfg)})
                if signum:
                    raise Interrupted.after_step(label, signum, step, tcfg.steps, saved)
        finally:
            stop_signals.restore()
            if bar is not None:
                bar.close()

    if last_eval_step != step:  # resumed at the end: evaluate the final weights once
        val_loss, accuracy = evaluate(model, held_out)
    wall = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "model": label, "steps": step, "final_val_loss": val_loss, "val_accuracy": accuracy,
        "final_train_loss": train_loss, "wall_time_s": wall, "tokens": step * tcfg.batch_size * mcfg.num_tokens,
        "images": step * tcfg.batch_size, "params": params, "active_params": active_params, "world_size": 1,
        "target": None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if tcfg.plots:
        write_plots(out, label, loss_unit="nats / image")
    print(f"[{label}] done: step {step}, held-out accuracy {accuracy:.4f}, loss {val_loss:.4f}, {wall:.1f} s",
          flush=True)
    return RunResult(val_loss, train_loss, step, wall, int(summary["tokens"]), None, summary)


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
