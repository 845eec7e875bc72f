"""A first look at flexmoe on a CUDA machine, in one short run.

* the layer's forward and backward on the GPU against the same layer in float64 on the CPU (fp32 and bf16; the
  inputs and weights are rounded to the dtype first and the router runs in fp32, so both route alike);
* ``torch.compile(fullgraph=True)`` of the layer, dropless and capacity mode;
* a converted Hugging Face Qwen3-MoE's logits against HF's own;
* the layer's forward + backward time against a dense FFN of the same FLOPs (the compute floor), side by side.

    PYTHONPATH=src python benchmarks/cuda_probe.py [--out DIR]     # prints one line per check, writes probe.json

Results: docs/performance.md, "CUDA: the first check".
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import flexmoe.hf
from flexmoe import MoELayer

CUDA = torch.device("cuda")


def check(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one check; its numbers (or its error) go into ``results[name]`` and one printed line."""
    t = time.perf_counter()
    try:
        found = fn()
        results[name] = {"ok": True, "s": round(time.perf_counter() - t, 2), **found}
    except Exception as e:  # a probe reports every failure and goes on
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600], "tb": traceback.format_exc()[-2000:]}
    print(name, json.dumps(results[name])[:800], flush=True)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double().cpu() - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)


def layer_against_float64(dtype: torch.dtype, **options: Any) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        if dtype != torch.float32:
            options["router_dtype"] = torch.float32
        layer = MoELayer(64, 8, 128, group="single", **options)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(p.to(dtype).float())  # exactly representable in dtype
        x = torch.randn(4, 32, 64).to(dtype).float()
        ref = MoELayer(64, 8, 128, group="single", **options).double()
        ref.load_state_dict(layer.state_dict())
        x_ref = x.double().requires_grad_()
        ref(x_ref).square().sum().backward()
        y_ref = ref(x_ref.detach())
        on_gpu = layer.to(CUDA, dtype)
        x_gpu = x.to(CUDA, dtype).requires_grad_()
        y = on_gpu(x_gpu)
        y.float().square().sum().backward()
        assert x_gpu.grad is not None and x_ref.grad is not None
        weight_err = max(_rel(p.grad, q.grad) for p, q in zip(on_gpu.parameters(), ref.parameters())
                         if q.grad is not None and p.grad is not None)
        errors = {"rel_err_y": _rel(y, y_ref), "rel_err_wgrad": weight_err,
                  "rel_err_xgrad": _rel(x_gpu.grad, x_ref.grad)}
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        return {**errors, "within_tol": max(errors.values()) < tolerance}
    return run


def compiled(capacity_factor: float) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        layer = MoELayer(64, 8, 128, group="single", k=2, capacity_factor=capacity_factor).to(CUDA)
        x = torch.randn(128, 64, device=CUDA, requires_grad=True)
        eager = layer(x)
        y = torch.compile(layer, fullgraph=True)(x)
        y.sum().backward()
        return {"max_diff": (eager - y).abs().max().item()}
    return run


def hf_parity() -> dict[str, Any]:
    import transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                         num_experts_per_tok=2, head_dim=16)  # type: ignore[call-arg]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(CUDA).eval()
    ids = torch.randint(0, 128, (2, 16), device=CUDA)
    with torch.no_grad():
        hf = model(ids).logits
        flexmoe.hf.convert(model, group="single")
        ours = model(ids).logits
    return {"transformers": transformers.__version__, "max_diff": (hf - ours).abs().max().item()}


def _mean_time(step: Callable[[], None], repeats: int = 10) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def against_floor() -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for tokens, experts, model_dim, hidden, k, dtype in [(4096, 8, 512, 1024, 2, torch.bfloat16),
                                                         (8192, 64, 1024, 512, 8, torch.bfloat16),
                                                         (4096, 8, 512, 1024, 2, torch.float32)]:
        torch.manual_seed(0)
        layer = MoELayer(model_dim, experts, hidden, group="single", k=k, capacity_factor=0).to(CUDA, dtype)
        x = torch.randn(tokens, model_dim, device=CUDA, dtype=dtype, requires_grad=True)
        w1 = torch.randn(hidden, model_dim, device=CUDA, dtype=dtype, requires_grad=True)
        w2 = torch.randn(model_dim, hidden, device=CUDA, dtype=dtype, requires_grad=True)
        pairs = torch.randn(tokens * k, model_dim, device=CUDA, dtype=dtype, requires_grad=True)

        def moe(layer: MoELayer = layer, x: torch.Tensor = x) -> None:
            layer(x).float().sum().backward()

        def dense(pairs: torch.Tensor = pairs, w1: torch.Tensor = w1, w2: torch.Tensor = w2) -> None:
            F.linear(F.gelu(F.linear(pairs, w1)), w2).float().sum().backward()  # the same FLOPs, over every pair

        moe_s, floor_s = _mean_time(moe), _mean_time(dense)
        name = f"T{tokens}_E{experts}_M{model_dim}_H{hidden}_k{k}_{str(dtype).split('.')[-1]}"
        rows[name] = {"moe_over_floor": round(moe_s / floor_s, 2), "moe_ms": round(moe_s * 1e3, 3),
                      "floor_ms": round(floor_s * 1e3, 3)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp", help="folder for probe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"cuda_probe: no CUDA device (torch {torch.__version__}); nothing to probe")
        return
    results: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    print(results, flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).split(".")[-1]
        check(results, f"layer_top2_dropless_{tag}", layer_against_float64(dtype, k=2, capacity_factor=0))
        check(results, f"layer_top2_capacity_{tag}", layer_against_float64(dtype, k=2, capacity_factor=1.25))
        check(results, f"layer_top4_glu_silu_{tag}",
              layer_against_float64(dtype, k=4, capacity_factor=0, glu=True, activation="silu"))
        check(results, f"layer_top1_bias_{tag}", layer_against_float64(dtype, k=1, capacity_factor=1.0, bias=True))
        check(results, f"layer_sigmoid_groups_shared_{tag}", layer_against_float64(
            dtype, k=2, capacity_factor=0, score_func="sigmoid", num_expert_groups=4, num_limited_groups=2,
            shared_experts=1, glu=True, activation="silu"))
        check(results, f"layer_glu_limit_{tag}", layer_against_float64(
            dtype, k=2, capacity_factor=0, glu=True, activation="silu", glu_limit=7.0, bias=True))
    check(results, "compile_dropless_fullgraph", compiled(0.0))
    check(results, "compile_capacity_fullgraph", compiled(1.5))
    check(results, "hf_qwen3moe_convert_parity", hf_parity)
    check(results, "layer_against_dense_floor", against_floor)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
