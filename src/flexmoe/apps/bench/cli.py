"""The ``flexmoe bench`` command: its flags, and which part of the package each kind of run goes to.

One layer against the floor (:mod:`flexmoe.apps.bench.layer`), the suite of targets
(:mod:`flexmoe.apps.bench.suite`), a Hugging Face block (:mod:`flexmoe.apps.bench.hf`), the routing families
(:mod:`flexmoe.apps.bench.families`), or every expert-parallel setting over ranks
(:mod:`flexmoe.apps.bench.distributed`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

from flexmoe.apps.bench.config import DTYPES, BenchConfig
from flexmoe.apps.bench.distributed import bench_distributed, distributed_conclusions
from flexmoe.apps.bench.layer import bench_single
from flexmoe.apps.bench.suite import (
    SuiteSettings,
    format_suite_table,
    run_suite_checks,
    run_suite_isolated,
    suite_checks,
)
from flexmoe.apps.errors import UsageError
from flexmoe.apps.flags import COUNT, FINITE, NON_NEGATIVE, POSITIVE, SEED
from flexmoe.launch import relaunch, under_torchrun

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    a = parser.add_argument
    a("--tokens", type=COUNT, default=d.tokens, help="tokens per step (per rank under torchrun)")
    a("--model-dim", type=COUNT, default=d.model_dim, help="model (token) dimension M")
    a("--hidden-dim", type=COUNT, default=d.hidden_dim, help="hidden dimension H of each expert's FFN")
    a("--num-experts", "--experts", dest="experts", type=COUNT, default=d.experts,
      help="number of experts E (global under torchrun); --experts is the older spelling")
    a("--k", type=COUNT, default=d.k, help="experts per token (top-k)")
    a("--capacity-factor", type=FINITE, default=d.capacity_factor, help="0: dropless, < 0: adaptive")
    a("--dtype", choices=sorted(DTYPES), default=d.dtype, help="parameter and activation dtype")
    a("--glu", action="store_true", help="gated (SwiGLU-style) experts")
    a("--steps", type=COUNT, default=d.steps, help="timed steps per case (median reported)")
    a("--warmup", type=NON_NEGATIVE, default=d.warmup, help="untimed steps per case first")
    a("--seed", type=SEED, default=d.seed, help="seed of the weights and inputs")
    a("--device", type=_device, default=d.device,
      help="where the layer and every suite check run: cpu (default), cuda, cuda:1, ...; a check that only means "
           "something on the CPU (peers, gloo expert parallelism) says it was skipped")
    a("--threads", type=COUNT, default=None, help="torch threads (default: all cores, shared by local ranks)")
    a("--no-peers", action="store_true", help="skip DeepSpeed / fairscale / Tutel even when importable")
    a("--memory", action="store_true", help="also report activation memory, and E=64 at equal T, k, H")
    a("--suite", action="store_true",
      help="measure every target of the suite (flexmoe.apps.bench.suite) and print each against its target")
    a("--suite-groups", type=_names, default=None,
      help="run only these comma-separated suite groups, e.g. layer,fine-grained (default: all)")
    a("--suite-one-process", action="store_true",
      help="--suite: measure every check in this process (default: each in a fresh process, so that no check "
           "inherits the allocator state the checks before it left)")
    a("--families", action="store_true",
      help="DeepSeek-style routing vs plain top-k at E=64 (8 groups), k=8 (overrides --experts, --k)")
    a("--nproc", type=COUNT, default=1, help="launch N local ranks (gloo on 127.0.0.1)")
    a("--ranks-per-node", type=COUNT, default=None, help="for the 2-D hierarchical all-to-all (default: torchrun's)")
    a("--sleep-ms", type=POSITIVE, default=None,
      help="distributed: experts that stall this long per pass without using the CPU (overlap check) "
           "(default: real experts)")
    a("--degrees", type=_degrees, default=(1, 2, 4), help="distributed: overlap degrees to time (default: 1,2,4)")
    a("--profile", default=None,
      help="distributed: also run parallel='auto' steered by this cost-model profile ('local', 'a100-ndv4', a "
           "path) (default: none)")
    a("--hf", default=None, metavar="FAMILY",
      help="time one Hugging Face MoE block on HF's experts implementations and on flexmoe (flexmoe.apps.bench.hf): "
           "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss or all; needs transformers (default: off)")
    a("--host-reads", default=None, metavar="FAMILIES",
      help="count the aten operations and host reads of one forward + backward of Hugging Face blocks (comma-"
           "separated families, or all), HF's grouped_mm experts against the converted block with "
           "expert_kernel=grouped_mm, flexmoe.apps.bench.host_reads; and the median of --steps timed calls of "
           "each, side by side, their order rotated (x time; x auto: the block converted on the default kernel "
           "choice; x join: converted with joined_gate_up=True; x eval: a no-grad forward in eval mode, default "
           "choice, a decoding step at T=1; x cold, xe cold: x auto and x eval timed with each call right after "
           "the other's, never after itself, as a block runs between other layers) (default: off)")
    a("--hf-memory-gib", type=POSITIVE, default=1.0,
      help="--hf: skip HF batched_mm where its per-pair weight copies need more than this (default: 1)")
    a("--auto-trials", type=COUNT, default=None,
      help="distributed: timed trials per candidate for parallel='auto' (default: MeasuringChooser's own count)")
    a("--auto-runs", type=COUNT, default=1,
      help="distributed: tune parallel='auto' this many times from scratch, each timed against the best static")
    a("--json", action="store_true", help="print the report as JSON")


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated group names, got {text!r}")
    return names


def _device(text: str) -> str:
    """A device this machine has: ``cpu`` or ``cuda[:index]`` with CUDA available."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:index], got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device that torch {torch.__version__} "
                                         f"can use")
    if (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


def _degrees(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"overlap degrees must be >= 1, got {text!r}")
    return values


def _config(args: argparse.Namespace) -> BenchConfig:
    """The layer's configuration; each flag's range was checked as it was parsed (:mod:`flexmoe.apps.flags`)."""
    if args.k > args.experts:
        raise UsageError(f"--k {args.k} must be at most --num-experts {args.experts}")
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.sleep_ms is not None and args.experts % world:
        raise UsageError(f"--sleep-ms needs whole experts per rank: --num-experts {args.experts} must be a multiple "
                         f"of the {world} ranks")
    if args.device != "cpu" and (args.nproc > 1 or under_torchrun()):
        raise UsageError(f"--device {args.device}: the distributed benchmark runs on CPU ranks (gloo) only")
    # Every field from the flag of its name.
    return BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)})


