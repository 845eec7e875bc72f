"""``flexmoe simulate``: predicted single-layer throughput at scales we cannot run.

For every GPU count, the cost model predicts one MoE layer's forward + backward for a set of variants:

* ``gshard-baseline``: GShard/fairseq style, dense one-hot einsum dispatch (experts compute every padded slot),
  flat all-to-all, no pipelining, r = 1 (each sharded expert gathered whole, like replicated experts);
* ``flat`` / ``2dh``: index dispatch with the flat or the 2-D hierarchical all-to-all (r = 1, d = 1);
* ``2dh r=s``: experts kept sharded, tokens replicated (model-parallel style), a static r;
* ``2dh d=4``: a static overlap degree;
* ``adaptive``: the best (r, d, algorithm) the model finds among every candidate, the statics above included,
  so it is never worse than any of them;
* ``skewed`` / ``skewed+shadow``: the adaptive setting on a dropless, skewed load (the hottest expert gets
  ``--skew`` times the mean), without and with FasterMoE shadowing chosen by :func:`choose_shadowed`. Shadowing
  applies to whole experts, so these rows use ``max(E, W)`` experts.

Throughput is global tokens per second: ``W * tokens_per_gpu / layer_time``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, NON_NEGATIVE_REAL, RATIO, check_writable_dir
from flexmoe.apps.simulate_reproduce import FIGURES, format_rows, plot_reproduction, reproduce, save_figure
from flexmoe.apps.simulate_systems import SYSTEMS, Setting, parse_setting, parse_systems, peak_memory, price_system
from flexmoe.tuning.cost_model import LayerConfig, choose_shadowed, expert_rows, predict, score_candidates, valid_r
from flexmoe.tuning.profile import available_profiles, load_profile

__all__ = ["add_arguments", "run", "parse_gpus", "simulate", "simulate_systems", "VARIANTS"]

# Where the plot goes unless --plot says: beside the training runs (runs/default, ...), never the working directory.
DEFAULT_PLOT_DIR = Path("runs") / "simulate"
VARIANTS = ["gshard-baseline", "flat", "2dh", "2dh r=s", "2dh d=4", "adaptive", "skewed", "skewed+shadow"]
OVERLAP_CANDIDATES = (1, 2, 4, 8)


def parse_gpus(text: str) -> list[int]:
    """``"8,16,...,2048"`` (a geometric series from its first two terms) or an explicit list ``"8,64,512"``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if "..." not in parts:
        values = [int(p) for p in parts]
    else:
        i = parts.index("...")
        if i < 2 or i != len(parts) - 2:
            raise ValueError(f"write the series as 'a,b,...,z', got {text!r}")
        head = [int(p) for p in parts[:i]]
        last = int(parts[-1])
        ratio = head[1] / head[0]
        if ratio <= 1 or ratio != int(ratio):
            raise ValueError(f"a series needs an integer ratio > 1, got {head[0]}, {head[1]}")
        values = list(head)
        while values[-1] * ratio <= last:
            values.append(int(values[-1] * ratio))
        if values[-1] != last:
            raise ValueError(f"{last} is not in the series {head[0]}, {head[1]}, ...")
    if not values or any(v < 1 for v in values):
        raise ValueError(f"GPU counts must be >= 1, got {text!r}")
    return values


def _candidates(config: LayerConfig) -> list[dict[str, Any]]:
    return [{"r": r, "overlap_degree": d, "a2a": a}
            for r in valid_r(config) for d in OVERLAP_CANDIDATES for a in ("flat", "2dh")]


def _experts_at(w: int, experts: int, experts_per_gpu: int | None) -> int:
    """Global experts at w GPUs: ``experts_per_gpu * w``, else ``experts`` (raised to w where neither divides)."""
    if experts_per_gpu is not None:
        return experts_per_gpu * w
    return experts if (experts % w == 0 or w % experts == 0) else max(experts, w)


