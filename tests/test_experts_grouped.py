"""The experts' compute paths (one grouped GEMM per matrix; one addmm pair per expert, through autograd or with
the hand-written backward of flexmoe.experts.segment_ffn) against a plain row-by-row float64 reference, forward and
gradients: empty experts, all rows on one expert, E=256, views, bf16, activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexmoe.experts import expert_ffn
from flexmoe.experts.row_kernels import (
    active_experts_ffn,
    embedding_bag_ffn,
    grouped_expert_ffn,
    joined_unit_ffn,
    looped_expert_ffn,
    segmented_expert_ffn,
)
from flexmoe.experts.weights import ExpertWeights, gated_unit
from reference import ref_ffn_expert

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
requires_grouped_mm = pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no _grouped_mm")


def _weights(num_experts: int, model_dim: int, hidden: int, *, glu: bool, bias: bool, seed: int = 0,
             ) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()

    return {"w1": r(num_experts, model_dim, hidden), "b1": r(num_experts, hidden) if bias else None,
            "w2": r(num_experts, hidden, model_dim), "b2": r(num_experts, model_dim) if bias else None,
            "w3": r(num_experts, model_dim, hidden) if glu else None,
            "b3": r(num_experts, hidden) if glu and bias else None}


def _reference(rows: torch.Tensor, counts: list[int], weights: dict, glu: bool, glu_limit: float | None,
               ) -> torch.Tensor:
    """Each row through its expert, one row at a time, in float64."""
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    if glu_limit is None:
        one = ref_ffn_expert({k: v for k, v in weights.items() if v is not None}, "silu" if glu else "gelu", glu)
        out = [one(e, rows[i]) for i, e in enumerate(expert_of_row)]
    else:  # GPT-OSS's clamped gated unit, written out
        out = []
        for i, e in enumerate(expert_of_row):
            gate = rows[i] @ weights["w1"][e] + (weights["b1"][e] if weights["b1"] is not None else 0)
            up = rows[i] @ weights["w3"][e] + (weights["b3"][e] if weights["b3"] is not None else 0)
            h = F.silu(torch.minimum(gate, torch.tensor(glu_limit, dtype=gate.dtype))) * (
                torch.clamp(up, -glu_limit, glu_limit) + 1)
            out.append(h @ weights["w2"][e] + (weights["b2"][e] if weights["b2"] is not None else 0))
    model_dim = weights["w2"].shape[-1]
    return torch.stack(out) if out else rows.new_zeros(0, model_dim)


def _ew(w1, b1, w2, b2, w3, b3, activation=F.gelu, glu_limit: float | None = None) -> ExpertWeights:
    return ExpertWeights(w1, b1, w2, b2, w3, b3, activation, glu_limit)


def _run(path, rows: torch.Tensor, counts: list[int], weights: dict, glu: bool, glu_limit: float | None,
         ) -> torch.Tensor:
    act = F.silu if glu else F.gelu
    return path(rows, counts, _ew(*(weights[n] for n in ("w1", "b1", "w2", "b2", "w3", "b3")), act, glu_limit))


# Tolerances of a path in each dtype against the float64 reference (outputs of order 1). bf16: 8-bit significand
# (round-off 2^-9 ~ 2e-3) through two small matmuls and the unit.
TOLERANCES = {torch.float64: {"atol": 1e-12, "rtol": 1e-10}, torch.float32: {"atol": 2e-5, "rtol": 2e-5},
              torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}
# A weight's gradient sums its expert's rows: where the terms cancel, an element much smaller than its terms
# carries their rounding (bf16 inputs and intermediates), which no elementwise relative bound covers. In bf16 the
# gradients are held to this fraction of their tensor's largest element besides (a wrong gradient misses by far
# more); the other dtypes' round-off is too small for cancellation to matter here.
BF16_GRADIENT_SCALE_TOLERANCE = 1e-2


def _gradient_tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict[str, float]:
    tol = dict(TOLERANCES[dtype])
    if dtype == torch.bfloat16 and expected.numel():
        tol["atol"] += BF16_GRADIENT_SCALE_TOLERANCE * float(expected.abs().max())
    return tol


def _check_path(path, dtype: torch.dtype, counts: list[int], *, glu: bool = False, bias: bool = True,
                glu_limit: float | None = None, model_dim: int = 8, hidden: int = 12,
                device: torch.device | str = "cpu") -> None:
    """``path`` in ``dtype`` on ``device`` against the float64 CPU reference: output and every gradient."""
    weights64 = _weights(len(counts), model_dim, hidden, glu=glu, bias=bias)
    gen = torch.Generator().manual_seed(1)
    rows64 = torch.randn(sum(counts), model_dim, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(sum(counts), model_dim, generator=gen, dtype=torch.float64)

    expected = _reference(rows64, counts, weights64, glu, glu_limit)
    names = [n for n, w in weights64.items() if w is not None]
    expected_grads = torch.autograd.grad(expected, [rows64] + [weights64[n] for n in names], grad_out,
                                         allow_unused=True) if expected.numel() else None

    rows = rows64.detach().to(device, dtype).requires_grad_()
    weights = {n: (w.detach().to(device, dtype).requires_grad_() if w is not None else None)
               for n, w in weights64.items()}
    got = _run(path, rows, counts, weights, glu, glu_limit)
    assert got.shape == (sum(counts), model_dim) and got.dtype == dtype and got.device == rows.device
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.to("cpu", torch.float64), expected, **tol)
    if expected_grads is None:
        return
    got_grads = torch.autograd.grad(got, [rows] + [weights[n] for n in names], grad_out.to(device, dtype),
                                    allow_unused=True)
    for name, g, e in zip(["rows"] + names, got_grads, expected_grads):
        e = torch.zeros_like(weights64[name] if name != "rows" else rows64) if e is None else e
        g = torch.zeros_like(e) if g is None else g.to("cpu", torch.float64)
        torch.testing.assert_close(g, e, **_gradient_tolerance(dtype, e),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


# The expert FFN variants every path is checked in: plain with and without biases, gated, gated and clamped.
FFN_VARIANTS = pytest.mark.parametrize("glu,bias,glu_limit", [(False, True, None), (False, False, None),
                                                              (True, True, None), (True, False, 7.0)])

COUNTS = {
    "mixed with empty experts": [3, 0, 5, 1, 0, 2],
    "all rows on one expert": [0, 0, 9, 0],
    "first and last empty": [0, 4, 4, 0],
}


@requires_grouped_mm
@pytest.mark.parametrize("case", list(COUNTS))
@FFN_VARIANTS
def test_grouped_path_matches_the_reference(case: str, glu: bool, bias: bool, glu_limit: float | None,
                                            device: torch.device) -> None:
    """float32 on the CPU (its grouped GEMM's dtype there); bf16 on CUDA, the dtype of CUDA's grouped GEMM."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    _check_path(grouped_expert_ffn, dtype, COUNTS[case], glu=glu, bias=bias, glu_limit=glu_limit,
                model_dim=16, hidden=16, device=device)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(COUNTS))