def _run_host_reads(families: str, steps: int, as_json: bool) -> int:
    from flexmoe.apps.bench.hf import FAMILY_NAMES
    from flexmoe.apps.bench.host_reads import count_hf_blocks, format_counts

    names = list(FAMILY_NAMES) if families == "all" else families.split(",")
    unknown = [n for n in names if n not in FAMILY_NAMES]
    if unknown:
        raise UsageError(f"--host-reads must name families of {', '.join(FAMILY_NAMES)} (or all), got {unknown}")
    rows = count_hf_blocks(names, steps=steps)
    print(json.dumps(rows, indent=1) if as_json else format_counts(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.nproc > 1 and not under_torchrun():
        argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
        return relaunch(args.nproc, "bench", _without_nproc(argv))
    if under_torchrun():
        return _run_distributed(cfg, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.suite or args.suite_groups:
        try:
            checks = suite_checks(args.suite_groups)
        except ValueError as exc:
            raise UsageError(f"--suite-groups: {exc}") from None
        settings = SuiteSettings(steps=cfg.steps, warmup=cfg.warmup, seed=cfg.seed, peers=not args.no_peers,
                                 show=not args.json, device=cfg.device)
        if args.suite_one_process:
            results = run_suite_checks(checks, settings)
        else:
            results = run_suite_isolated(args.suite_groups, settings, torch.get_num_threads())
        print(json.dumps({"suite": results}, indent=1) if args.json else format_suite_table(results))
        return 0
    if args.host_reads is not None:
        return _run_host_reads(args.host_reads, args.steps, args.json)
    if args.hf is not None:
        from flexmoe.apps.bench.hf import run_hf
        return run_hf(args.hf, steps=cfg.steps, warmup=cfg.warmup, seed=cfg.seed, memory_gib=args.hf_memory_gib,
                      tokens=cfg.tokens, model_dim=cfg.model_dim, as_json=args.json, device=cfg.device)
    if args.families:
        from flexmoe.apps.bench.families import bench_families, format_families
        report = bench_families(cfg)
        print(json.dumps(report, indent=1) if args.json else format_families(report))
        return 0
    report = bench_single(cfg, peers=not args.no_peers, memory=args.memory, show=not args.json)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out


def _run_distributed(cfg: BenchConfig, args: argparse.Namespace) -> int:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun, like RANK and WORLD_SIZE
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        report = bench_distributed(cfg, args.sleep_ms, args.ranks_per_node, args.profile, args.degrees,
                                   show=not args.json, auto_trials=args.auto_trials, auto_runs=args.auto_runs)
        if report["rank"] == 0:
            print(json.dumps(report, indent=1) if args.json else "\n".join(distributed_conclusions(report)),
                  flush=True)
    finally:
        dist.destroy_process_group()
    return 0
