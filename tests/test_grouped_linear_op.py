"""flexmoe::grouped_linear (flexmoe.experts.grouped_op) against a plain per-row loop written here, and torch's own
custom-op checks (schema, fake, autograd registration)."""

from __future__ import annotations

import pytest
import torch

from devices import on_cpu64
from flexmoe.experts.grouped_op import device_offsets_linear, grouped_linear, uses_device_offsets
from flexmoe.experts.padded_op import padded_op_available

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
def test_grouped_linear_equals_a_row_loop_forward_and_backward(bias: bool, device: torch.device) -> None:
    """Experts with no rows (zero weight gradients) and two uncounted rows at the end (zero output, zero gradient).
    The op runs in float64 on ``device``, the loop on the CPU."""
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0]
    rows = torch.randn(11, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    grad = torch.randn(11, 6, dtype=torch.float64, generator=g)
    leaves = [t for t in (rows, w, b) if t is not None]
    on_device = [t.detach().to(device).requires_grad_() for t in leaves]
    got = grouped_linear(on_device[0], torch.tensor(counts, device=device), on_device[1],
                         on_device[2] if bias else None)
    got_grads = [on_cpu64(t) for t in torch.autograd.grad(got, on_device, grad.to(device))]
    want = _loop(rows, counts, w, b)
    want_grads = torch.autograd.grad(want, leaves, grad)
    torch.testing.assert_close(on_cpu64(got), want.detach(), rtol=1e-12, atol=1e-12)
    for got_g, want_g in zip(got_grads, want_grads):
        torch.testing.assert_close(got_g, want_g, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got_grads[1][[1, 4]]) == 0 and torch.count_nonzero(got_grads[0][9:]) == 0


def test_grouped_linear_passes_torch_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(7, 3, generator=g, requires_grad=True), torch.tensor([2, 0, 5]),
            torch.randn(3, 3, 4, generator=g, requires_grad=True), torch.randn(3, 4, generator=g, requires_grad=True))
    torch.library.opcheck(torch.ops.flexmoe.grouped_linear.default, args)


@pytest.mark.parametrize("bias", [True, False])
def test_the_device_offsets_path_compiles_whole_and_equals_a_row_loop(bias: bool, device: torch.device) -> None:
    """The GPU's path (torch._grouped_mm, row ends on the device), in bf16 on ``device`` (also on the CPU, where
    the layer does not take it) and compiled with fullgraph=True (a host read would break the graph): values and
    gradients against the float64 row loop on the CPU."""
    g = torch.Generator().manual_seed(2)
    counts = [3, 0, 5, 2]
    rows = torch.randn(10, 16, dtype=torch.float64, generator=g)
    w = torch.randn(4, 16, 8, dtype=torch.float64, generator=g) / 4
    b = torch.randn(4, 8, dtype=torch.float64, generator=g) if bias else None
    grad = torch.randn(10, 8, dtype=torch.float64, generator=g)
    low = [t.to(device, torch.bfloat16).requires_grad_() if t is not None else None for t in (rows, w, b)]
    compiled = torch.compile(device_offsets_linear, fullgraph=True, backend="aot_eager")
    got = compiled(low[0], torch.tensor(counts, device=device), low[1], low[2])
    leaves = [t for t in low if t is not None]
    got_grads = [on_cpu64(t) for t in torch.autograd.grad(got, leaves, grad.to(device, torch.bfloat16))]
    exact = [t.to(torch.bfloat16).double().requires_grad_() if t is not None else None for t in (rows, w, b)]
    want = _loop(exact[0], counts, exact[1], exact[2])
    want_grads = torch.autograd.grad(want, [t for t in exact if t is not None], grad.to(torch.bfloat16).double())
    torch.testing.assert_close(on_cpu64(got), want.detach(), rtol=2e-2, atol=2e-2)
    for got_g, want_g in zip(got_grads, want_grads):
        torch.testing.assert_close(got_g, want_g, rtol=2e-2, atol=5e-2)


def test_only_bf16_off_the_cpu_with_aligned_sizes_takes_the_device_offsets_path() -> None:
    assert uses_device_offsets("cuda", torch.bfloat16, (8, 64, 128))
    assert not uses_device_offsets("cpu", torch.bfloat16, (8, 64, 128))  # the custom op, faster here
    assert not uses_device_offsets("cuda", torch.float32, (8, 64, 128))
    assert not uses_device_offsets("cuda", torch.bfloat16, (8, 60, 128))  # 60 bf16 values: not 16-byte aligned
