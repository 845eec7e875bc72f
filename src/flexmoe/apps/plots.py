"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "plot_losses", "plot_expert_load", "plot_balance", "balance_curves", "plot_compare",
           "expert_shares", "share_scale"]


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


def _save_loss_axes(fig: Any, ax: Any, title: str, path: str | Path, unit: str) -> Path:
    """Label the loss-against-step axes (``unit``: of the cross-entropy), then save the figure."""
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_losses(records: list[dict[str, Any]], path: str | Path, title: str = "training",
                unit: str = "nats / byte") -> Path:
    """Train and validation loss against step."""
    plt = _plt()
    ts, tl, vs, vl = _curves(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ts, tl, label="train", alpha=0.7)
    if vs:
        ax.plot(vs, vl, "o-", label="validation")
    return _save_loss_axes(fig, ax, title, path, unit)


def expert_shares(records: list[dict[str, Any]], layer: int) -> tuple[Any, Any | None]:
    """One MoE layer's load as shares of the (token, choice) pairs the router placed, ``[E, logged steps]``.

    Returns (computed, wanted): ``computed`` the rows each expert computed (after the capacity limit), ``wanted``
    the pairs the router sent it before that limit (None for runs logged without ``expert_demand``). Both are
    divided by the pairs routed, so an overflowing expert's computed share sits below its wanted share and the
    dropped pairs are the difference.
    """
    import numpy as np

    load = np.array([r["expert_load"][layer] for r in records], dtype=float).T
    if not all(r.get("expert_demand") for r in records):
        return load / np.maximum(load.sum(axis=0, keepdims=True), 1), None
    wanted = np.array([r["expert_demand"][layer] for r in records], dtype=float).T
    routed = np.maximum(wanted.sum(axis=0, keepdims=True), 1)
    return load / routed, wanted / routed


def share_scale(panels: list[Any], num_experts: int) -> float:
    """The top of the colour scale shared by every panel: the 99th percentile of all shares after the first
    logged step (whose untrained router may send most tokens to one expert), at least twice the uniform 1/E.
    Larger shares saturate at the top colour rather than flattening the rest of the run."""
    import numpy as np

    later = [p[:, 1:] for p in panels if p.shape[1] > 1] or panels
    values = np.concatenate([p.ravel() for p in later])
    return float(max(np.percentile(values, 99), 2.0 / num_experts))


def plot_expert_load(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Heat maps per MoE layer, experts (rows) over logged steps (columns): the share of the routed pairs each
    expert was sent (wanted, before the capacity limit) beside the share it computed (after it).

    One colour scale for every panel, diverging at the uniform share 1/E (white): red experts are overloaded,
    blue ones starved; where a wanted share is red and the computed one paler, tokens were dropped.
    """
    rows = [r for r in records if r.get("expert_load")]
    if not rows:
        return None
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm

    n_layers = len(rows[0]["expert_load"])
    num_experts = len(rows[0]["expert_load"][0])
    shares = [expert_shares(rows, i) for i in range(n_layers)]
    has_wanted = shares[0][1] is not None
    titles = ["wanted (routed, before the capacity limit)", "computed (after the capacity limit)"] \
        if has_wanted else ["computed"]
    panels = [[w, c] if has_wanted else [c] for c, w in shares]
    uniform = 1.0 / num_experts
    norm = TwoSlopeNorm(vmin=0.0, vcenter=uniform,
                        vmax=share_scale([p for layer in panels for p in layer], num_experts))

    steps = [r["step"] for r in rows]
    half = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) / 2 or 0.5  # each column centred on its step
    height = max(0.22 * num_experts, 1.6)
    fig, axes = plt.subplots(n_layers, len(titles), figsize=(5.5 * len(titles) + 1.5, height * n_layers + 1.2),
                             squeeze=False, sharex=True, sharey=True)
    image = None
    for i, layer_panels in enumerate(panels):
        for j, share in enumerate(layer_panels):
            ax = axes[i][j]
            image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                              extent=(steps[0] - half, steps[-1] + half, num_experts - 0.5, -0.5))
            ax.set_yticks(range(num_experts))
            ax.set_yticklabels([str(e) for e in range(num_experts)], fontsize=8 if num_experts <= 16 else 5)
            if i == 0:
                ax.set_title(titles[j], fontsize=10)
            if j == 0:
                ax.set_ylabel(f"MoE layer {i}\nexpert")
            if i == n_layers - 1:
                ax.set_xlabel("step")
    bar = fig.colorbar(image, ax=axes, extend="max", label="share of the routed (token, choice) pairs")
    multiples = [0.0, 0.5, 1.0] + [float(m) for m in range(2, int(float(norm.vmax or uniform) / uniform) + 1)]
    bar.set_ticks([m * uniform for m in multiples])
    bar.set_ticklabels(["0" if m == 0 else f"uniform 1/E = {uniform:.3g}" if m == 1 else f"{m:g}/E"
                        for m in multiples])
    fig.suptitle(f"expert load per MoE layer ({num_experts} experts; white = uniform 1/E, red = overloaded)")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


# The balance metrics plotted, in panel order, with their axis labels (flexmoe.routing.balance_metrics defines them).
BALANCE_PANELS = {
    "max_over_mean": "max / mean expert load (1 = even)",
    "cv": "coefficient of variation of the load (0 = even)",
    "router_entropy": "mean router entropy per token (nats)",
    "dropped_share": "dropped share of the (token, choice) pairs",
}


def balance_curves(records: list[dict[str, Any]], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per MoE layer, ``metric``'s (steps, values) from the records' ``balance`` entries (flat
    ``"<layer>/<metric>"`` keys, as :func:`flexmoe.balance_metrics` gives them)."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    suffix = "/" + metric
    for r in records:
        for key, value in r.get("balance", {}).items():
            if key.endswith(suffix):
                steps, values = curves.setdefault(key[: -len(suffix)], ([], []))
                steps.append(r["step"])
                values.append(value)
    return curves


def plot_balance(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """One panel per balance metric (:data:`BALANCE_PANELS`), one line per MoE layer, against step; None when the
    records hold no ``balance`` entries (a dense run)."""
    if not any(r.get("balance") for r in records):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True, squeeze=False)
    for ax, (metric, label) in zip(axes.ravel(), BALANCE_PANELS.items()):
        for layer, (steps, values) in balance_curves(records, metric).items():
            ax.plot(steps, values, label=layer)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8, title="MoE layer")
    fig.suptitle("expert balance per MoE layer (the last micro-batch of each logged step)")
    return _save(fig, path)


def plot_compare(runs: dict[str, list[dict[str, Any]]], path: str | Path, unit: str = "nats / byte") -> Path:
    """Train (faint) and validation (bold) curves of several runs in one plot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, records) in enumerate(runs.items()):
        ts, tl, vs, vl = _curves(records)
        color = f"C{i}"
        ax.plot(ts, tl, color=color, alpha=0.3, label=f"{name} train")
        if vs:
            ax.plot(vs, vl, "o-", color=color, label=f"{name} validation")
    return _save_loss_axes(fig, ax, "MoE vs dense twin (equal active compute)", path, unit)
