"""Timing side by side, the way every number of ``flexmoe bench`` is measured.

Timings on a shared machine are noisy, so every number that matters is a ratio measured side by side in one
run: the cases take turns step by step (the order rotates every step), and each reports the median of its
steps. On a device that runs asynchronously (CUDA) each case's time ends when the device has finished its work.
The bottom of the package: it imports nothing of flexmoe.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["wait_for", "time_side_by_side", "saved_activation_bytes"]


def wait_for(device: torch.device | str) -> None:
    """Block until the work queued on ``device`` is done (CUDA runs kernels asynchronously; the CPU does not)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_side_by_side(cases: dict[str, Callable[[], None]], steps: int, warmup: int,
                      sync: Callable[[float], float] = lambda t: t, desc: str | None = None,
                      device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Seconds of each case per step, the cases taking turns (order rotated each step so none always runs
    first). ``sync`` maps one local time to the time that counts (under torchrun: the slowest rank's).
    ``device``: where the cases run; each case's time ends when that device has finished its work.

    With ``desc``, a progress bar on stderr counts the rounds (every case once) and shows each case's running
    median over the floor's; the rows themselves exist only once all rounds are in, since the cases share them.
    """
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    bar = _progress_bar(warmup + steps, desc)
    for step in range(warmup + steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            wait_for(device)
            start = time.perf_counter()
            cases[name]()
            wait_for(device)
            elapsed = sync(time.perf_counter() - start)
            if step >= warmup:
                times[name].append(elapsed)
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str("warm-up" if step < warmup else _running_ratios(times))
    if bar is not None:
        bar.close()
    return times


def _progress_bar(total: int, desc: str | None) -> Any:
    if desc is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="round", file=sys.stderr, dynamic_ncols=True, leave=False)


def _running_ratios(times: dict[str, list[float]]) -> str:
    """'case 1.02x' for every case, its median so far over the first case's (the floor's)."""
    medians = {name: statistics.median(v) for name, v in times.items() if v}
    first = next(iter(medians.values()), None)
    if not first:
        return ""
    return ", ".join(f"{name.split(' ')[0]} {m / first:.2f}x" for name, m in list(medians.items())[1:])


def saved_activation_bytes(step: Callable[[], Tensor], params: Sequence[Tensor]) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``step()`` (storages counted once, parameters
    excluded): the activation memory of a forward + backward beyond parameters and their gradients."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    del out
    return sum(saved.values())