def simulate(profile_name: str, gpus: list[int], tokens: int = 4096, model_dim: int = 2048, hidden_dim: int = 2048,
             experts: int = 64, k: int = 2, capacity_factor: float = 1.25, dtype: str = "bfloat16",
             skew: float = 4.0, experts_per_gpu: int | None = None) -> list[dict[str, Any]]:
    """One row per (GPU count, variant): ``gpus``, ``variant``, ``tokens_per_s``, ``seconds``, ``setting``.
    ``experts_per_gpu`` (E = N x W at every W) replaces ``experts`` when given."""
    profile = load_profile(profile_name)
    rows: list[dict[str, Any]] = []
    for w in gpus:
        e = _experts_at(w, experts, experts_per_gpu)
        base = LayerConfig(tokens=tokens, model_dim=model_dim, hidden_dim=hidden_dim, experts=e, k=k,
                           capacity_factor=capacity_factor, dtype=dtype, ranks=w)
        s = base.shards
        settings: dict[str, tuple[LayerConfig, dict[str, Any]]] = {
            "gshard-baseline": (replace(base, dispatch="dense", r=1 if s > 1 else None),
                                {"r": 1, "d": 1, "a2a": "flat"}),
            "flat": (replace(base, r=1 if s > 1 else None), {"r": 1, "d": 1, "a2a": "flat"}),
            "2dh": (replace(base, a2a="2dh", r=1 if s > 1 else None), {"r": 1, "d": 1, "a2a": "2dh"}),
            "2dh r=s": (replace(base, a2a="2dh", r=s), {"r": s, "d": 1, "a2a": "2dh"}),
            "2dh d=4": (replace(base, a2a="2dh", overlap_degree=4, r=1 if s > 1 else None),
                        {"r": 1, "d": 4, "a2a": "2dh"}),
        }
        for name, (cfg, setting) in settings.items():
            rows.append(_row(w, name, predict(profile, cfg), tokens, setting))
        seconds, best = score_candidates(profile, base, _candidates(base))[0]
        rows.append(_row(w, "adaptive", seconds, tokens, _short(best)))

        # Skewed, dropless load on whole experts; the setting is re-tuned for it, then shadowing is added.
        skewed = LayerConfig(tokens=tokens, model_dim=model_dim, hidden_dim=hidden_dim, experts=max(e, w), k=k,
                             capacity_factor=0.0, dtype=dtype, ranks=w, skew=skew)
        seconds, best = score_candidates(profile, skewed, _candidates(skewed))[0]
        tuned = replace(skewed, r=best["r"], overlap_degree=best["overlap_degree"], a2a=best["a2a"])
        rows.append(_row(w, "skewed", seconds, tokens, _short(best)))
        global_load = expert_rows(tuned)
        shadow = choose_shadowed(profile, tuned, global_load)
        shadowed = replace(tuned, expert_shares=tuple(global_load), shadowed=tuple(shadow))
        rows.append(_row(w, "skewed+shadow", predict(profile, shadowed), tokens,
                         {**_short(best), "shadowed": len(shadow)}))
    return rows


def simulate_systems(profile_name: str, gpus: list[int], systems: list[str], setting: Setting | None = None,
                     tokens: int = 4096, model_dim: int = 2048, hidden_dim: int = 2048, experts: int = 64,
                     k: int = 2, capacity_factor: float = 1.25, dtype: str = "bfloat16",
                     experts_per_gpu: int | None = None) -> list[dict[str, Any]]:
    """One row per (system, GPU count): ``system``, ``gpus``, ``experts``, ``seconds`` (one training step of the
    layer: forward + backward + the router's gradient all-reduce), ``tokens_per_s``, ``setting`` and
    ``memory_bytes`` (:func:`~flexmoe.apps.simulate_systems.peak_memory`)."""
    profile = load_profile(profile_name)
    rows: list[dict[str, Any]] = []
    for system in systems:
        for w in gpus:
            e = _experts_at(w, experts, experts_per_gpu)
            base = LayerConfig(tokens=tokens, model_dim=model_dim, hidden_dim=hidden_dim, experts=e, k=k,
                               capacity_factor=capacity_factor, dtype=dtype, ranks=w)
            seconds, used = price_system(profile, system, base, setting or Setting())
            rows.append({"system": system, "gpus": w, "experts": e, "seconds": seconds,
                         "tokens_per_s": w * tokens / seconds, "setting": used,
                         "memory_bytes": peak_memory(system, base)["total"]})
    return rows


def format_systems(rows: list[dict[str, Any]], profile: str) -> str:
    lines = [f"predicted step of one MoE layer (forward + backward + router all-reduce), profile {profile}",
             f"{'system':<13s} {'GPUs':>6s} {'experts':>8s} {'seconds':>9s} {'M tok/s':>9s} {'mem GB':>7s}  setting"]
    for r in rows:
        lines.append(f"{r['system']:<13s} {r['gpus']:>6d} {r['experts']:>8d} {r['seconds']:>9.4f} "
                     f"{r['tokens_per_s'] / 1e6:>9.2f} {r['memory_bytes'] / 1e9:>7.2f}  {r['setting']}")
    return "\n".join(lines)


