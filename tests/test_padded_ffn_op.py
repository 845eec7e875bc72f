"""flexmoe::padded_experts called directly (no compiling), forward and backward, against a row-by-row float64
reference: a padded layout of several sequences per expert (an expert's weight gradients summed over its
units), units without rows, an expert without any, padding rows holding garbage that must not leak into the
output or the gradients, every named activation and the gated units; and the packed layout of a dropless plan
(an expert with one row, one without)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import Tensor

from devices import on_cpu64
from flexmoe.experts.padded_op import PACKED, padded_op_available, padded_segments, padding_ranges
from reference import assert_expert_grads, randn64, random_expert_params, ref_activation, ref_layout_split

pytestmark = pytest.mark.skipif(not padded_op_available(), reason="this torch has no torch.library.custom_op")

CAPACITY = 4
# 3 experts x 2 sequences: expert 0 has a full unit and an empty one, expert 1 two partial units, expert 2 none.
UNIT_ROWS = [4, 0, 2, 3, 0, 0]
NUM_EXPERTS, MODEL_DIM, HIDDEN = 3, 5, 7
# Packed (dropless, compiled): one unit per expert, back to back; expert 0 has one row, expert 2 none.
LAYOUTS = {"padded": (UNIT_ROWS, CAPACITY), "packed": ([1, 5, 0], PACKED)}


def test_padding_ranges_lists_the_rows_after_each_units_real_rows_merged() -> None:
    assert padding_ranges(UNIT_ROWS, CAPACITY) == [(4, 8), (10, 12), (15, 24)]
    assert padding_ranges([4, 4], 4) == []
    assert padding_ranges([0, 0], 3) == [(0, 6)]
    assert padding_ranges([1, 3, 0], 3) == [(1, 3), (6, 9)]
    assert padding_ranges([1, 5, 0], PACKED) == []


def test_packed_segments_follow_each_other() -> None:
    assert padded_segments([1, 5, 0, 2], PACKED, 4) == [(0, 0, 1), (1, 1, 5), (3, 6, 2)]
    assert padded_segments(UNIT_ROWS, CAPACITY, NUM_EXPERTS) == [(0, 0, 4), (1, 8, 2), (1, 12, 3)]


def _reference_row(x: Tensor, e: int, p: dict[str, Tensor | None], activation: str, glu: bool,
                   glu_limit: float | None) -> Tensor:
    """Expert e on one row, written out: act(x w1 + b1) [gated by x w3 + b3] w2 + b2."""
    def linear(w: str, b: str) -> Tensor:
        weight, bias = p[w], p[b]
        assert weight is not None
        out = x @ weight[e]
        return out + bias[e] if bias is not None else out

    act = ref_activation(activation)
    gate = linear("w1", "b1")
    if not glu:
        h = act(gate)
    elif glu_limit is None:
        h = act(gate) * linear("w3", "b3")
    else:
        up = linear("w3", "b3")
        h = act(torch.where(gate > glu_limit, torch.full_like(gate, glu_limit), gate)) * (
            torch.where(up.abs() > glu_limit, torch.sign(up) * glu_limit, up) + 1)
    return linear_out(h, e, p)


def linear_out(h: Tensor, e: int, p: dict[str, Tensor | None]) -> Tensor:
    w2, b2 = p["w2"], p["b2"]
    assert w2 is not None
    return h @ w2[e] + (b2[e] if b2 is not None else 0)


CASES = {
    "gelu bias": dict(activation="gelu", glu=False, bias=True, glu_limit=None),
    "relu no bias": dict(activation="relu", glu=False, bias=False, glu_limit=None),
    "silu bias": dict(activation="silu", glu=False, bias=True, glu_limit=None),
    "glu silu bias": dict(activation="silu", glu=True, bias=True, glu_limit=None),
    "glu silu clamped, no bias": dict(activation="silu", glu=True, bias=False, glu_limit=0.4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_op_computes_real_rows_only_and_matches_the_reference(case: str, dtype: torch.dtype, layout: str,
                                                              device: torch.device) -> None:
    options = CASES[case]
    activation, glu, bias, glu_limit = (options["activation"], options["glu"], options["bias"],
                                        options["glu_limit"])
    gen = torch.Generator().manual_seed(0)
    r = partial(randn64, gen)
    p64 = random_expert_params(gen, NUM_EXPERTS, MODEL_DIM, HIDDEN, glu=glu, bias=bias)
    unit_rows, capacity = LAYOUTS[layout]
    num_rows, expert_of, real, padding = ref_layout_split(unit_rows, capacity, NUM_EXPERTS)
    rows64, grad64 = r(num_rows, MODEL_DIM), r(num_rows, MODEL_DIM)
    assert bool(padding) == (layout == "padded")
    rows64[padding] = float("nan")  # never read: neither the output nor any gradient may see it

    # Reference: each real row through its expert, float64 autograd.
    ref_p = {n: t.clone().requires_grad_() if t is not None else None for n, t in p64.items()}
    ref_rows = rows64.clone().requires_grad_()
    ref_out = {i: _reference_row(ref_rows[i], expert_of[i], ref_p, activation, glu, glu_limit) for i in real}
    torch.stack([ref_out[i] for i in real]).mul(grad64[real]).sum().backward()

    got_p = {n: t.to(device, dtype).requires_grad_() if t is not None else None for n, t in p64.items()}
    got_rows = rows64.to(device, dtype).requires_grad_()
    out, *saved = torch.ops.flexmoe.padded_experts(
        got_rows, torch.tensor(unit_rows, device=device), capacity, got_p["w1"], got_p["b1"], got_p["w2"], got_p["b2"],
        got_p["w3"], got_p["b3"], activation, glu_limit)
    # The pre-activations and the unit's output only ride along for the backward: no gradient flows into them.
    # Padded: one [capacity, H] piece per unit each (pre3: none without gating); packed: one [N, H] piece.
    pre1, pre3, h = saved
    pieces, piece_rows = (len(unit_rows), capacity) if layout == "padded" else (1, num_rows)
    assert len(pre1) == len(h) == pieces and len(pre3) == (pieces if glu else 0)
    assert all(t.shape == (piece_rows, HIDDEN) for t in [*pre1, *pre3, *h])
    assert out.requires_grad and not any(t.requires_grad for t in [*pre1, *pre3, *h])
    out.backward(grad64.to(device, dtype))

    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    out, got_grad = on_cpu64(out), on_cpu64(got_rows.grad)
    assert torch.equal(out[padding], torch.zeros(len(padding), MODEL_DIM, dtype=torch.float64))
    torch.testing.assert_close(out[real], torch.stack([ref_out[i] for i in real]).detach(), **tol)
    assert ref_rows.grad is not None
    assert torch.equal(got_grad[padding], torch.zeros(len(padding), MODEL_DIM, dtype=torch.float64))
    torch.testing.assert_close(got_grad[real], ref_rows.grad[real], **tol)
    assert_expert_grads(got_p, ref_p, idle_expert=2, **tol)