def test_looped_path_and_expert_ffn_match_the_reference(dtype: torch.dtype, case: str,
                                                        device: torch.device) -> None:
    _check_path(looped_expert_ffn, dtype, COUNTS[case], glu=True, device=device)
    _check_path(expert_ffn, dtype, COUNTS[case], device=device)


def _check_without_autograd(path, dtype: torch.dtype, counts: list[int], *, glu: bool, bias: bool,
                            glu_limit: float | None, model_dim: int = 8, hidden: int = 12,
                            device: torch.device | str = "cpu") -> None:
    weights64 = _weights(len(counts), model_dim, hidden, glu=glu, bias=bias)
    rows64 = torch.randn(sum(counts), model_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = _reference(rows64, counts, weights64, glu, glu_limit)
    with torch.no_grad():
        weights = {n: (w.detach().to(device, dtype) if w is not None else None) for n, w in weights64.items()}
        got = _run(path, rows64.to(device, dtype), counts, weights, glu, glu_limit)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got.to("cpu", torch.float64), expected, **TOLERANCES[dtype])


# The decoding paths: joined_unit_ffn runs each expert's matmuls into its rows of one buffer and the unit once over
# all rows; embedding_bag_ffn runs no matmul, each row's products as weighted sums of its expert's weight rows.
@pytest.mark.parametrize("path", [joined_unit_ffn, active_experts_ffn, looped_expert_ffn, embedding_bag_ffn],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(COUNTS))
@FFN_VARIANTS
def test_path_without_autograd_matches_the_reference(path, dtype: torch.dtype, case: str, glu: bool, bias: bool,
                                                     glu_limit: float | None, device: torch.device) -> None:
    _check_without_autograd(path, dtype, COUNTS[case], glu=glu, bias=bias, glu_limit=glu_limit, device=device)