def plot_systems(rows: list[dict[str, Any]], path: Path, profile: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    _curves_by_gpus(ax, rows, "system", "seconds", 1.0, "seconds per step of one layer",
                    f"predicted step time by system, {profile}")
    return save_figure(fig, path)


def _curves_by_gpus(ax: Any, rows: list[dict[str, Any]], key: str, value: str, scale: float, ylabel: str,
                    title: str) -> None:
    """One curve per ``row[key]`` of ``row[value] / scale`` against the GPU count, on log-log axes."""
    for name in dict.fromkeys(r[key] for r in rows):
        pts = sorted((r["gpus"], r[value]) for r in rows if r[key] == name)
        ax.plot([p[0] for p in pts], [p[1] / scale for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)


def _short(candidate: dict[str, Any]) -> dict[str, Any]:
    return {"r": candidate["r"], "d": candidate["overlap_degree"], "a2a": candidate["a2a"]}


def _row(gpus: int, variant: str, seconds: float, tokens: int, setting: dict[str, Any]) -> dict[str, Any]:
    return {"gpus": gpus, "variant": variant, "tokens_per_s": gpus * tokens / seconds, "seconds": seconds,
            "setting": setting}


def format_table(rows: list[dict[str, Any]], profile: str) -> str:
    gpus = sorted({r["gpus"] for r in rows})
    by = {(r["gpus"], r["variant"]): r for r in rows}
    width = 15
    lines = [f"predicted single-layer throughput (M tokens/s, forward + backward), profile {profile}",
             f"{'GPUs':>6s} " + " ".join(f"{v:>{width}s}" for v in VARIANTS)]
    for w in gpus:
        cells = [f"{by[(w, v)]['tokens_per_s'] / 1e6:>{width}.2f}" for v in VARIANTS]
        lines.append(f"{w:>6d} " + " ".join(cells))
    lines.append("")
    lines.append(f"{'GPUs':>6s} {'2dh/flat':>9s} {'adaptive/base':>14s} {'shadow gain':>12s}  adaptive setting")
    for w in gpus:
        def tp(v: str) -> float:
            return by[(w, v)]["tokens_per_s"]
        lines.append(f"{w:>6d} {tp('2dh') / tp('flat'):>8.2f}x {tp('adaptive') / tp('gshard-baseline'):>13.2f}x "
                     f"{tp('skewed+shadow') / tp('skewed'):>11.2f}x  {by[(w, 'adaptive')]['setting']}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, profile: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    _curves_by_gpus(ax1, rows, "variant", "tokens_per_s", 1e6, "M tokens / s (one layer, fwd + bwd)",
                    f"predicted throughput, {profile}")
    by = {(r["gpus"], r["variant"]): r["tokens_per_s"] for r in rows}
    gpus = sorted({r["gpus"] for r in rows})
    for num, den, label in (("2dh", "flat", "2DH / flat"), ("adaptive", "gshard-baseline", "adaptive / baseline"),
                            ("skewed+shadow", "skewed", "shadowing on skew")):
        ax2.plot(gpus, [by[(w, num)] / by[(w, den)] for w in gpus], marker="o", label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("GPUs")
    ax2.set_ylabel("speed-up")
    ax2.set_title("speed-ups from the model")
    ax2.legend(fontsize=8)
    return save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="a100-ndv4",
                        help=f"published profile ({', '.join(available_profiles())}), 'local', or a JSON path")
    parser.add_argument("--gpus", default="8,16,...,2048", help="GPU counts: '8,16,...,2048' or a list")
    parser.add_argument("--tokens", type=COUNT, default=4096, help="tokens per GPU")
    parser.add_argument("--model-dim", type=COUNT, default=2048, help="model (token) dimension M")
    parser.add_argument("--hidden-dim", type=COUNT, default=2048, help="hidden dimension H of each expert's FFN")
    experts = parser.add_mutually_exclusive_group()
    experts.add_argument("--num-experts", "--experts", dest="experts", type=COUNT, default=None,
                         help="global experts (sharded when GPUs > experts); --experts is the older spelling "
                              "(default: 64)")
    experts.add_argument("--experts-per-gpu", type=COUNT, default=None,
                         help="experts per GPU: E = N x GPUs at every GPU count, instead of --num-experts "
                              "(default: none, --num-experts)")
    parser.add_argument("--k", type=COUNT, default=2, help="experts per token (top-k)")
    parser.add_argument("--capacity-factor", type=NON_NEGATIVE_REAL, default=1.25,
                        help="expert capacity / even share of tokens (0: dropless)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="parameter and activation dtype")
    parser.add_argument("--skew", type=RATIO, default=4.0, help="hottest expert's load / mean in the skewed rows")
    parser.add_argument("--plot", type=Path, default=None,
                        help=f"PNG path (default: {DEFAULT_PLOT_DIR}/simulate-<profile>.png)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--system", default=None,
                        help=f"price these systems instead of the variants: a comma list of {', '.join(SYSTEMS)}, "
                             f"or 'all' (flexmoe.apps.simulate_systems) (default: none, the variants table)")
    parser.add_argument("--setting", default=None,
                        help="with --system: fix r, d and the all-to-all, e.g. 'r=1,d=4,a2a=2dh' (any subset) "
                             "(default: none, each system's own choice)")
    parser.add_argument("--reproduce", default=None, choices=FIGURES,
                        help="print a published figure against the prediction (its own setup; the shape flags do "
                             "not apply) and draw both (flexmoe.apps.simulate_reproduce) (default: none)")
    parser.add_argument("--load-trace", type=Path, default=None,
                        help="a run's metrics.jsonl (or JSON with expert_load): instead, price static, shadowed and "
                             "replicated expert placement on that load at E = 64, 128, 256 (flexmoe.apps."
                             "simulate_placement) (default: none, the throughput table)")
    parser.add_argument("--redundant-experts", type=COUNT, default=2,
                        help="replica slots per GPU in the --load-trace table")


def run(args: argparse.Namespace) -> int:
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as exc:
        raise UsageError(f"--gpus {args.gpus!r}: {exc}; write a list such as 8,64,512 or a series such as "
                         f"8,16,...,2048") from None
    try:
        load_profile(args.profile)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(f"--profile: {exc}") from None
    name = Path(str(args.profile)).stem
    experts = 64 if args.experts is None else args.experts
    if args.setting is not None and args.system is None:
        raise UsageError("--setting fixes a system's choice: give --system too")
    if args.load_trace is not None:
        return _run_placements(args, gpus, name)
    if args.reproduce is not None:
        return _run_reproduce(args, name)
    stem = f"simulate-systems-{name}" if args.system is not None else f"simulate-{name}"
    plot_path = _plot_path(args, stem)
    try:
        if args.system is not None:
            systems = parse_systems(args.system)
            setting = parse_setting(args.setting) if args.setting is not None else None
            rows = simulate_systems(args.profile, gpus, systems, setting, tokens=args.tokens,
                                    model_dim=args.model_dim, hidden_dim=args.hidden_dim, experts=experts, k=args.k,
                                    capacity_factor=args.capacity_factor, dtype=args.dtype,
                                    experts_per_gpu=args.experts_per_gpu)
        else:
            rows = simulate(args.profile, gpus, tokens=args.tokens, model_dim=args.model_dim,
                            hidden_dim=args.hidden_dim, experts=experts, k=args.k,
                            capacity_factor=args.capacity_factor, dtype=args.dtype, skew=args.skew,
                            experts_per_gpu=args.experts_per_gpu)
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(rows, indent=1))
    elif args.system is not None:
        print(format_systems(rows, name))
    else:
        print(format_table(rows, name))
    if plot_path is not None:
        path = plot_systems(rows, plot_path, name) if args.system is not None else plot(rows, plot_path, name)
        if not args.json:
            print(f"plot: {path}")
    return 0


def _plot_path(args: argparse.Namespace, stem: str) -> Path | None:
    """Where the PNG goes (None with --no-plot), checked before any work is done."""
    if args.no_plot:
        return None
    path: Path = args.plot or DEFAULT_PLOT_DIR / f"{stem}.png"
    if path.is_dir():
        raise UsageError(f"--plot {path}: is a directory; give the PNG file's path")
    check_writable_dir(path.parent, "--plot")
    return path


def _run_reproduce(args: argparse.Namespace, profile: str) -> int:
    """``--reproduce NAME``: the published figure against the prediction, and the chart of both."""
    plot_path = _plot_path(args, f"reproduce-{args.reproduce}-{profile}")
    rows = reproduce(load_profile(args.profile), args.reproduce)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=1))
    else:
        print(format_rows(rows, profile))
    if plot_path is not None:
        path = plot_reproduction(rows, plot_path, profile)
        if not args.json:
            print(f"plot: {path}")
    return 0


def _run_placements(args: argparse.Namespace, gpus: list[int], profile: str) -> int:
    """``--load-trace``: the placement table (:mod:`flexmoe.apps.simulate_placement`), no plot."""
    from flexmoe.apps.simulate_placement import format_placements, read_load_trace, simulate_placements

    try:
        shares = read_load_trace(args.load_trace)
        rows = simulate_placements(args.profile, gpus, shares, k=args.k, tokens=args.tokens,
                                   model_dim=args.model_dim, hidden_dim=args.hidden_dim, dtype=args.dtype,
                                   redundant=args.redundant_experts)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--load-trace: {exc}") from None
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        shape = (f"k={args.k}, {args.tokens} tokens per GPU, M={args.model_dim}, H={args.hidden_dim}, {args.dtype}, "
                 f"dropless")
        print(format_placements(rows, profile, str(args.load_trace), args.redundant_experts, shape))
    return 0
