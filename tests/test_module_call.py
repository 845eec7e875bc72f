"""flexmoe.module_call: a layer calls its submodules' forward directly only while nothing observes them. Every hook
a user (or FSDP2, or transformers' output recorders) puts on the router, the shared experts, their gate or the
layer itself still runs and still changes what it changes. And flexmoe.autograd_state.autocast_on, the cheaper
question the layer's call asks about autocast, answers as torch does."""

from __future__ import annotations

import torch
from torch import nn

from flexmoe import MoELayer
from flexmoe.module_call import call_module, runs_unobserved


def _layer() -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(16, 4, 8, k=2, glu=True, activation="silu", bias=False, shared_experts=1,
                    shared_gate=True,
                    expert_kernel="grouped_mm").eval()


def _scale_output(factor: float):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * factor
    return hook


def test_call_module_runs_forward_hooks_and_pre_hooks() -> None:
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    assert runs_unobserved(lin)
    torch.testing.assert_close(call_module(lin, x), x @ lin.weight.T + lin.bias, rtol=0, atol=0)
    handle = lin.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    assert not runs_unobserved(lin)
    torch.testing.assert_close(call_module(lin, x), (2 * x) @ lin.weight.T + lin.bias)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(_scale_output(3.0))
    try:
        assert not runs_unobserved(lin)  # a global hook observes every module
        torch.testing.assert_close(call_module(lin, x), 3 * (x @ lin.weight.T + lin.bias))
    finally:
        handle.remove()
    assert runs_unobserved(lin)


def test_hooks_on_the_shared_experts_and_their_gate_still_run() -> None:
    layer = _layer()
    x = torch.randn(10, 16)
    with torch.no_grad():
        routed_only = layer(x) - layer.shared_gate(x, layer.shared(x, [10]))
        # The shared output by hand: sigmoid(x g^T) * (silu(x w1) * (x w3)) w2, the one shared expert's weights.
        s = layer.shared
        by_hand = torch.sigmoid(x @ layer.shared_gate.weight.T) * (
            (torch.nn.functional.silu(x @ s.w1[0]) * (x @ s.w3[0])) @ s.w2[0])
        torch.testing.assert_close(layer(x), routed_only + by_hand)
        calls = []
        h1 = layer.shared.register_forward_hook(lambda m, a, o: calls.append("shared") or o * 2)
        h2 = layer.shared_gate.register_forward_hook(lambda m, a, o: calls.append("gate") or o * 5)
        torch.testing.assert_close(layer(x), routed_only + 10 * by_hand)
        assert calls == ["shared", "gate"]
        h1.remove()
        h2.remove()
        torch.testing.assert_close(layer(x), routed_only + by_hand)


def test_a_hook_on_the_router_sees_and_changes_its_logits() -> None:
    layer = _layer()
    x = torch.randn(10, 16)
    seen = []
    with torch.no_grad():
        layer.router.register_forward_hook(lambda m, a, o: seen.append(o.clone()) or -o)
        layer(x)
        # The plan routes by the hooked (negated) logits: each token's choices are its k lowest plain logits.
        plain = x @ layer.router.weight.T
        torch.testing.assert_close(seen[0], plain)
        lowest = plain.topk(2, dim=-1, largest=False).indices.sort(-1).values
        torch.testing.assert_close(layer.last_plan.expert_index.sort(-1).values, lowest)


def test_autocast_on_answers_as_torch_does_for_the_tensors_device() -> None:
    """autocast_on(t) is torch.is_autocast_enabled(t.device.type), whichever device autocast is on for."""
    from flexmoe.autograd_state import autocast_on

    t = torch.randn(2, 3)
    assert autocast_on(t) is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_on(t) is True and torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", enabled=False):
            assert autocast_on(t) is False
    assert autocast_on(t) is False

