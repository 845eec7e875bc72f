"""``flexmoe fit-a2a``: fit the simulator's all-to-all to a cluster's own ``alltoall_perf`` logs.

    flexmoe fit-a2a --profile a100-ndv4 --line-gbps 200 --out mine.json node1.log node2.log node8.log node32.log
    flexmoe simulate --profile mine.json --experts-per-gpu 2 --gpus 16,256,2048

Each log is the whole output of NCCL's ``alltoall_perf`` (nccl-tests) at one scale, header included (its
``# Rank`` lines name each rank's host). The constants of :mod:`flexmoe.tuning.a2a_scale` are fitted to them
(:mod:`flexmoe.tuning.a2a_measured`) and written into a copy of ``--profile`` (compute, memory and the rest
unchanged). The command prints, per log, what the fit makes of it and how far it is from every measured size.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import POSITIVE, SHARE, check_writable_dir
from flexmoe.tuning.a2a_measured import RunFit, fit_scale, parse_alltoall_perf, run_seconds
from flexmoe.tuning.a2a_scale import A2AScale, scale_for
from flexmoe.tuning.cost_model import a2a_flat_time
from flexmoe.tuning.profile import Profile, load_profile

__all__ = ["add_arguments", "run", "fit_profile", "report"]

# What the fit cannot learn from alltoall_perf: the SMs an NCCL kernel holds while compute runs beside it.
DEFAULT_SM_SHARE = 12 / 132  # DeepEP's inter-node kernel on an H100 (docs/cost_model.md)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", type=Path, help="alltoall_perf logs, one per scale (header included)")
    parser.add_argument("--profile", default="a100-ndv4",
                        help="the profile to copy (a published name, 'local', or a JSON path); its compute and "
                             "memory numbers are kept")
    parser.add_argument("--line-gbps", type=POSITIVE, required=True,
                        help="one GPU's NIC line rate in Gb/s (200 for HDR InfiniBand, 400 for NDR)")
    parser.add_argument("--sm-share", type=SHARE, default=None,
                        help="share of the SMs an NCCL kernel holds beside compute (default: the copied "
                             f"profile's, else {DEFAULT_SM_SHARE:.3f})")
    parser.add_argument("--name", default=None, help="the new profile's name (default: '<profile>-fitted')")
    parser.add_argument("--out", type=Path, required=True, help="where to write the fitted profile (JSON)")


def fit_profile(base: Profile, logs: list[Path], line_Bps: float, sm_share: float | None = None,
                name: str | None = None) -> tuple[Profile, list[RunFit]]:
    """A copy of ``base`` whose ``a2a_scale`` is fitted to ``logs``, and each log's fit."""
    runs = []
    for path in logs:
        try:
            text = path.read_text()
        except OSError as exc:
            raise UsageError(f"cannot read alltoall_perf log {path}: {exc.strerror or exc}") from None
        runs.append(parse_alltoall_perf(text, source=str(path)))
    if sm_share is None:
        published = scale_for(base)
        sm_share = published.sm_share if published is not None else DEFAULT_SM_SHARE
    scale, fits = fit_scale(runs, line_Bps=line_Bps, sm_share=sm_share)
    sources = [*base.sources, "a2a_scale fitted by `flexmoe fit-a2a` to alltoall_perf logs: "
               + ", ".join(f"{r.source} ({r.ranks} ranks, {r.nodes} nodes)" for r in runs)]
    fitted = replace(base, name=name or f"{base.name}-fitted", a2a_scale=scale.to_dict(), sources=sources)
    return fitted, fits


def report(profile: Profile, fits: list[RunFit]) -> str:
    """Per log: ranks, nodes, the level it measures, its per-message cost and bandwidth, and the median and worst
    error over its sizes of (a) its own two-constant fit and (b) the fitted profile's all-to-all model."""
    scale = A2AScale.from_dict(profile.a2a_scale)
    lines = [f"{'log':<28s} {'ranks':>5s} {'nodes':>5s} {'level':>5s} {'alpha':>9s} {'bandwidth':>10s} "
             f"{'own fit':>8s} {'model':>13s}"]
    for f in fits:
        own = [abs(run_seconds(f, s) / t - 1) for s, t in f.run.points]
        model = [abs(a2a_flat_time(profile, s, f.run.ranks, f.run.ranks_per_node) / t - 1) for s, t in f.run.points]
        lines.append(f"{Path(f.run.source).name[:28]:<28s} {f.run.ranks:>5d} {f.run.nodes:>5d} {f.level:>5s} "
                     f"{f.alpha_s * 1e6:>7.2f}us {f.bandwidth_Bps / 1e9:>7.2f}GB/s {statistics.median(own):>7.1%} "
                     f"{statistics.median(model):>6.1%}/{max(model):>5.0%}")
    lines.append(f"fitted: NVLink {scale.intra_bandwidth_Bps / 1e9:.1f} GB/s, inter-node share e_2 "
                 f"{scale.inter_efficiency_2:.3f} / e_inf {scale.inter_efficiency_many:.3f} of "
                 f"{scale.inter_line_Bps / 1e9:.1f} GB/s, alpha {scale.alpha_s * 1e6:.2f} us + "
                 f"{scale.per_peer_s * 1e9:.2f} ns per peer, one peer {scale.peer_Bps / 1e9:.1f} GB/s, "
                 f"SM share {scale.sm_share:.3f}")
    lines.append("own fit / model: median relative error over each log's sizes (model: median/worst)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        base = load_profile(args.profile)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise UsageError(f"--profile {args.profile!r}: {exc}") from None
    if args.out.exists() and args.out.is_dir():
        raise UsageError(f"--out {args.out}: is a directory; give the path of the profile's JSON file")
    check_writable_dir(args.out.parent, "--out")
    try:
        profile, fits = fit_profile(base, list(args.logs), args.line_gbps * 1e9 / 8, args.sm_share, args.name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    path = profile.save(args.out)
    print(report(profile, fits))
    print(f"wrote {path} (profile {profile.name}); use it with: flexmoe simulate --profile {path}")
    return 0
