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

Also here: a whole training step of a small causal LM (2 layers, M=256, built from its config) converted vs
HF's default experts implementation (:func:`bench_train_step`), and decoding latency, no grad, T = 1, 8, 64
tokens per call, converted vs HF ``grouped_mm`` on the same weights (:func:`bench_decode`). The suite groups
``hf`` and ``decode-hf`` (:func:`hf_checks`, :func:`decode_checks`) check all three.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.apps.baselines import expert_floor
from flexmoe.apps.bench.config import BenchConfig
from flexmoe.apps.bench.families import floor_with_shared
from flexmoe.apps.bench.suite import Measurement, SuiteCheck, SuiteSettings
from flexmoe.apps.bench.timing import time_side_by_side
from flexmoe.experts import FeedForwardExperts
from flexmoe.layer import MoELayer

__all__ = ["FAMILY_NAMES", "HFShape", "SHAPES", "shapes_of", "build_hf_block", "bench_hf_block", "bench_hf",
           "bench_train_step", "bench_decode", "format_hf", "run_hf", "hf_checks", "decode_checks"]

FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
BUILT_IN = ("eager", "grouped_mm", "batched_mm")  # HF's experts implementations that run on any device


@dataclass(frozen=True)
class HFShape:
    """One block shape: T tokens (one sequence), model dim M, E routed experts of hidden size H, top-k. ``groups``
    / ``limited_groups``: DeepSeek-V3's ``n_group`` / ``topk_group`` (1 / 1: no group limit)."""

    name: str
    tokens: int = 4096
    model_dim: int = 512
    experts: int = 64
    k: int = 8
    hidden_dim: int = 256
    groups: int = 1
    limited_groups: int = 1

    def describe(self) -> str:
        groups = f" {self.groups} groups (best {self.limited_groups})" if self.groups > 1 else ""
        return (f"T={self.tokens} M={self.model_dim} E={self.experts} k={self.k} H={self.hidden_dim}{groups}")


SHAPES: dict[str, HFShape] = {
    "fine": HFShape("fine"),
    "coarse": HFShape("coarse", experts=8, k=2, hidden_dim=1024),
    "deepseek": HFShape("deepseek", groups=8, limited_groups=4),
}


def shapes_of(family: str) -> list[str]:
    """The shapes a family is measured at: the DeepSeek-like one is DeepSeek-V3's routing, so that family only."""
    return ["fine", "coarse", "deepseek"] if family == "deepseek_v3" else ["fine", "coarse"]


# ------------------------------------------------------------------------------------------ building blocks


