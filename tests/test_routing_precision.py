"""Routing precision: ``router_dtype=None`` (the router's own precision under autocast), ``ties`` and bf16 logits.

The references are plain torch written here: ``F.linear`` on bf16-rounded operands for what autocast computes,
``torch.topk`` for the tie rule Hugging Face's routers follow, and float32 arithmetic on the bf16 values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe import MoELayer
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import make_plan
from flexmoe.routing.read_free import read_free_plan
from flexmoe.routing.routers import route
from flexmoe.routing.scores import router_scores, select_experts, top_k

M, E, H = 16, 8, 12


def _tied_scores() -> Tensor:
    """``[200, E]`` probabilities with many exact ties (values on a coarse grid, as bf16 logits give)."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 4, (200, E), generator=g).float() / 4


def test_ties_topk_breaks_ties_as_torch_topk_and_lower_by_index() -> None:
    scores = _tied_scores()
    _, ours = top_k(scores, 3, ties="topk")
    assert torch.equal(ours, torch.topk(scores, 3, dim=-1).indices)
    _, lower = top_k(scores, 3)
    # The default: of equal scores the lower index, i.e. a stable descending sort.
    assert torch.equal(lower, torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :3])
    assert not torch.equal(lower, ours), "the case must have ties that the two rules break differently"


class _FixedLogits(nn.Module):
    """A router returning given logits ``[T, E]`` whatever the tokens (the input's shape is recorded)."""

    def __init__(self, logits: Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.shapes.append(tuple(x.shape))
        return self.logits.view(*x.shape[:-1], -1)


def test_layer_with_ties_topk_picks_torch_topk_experts() -> None:
    logits = torch.log(_tied_scores() + 0.1)  # ties in the logits are ties in the softmax
    for ties in ("topk", "lower"):
        moe = MoELayer(M, E, H, k=2, capacity_factor=0.0, router=_FixedLogits(logits), ties=ties, group="single")
        with torch.no_grad():
            moe(torch.randn(200, M))
        expected = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1).indices
        assert torch.equal(moe.last_plan.expert_index, expected) == (ties == "topk")
    with pytest.raises(ValueError, match="ties must be 'lower' or 'topk'"):
        MoELayer(M, E, H, ties="first")


def test_router_dtype_none_routes_in_the_callers_autocast() -> None:
    torch.manual_seed(0)
    moe = MoELayer(M, E, H, k=2, capacity_factor=0.0, router_dtype=None, group="single")
    x = torch.randn(64, M)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = route(moe.router, x, dtype=None)
        in_float32 = route(moe.router, x, dtype=torch.float32)
    # What autocast computes: the linear map on bf16-rounded operands, a bf16 result.
    expected = F.linear(x.bfloat16(), moe.router.weight.bfloat16())
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)
    assert in_float32.dtype == torch.float32
    torch.testing.assert_close(in_float32, F.linear(x, moe.router.weight), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="router_dtype must be a floating dtype or None"):
        MoELayer(M, E, H, router_dtype=torch.int32)


def test_bf16_logits_take_a_float32_softmax_and_give_bf16_weights() -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(300, E, generator=g) * 2).bfloat16()
    scores = router_scores(logits)
    reference = torch.softmax(logits.float(), dim=-1)
    assert scores.dtype == torch.float32 and torch.equal(scores, reference)
    plan = make_plan(logits, 2, capacity_factor=0.0, normalize_weights=True)
    top = torch.topk(reference, 2, dim=-1)
    assert torch.equal(plan.expert_index, top.indices)
    assert plan.weight.dtype == torch.bfloat16
    assert torch.equal(plan.weight, (top.values / top.values.sum(dim=-1, keepdim=True)).bfloat16())


def test_selection_bias_is_added_in_the_wider_dtype() -> None:
    """DeepSeek-V3 under autocast adds its float32 correction bias to bf16 sigmoid scores: a float32 sum."""
    g = torch.Generator().manual_seed(2)
    scores = torch.sigmoid(torch.randn(300, E, generator=g)).bfloat16()
    bias = torch.randn(E, generator=g) * 1e-3  # below bf16's spacing near 0.5: lost if added in bf16
    index, choice = select_experts(scores, 2, selection_bias=bias)
    assert choice.dtype == torch.float32 and torch.equal(choice, scores.float() + bias)
    assert torch.equal(index, torch.sort(scores.float() + bias, dim=-1, descending=True, stable=True).indices[:, :2])


