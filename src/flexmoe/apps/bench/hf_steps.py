"""``flexmoe bench --hf``'s whole-model measurements: a training step of a small causal LM converted vs HF's
default experts implementation (:func:`bench_train_step`), and decoding latency, no grad, at a few tokens per call,
converted vs HF ``grouped_mm`` on the same weights (:func:`bench_decode`).
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from flexmoe.apps.baselines import expert_floor
from flexmoe.apps.bench import hf_blocks
from flexmoe.apps.bench.hf_blocks import SHAPES, HFShape
from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.experts import FeedForwardExperts

__all__ = ["TRAIN_SHAPE", "DECODE_TOKENS", "build_causal_lm", "bench_train_step", "format_train", "bench_decode",
           "format_decode"]


TRAIN_SHAPE = HFShape("train", tokens=1024, model_dim=256, experts=16, k=4, hidden_dim=256)


def build_causal_lm(family: str, seed: int = 0, shape: HFShape = TRAIN_SHAPE) -> nn.Module:
    """A small causal LM of ``family`` from its config: 2 layers, every one an MoE layer, M=256, 4 heads,
    vocabulary 2048; HF's default experts implementation; weights filled under ``seed``."""
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                 vocab_size=2048, max_position_embeddings=512, intermediate_size=2 * shape.hidden_dim)
    if family in ("mixtral", "olmoe", "gpt_oss"):
        extra.pop("intermediate_size")  # their routed experts' hidden size, set by _config
    if family == "deepseek_v3":  # every layer MoE; its latent attention at small ranks
        extra.update(first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16,
                     qk_nope_head_dim=48, v_head_dim=64, head_dim=16)  # head_dim: the rotary part
    if family == "gpt_oss":
        extra.update(layer_types=["full_attention"] * 2)
    if family == "qwen2_moe":
        extra.update(decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_blocks.hf_config(family, shape, **extra))
    hf_blocks.fill_weights(model, seed)
    return model.train()


def bench_train_step(family: str = "qwen3_moe", *, steps: int = 5, warmup: int = 1, seed: int = 0,
                     batch: int = 4, shape: HFShape = TRAIN_SHAPE, show: bool = False,
                     device: str = "cpu") -> dict[str, Any]:
    """One AdamW training step (forward, loss, backward, update) of :func:`build_causal_lm` on ``device``:
    converted vs HF's default experts implementation, side by side. Both first compute the same loss and
    gradients."""
    import flexmoe.hf

    hf_model: Any = build_causal_lm(family, seed, shape).to(device)  # a transformers PreTrainedModel
    default = str(hf_model.config._experts_implementation)
    ours: Any = flexmoe.hf.convert(copy.deepcopy(hf_model))
    seq = shape.tokens // batch
    ids = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    losses, grads = {}, {}
    for name, model in (("hf", hf_model), ("converted", ours)):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = model.get_input_embeddings().weight.grad
    hf_blocks.assert_same("converted model", losses["converted"], losses["hf"], "loss")
    hf_blocks.assert_same("converted model", grads["converted"], grads["hf"], "embedding gradient")
    optimizers = {"hf": torch.optim.AdamW(hf_model.parameters(), lr=1e-4),
                  "converted": torch.optim.AdamW(ours.parameters(), lr=1e-4)}

    def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    cases: dict[str, Callable[[], None]] = {f"hf {default}": partial(train_step, hf_model, optimizers["hf"]),
             "converted": partial(train_step, ours, optimizers["converted"])}
    times = time_side_by_side(cases, steps, warmup, desc=f"{family} training step" if show else None,
                              device=device)
    medians = {n: statistics.median(v) for n, v in times.items()}
    ratio = medians["converted"] / medians[f"hf {default}"]
    report = {"family": family, "hf_default": default, "tokens": shape.tokens, "shape": asdict(shape),
              "seconds": medians, "converted_over_hf": ratio, "met": ratio < 1.0, "steps": steps}
    if show:
        print(format_train(report), flush=True)
    return report


def format_train(report: dict[str, Any]) -> str:
    s = HFShape(**report["shape"])
    parts = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in report["seconds"].items())
    return (f"training step, {report['family']} causal LM (2 layers, M={s.model_dim}, E={s.experts}, k={s.k}, "
            f"H={s.hidden_dim}, {report['tokens']} tokens, AdamW): {parts}; converted / HF default "
            f"({report['hf_default']}) {report['converted_over_hf']:.3f}  {'pass' if report['met'] else 'FAIL'}")