def test_embedding_bag_path_with_model_dim_unlike_hidden_and_many_experts() -> None:
    """The bags of w1 (model_dim long) and w2 (hidden long) differ; rows of the last of 256 experts."""
    counts = [0] * 256
    counts[0], counts[97], counts[255] = 2, 1, 3
    _check_without_autograd(embedding_bag_ffn, torch.float32, counts, glu=True, bias=True, glu_limit=None,
                            model_dim=24, hidden=40)
    with torch.no_grad(), pytest.raises(ValueError, match="counts must sum"):
        embedding_bag_ffn(torch.zeros(5, 24), counts, _ew(torch.zeros(256, 24, 40), None, torch.zeros(256, 40, 24),
                                                          None, None, None))


@requires_grouped_mm
def test_grouped_path_with_256_experts_many_empty() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (256,), generator=gen).tolist()  # about a third of the experts get no row
    assert 0 in counts
    _check_path(grouped_expert_ffn, torch.float32, counts, model_dim=4, hidden=8)
    _check_path(expert_ffn, torch.float32, counts, model_dim=4, hidden=8)


@requires_grouped_mm
def test_grouped_path_with_no_rows_gives_an_empty_result() -> None:
    weights = _weights(3, 4, 5, glu=False, bias=True)
    weights = {n: w.detach().float() if w is not None else None for n, w in weights.items()}
    out = _run(grouped_expert_ffn, torch.zeros(0, 4), [0, 0, 0], weights, False, None)
    assert out.shape == (0, 4)


@requires_grouped_mm
def test_grouped_and_looped_agree_on_hidden_shards_and_transposed_weights() -> None:
    """Expert parallelism hands ``expert_ffn`` hidden shards (slices) and Tutel's experts pass transposed
    weights: neither is contiguous, both must give the loop's numbers."""
    gen = torch.Generator().manual_seed(4)
    counts = [4, 0, 7]
    rows = torch.randn(11, 8, generator=gen)
    w1_full = torch.randn(3, 12, 8, generator=gen).transpose(1, 2)  # [E, M, H], transposed storage
    w2_full = torch.randn(3, 12, 8, generator=gen)
    b1_full, b2 = torch.randn(3, 12, generator=gen), torch.randn(3, 8, generator=gen)
    w1, w2, b1 = w1_full[:, :, 4:8], w2_full[:, 4:8], b1_full[:, 4:8]  # one hidden shard of three
    args = (rows, counts, _ew(w1, b1, w2, b2, None, None))
    torch.testing.assert_close(grouped_expert_ffn(*args), looped_expert_ffn(*args), atol=1e-5, rtol=1e-5)


def test_gated_unit_is_shared_by_both_paths() -> None:
    gate, up = torch.tensor([[-1.0, 2.0, 9.0]]), torch.tensor([[0.5, -9.0, 9.0]])
    torch.testing.assert_close(gated_unit(gate, up, F.silu, 7.0),
                               F.silu(torch.tensor([[-1.0, 2.0, 7.0]])) * torch.tensor([[1.5, -6.0, 8.0]]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("glu", [False, True])
def test_expert_ffn_without_grad_matches_the_reference(dtype: torch.dtype, glu: bool) -> None:
    """Decoding: a few rows over many experts, no autograd (the loop then visits only experts with rows)."""
    gen = torch.Generator().manual_seed(5)
    counts = [0] * 64
    for e in torch.randperm(64, generator=gen)[:6].tolist():
        counts[e] = 1 + e % 3
    weights64 = _weights(64, 8, 12, glu=glu, bias=True)
    rows64 = torch.randn(sum(counts), 8, generator=gen, dtype=torch.float64)
    expected = _reference(rows64, counts, weights64, glu, None)
    weights = {n: (w.detach().to(dtype) if w is not None else None) for n, w in weights64.items()}
    with torch.no_grad():
        got = _run(expert_ffn, rows64.to(dtype), counts, weights, glu, None)
        one_expert = _run(active_experts_ffn, rows64[:3].to(dtype), [0] * 10 + [3] + [0] * 53, weights, glu, None)
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-5, "rtol": 2e-5}
    torch.testing.assert_close(got.double(), expected, **tol)
    torch.testing.assert_close(one_expert.double(), _reference(rows64[:3], [0] * 10 + [3] + [0] * 53, weights64,
                                                               glu, None), **tol)
    with torch.no_grad(), pytest.raises(ValueError, match="counts must sum"):
        active_experts_ffn(rows64[:2], [3], _ew(*[weights64[n] for n in ("w1", "b1", "w2", "b2", "w3", "b3")]))


# ---- the loop with the hand-written backward (flexmoe.experts.segment_ffn) -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(COUNTS))
@FFN_VARIANTS
def test_segmented_path_matches_the_reference(dtype: torch.dtype, case: str, glu: bool, bias: bool,
                                              glu_limit: float | None, device: torch.device) -> None:
    _check_path(segmented_expert_ffn, dtype, COUNTS[case], glu=glu, bias=bias, glu_limit=glu_limit, device=device)


def test_segmented_path_with_256_experts_and_no_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 3, (256,), generator=gen).tolist()
    _check_path(segmented_expert_ffn, torch.float64, counts, model_dim=4, hidden=8, glu=True)
    _check_path(segmented_expert_ffn, torch.float64, [0, 0, 0], model_dim=4, hidden=8)


