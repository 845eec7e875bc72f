"""``flexmoe simulate --reproduce NAME``: published MoE figures against the simulator's predictions.

Each figure is a list of rows: what was measured, the published value, the setup it was measured at (as far as
the paper or its artifact states it), the prediction and the error. A row whose setup cannot be recovered says
so and is not scored; a row the model misses by more than its tolerance names the mechanism the model lacks.
The all-to-all constants behind the predictions were fitted to all-to-all measurements only
(:mod:`flexmoe.tuning.a2a_scale`), never to these figures.

Figures:

* ``tutel-readme``: microsoft/tutel's README chart "Step Time of MoE Layer on Large Scale Azure NDv4s (80G)"
  (figure.svg, commit 279518f, 2022-02-23), three systems at 16-2,048 GPUs, read off the picture; the setup is
  tutel/examples/helloworld.py's defaults at that commit;
* ``tutel-paper``: Hwang et al., "Tutel: Adaptive Mixture-of-Experts at Scale", MLSys 2023 (arXiv 2206.03382 v2):
  the single-layer breakdown of section 5.2 and the memory of table 9, plus the blog's and v1's headline claims;
* ``fastermoe``: He et al., "FasterMoE", PPoPP 2022: the speed-ups of its three techniques.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flexmoe.apps.simulate_systems import peak_memory, step_seconds, system_config
from flexmoe.tuning.cost_model import LayerConfig, a2a_2dh_time, a2a_flat_time
from flexmoe.tuning.profile import Profile

__all__ = ["FIGURES", "Row", "reproduce", "format_rows", "plot_reproduction", "save_figure", "TUTEL_README",
           "tutel_shape"]

FIGURES = ("tutel-readme", "tutel-paper", "fastermoe")
TOLERANCE = 0.15  # relative error a reproduced point may have
PICTURE_TOLERANCE_S = 0.015  # or, for values read off a picture, this many seconds

# Step time (s) read off figure.svg (1228 x 461 PNG inside the SVG): the curves' pixel rows at each GPU count's
# tick, through the y axis' ticks (0.0 at row 402, 2.0 at row 121: 0.0071 s per pixel). Tutel + Torch A2A
# (linear) at 16 and 32 GPUs lies under the green curve; it is read as the green one there.
TUTEL_README: dict[str, dict[int, float]] = {
    "tutel-2dh": {16: 0.061, 32: 0.082, 64: 0.096, 128: 0.110, 256: 0.114, 512: 0.117, 1024: 0.164, 2048: 0.448},
    "tutel-linear": {16: 0.061, 32: 0.082, 64: 0.085, 128: 0.100, 256: 0.104, 512: 0.146, 1024: 0.206,
                     2048: 2.191},
    "deepspeed": {16: 0.168, 32: 0.174, 64: 0.200, 128: 0.210, 256: 0.224, 512: 0.252, 1024: 0.416, 2048: 2.354},
}
# The compute alone, published beside the chart: the README's "Single-GPU Throughput" table (commit 159bc70,
# 2021-11-25, still in the README at the chart's commit), helloworld.py and helloworld_deepspeed.py at their
# defaults (batch 16) on one A100 40GB: 715.86 and 115.43 sequences of 1,024 tokens per second, i.e. one step of
# 16 sequences in 16 / 715.86 and 16 / 115.43 s (as steps per second the first would be 1.2 PFLOP/s of expert
# GEMMs on one GPU). One GPU has no all-to-all: these rows check everything else the chart's steps contain.
TUTEL_README_ONE_GPU_S = {"tutel-linear": 16 / 715.86, "deepspeed": 16 / 115.43}
# NVIDIA A100 datasheet: the 40GB SXM part streams 1,555 GB/s of HBM2 (the 80GB one 2,039 GB/s of HBM2e); the
# TF32 peak is the same, so the single-GPU rows are priced with the profile's memory bandwidths scaled by this.
A100_40GB_HBM_RATIO = 1555 / 2039
# The chart's memory panel (GB per GPU, bars read off the same picture; the GPU count is not stated).
TUTEL_README_MEMORY_GB = {"deepspeed": 13.8, "tutel-2dh": 6.5}

LARGE_SCALE_NOTE = ("missing mechanism: the all-to-all's collapse past 32 nodes (NCCL with thousands of peers "
                    "on NDv4's fabric); the fitted data (NCCL on 2 NDv4 nodes, nccl #1531 at 8 nodes, DeepEP to "
                    "32) stop there, and Tutel's own NDv4 all-to-all sweeps to 2,048 GPUs (its figures 16b and "
                    "18) are published only as images")
SMALL_SCALE_NOTE = ("missing mechanism: the inter-node all-to-all of the chart's NCCL (2.10, early 2022, before "
                    "2.12's PXN) at 2-64 NDv4 nodes; the fit's share of the line comes from NCCL 2.17 on 2 NDv4 "
                    "nodes (0.81) and DeepEP at 4-32 nodes (0.74); the compute alone is checked at 1 GPU (the "
                    "README's single-GPU rows)")

OWN_FIT_NOTE = ("missed with this profile's own all-to-all (its a2a_scale, from `flexmoe fit-a2a`): do its logs "
                "cover this scale and the chart's NCCL?")


def _miss_note(profile: Profile, gpus: int) -> str:
    """Why a time row misses: the published fit's known gaps, or the profile's own fit."""
    if profile.a2a_scale:
        return OWN_FIT_NOTE
    return LARGE_SCALE_NOTE if gpus >= 1024 else SMALL_SCALE_NOTE


@dataclass
class Row:
    """One published number against its prediction. ``predicted`` None: the setup cannot be recovered."""

    figure: str
    what: str
    gpus: int | None
    published: float
    predicted: float | None
    unit: str
    note: str = ""
    picture: bool = False

    @property
    def error(self) -> float | None:
        if self.predicted is None:
            return None
        return self.predicted / self.published - 1.0

    @property
    def ok(self) -> bool | None:
        if self.predicted is None:
            return None
        if abs(self.error or 0.0) <= TOLERANCE:
            return True
        return self.picture and self.unit == "s" and abs(self.predicted - self.published) <= PICTURE_TOLERANCE_S

    def to_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "what": self.what, "gpus": self.gpus, "published": self.published,
                "predicted": self.predicted, "unit": self.unit, "error": self.error, "ok": self.ok,
                "note": self.note}


def tutel_shape(gpus: int, tokens: int = 16384, model_dim: int = 2048, hidden_dim: int = 2048,
                experts_per_gpu: int = 2) -> LayerConfig:
    """Tutel's helloworld.py defaults at the chart's commit (and the paper's section 5.2): 16 x 1024 tokens per
    GPU, M = H = 2048, 2 experts per GPU, top-2, capacity factor 1.0, float32 (TF32 GEMMs)."""
    return LayerConfig(tokens=tokens, model_dim=model_dim, hidden_dim=hidden_dim, experts=experts_per_gpu * gpus,
                       k=2, capacity_factor=1.0, dtype="float32", ranks=gpus)


def _seconds(profile: Profile, system: str, shape: LayerConfig, **changes: Any) -> float:
    return step_seconds(profile, replace(system_config(system, shape), **changes))


def _tutel_best(profile: Profile, shape: LayerConfig, algorithms: tuple[str, ...] = ("flat", "2dh"),
                degrees: tuple[int, ...] = (1, 2, 4, 8)) -> float:
    """Tutel with adaptive pipelining: the best (all-to-all, degree) for its padded exchange."""
    return min(_seconds(profile, "tutel-2dh", shape, a2a=a, overlap_degree=d) for a in algorithms for d in degrees)


def _one_gpu_rows(profile: Profile) -> list[Row]:
    """The README's single-GPU table against the model on an A100 40GB (:data:`TUTEL_README_ONE_GPU_S`)."""
    r = A100_40GB_HBM_RATIO
    small = replace(profile, memory_bandwidth_Bps=profile.memory_bandwidth_Bps * r,
                    gather_bandwidth_Bps=profile.gather_bandwidth_Bps * r,
                    scatter_bandwidth_Bps=profile.scatter_bandwidth_Bps * r,
                    grad_stack_bandwidth_Bps=profile.grad_stack_bandwidth_Bps * r)
    rows = []
    for system, published in TUTEL_README_ONE_GPU_S.items():
        row = Row("tutel-readme", system, 1, published, _seconds(small, system, tutel_shape(1)), "s",
                  note="README's single-GPU table (A100 40GB): compute alone, no all-to-all")
        if not row.ok:
            row.note = "missing mechanism: the compute alone is off (" + row.note + ")"
        rows.append(row)
    return rows


def _readme_rows(profile: Profile) -> list[Row]:
    rows = _one_gpu_rows(profile)
    for system, points in TUTEL_README.items():
        for w, published in points.items():
            predicted = _seconds(profile, system, tutel_shape(w))
            row = Row("tutel-readme", system, w, published, predicted, "s", picture=True)
            if not row.ok:
                row.note = _miss_note(profile, w)
            rows.append(row)
    for system, gb in TUTEL_README_MEMORY_GB.items():
        predicted = peak_memory(system, tutel_shape(16))["total"] / 1e9
        row = Row("tutel-readme", f"{system} memory", None, gb, predicted, "GB", picture=True)
        if not row.ok:
            row.note = ("GPU count not stated (priced at 16); missing: CUDA context, NCCL's per-peer buffers and "
                        "the allocator's slack (the model counts tensors only)")
        rows.append(row)
    return rows


def _paper_rows(profile: Profile) -> list[Row]:
    fig = "tutel-paper"
    rows: list[Row] = []

    def speedup(w: int, numerator: float, denominator: float) -> float:
        return denominator / numerator

    # Section 5.2 / figure 14: the breakdown over the Fairseq / DeepSpeed baseline, setup stated in the text.
    for w, published in ((16, 4.96), (128, 3.11), (2048, 5.75)):
        shape = tutel_shape(w)
        base = _seconds(profile, "fairseq", shape)
        rows.append(Row(fig, "Tutel (all features, r=1) over Fairseq", w, published,
                        speedup(w, _tutel_best(profile, shape), base), "x"))
    for w, published in ((16, 3.52), (2048, 1.04)):
        shape = tutel_shape(w)
        rows.append(Row(fig, "Tutel kernels + linear A2A over Fairseq", w, published,
                        _seconds(profile, "fairseq", shape) / _seconds(profile, "tutel-linear", shape), "x"))
    shape = tutel_shape(2048)
    rows.append(Row(fig, "2DH A2A over linear (Tutel kernels)", 2048, 4.25,
                    _seconds(profile, "tutel-linear", shape) / _seconds(profile, "tutel-2dh", shape), "x"))
    rows.append(Row(fig, "Flexible A2A layout", 2048, 1.24, None, "x",
                    "not modelled: the model prices every expert GEMM in the flexible layout (E_g, C, D)"))
    for w, published in ((16, 1.43), (2048, 1.04)):
        shape = tutel_shape(w)
        fixed = min(_seconds(profile, "tutel-2dh", shape, a2a=a) for a in ("flat", "2dh"))
        rows.append(Row(fig, "adaptive pipelining degree (over best d=1)", w, published,
                        fixed / _tutel_best(profile, shape), "x"))
    # Headline numbers whose setups the texts do not give.
    rows.append(Row(fig, "Tutel over fairseq (blog, 2021-11)", 8, 8.49, None, "x",
                    "setup not recoverable: the blog states no layer shape"))
    rows.append(Row(fig, "Tutel over fairseq (blog, 2021-11)", 512, 2.75, None, "x",
                    "setup not recoverable: the blog states no layer shape"))
    rows.append(Row(fig, "2DH A2A over linear, up to (v1)", 2048, 20.7, None, "x",
                    "setup not recoverable: the message size is in figure 18 (an image) only; for reference the "
                    f"model gives {a2a_flat_time(profile, 2**20, 2048, 8) / a2a_2dh_time(profile, 2**20, 2048, 8):.1f}x"
                    " at 1 MiB per GPU"))
    rows.append(Row(fig, "adaptive parallelism, up to (v1)", None, 1.74, None, "x",
                    "setup not recoverable: figure 12's values are an image (E=16, D=2K, 64 GPUs, f 1..8)"))
    rows.append(Row(fig, "adaptive pipelining, up to (table 6a)", None, 2.00, None, "x",
                    "setup partly stated (243 shapes, 16-256 GPUs) but table 6 is an image: per-shape values "
                    "unknown"))
    rows.append(Row(fig, "all-to-all 2.56-5.93x at 512 GPUs", 512, 5.93, None, "x",
                    "not found in the paper's v2 text; setup not recoverable"))
    # Table 9: GPU memory of one layer, D = H = 4096, top-2, E_g = 2 (GPU count not stated: priced at 16).
    for tokens, fairseq_gib, tutel_gib in ((4096, 3.7, 2.9), (8192, 6.2, 3.2), (16384, 16.3, 4.0),
                                           (32768, 57.9, 5.7)):
        shape = tutel_shape(16, tokens=tokens, model_dim=4096, hidden_dim=4096)
        for system, published in (("fairseq", fairseq_gib), ("tutel-2dh", tutel_gib)):
            row = Row(fig, f"memory {system}, {tokens} tokens", None, published,
                      peak_memory(system, shape)["total"] / 2**30, "GiB")
            if not row.ok:
                row.note = "missing: CUDA context, NCCL buffers and allocator slack (a constant ~1.5-2 GiB)"
            rows.append(row)
    for row in rows:
        if row.ok is False and not row.note:
            row.note = _miss_note(profile, row.gpus or 0)
    return rows


def _fastermoe_rows(profile: Profile) -> list[Row]:
    """FasterMoE (PPoPP 2022), section 5: clusters *johnny* (2 nodes x 8 V100-PCIe, InfiniBand EDR degraded to
    50 Gb/s) and *trevor* (16 nodes x 4 V100-SXM2 on an NVLink ring, EDR 100 Gb/s); models of table 2 (MoE-GPT,
    MoE-BERT-Deep: 16 experts on johnny; MoE-BERT-Wide: 64 experts on trevor; H 1024-4096, FFN 2H). Every speed-up
    below is measured on an expert-selection dataset recorded from their training runs (the artifact on Zenodo,
    record 5728493, not in thu-pacman/FasterMoE): the load that shadowing and the schedule act on is not
    published, and no V100 profile ships here."""
    fig = "fastermoe"
    load = "setup not recoverable: the gain depends on the recorded expert selections (Zenodo artifact only)"
    return [
        Row(fig, "shadowing, one iteration, up to (fig. 11)", 16, 1.97, None, "x", load),
        Row(fig, "shadowing, johnny (fig. 13)", 16, 1.95, None, "x", load),
        Row(fig, "shadowing, trevor (fig. 13)", 64, 4.74, None, "x", load),
        Row(fig, "smart schedule per layer, up to (fig. 12)", 16, 1.42, None, "x", load),
        Row(fig, "smart schedule (fig. 13)", 16, 1.40, None, "x", load),
        Row(fig, "shadowing + schedule over FastMoE (table 3)", 16, 2117 / 1609, None, "x", load),
        Row(fig, "topology-aware gate, per iteration (table 3)", 16, 1609 / 1471, None, "x",
            "not modelled: the gate changes the routing itself (fewer tokens cross nodes); and the load above"),
    ]


def reproduce(profile: Profile, figure: str) -> list[Row]:
    """The rows of ``figure`` (one of :data:`FIGURES`)."""
    if figure == "tutel-readme":
        return _readme_rows(profile)
    if figure == "tutel-paper":
        return _paper_rows(profile)
    if figure == "fastermoe":
        return _fastermoe_rows(profile)
    raise ValueError(f"--reproduce takes one of {', '.join(FIGURES)}; got {figure!r}")


def format_rows(rows: list[Row], profile: str) -> str:
    """The table: what, GPUs, published, predicted, error, within tolerance, note."""
    figure = rows[0].figure if rows else ""
    lines = [f"{figure}: published against predicted (profile {profile}; ok = within 15%, or 0.015 s for values "
             f"read off a picture)",
             f"{'what':<44s} {'GPUs':>5s} {'published':>10s} {'predicted':>10s} {'error':>7s} {'ok':>3s}  note"]
    for r in rows:
        gpus = f"{r.gpus:>5d}" if r.gpus is not None else f"{'-':>5s}"
        pred = f"{r.predicted:>10.3f}" if r.predicted is not None else f"{'-':>10s}"
        err = f"{r.error:>+7.0%}" if r.error is not None else f"{'-':>7s}"
        ok = {True: "yes", False: "NO", None: "-"}[r.ok]
        lines.append(f"{r.what:<44s} {gpus} {r.published:>8.3f}{r.unit:<2s} {pred} {err} {ok:>3s}  {r.note}")
    scored = [r for r in rows if r.ok is not None]
    lines.append(f"{sum(1 for r in scored if r.ok)} of {len(scored)} scored rows within tolerance; "
                 f"{len(rows) - len(scored)} rows not scored (setup not recoverable or not modelled)")
    return "\n".join(lines)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write (110 dpi PNG, creating the folder) and close a matplotlib figure; its path back."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reproduction(rows: list[Row], path: Path, profile: str) -> Path:
    """Predicted curves beside the published points: step time per system against GPUs (``tutel-readme``), or
    published against predicted for every scored row (other figures)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    timed = [r for r in rows if r.unit == "s" and r.gpus is not None]
    if timed:
        colors = {"deepspeed": "orange", "tutel-linear": "blue", "tutel-2dh": "green"}
        for system in dict.fromkeys(r.what for r in timed):
            pts = sorted((float(r.gpus or 0), r.published, float(r.predicted or 0.0)) for r in timed
                         if r.what == system)
            xs = [p[0] for p in pts]
            color = colors.get(system)
            ax.plot(xs, [p[1] for p in pts], "o", color=color, label=f"{system} published")
            ax.plot(xs, [p[2] for p in pts], "-", color=color, label=f"{system} predicted")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("step time of one MoE layer (s)")
    else:
        scored = [(r.what, r.published, float(r.predicted)) for r in rows if r.predicted is not None]
        ax.plot([s[1] for s in scored], [s[2] for s in scored], "o")
        for what, published, predicted in scored:
            ax.annotate(what[:28], (published, predicted), fontsize=6)
        low = min([s[1] for s in scored] + [s[2] for s in scored] + [1.0])
        top = max([s[1] for s in scored] + [s[2] for s in scored] + [1.0])
        ax.plot([low, top], [low, top], color="gray", lw=0.8)  # the diagonal: predicted = published
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("published")
        ax.set_ylabel("predicted")
    ax.set_title(f"{rows[0].figure if rows else ''}: published vs predicted ({profile})")
    if timed:
        ax.legend(fontsize=7)
    return save_figure(fig, path)
