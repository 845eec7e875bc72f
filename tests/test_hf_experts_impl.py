"""The ``"flexmoe"`` experts implementation on HF's stored expert layouts, against HF eager.

:func:`flexmoe.hf.experts_impl.flexmoe_experts_forward` computes on HF's tensors as stored: one fused gate/up
matmul per expert under autograd, and without autograd the grouped GEMM or the loop over the active experts
(:func:`flexmoe.experts.use_grouped_mm`). Each path and each layout (gate/up halves concatenated as Mixtral, or
interleaved and transposed with biases as GPT-OSS, and a non-gated unit) must give HF eager's output and
gradients. The reference is HF's own eager experts forward, or for the non-gated module a dense loop over tokens
and choices written here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="flexmoe.hf needs transformers (CI installs it via .[test])")

from flexmoe.apps.bench.hf import HFShape, build_hf_block  # noqa: E402
from flexmoe.hf.experts_impl import flexmoe_experts_forward  # noqa: E402

# H = 128 >= the grouped GEMM's smallest hidden size, float32 and 16-byte strides: without autograd, with most
# experts active, flexmoe runs the grouped GEMM; with one token (2 of 8 experts) the loop over active experts.
SHAPE = HFShape("test", tokens=24, model_dim=32, experts=8, k=2, hidden_dim=128)


def _choices(tokens: int, seed: int, among: int = SHAPE.experts) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token among the first ``among``, and positive weights: ``[T, k]`` long and
    float."""
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(among, generator=g)[: SHAPE.k] for _ in range(tokens)])
    return index, torch.rand(tokens, SHAPE.k, generator=g) + 0.1


def _run(experts: nn.Module, implementation: str, x: torch.Tensor, index: torch.Tensor,
         weight: torch.Tensor) -> torch.Tensor:
    experts.config._experts_implementation = implementation
    if implementation == "flexmoe":
        return flexmoe_experts_forward(experts, x, index, weight)
    return experts(x, index, weight)


def _with_grads(experts: nn.Module, implementation: str, x: torch.Tensor, index: torch.Tensor,
                weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and the gradients of the experts' parameters, the input and the combine weights."""
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    out = _run(experts, implementation, x, index, weight)
    out.backward(grad)
    grads = {name: p.grad for name, p in experts.named_parameters()}
    grads.update(x=x.grad, weight=weight.grad)
    return out.detach(), grads


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=what)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_training_gives_hf_eager_output_and_gradients(family: str, one_thread: None) -> None:
    experts: Any = build_hf_block(family, SHAPE).experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE.tokens, SHAPE.model_dim, generator=g)
    grad = torch.randn(x.shape, generator=g)
    index, weight = _choices(SHAPE.tokens, seed=6, among=SHAPE.experts - 1)  # the last expert gets no rows
    want_out, want = _with_grads(experts, "eager", x, index, weight, grad)
    got_out, got = _with_grads(experts, "flexmoe", x, index, weight, grad)
    _assert_close(got_out, want_out, "output")
    assert set(got) == set(want)
    for name in want:
        assert got[name] is not None, name
        _assert_close(got[name], want[name], name)
        if name != "x" and name != "weight":  # the parameters' gradients keep their own layout
            assert got[name].stride() == dict(experts.named_parameters())[name].stride(), name


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("tokens", [SHAPE.tokens, 1])
def test_inference_gives_hf_eager_output(family: str, tokens: int, one_thread: None) -> None:
    experts: Any = build_hf_block(family, SHAPE).experts
    x = torch.randn(tokens, SHAPE.model_dim, generator=torch.Generator().manual_seed(7))
    index, weight = _choices(tokens, seed=8)
    with torch.no_grad():
        want = _run(experts, "eager", x, index, weight)
        got = _run(experts, "flexmoe", x, index, weight)
    _assert_close(got, want, "output")


class _PlainConfig:
    """The little of a config HF's experts decorator and flexmoe read."""

    _experts_implementation = "eager"
    hidden_act = "relu"


def _plain_experts_class() -> type[nn.Module]:
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_bias=True)
    class PlainExperts(nn.Module):
        """Non-gated experts with biases, ``up_proj [E, H, M]``, ``down_proj [E, M, H]``; the forward is the
        reference, a dense loop over tokens and choices."""

        def __init__(self, config: Any) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(9)
            E, M, H = SHAPE.experts, SHAPE.model_dim, SHAPE.hidden_dim
            self.num_experts = E
            self.up_proj = nn.Parameter(torch.randn(E, H, M, generator=g) / M**0.5)
            self.up_proj_bias = nn.Parameter(torch.randn(E, H, generator=g) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(E, M, H, generator=g) / H**0.5)
            self.down_proj_bias = nn.Parameter(torch.randn(E, M, generator=g) * 0.1)
            self.act_fn = nn.ReLU()

        def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            rows = []
            for t in range(x.shape[0]):
                y = torch.zeros(x.shape[1])
                for j in range(index.shape[1]):
                    e = int(index[t, j])
                    h = torch.relu(self.up_proj[e] @ x[t] + self.up_proj_bias[e])
                    y = y + weight[t, j] * (self.down_proj[e] @ h + self.down_proj_bias[e])
                rows.append(y)
            return torch.stack(rows)

    return PlainExperts


def test_non_gated_experts_with_biases_match_a_dense_loop(one_thread: None) -> None:
    experts: Any = _plain_experts_class()(_PlainConfig())
    g = torch.Generator().manual_seed(10)
    x = torch.randn(SHAPE.tokens, SHAPE.model_dim, generator=g)
    grad = torch.randn(x.shape, generator=g)
    index, weight = _choices(SHAPE.tokens, seed=11)
    want_out, want = _with_grads(experts, "eager", x, index, weight, grad)
    got_out, got = _with_grads(experts, "flexmoe", x, index, weight, grad)
    _assert_close(got_out, want_out, "output")
    for name in want:
        _assert_close(got[name], want[name], name)
    with torch.no_grad():
        for tokens in (SHAPE.tokens, 1):  # the grouped GEMM, then the loop over the active experts
            _assert_close(_run(experts, "flexmoe", x[:tokens], index[:tokens], weight[:tokens]),
                          _run(experts, "eager", x[:tokens], index[:tokens], weight[:tokens]), f"no grad, {tokens}")


def test_a_gpt_oss_look_alike_is_known_by_its_unit_not_its_class_name(one_thread: None) -> None:
    """Recognition reads what the module computes, the function its ``_apply_gate`` resolves to, with what it
    holds (``alpha``, ``limit``, the layout flags): a class named ``GptOssExperts`` holding GPT-OSS's attributes
    and layout but with another gated unit is refused, never computed as GPT-OSS's."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_concatenated=False, is_transposed=True, has_bias=True)
    class GptOssExperts(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            E, M, H = 4, 6, 5
            self.num_experts = E
            self.gate_up_proj = nn.Parameter(torch.randn(E, M, 2 * H))
            self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * H))
            self.down_proj = nn.Parameter(torch.randn(E, H, M))
            self.down_proj_bias = nn.Parameter(torch.randn(E, M))
            self.alpha, self.limit = 1.702, 7.0

        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:  # no clamp, no sigmoid
            return gate_up[..., ::2] * gate_up[..., 1::2]

    experts: Any = GptOssExperts(_PlainConfig())
    index = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="GptOssExperts has its own gated unit"):
        flexmoe_experts_forward(experts, torch.randn(2, 6), index, torch.full((2, 2), 0.5))
