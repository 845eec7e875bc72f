"""Wall-clock timing of work that may run asynchronously on an accelerator.

A CUDA (or other accelerator) kernel launch returns before the kernel has run, so ``time.perf_counter`` around a
launch measures the launch alone. Every timer in flexmoe (the expert-kernel chooser, ``parallel="auto"``) reads
the clock after :func:`synchronize` on the device the timed tensors live on; on the CPU that is free.
"""

from __future__ import annotations

import torch

__all__ = ["synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait until every kernel queued on ``device`` has finished (nothing to wait for on the CPU or meta)."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps: each has synchronize()
    wait = getattr(backend, "synchronize", None)
    if wait is None:
        raise ValueError(f"cannot wait for work on device {device} (torch.{device.type}.synchronize is missing): "
                         f"timing it would measure kernel launches only")
    if device.type in ("cuda", "xpu"):
        wait(device)
    else:
        wait()