def _row_by_row(rows: torch.Tensor, counts: list[int], w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor, act) -> torch.Tensor:
    """Each row through its expert, one row at a time (any activation callable)."""
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    return torch.stack([act(rows[i] @ w1[e] + b1[e]) @ w2[e] + b2[e] for i, e in enumerate(expert_of_row)])


def test_segmented_path_takes_views_and_any_activation() -> None:
    """Expert parallelism passes hidden shards (slices), Hugging Face transposed views; the gradients reach the
    tensors the views were taken from. The activation is any elementwise callable."""
    gen = torch.Generator().manual_seed(4)
    counts = [4, 0, 7]
    rows = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w1_full = torch.randn(3, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)  # stored [E, H, M]
    w2_full = torch.randn(3, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b1_full = torch.randn(3, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    leaves = [rows, w1_full, w2_full, b1_full, b2]

    def act(h: torch.Tensor) -> torch.Tensor:
        return h * torch.tanh(h)

    def views() -> tuple[torch.Tensor, ...]:  # one hidden shard of three, w1 transposed to [E, M, H]
        return w1_full.transpose(1, 2)[:, :, 4:8], b1_full[:, 4:8], w2_full[:, 4:8]

    grad = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    w1, b1, w2 = views()
    expected = _row_by_row(rows, counts, w1, b1, w2, b2, act)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    w1, b1, w2 = views()
    got = segmented_expert_ffn(rows, counts, _ew(w1, b1, w2, b2, None, None, act))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for g, e in zip(torch.autograd.grad(got, leaves, grad), expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_segmented_path_in_bfloat16() -> None:
    counts = [5, 0, 3, 8]
    weights64 = _weights(4, 16, 32, glu=True, bias=True)
    gen = torch.Generator().manual_seed(6)
    rows64 = torch.randn(16, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    expected = _reference(rows64, counts, weights64, True, None)
    names = [n for n, w in weights64.items() if w is not None]
    expected_grads = torch.autograd.grad(expected, [rows64] + [weights64[n] for n in names], grad)
    rows = rows64.detach().bfloat16().requires_grad_()
    weights = {n: (w.detach().bfloat16().requires_grad_() if w is not None else None) for n, w in weights64.items()}
    got = _run(segmented_expert_ffn, rows, counts, weights, True, None)
    assert got.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: errors up to about 1% of the largest entry, as the autograd loop's.
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-2 * float(expected.detach().abs().max()))
    got_grads = torch.autograd.grad(got, [rows] + [weights[n] for n in names], grad.bfloat16())
    for name, g, e in zip(["rows"] + names, got_grads, expected_grads):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.double(), e, rtol=0, atol=1e-2 * float(e.abs().max()), msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_segmented_path_under_activation_checkpointing(use_reentrant: bool) -> None:
    counts = [3, 0, 5, 1]
    weights = _weights(4, 8, 12, glu=True, bias=True)
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    names = [n for n, w in weights.items() if w is not None]
    leaves = [rows] + [weights[n] for n in names]
    expected = _reference(rows, counts, weights, True, None)
    expected_grads = torch.autograd.grad(expected, leaves, grad)

    def run(x: torch.Tensor) -> torch.Tensor:
        return _run(segmented_expert_ffn, x, counts, weights, True, None)

    got = torch.utils.checkpoint.checkpoint(run, rows, use_reentrant=use_reentrant)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    got.backward(grad)
    for leaf, e in zip(leaves, expected_grads):
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad, e, rtol=1e-10, atol=1e-12)