# ------------------------------------------------------------------------------------------------- decoding


DECODE_TOKENS = (1, 8, 64)


def bench_decode(tokens: tuple[int, ...] = DECODE_TOKENS, *, family: str = "qwen3_moe", steps: int = 20,
                 warmup: int = 3, seed: int = 0, calls: int = 0, model_dim: int = 512,
                 show: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Decoding latency, no grad, at ``fine`` (E=64 k=8 H=256 M=512) with T = ``tokens`` per call: the converted
    block and the flexmoe implementation vs HF ``grouped_mm`` on the same weights, and the floor (the experts
    alone on the routed rows). A timed step is ``calls`` calls (default: enough for ~256 tokens) so that one
    step is long enough to time. Outputs are checked against HF eager first."""
    import flexmoe.hf

    flexmoe.hf.register()
    rows = []
    for t in tokens:
        shape = replace(SHAPES["fine"], tokens=t, model_dim=model_dim)
        reference = hf_blocks.build_hf_block(family, shape, seed).eval().to(device)
        x = torch.randn(1, t, shape.model_dim, generator=torch.Generator().manual_seed(seed + 1)).to(device)
        modules = {"hf grouped_mm": hf_blocks.set_experts_implementation(copy.deepcopy(reference), "grouped_mm"),
                   "flexmoe impl": hf_blocks.set_experts_implementation(copy.deepcopy(reference), "flexmoe"),
                   "converted": flexmoe.hf.convert(copy.deepcopy(reference)).eval()}
        with torch.no_grad():
            want = hf_blocks.block_output(hf_blocks.set_experts_implementation(reference, "eager")(x))
            for name, module in modules.items():
                hf_blocks.assert_same(name, hf_blocks.block_output(module(x)), want, "output")
        moe = hf_blocks.converted_layer(modules["converted"])
        plan = moe.last_plan
        assert plan is not None
        n = calls or max(1, 256 // t)
        rows_in = torch.randn(sum(plan.counts), shape.model_dim,
                              generator=torch.Generator().manual_seed(seed + 2)).to(device)

        def repeat(fn: Callable[[], Any], n: int = n) -> Callable[[], None]:
            def run() -> None:
                with torch.no_grad():
                    for _ in range(n):
                        fn()
            return run

        experts = moe.experts
        assert isinstance(experts, FeedForwardExperts)  # convert builds the built-in experts
        cases = {"floor": repeat(partial(expert_floor, experts, rows_in, plan.counts))}
        cases.update({name: repeat(partial(module, x)) for name, module in modules.items()})
        times = time_side_by_side(cases, steps, warmup, desc=f"decode T={t}" if show else None, device=device)
        medians = {name: statistics.median(v) / n for name, v in times.items()}
        hf = medians["hf grouped_mm"]
        rows.append({"tokens": t, "calls_per_step": n, "seconds": medians,
                     "x_hf_grouped_mm": {k: v / hf for k, v in medians.items()},
                     "x_floor": {k: v / medians["floor"] for k, v in medians.items()},
                     "met": medians["converted"] < hf})
        if show:
            print(format_decode({"family": family, "shape": asdict(shape), "rows": rows[-1:]}), flush=True)
    report = {"family": family, "shape": asdict(replace(SHAPES["fine"], model_dim=model_dim)), "rows": rows,
              "met": all(r["met"] for r in rows), "steps": steps}
    if show:
        print(format_decode(report), flush=True)
    return report


def format_decode(report: dict[str, Any]) -> str:
    names = ["floor", "hf grouped_mm", "flexmoe impl", "converted"]
    lines = [f"decoding, no grad, {report['family']} block E=64 k=8 H=256 M={report['shape']['model_dim']}: latency "
             f"per call (us), "
             f"and x HF grouped_mm / x floor",
             f"{'T':>4}" + "".join(f"{n:>24}" for n in names) + "   target"]
    for r in report["rows"]:
        cells = "".join(f"{r['seconds'][n] * 1e6:>9.0f} {r['x_hf_grouped_mm'][n]:>6.2f}x {r['x_floor'][n]:>5.2f}x"
                        for n in names)
        lines.append(f"{r['tokens']:>4}{cells}   {'pass' if r['met'] else 'FAIL'}")
    return "\n".join(lines)

