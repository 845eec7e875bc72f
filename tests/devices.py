"""What device-parametrised tests share (the ``device`` fixture itself lives in conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor


def skip_on_cuda(device: torch.device, why: str) -> None:
    """Skip a device test on CUDA, saying why the case means nothing there (e.g. it tests a CPU-only kernel)."""
    if device.type == "cuda":
        pytest.skip(f"CPU-only on purpose: {why}")


def on_cpu64(t: Tensor) -> Tensor:
    """A float64 CPU copy, detached: what a result on any device is compared in, against a CPU reference."""
    return t.detach().to("cpu", torch.float64)
