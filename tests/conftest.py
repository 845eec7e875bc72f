"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and do not fight other processes for the two cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def kernels_by_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers built in tests take the rule's kernel (the loop) wherever no test forces one: nothing is timed, and
    no cache file of the machine is read or written, so every run computes alike. The tests of the kernels force
    each one, and give the chooser its own timer and cache (tests/test_expert_kernels.py)."""
    from flexmoe.kernel_chooser import KernelChooser

    monkeypatch.setattr(KernelChooser, "default_timer", None)
    monkeypatch.setattr(KernelChooser, "default_cache_dir", None)
