"""flexmoe::grouped_linear (flexmoe.grouped_linear_op) against a plain per-row loop written here, and torch's own
custom-op checks (schema, fake, autograd registration)."""

from __future__ import annotations

import pytest
import torch

from flexmoe.grouped_linear_op import device_offsets_linear, grouped_linear, uses_device_offsets
from flexmoe.padded_ffn_op import padded_op_available

pytestmark = pytest.mark.skipif(not padded_op_available(), reason="needs torch.library.custom_op (torch >= 2.4)")


def _loop(rows: torch.Tensor, counts: list[int], w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Row r of expert e: rows[r] @ w[e] + b[e]; rows past the counted ones: zeros."""
    out, r = [], 0
    for e, n in enumerate(counts):
        for _ in range(n):
            out.append(rows[r] @ w[e] + (b[e] if b is not None else 0))
            r += 1
    out += [rows.new_zeros(w.shape[-1])] * (rows.shape[0] - r)
    return torch.stack(out)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_equals_a_row_loop_forward_and_backward(bias: bool) -> None:
    """Experts with no rows (zero weight gradients) and two uncounted rows at the end (zero output, zero gradient)."""
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0]
    rows = torch.randn(11, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    grad = torch.randn(11, 6, dtype=torch.float64, generator=g)
    leaves = [t for t in (rows, w, b) if t is not None]
    got = grouped_linear(rows, torch.tensor(counts), w, b)
    got_grads = torch.autograd.grad(got, leaves, grad)
    want = _loop(rows, counts, w, b)
    want_grads = torch.autograd.grad(want, leaves, grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got_g, want_g in zip(got_grads, want_grads):
        torch.testing.assert_close(got_g, want_g, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got_grads[1][[1, 4]]) == 0 and torch.count_nonzero(got_grads[0][9:]) == 0


def test_grouped_linear_passes_torch_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(7, 3, generator=g, requires_grad=True), torch.tensor([2, 0, 5]),
            torch.randn(3, 3, 4, generator=g, requires_grad=True), torch.randn(3, 4, generator=g, requires_grad=True))
    torch.library.opcheck(torch.ops.flexmoe.grouped_linear.default, args)


@pytest.mark.parametrize("bias", [True, False])
def test_the_device_offsets_path_compiles_whole_and_equals_a_row_loop(bias: bool) -> None:
    """The GPU's path (torch._grouped_mm, row ends on the device), run here in bf16 on the CPU and compiled with
    fullgraph=True (a host read would break the graph): values and gradients against the float64 row loop."""
    g = torch.Generator().manual_seed(2)
    counts = [3, 0, 5, 2]
    rows = torch.randn(10, 16, dtype=torch.float64, generator=g)
    w = torch.randn(4, 16, 8, dtype=torch.float64, generator=g) / 4
    b = torch.randn(4, 8, dtype=torch.float64, generator=g) if bias else None
    grad = torch.randn(10, 8, dtype=torch.float64, generator=g)
    low = [t.to(torch.bfloat16).requires_grad_() if t is not None else None for t in (rows, w, b)]
    compiled = torch.compile(device_offsets_linear, fullgraph=True, backend="aot_eager")
    got = compiled(low[0], torch.tensor(counts), low[1], low[2])
    leaves = [t for t in low if t is not None]
    got_grads = torch.autograd.grad(got, leaves, grad.to(torch.bfloat16))
    exact = [t.to(torch.bfloat16).double().requires_grad_() if t is not None else None for t in (rows, w, b)]
    want = _loop(exact[0], counts, exact[1], exact[2])
    want_grads = torch.autograd.grad(want, [t for t in exact if t is not None], grad.to(torch.bfloat16).double())
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    for got_g, want_g in zip(got_grads, want_grads):
        torch.testing.assert_close(got_g.double(), want_g, rtol=2e-2, atol=5e-2)


def test_only_bf16_off_the_cpu_with_aligned_sizes_takes_the_device_offsets_path() -> None:
    assert uses_device_offsets("cuda", torch.bfloat16, (8, 64, 128))
    assert not uses_device_offsets("cpu", torch.bfloat16, (8, 64, 128))  # the custom op, faster here
    assert not uses_device_offsets("cuda", torch.float32, (8, 64, 128))
    assert not uses_device_offsets("cuda", torch.bfloat16, (8, 60, 128))  # 60 bf16 values: not 16-byte aligned
