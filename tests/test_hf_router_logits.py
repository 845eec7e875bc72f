"""A converted block's gate (flexmoe.hf.block.HFRouterLogits) computes HF's router logits without running the
router's top-k when nothing observes the router, and runs the router module itself when something does (a hook,
transformers' output recorders, a replaced forward). The reference is the HF router module's own forward."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import flexmoe.hf
from flexmoe.apps.bench.hf_blocks import HFShape, build_hf_block, converted_layer
from flexmoe.apps.bench.host_reads import OpCounter
from flexmoe.hf.block import HFRouterLogits, direct_logits_of
from flexmoe.module_call import runs_unobserved

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
TOPK = "aten.topk.default"  # every one of these routers picks its experts by torch.topk


def _gate(family: str) -> HFRouterLogits:
    grouped = family == "deepseek_v3"
    shape = HFShape("router", tokens=5, model_dim=64, experts=8, k=2, hidden_dim=32,
                    groups=4 if grouped else 1, limited_groups=2 if grouped else 1)
    converted = flexmoe.hf.convert(build_hf_block(family, shape, seed=1), expert_kernel="grouped_mm")
    gate = converted_layer(converted).router
    assert isinstance(gate, HFRouterLogits)
    return gate


def _logits_and_grads(gate: HFRouterLogits, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None, OpCounter]:
    x = x.clone().requires_grad_()
    gate.zero_grad()
    with OpCounter() as counted:
        logits = gate(x)
    (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
    weight = gate.hf_router.weight
    assert isinstance(weight, Tensor)
    return logits.detach(), x.grad, weight.grad, counted


def _module_logits(gate: HFRouterLogits, x: Tensor) -> Tensor:
    """The reference: HF's router module's forward, element logits_at, flattened, in the gate's score dtype."""
    logits = gate.hf_router(x)[gate.logits_at]
    logits = logits.reshape(-1, logits.shape[-1])
    return logits if gate.score_dtype is None else logits.to(gate.score_dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_unobserved_router_logits_equal_the_modules_without_its_topk(family: str) -> None:
    gate = _gate(family)
    assert direct_logits_of(gate.hf_router) is not None, type(gate.hf_router)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    logits, x_grad, w_grad, counted = _logits_and_grads(gate, x)
    assert TOPK not in counted.by_name  # the router's forward did not run

    reference = copy.deepcopy(gate)
    xr = x.clone().requires_grad_()
    expected = _module_logits(reference, xr)
    (expected * torch.linspace(-1, 1, expected.numel()).view_as(expected)).sum().backward()
    assert logits.dtype == expected.dtype and torch.equal(logits, expected.detach())
    reference_weight = reference.hf_router.weight
    assert isinstance(reference_weight, Tensor) and xr.grad is not None and reference_weight.grad is not None
    assert x_grad is not None and torch.equal(x_grad, xr.grad)
    assert w_grad is not None and torch.equal(w_grad, reference_weight.grad)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_router_logits_under_autocast_equal_the_modules(family: str) -> None:
    """bf16 autocast on the CPU: the linear map's dtype is autocast's (DeepSeek-V3's float32 casts included)."""
    gate = _gate(family)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
        expected = _module_logits(gate, x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hooked_router_runs_and_its_hook_sees_the_logits(family: str) -> None:
    gate = _gate(family)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    seen: list[Tensor] = []
    handle = gate.hf_router.register_forward_hook(lambda module, args, out: seen.append(out[0].detach()))
    try:
        assert not runs_unobserved(gate.hf_router)
        logits, _, _, counted = _logits_and_grads(gate, x)
    finally:
        handle.remove()
    assert TOPK in counted.by_name and len(seen) == 1
    assert torch.equal(logits, seen[0].reshape(-1, seen[0].shape[-1]).to(logits.dtype))
    assert runs_unobserved(gate.hf_router)


def test_a_global_module_hook_makes_the_router_run() -> None:
    gate = _gate("qwen3_moe")
    x = torch.randn(3, 64)
    called: list[str] = []

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        called.append(type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        gate(x)
    finally:
        handle.remove()
    assert type(gate.hf_router).__name__ in called


def test_a_replaced_or_subclassed_router_forward_runs() -> None:
    gate = _gate("qwen3_moe")
    router = gate.hf_router
    x = torch.randn(3, 64)

    def doubled(hidden_states: Tensor) -> tuple[Tensor, ...]:
        out = type(router).forward(router, hidden_states)
        return (out[0] * 2, *out[1:])

    router.forward = doubled
    assert direct_logits_of(router) is None
    torch.testing.assert_close(gate(x), 2 * type(router).forward(router, x)[0], rtol=0, atol=0)
    del router.forward

    class Wrapped(type(router)):  # type: ignore[misc]
        def forward(self, hidden_states: Tensor) -> tuple[Tensor, ...]:
            out = super().forward(hidden_states)
            return (out[0] + 1, *out[1:])

    plain_forward = type(router).forward
    router.__class__ = Wrapped
    assert direct_logits_of(router) is None
    torch.testing.assert_close(gate(x), plain_forward(router, x)[0] + 1, rtol=0, atol=0)
