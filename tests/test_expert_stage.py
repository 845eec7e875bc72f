"""The expert stage (flexmoe.experts.stage.ExpertStage): a forced expert_kernel or expert_route is honoured on
every path a layer call takes (eager training, eager without autograd, decoding, compiled dropless, compiled
capacity mode), or replaced by what runs with one warning naming it; each path's numbers against the dense
reference of tests/reference.py, and the kernel that ran as the stage reports it."""

from __future__ import annotations

import warnings

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.experts.kernels import KERNELS
from reference import reference_for_layer

M, E, H, K = 8, 4, 16, 2
PATHS = ("eager_train", "eager_no_grad", "decoding", "compiled_dropless", "compiled_capacity")

# What runs for each forced kernel on each path (CPU, float32, gelu): the kernel itself where it runs the case,
# else the eager rule (the loop) or, compiled, the custom op over the real rows. Written from each kernel's
# documented limits: segmented needs autograd and no tracing; grouped_mm is traced in bf16 only; embedding_bag
# and joined_unit run without autograd, and embedding_bag is never traced. A forced grouped_mm in capacity mode
# takes the read-free path (docs/architecture.md, "Expert compute"): the padded rows by batched matmuls, no warning.
READ_FREE_PADDED = ("grouped_mm", "compiled_capacity")
EXPECTED = {
    "loop": dict(eager_train="loop", eager_no_grad="loop", decoding="loop", compiled_dropless="loop",
                 compiled_capacity="loop"),
    "segmented": dict(eager_train="segmented", eager_no_grad="loop", decoding="loop",
                      compiled_dropless="padded_op", compiled_capacity="padded_op"),
    "grouped_mm": dict(eager_train="grouped_mm", eager_no_grad="grouped_mm", decoding="grouped_mm",
                       compiled_dropless="padded_op", compiled_capacity="padded_bmm"),
    "embedding_bag": dict(eager_train="loop", eager_no_grad="embedding_bag", decoding="embedding_bag",
                          compiled_dropless="padded_op", compiled_capacity="padded_op"),
    "joined_unit": dict(eager_train="loop", eager_no_grad="joined_unit", decoding="joined_unit",
                        compiled_dropless="padded_op", compiled_capacity="padded_op"),
}


def _run(moe: MoELayer, x: torch.Tensor, path: str) -> torch.Tensor:
    if path == "eager_train":
        return moe(x)
    if path in ("eager_no_grad", "decoding"):
        moe.train(path == "eager_no_grad")  # in training mode a call without autograd still builds its plan
        with torch.no_grad():
            return moe(x)
    torch._dynamo.reset()
    return torch.compile(moe, backend="eager")(x)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_forced_kernel_runs_on_every_path_or_warns(kernel: str, path: str) -> None:
    if kernel == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    capacity = {"capacity_factor": 2.0} if path == "compiled_capacity" else {"capacity_factor": 0.0}
    torch.manual_seed(0)
    moe = MoELayer(M, E, H, k=K, expert_kernel=kernel, **capacity)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(1), requires_grad=path != "decoding")
    ref, x64, params = reference_for_layer(moe, x, k=K, **capacity)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(moe, x, path)
    want = EXPECTED[kernel][path]
    assert moe.expert_stage.last_route == "rows"  # a forced kernel runs inside the rows route
    assert moe.expert_stage.last_kernel == want, (kernel, path, moe.expert_stage.last_kernel)
    named = [str(w.message) for w in caught if f"expert_kernel={kernel!r}" in str(w.message)]
    forced_ran = want == kernel or (kernel, path) == READ_FREE_PADDED
    assert bool(named) == (not forced_ran), named  # a warning exactly where the forced kernel did not run
    assert (moe.last_plan.padded if moe.last_plan is not None else False) == (
        path == "compiled_capacity" and want != kernel)
    torch.testing.assert_close(got.double(), ref.y.detach(), rtol=1e-5, atol=1e-5)
    if path in ("eager_train", "compiled_dropless", "compiled_capacity"):
        grad = torch.randn(12, M, generator=torch.Generator().manual_seed(2))
        got.backward(grad)
        ref.y.backward(grad.double())
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(moe.experts.w1.grad.double(), params["experts.w1"].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", ("eager_train", "compiled_dropless", "compiled_capacity"))
@pytest.mark.parametrize("route", ("fused", "rows"))
def test_a_forced_route_is_taken_in_training(route: str, path: str) -> None:
    capacity = {"capacity_factor": 2.0} if path == "compiled_capacity" else {"capacity_factor": 0.0}
    torch.manual_seed(0)
    moe = MoELayer(M, E, H, k=K, expert_route=route, **capacity)
    x = torch.randn(12, M, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref, x64, _ = reference_for_layer(moe, x, k=K, **capacity)
    got = _run(moe, x, path)
    assert moe.expert_stage.last_route == route
    grad = torch.randn(12, M, generator=torch.Generator().manual_seed(2))
    got.backward(grad)
    ref.y.backward(grad.double())
    torch.testing.assert_close(got.double(), ref.y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


def test_a_forced_fused_route_that_cannot_run_warns_once_and_runs_rows() -> None:
    moe = MoELayer(M, E, H, k=K, expert_route="fused", capacity_factor=0.0)
    x = torch.randn(12, M)
    with pytest.warns(RuntimeWarning, match="expert_route='fused' does not run this call"):
        with torch.no_grad():
            moe(x)
    assert moe.expert_stage.last_route == "rows"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            moe(x)  # once only


def test_fused_is_a_route_not_a_kernel() -> None:
    with pytest.raises(ValueError, match="expert_kernel='fused' names a route .* use expert_route='fused'"):
        MoELayer(M, E, H, expert_kernel="fused")
    with pytest.raises(ValueError, match="expert_route must be one of"):
        MoELayer(M, E, H, expert_route="loop")
    with pytest.raises(TypeError, match="expert_route must be a str"):
        MoELayer(M, E, H, expert_route=1)


def test_old_module_names_import_the_moved_modules() -> None:
    import flexmoe.experts.chooser
    import flexmoe.kernel_chooser
    from flexmoe.expert_kernels import KERNELS as OLD_KERNELS

    assert flexmoe.kernel_chooser is flexmoe.experts.chooser and OLD_KERNELS is KERNELS


@pytest.mark.parametrize("route", ("auto", "rows"))
def test_a_forced_rows_route_holds_where_the_chooser_would_take_fused(monkeypatch: pytest.MonkeyPatch,
                                                                      route: str) -> None:
    """A timer that makes the fused route the fastest: "auto" takes it (the control), a forced "rows" does not. A
    call of more rows than the CPU's read-free rule takes (CPU_READ_FREE_MAX_ROWS), so that auto times it."""
    from flexmoe.experts.chooser import KernelChooser
    from flexmoe.experts.stage import CPU_READ_FREE_MAX_ROWS

    def fused_fastest(name: str, run) -> float:
        run()
        return 1.0 if name == "fused" else 2.0

    monkeypatch.setattr(KernelChooser, "default_timer", staticmethod(fused_fastest))
    moe = MoELayer(M, E, H, k=K, expert_route=route, capacity_factor=0.0)
    x = torch.randn(CPU_READ_FREE_MAX_ROWS // K + 1, M, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    ref, _, _ = reference_for_layer(moe, x, k=K, capacity_factor=0.0)
    got = moe(x)
    assert moe.expert_stage.last_route == ("fused" if route == "auto" else "rows")
    torch.testing.assert_close(got.double(), ref.y.detach(), rtol=1e-5, atol=1e-5)