def test_a_router_routing_per_sequence_sees_the_sequences() -> None:
    router = _FixedLogits(torch.randn(2 * 6, E))
    for options in (dict(capacity_per="sequence", capacity=2), dict(aux_loss_type="sequence")):
        moe = MoELayer(M, E, H, k=1, router=router, group="single", **options)
        with torch.no_grad():
            moe(torch.randn(2, 6, M))
        assert router.shapes[-1] == (2, 6, M)
    moe = MoELayer(M, E, H, k=1, router=router, group="single")
    with torch.no_grad():
        moe(torch.randn(2, 6, M))
    assert router.shapes[-1] == (12, M)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("ties", ["lower", "topk"])
def test_select_by_logits_orders_experts_whose_scores_are_equal(ties: str, score_func: str) -> None:
    """select_by="logits" ranks the logits (GPT-OSS's router): where distinct logits give equal scores (a softmax
    underflowing to 0, a sigmoid rounding to 1), the experts still come in the logits' order, on every path (the
    eager plan, the read-free plan in training and without autograd, the plan-free decoding call); ranking the
    scores takes the equal ones by the tie rule."""
    if score_func == "softmax":
        row = torch.tensor([0.0, -400.0, -300.0, -200.0, -350.0, -250.0, -450.0, -150.0])
        tied = torch.softmax(row, -1)[1:]  # every other score underflowed to 0
        want_weight = [1.0, 0.0, 0.0, 0.0]
    else:
        row = torch.tensor([45.0, 20.0, 30.0, 40.0, 25.0, 35.0, 0.0, 50.0])
        tied = torch.sigmoid(row)[torch.tensor([0, 1, 2, 3, 4, 5, 7])]  # all rounded to 1.0
        want_weight = [0.25] * 4
    k = 4
    assert bool((tied == tied[0]).all())  # the case: distinct logits, equal scores
    want = sorted(range(E), key=lambda e: -float(row[e]))[:k]
    for num_tokens in (1, 64):
        logits = row.repeat(num_tokens, 1)
        plan = make_plan(logits, k, capacity_factor=0.0, ties=ties, select_by="logits", score_func=score_func)
        assert plan.expert_index.tolist() == [want] * num_tokens
        for kernel in ("auto", "grouped_mm"):
            for grad in (False, True):
                moe = MoELayer(M, E, H, k=k, capacity_factor=0.0, router=_FixedLogits(logits), ties=ties,
                               select_by="logits", score_func=score_func, expert_kernel=kernel, group="single")
                with torch.set_grad_enabled(grad):
                    y = moe(torch.randn(num_tokens, M))
                assert moe.last_plan.expert_index.tolist() == [want] * num_tokens, (kernel, grad, num_tokens)
                assert moe.last_plan.weight.tolist() == [want_weight] * num_tokens
                assert bool(torch.isfinite(y).all())
    by_scores = make_plan(row.repeat(3, 1), k, capacity_factor=0.0, score_func=score_func).expert_index.tolist()
    assert by_scores != [want] * 3


def test_select_by_is_checked_against_the_options_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="select_by must be 'scores' or 'logits', got 'probs'"):
        MoELayer(M, E, H, select_by="probs")
    with pytest.raises(ValueError, match="select_by='logits' cannot be combined with balance='bias'"):
        MoELayer(M, E, H, select_by="logits", balance="bias")
    with pytest.raises(ValueError, match="select_by='logits' cannot be combined with num_expert_groups"):
        MoELayer(M, E, H, select_by="logits", score_func="sigmoid", num_expert_groups=4, num_limited_groups=2)
    with pytest.raises(ValueError, match="select_by='logits' needs a top-k router"):
        MoELayer(M, E, H, select_by="logits", router="expert_choice")
    with pytest.raises(ValueError, match="select_by='logits' cannot be combined with balance='bias'"):
        make_plan(torch.randn(4, E), 2, capacity_factor=0.0, select_by="logits", selection_bias=torch.zeros(E))
    with pytest.raises(ValueError, match="select_by='logits' cannot be combined with balance='bias'"):
        read_free_plan(torch.randn(4, E), RoutingOptions(k=2, capacity_factor=0.0, select_by="logits"),
                       selection_bias=torch.zeros(E))
