"""``flexmoe bench --hf FAMILY``: one Hugging Face MoE block on HF's experts implementations and on flexmoe.

For each family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) and shape, the block is built from a
``transformers`` config (nothing is downloaded), its weights drawn under a seed, and copies of it are timed
forward + backward, side by side in one run (:func:`flexmoe.apps.bench.timing.time_side_by_side`):

* ``hf eager``, ``hf grouped_mm``, ``hf batched_mm``: HF's own experts implementations (``batched_mm`` copies
  one ``[2H, M]`` weight matrix per (token, choice) pair; a shape where those copies would not fit in
  ``--hf-memory-gib`` is skipped and says so);
* ``flexmoe impl``: the ``"flexmoe"`` experts implementation (:func:`flexmoe.hf.register`) under HF's routing;
* ``converted``: the block replaced by :func:`flexmoe.hf.convert`;
* ``floor``: the converted layer's expert FFNs alone on the rows the router chose (plus the shared expert on
  every token), as ``flexmoe bench --families`` measures it.

Before anything is timed every case runs once and must give HF eager's output and input gradient (float32
rounding): a number measuring another computation is worthless. Ratios are to HF's fastest built-in
implementation in the same run (``x hf best``) and to the floor.

Shapes (T=4096, M=512): ``fine`` E=64 k=8 H=256 (Qwen3-MoE-like), ``coarse`` E=8 k=2 H=1024, and ``deepseek``
E=64 k=8 H=256 with sigmoid scores, 8 groups of which 4 stay eligible and one shared expert (DeepSeek-V3's
routing: that family only). The target: the converted block and the registered implementation are both faster
than HF's best built-in implementation, every family, every shape.

Also measured: a whole training step of a small causal LM (2 layers, M=256, built from its config) converted vs
HF's default experts implementation (:func:`bench_train_step`), and decoding latency, no grad, T = 1, 8, 64
tokens per call, converted vs HF ``grouped_mm`` on the same weights (:func:`bench_decode`). The suite groups
``hf`` and ``decode-hf`` (:func:`hf_checks`, :func:`decode_checks`) check all three.

This module is the command (:func:`run_hf`) and its summary table; the parts live beside it:
:mod:`~flexmoe.apps.bench.hf_blocks` (families, shapes, building a block), :mod:`~flexmoe.apps.bench.hf_timing`
(one block timed), :mod:`~flexmoe.apps.bench.hf_steps` (training step and decoding) and
:mod:`~flexmoe.apps.bench.hf_checks` (the suite's groups). Their public names are importable from here too.
"""

from __future__ import annotations

from typing import Any

from flexmoe.apps.bench.hf_blocks import (
    FAMILY_NAMES,
    SHAPES,
    HFShape,
    build_hf_block,
    set_experts_implementation,
    shapes_of,
)
from flexmoe.apps.bench.hf_checks import decode_checks, hf_checks
from flexmoe.apps.bench.hf_steps import TRAIN_SHAPE, bench_decode, bench_train_step, format_decode, format_train
from flexmoe.apps.bench.hf_timing import bench_hf, bench_hf_block

__all__ = ["FAMILY_NAMES", "HFShape", "SHAPES", "shapes_of", "build_hf_block", "set_experts_implementation",
           "bench_hf_block", "bench_hf", "bench_train_step", "bench_decode", "format_hf", "run_hf", "hf_checks",
           "decode_checks"]


def format_hf(report: dict[str, Any]) -> str:
    """The summary table: one line per (family, shape), each case's time over HF's best built-in."""
    names = ["hf eager", "hf grouped_mm", "hf batched_mm", "flexmoe impl", "converted", "floor"]
    lines = [f"flexmoe bench --hf: forward + backward, x HF's best built-in experts implementation "
             f"(same run), {report['threads']} threads",
             f"{'family':<12}{'shape':<10}" + "".join(f"{n:>15}" for n in names) + "   target"]
    for b in report["blocks"]:
        by = {r["case"]: r["x_hf_best"] for r in b["rows"]}
        cells = "".join(f"{by[n]:>15.3f}" if n in by else f"{'-':>15}" for n in names)
        lines.append(f"{b['family']:<12}{b['shape']['name']:<10}{cells}   {'pass' if b['met'] else 'FAIL'}")
    lines += [format_train(t) for t in report.get("train", [])]
    if "decode" in report:
        lines.append(format_decode(report["decode"]))
    lines.append(f"all targets: {'pass' if report['met'] else 'FAIL'}")
    return "\n".join(lines)


def run_hf(family: str, *, steps: int, warmup: int, seed: int, memory_gib: float, as_json: bool,
           tokens: int = 4096, model_dim: int = 512, train_shape: HFShape | None = None, device: str = "cpu") -> int:
    """``flexmoe bench --hf FAMILY`` (or ``all``): the blocks at every shape (T = ``tokens``, M = ``model_dim``),
    the training step of each family's small causal LM (``train_shape``, default :data:`TRAIN_SHAPE`), and
    decoding on the family's block (qwen3_moe's for ``all``); the summary table last."""
    import json

    from flexmoe.apps.errors import UsageError

    if family != "all" and family not in FAMILY_NAMES:
        raise UsageError(f"--hf must be one of {', '.join(FAMILY_NAMES)} or all, got {family!r}")
    try:
        import flexmoe.hf  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--hf: {exc}") from None
    families = list(FAMILY_NAMES) if family == "all" else [family]
    show = not as_json
    report = bench_hf(families, steps=steps, warmup=warmup, seed=seed, memory_gib=memory_gib, tokens=tokens,
                      model_dim=model_dim, show=show, device=device)
    report["train"] = [bench_train_step(f, steps=steps, warmup=warmup, seed=seed, show=show,
                                        shape=train_shape or TRAIN_SHAPE, device=device) for f in families]
    report["decode"] = bench_decode(family="qwen3_moe" if family == "all" else family, steps=max(steps, 10),
                                    warmup=warmup, seed=seed, model_dim=model_dim, show=show, device=device)
    report["met"] = (report["met"] and all(t["met"] for t in report["train"]) and report["decode"]["met"])
    print(json.dumps(report, indent=1) if as_json else format_hf(report))
    return 0

