"""The benchmark suite's groups ``hf`` and ``decode-hf`` (:mod:`flexmoe.apps.bench.suite`): the ``--hf`` block
timing at every family's shapes, the training step, and decoding latency, each as a ratio with its target.
"""

from __future__ import annotations

from functools import partial

from flexmoe.apps.bench.hf_blocks import FAMILY_NAMES, SHAPES, shapes_of
from flexmoe.apps.bench.hf_steps import DECODE_TOKENS, bench_decode, bench_train_step
from flexmoe.apps.bench.hf_timing import bench_hf_block
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings

__all__ = ["hf_checks", "decode_checks"]


def hf_checks() -> list[SuiteCheck]:
    """The suite's "hf" group: every family at each of its shapes (the slower of the converted block and the
    flexmoe implementation over HF's best built-in, target < 1), and the training step (converted over HF's
    default, target < 1)."""
    checks = []
    for family in FAMILY_NAMES:
        for name in shapes_of(family):
            checks.append(SuiteCheck("hf", f"{family} {name} max(converted, impl) / hf best", 0.999,
                                     partial(_block_measure, family, name)))
    checks.append(SuiteCheck("hf", "training step qwen3_moe converted / hf default", 0.999, _train_measure))
    return checks


def _block_measure(family: str, shape: str, settings: SuiteSettings) -> Measurement:
    report = bench_hf_block(family, SHAPES[shape], steps=min(5, settings.steps), warmup=min(1, settings.warmup),
                            seed=settings.seed, show=settings.show, device=settings.device)
    by = {r["case"]: r["x_hf_best"] for r in report["rows"]}
    return Measurement(max(by["converted"], by["flexmoe impl"]), f"x {report['hf_best']}", {"report": report},
                       f"converted {by['converted']:.3f}x, impl {by['flexmoe impl']:.3f}x")


def _train_measure(settings: SuiteSettings) -> Measurement:
    report = bench_train_step(steps=min(5, settings.steps), warmup=min(1, settings.warmup), seed=settings.seed,
                              show=settings.show, device=settings.device)
    return Measurement(report["converted_over_hf"], f"x hf {report['hf_default']}", {"report": report})


def decode_checks() -> list[SuiteCheck]:
    """The suite's "decode-hf" group: decoding latency at T = 1, 8, 64, converted over HF grouped_mm (< 1)."""
    return [SuiteCheck("decode-hf", f"decode T={t} converted / hf grouped_mm", 0.999, partial(_decode_measure, t))
            for t in DECODE_TOKENS]


def _decode_measure(tokens: int, settings: SuiteSettings) -> Measurement:
    report = bench_decode((tokens,), steps=max(settings.steps, 10), warmup=settings.warmup, seed=settings.seed,
                          show=settings.show, device=settings.device)
    row = report["rows"][0]
    return Measurement(row["x_hf_grouped_mm"]["converted"], "x hf grouped_mm", {"report": report},
                       f"{row['x_floor']['converted']:.2f}x floor, impl {row['x_hf_grouped_mm']['flexmoe impl']:.2f}x")