def _config(family: str, shape: HFShape, **extra: Any) -> Any:
    """The transformers config of ``family`` with the MoE sizes of ``shape`` (``extra``: more config fields)."""
    M, E, k, H = shape.model_dim, shape.experts, shape.k, shape.hidden_dim
    common = dict(hidden_size=M, num_experts_per_tok=k, hidden_act="silu", **extra)
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=H, num_local_experts=E, **common)
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(moe_intermediate_size=H, shared_expert_intermediate_size=H, num_experts=E,
                              norm_topk_prob=False, **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(moe_intermediate_size=H, num_experts=E, norm_topk_prob=True, **common)
    if family == "olmoe":
        from transformers import OlmoeConfig
        return OlmoeConfig(intermediate_size=H, num_experts=E, norm_topk_prob=False, **common)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        return DeepseekV3Config(moe_intermediate_size=H, n_routed_experts=E, n_group=shape.groups,
                                topk_group=shape.limited_groups, n_shared_experts=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5, **common)
    if family == "gpt_oss":
        from transformers import GptOssConfig
        common.pop("hidden_act")
        return GptOssConfig(intermediate_size=H, num_local_experts=E, **common)
    raise ValueError(f"family must be one of {list(FAMILY_NAMES)}, got {family!r}")


def _block_class(family: str) -> type[nn.Module]:
    import transformers.models as m
    return {"mixtral": m.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
            "qwen2_moe": m.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
            "qwen3_moe": m.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
            "olmoe": m.olmoe.modeling_olmoe.OlmoeSparseMoeBlock,
            "deepseek_v3": m.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
            "gpt_oss": m.gpt_oss.modeling_gpt_oss.GptOssMLP}[family]


def fill_weights(module: nn.Module, seed: int) -> None:
    """Draw every parameter under ``seed`` (HF leaves a block built from a config uninitialised): matrices
    N(0, 1/last dim), so that activations stay O(1) and the router's logits spread; vectors N(0, 0.1^2).
    DeepSeek-V3's ``e_score_correction_bias`` buffers too, so that the selection bias changes some choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            std = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def build_hf_block(family: str, shape: HFShape, seed: int = 0) -> nn.Module:
    """``family``'s sparse-MoE block at ``shape``, weights filled under ``seed``, in training mode."""
    block = _block_class(family)(_config(family, shape))
    fill_weights(block, seed)
    return block.train()


def set_experts_implementation(block: nn.Module, name: str) -> nn.Module:
    """Make ``block``'s experts run HF's experts implementation ``name`` (the experts read their config's
    ``_experts_implementation`` at every call; a standalone block has no model to ``set_experts_implementation``
    on). Returns ``block``."""
    experts: Any = block.experts
    experts.config._experts_implementation = name
    return block


def _converted_layer(block: nn.Module) -> MoELayer:
    """The :class:`~flexmoe.MoELayer` inside a block :func:`flexmoe.hf.convert` returned."""
    moe = getattr(block, "moe", None)
    if not isinstance(moe, MoELayer):
        raise TypeError(f"expected a converted block holding an MoELayer, got {type(block).__name__}")
    return moe


def _output(out: Tensor | tuple[Tensor, ...]) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # GPT-OSS's block returns (hidden_states, router_scores)


# ------------------------------------------------------------------------------------------------ one block


def _batched_mm_bytes(shape: HFShape) -> int:
    """What HF's batched_mm keeps per call: a copy of each pair's gate_up and down matrices (float32)."""
    return shape.tokens * shape.k * 3 * shape.hidden_dim * shape.model_dim * 4


def _assert_same(name: str, got: Tensor, want: Tensor, what: str) -> None:
    """Equal to float32 rounding: within 1e-4 relative, or 1e-4 of the largest element."""
    scale = float(want.detach().abs().max())
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
    except AssertionError as exc:
        raise RuntimeError(f"{name} computed another {what} than HF eager, so its timing would mean nothing: "
                           f"{str(exc).splitlines()[0:3]}") from None


def bench_hf_block(family: str, shape: HFShape, *, steps: int = 5, warmup: int = 1, seed: int = 0,
                   memory_gib: float = 1.0, show: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Time ``family``'s block at ``shape`` on every implementation, forward + backward, side by side, on
    ``device``.

    Returns ``{"family", "shape", "rows": [{"case", "seconds", "x_hf_best", "x_floor"}], "hf_best", "skipped",
    "met"}``; ``met``: the converted block and the flexmoe implementation both beat HF's best built-in one.
    Raises ``RuntimeError`` when a case's output or input gradient differs from HF eager's.
    """
    import flexmoe.hf

    flexmoe.hf.register()
    reference = build_hf_block(family, shape, seed).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, shape.tokens, shape.model_dim, generator=gen).to(device).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device)
    modules: dict[str, nn.Module] = {}
    skipped: list[str] = []
    for impl in BUILT_IN:
        need = _batched_mm_bytes(shape) / 2**30
        if impl == "batched_mm" and need > memory_gib:
            skipped.append(f"hf batched_mm: skipped (its per-pair weight copies need {need:.0f} GiB, "
                           f"over --hf-memory-gib {memory_gib:g})")
            continue
        modules[f"hf {impl}"] = set_experts_implementation(copy.deepcopy(reference), impl)
    modules["flexmoe impl"] = set_experts_implementation(copy.deepcopy(reference), "flexmoe")
    converted = flexmoe.hf.convert(copy.deepcopy(reference))
    modules["converted"] = converted

    def forward(module: nn.Module) -> Tensor:
        return _output(module(x))

    # Every case must compute HF eager's function before its time means anything.
    want_out, want_grad = _run_once(modules["hf eager"], forward, x, grad)
    for name, module in modules.items():
        out, x_grad = _run_once(module, forward, x, grad)
        _assert_same(name, out, want_out, "output")
        _assert_same(name, x_grad, want_grad, "input gradient")
    plan = _converted_layer(converted).last_plan
    assert plan is not None  # set by the forward above
    floor_cfg = BenchConfig(tokens=shape.tokens, model_dim=shape.model_dim, hidden_dim=shape.hidden_dim,
                            experts=shape.experts, k=shape.k, seed=seed, device=device)

    floor = floor_with_shared(_converted_layer(converted), plan.counts, floor_cfg)
    cases: dict[str, Callable[[], None]] = {"floor": floor}
    for name, module in modules.items():
        cases[name] = partial(_step, module, forward, x, grad)
    if show:
        print(f"{family} {shape.name}: {shape.describe()}, all cases equal HF eager; timing ...", flush=True)
    times = time_side_by_side(cases, steps, warmup, desc=f"{family} {shape.name}" if show else None,
                              device=device)
    medians = {name: statistics.median(v) for name, v in times.items()}
    hf_best = min((n for n in medians if n.startswith("hf ")), key=medians.__getitem__)
    rows = [{"case": name, "seconds": medians[name], "x_hf_best": medians[name] / medians[hf_best],
             "x_floor": medians[name] / medians["floor"]} for name in medians]
    met = all(medians[n] < medians[hf_best] for n in ("converted", "flexmoe impl"))
    report = {"family": family, "shape": asdict(shape), "rows": rows, "hf_best": hf_best, "skipped": skipped,
              "met": met, "threads": torch.get_num_threads(), "steps": steps}
    if show:
        print(format_block(report), flush=True)
    return report


def _run_once(module: nn.Module, forward: Callable[[nn.Module], Tensor], x: Tensor,
              grad: Tensor) -> tuple[Tensor, Tensor]:
    x.grad = None
    module.zero_grad(set_to_none=True)
    out = forward(module)
    out.backward(grad)
    assert x.grad is not None
    x_grad, x.grad = x.grad, None
    return out.detach(), x_grad


def _step(module: nn.Module, forward: Callable[[nn.Module], Tensor], x: Tensor, grad: Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    forward(module).backward(grad)


def bench_hf(families: list[str], *, steps: int = 5, warmup: int = 1, seed: int = 0, memory_gib: float = 1.0,
             tokens: int = 4096, model_dim: int = 512, show: bool = False, device: str = "cpu") -> dict[str, Any]:
    """:func:`bench_hf_block` for every family at each of its shapes, with ``tokens`` and ``model_dim``."""
    blocks = []
    for family in families:
        for name in shapes_of(family):
            shape = replace(SHAPES[name], tokens=tokens, model_dim=model_dim)
            blocks.append(bench_hf_block(family, shape, steps=steps, warmup=warmup, seed=seed,
                                         memory_gib=memory_gib, show=show, device=device))
    return {"blocks": blocks, "met": all(b["met"] for b in blocks), "threads": torch.get_num_threads()}


def format_block(report: dict[str, Any]) -> str:
    shape = HFShape(**report["shape"])
    lines = [f"{report['family']} {shape.name} ({shape.describe()}), forward + backward, median of "
             f"{report['steps']} steps, {report['threads']} threads",
             f"  {'case':<16}{'ms/step':>10}{'x hf best':>11}{'x floor':>9}"]
    for row in report["rows"]:
        best = "  <- hf best" if row["case"] == report["hf_best"] else ""
        lines.append(f"  {row['case']:<16}{row['seconds'] * 1e3:>10.1f}{row['x_hf_best']:>11.3f}"
                     f"{row['x_floor']:>9.3f}{best}")
    lines += [f"  {s}" for s in report["skipped"]]
    lines.append(f"  target (converted and flexmoe impl faster than {report['hf_best']}): "
                 f"{'pass' if report['met'] else 'FAIL'}")
    return "\n".join(lines)


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


# -------------------------------------------------------------------------------------------- training step


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
    model = AutoModelForCausalLM.from_config(_config(family, shape, **extra))
    fill_weights(model, seed)
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
    _assert_same("converted model", losses["converted"], losses["hf"], "loss")
    _assert_same("converted model", grads["converted"], grads["hf"], "embedding gradient")
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
        reference = build_hf_block(family, shape, seed).eval().to(device)
        x = torch.randn(1, t, shape.model_dim, generator=torch.Generator().manual_seed(seed + 1)).to(device)
        modules = {"hf grouped_mm": set_experts_implementation(copy.deepcopy(reference), "grouped_mm"),
                   "flexmoe impl": set_experts_implementation(copy.deepcopy(reference), "flexmoe"),
                   "converted": flexmoe.hf.convert(copy.deepcopy(reference)).eval()}
        with torch.no_grad():
            want = _output(set_experts_implementation(reference, "eager")(x))
            for name, module in modules.items():
                _assert_same(name, _output(module(x)), want, "output")
        moe = _converted_layer(modules["converted"])
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


# ---------------------------------------------------------------------------------------------- the command


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


# ------------------------------------------------------------------------------------------------ the suite


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
