"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "plot_losses", "plot_expert_load", "plot_compare"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window, works on headless CI
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _curves(records: list[dict[str, Any]]) -> tuple[list[int], list[float], list[int], list[float]]:
    train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return [s for s, _ in train], [v for _, v in train], [s for s, _ in val], [v for _, v in val]


def _save(fig: Any, path: str | Path) -> Path:
    """Write the figure as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return Path(path)


def _save_loss_axes(fig: Any, ax: Any, title: str, path: str | Path) -> Path:
    """Label the loss-against-step axes, then save the figure."""
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_losses(records: list[dict[str, Any]], path: str | Path, title: str = "training") -> Path:
    """Train and validation loss against step."""
    plt = _plt()
    ts, tl, vs, vl = _curves(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ts, tl, label="train", alpha=0.7)
    if vs:
        ax.plot(vs, vl, "o-", label="validation")
    return _save_loss_axes(fig, ax, title, path)


def plot_expert_load(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Heat map per MoE layer: share of routed tokens per expert (rows) over logged steps (columns)."""
    rows = [r for r in records if r.get("expert_load")]
    if not rows:
        return None
    plt = _plt()
    import numpy as np

    n_layers = len(rows[0]["expert_load"])
    fig, axes = plt.subplots(n_layers, 1, figsize=(8, 2.2 * n_layers + 0.8), squeeze=False)
    steps = [r["step"] for r in rows]
    half = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) / 2 or 0.5  # each column centred on its step
    for i in range(n_layers):
        load = np.array([r["expert_load"][i] for r in rows], dtype=float).T  # [E, logged steps]
        share = load / np.maximum(load.sum(axis=0, keepdims=True), 1)
        ax = axes[i][0]
        im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(steps[0] - half, steps[-1] + half, load.shape[0] - 0.5, -0.5))
        ax.set_ylabel(f"MoE layer {i}\nexpert")
        fig.colorbar(im, ax=ax, label="share of tokens")
    axes[-1][0].set_xlabel("step")
    fig.suptitle("expert load per layer (uniform = 1/E)")
    return _save(fig, path)


def plot_compare(runs: dict[str, list[dict[str, Any]]], path: str | Path) -> Path:
    """Train (faint) and validation (bold) curves of several runs in one plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, records) in enumerate(runs.items()):
        ts, tl, vs, vl = _curves(records)
        color = f"C{i}"
        ax.plot(ts, tl, color=color, alpha=0.3, label=f"{name} train")
        if vs:
            ax.plot(vs, vl, "o-", color=color, label=f"{name} validation")
    return _save_loss_axes(fig, ax, "MoE vs dense twin (equal active compute)", path)
