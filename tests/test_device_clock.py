"""Timers read the clock only once the device has finished the timed work (flexmoe.device_clock)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flexmoe.device_clock import synchronize
from flexmoe.experts.chooser import timed_run
from flexmoe.experts.weights import ExpertWeights
from flexmoe.parallel.auto import StageTimer


def _idle(device: torch.device) -> bool:
    """Whether nothing is left queued on ``device`` (always so on the CPU, which runs eagerly)."""
    return torch.cuda.current_stream(device).query() if device.type == "cuda" else True


def _rows(device: torch.device) -> int:
    # On a GPU, enough work (about 0.7 TFLOP) that the launches return well before the kernels end; the CPU runs
    # eagerly, so a small size checks the same code there.
    return 4096 if device.type != "cpu" else 128


def _slow_work(x: torch.Tensor) -> torch.Tensor:
    for _ in range(20):
        x = torch.tanh(x @ x.T @ x / x.shape[0])
    return x


@pytest.mark.parametrize("grad", [False, True])
def test_a_timed_kernel_run_returns_once_the_device_is_done(device: torch.device, grad: bool) -> None:
    x = torch.randn(_rows(device), 512, device=device, requires_grad=grad)
    weights = ExpertWeights(torch.zeros(1, 512, 8, device=device), None, torch.zeros(1, 8, 512, device=device),
                            None, None, None, F.gelu)
    run = timed_run(_slow_work, x, weights)
    assert _idle(device)
    result = run()
    assert _idle(device), "the timed run returned while its kernels were still queued"
    reference = x.detach().cpu().double().requires_grad_(grad)
    want = _slow_work(reference)
    if grad:  # the run is the forward and the backward to x, with ones as the output's gradient
        (want,) = torch.autograd.grad(want, reference, torch.ones_like(want))
        (result,) = result
    torch.testing.assert_close(result.cpu().double(), want, rtol=1e-3, atol=1e-4)


def test_the_parallel_stage_timer_waits_for_the_device(device: torch.device) -> None:
    reported: list[float] = []
    timer = StageTimer(reported.append)
    x = torch.randn(_rows(device), 512, device=device, requires_grad=True)
    out = timer.leave(_slow_work(timer.enter(x)))
    assert _idle(device)
    out.sum().backward()
    assert _idle(device) and len(reported) == 1 and reported[0] > 0


def test_a_device_without_a_way_to_wait_is_named() -> None:
    with pytest.raises(ValueError, match="privateuseone"):
        synchronize(torch.device("privateuseone"))
