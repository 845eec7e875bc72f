"""flexmoe::padded_fused_experts called directly (no compiling), forward and backward, against a float64
reference written with loops: a padded layout of several sequences per expert, units without rows, an expert
without any, padding rows whose tokens and weights hold garbage (NaN weights) that must reach neither the output
nor any gradient, tokens with no row; the named activations and the gated unit; the packed layout of a dropless
plan. And the rule that picks it."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import Tensor

from devices import on_cpu64
from flexmoe import MoELayer
from flexmoe.experts.padded_fused_op import padded_chunks, use_padded_fused
from flexmoe.experts.padded_op import PACKED, padded_op_available
from flexmoe.routing.build import build_plan
from reference import assert_expert_grads, randn64, random_expert_params, ref_activation, ref_layout_split

pytestmark = pytest.mark.skipif(not padded_op_available(), reason="this torch has no torch.library.custom_op")

CAPACITY = 4
# 3 experts x 2 sequences: expert 0 a full unit and an empty one, expert 1 two partial units, expert 2 none.
UNIT_ROWS = [4, 0, 2, 3, 0, 0]
NUM_EXPERTS, NUM_TOKENS, MODEL_DIM, HIDDEN = 3, 6, 5, 7
# Packed (dropless, compiled): one unit per expert, back to back; expert 0 has one row, expert 2 none.
LAYOUTS = {"padded": (UNIT_ROWS, CAPACITY), "packed": ([1, 5, 0], PACKED)}

CASES = {
    "gelu bias": dict(activation="gelu", glu=False, bias=True),
    "relu no bias": dict(activation="relu", glu=False, bias=False),
    "glu silu bias": dict(activation="silu", glu=True, bias=True),
    "glu gelu no bias": dict(activation="gelu", glu=True, bias=False),
}


def test_padded_chunks_are_the_units_with_rows() -> None:
    assert padded_chunks(UNIT_ROWS, CAPACITY, NUM_EXPERTS) == [(0, 4, [(0, 0, 4)]), (8, 2, [(1, 0, 2)]),
                                                                (12, 3, [(1, 0, 3)])]
    assert padded_chunks([1, 5, 0], PACKED, NUM_EXPERTS) == [(0, 1, [(0, 0, 1)]), (1, 5, [(1, 0, 5)])]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_the_reference_and_never_reads_padding(case: str, dtype: torch.dtype, layout: str,
                                                          device: torch.device) -> None:
    activation, glu, bias = CASES[case]["activation"], CASES[case]["glu"], CASES[case]["bias"]
    gen = torch.Generator().manual_seed(0)
    r = partial(randn64, gen)
    p64 = random_expert_params(gen, NUM_EXPERTS, MODEL_DIM, HIDDEN, glu=glu, bias=bias)
    unit_rows, capacity = LAYOUTS[layout]
    num_rows, expert_of, real, padding = ref_layout_split(unit_rows, capacity, NUM_EXPERTS)
    assert bool(padding) == (layout == "padded")
    row_token = torch.randint(0, NUM_TOKENS - 1, (num_rows,), generator=gen)  # the last token gets no row
    row_weight64 = r(num_rows)
    row_weight64[padding] = float("nan")
    tokens64, grad64 = r(NUM_TOKENS, MODEL_DIM), r(NUM_TOKENS, MODEL_DIM)
    act = ref_activation(activation)

    # Reference: y[t] = sum over the real rows r of token t of w_r * expert_e(r)(x_t), float64 autograd.
    ref_p = {n: t.clone().requires_grad_() if t is not None else None for n, t in p64.items()}
    ref_tokens, ref_weight = tokens64.clone().requires_grad_(), row_weight64.clone().requires_grad_()
    ref_y = [torch.zeros(MODEL_DIM, dtype=torch.float64) for _ in range(NUM_TOKENS)]
    for i in real:
        e, t = expert_of[i], int(row_token[i])
        x = ref_tokens[t]
        w1, w2, w3 = ref_p["w1"], ref_p["w2"], ref_p["w3"]
        assert w1 is not None and w2 is not None
        pre1 = x @ w1[e] + (ref_p["b1"][e] if ref_p["b1"] is not None else 0)
        h = act(pre1)
        if w3 is not None:
            h = h * (x @ w3[e] + (ref_p["b3"][e] if ref_p["b3"] is not None else 0))
        out = h @ w2[e] + (ref_p["b2"][e] if ref_p["b2"] is not None else 0)
        ref_y[t] = ref_y[t] + ref_weight[i] * out
    want = torch.stack(ref_y)
    (want * grad64).sum().backward()

    got_p = {n: t.to(device, dtype).requires_grad_() if t is not None else None for n, t in p64.items()}
    got_tokens = tokens64.to(device, dtype).requires_grad_()
    got_weight = row_weight64.to(device, dtype).requires_grad_()
    y, pre1, pre3, h = torch.ops.flexmoe.padded_fused_experts(
        got_tokens, row_token.to(device), got_weight, torch.tensor(unit_rows, device=device), capacity,
        got_p["w1"], got_p["b1"], got_p["w2"], got_p["b2"], got_p["w3"], got_p["b3"], activation)
    pieces = len(unit_rows) if layout == "padded" else 1  # packed: one [N, H] piece
    assert len(pre1) == len(h) == pieces and len(pre3) == (pieces if glu else 0)
    assert y.requires_grad and not any(t.requires_grad for t in [*pre1, *pre3, *h])  # saved for backward only
    y.backward(grad64.to(device, dtype))

    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    y = on_cpu64(y)
    torch.testing.assert_close(y, want.detach(), **tol)
    assert torch.equal(y[-1], torch.zeros(MODEL_DIM, dtype=torch.float64))  # the token without a row
    assert got_tokens.grad is not None and ref_tokens.grad is not None
    torch.testing.assert_close(on_cpu64(got_tokens.grad), ref_tokens.grad, **tol)
    assert got_weight.grad is not None and ref_weight.grad is not None
    weight_grad = on_cpu64(got_weight.grad)
    assert torch.equal(weight_grad[padding], torch.zeros(len(padding), dtype=torch.float64))
    torch.testing.assert_close(weight_grad[real], ref_weight.grad[real], **tol)
    assert_expert_grads(got_p, ref_p, idle_expert=2, **tol)


def _padded_plan(moe: MoELayer, x: Tensor):
    logits = moe.router(x)
    return build_plan(logits, moe.routing_options, training=True, padded=True)


def test_rule_takes_fine_grained_float32_training_only() -> None:
    torch.manual_seed(0)
    fine = MoELayer(512, 64, 256, k=8, capacity_factor=1.25)
    x = torch.randn(4096, 512)
    plan = _padded_plan(fine, x)
    assert use_padded_fused(x.requires_grad_(), plan, fine.experts.weights())  # the bench's E=64 shape: measured faster
    with torch.no_grad():
        assert not use_padded_fused(x, plan, fine.experts.weights())  # no autograd: not measured
    coarse = MoELayer(512, 8, 1024, k=2, capacity_factor=1.25)
    assert not use_padded_fused(x, _padded_plan(coarse, x), coarse.experts.weights())  # E=8 H=1024: few large experts
    small = MoELayer(128, 64, 256, k=8, capacity_factor=1.25)
    y = torch.randn(512, 128, requires_grad=True)
    assert not use_padded_fused(y, _padded_plan(small, y), small.experts.weights())  # a small block
    clamped = MoELayer(512, 64, 256, k=8, capacity_factor=1.25, glu=True, activation="silu", glu_limit=7.0)
    assert not use_padded_fused(x, _padded_plan(clamped, x), clamped.experts.weights())  # GPT-OSS's clamp: three stages
    custom = MoELayer(512, 64, 256, k=8, capacity_factor=1.25, activation=torch.tanh)
    assert not use_padded_fused(x, _padded_plan(custom, x), custom.experts.weights())  # not a named activation
