"""Fixtures shared by several test files, and the ``--device`` option.

``--device`` (default ``cpu``) names the device that the device-parametrised tests run on: a test takes the
``device`` fixture and builds its layer and inputs there, comparing against a reference computed on the CPU in
float64. Every such test is marked ``device`` automatically, so ``pytest -m device --device cuda`` (what
``make test-gpu`` runs) runs exactly those cases on the GPU; without ``--device`` they run on the CPU in the
default suite at no extra cost.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from typing import TextIO

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu",
                     help="device for the tests that take the `device` fixture (marked `device`): cpu (default), "
                          "cuda, cuda:1, ...")
    parser.addoption("--test-timeout", type=float, default=0.0,
                     help="seconds one test may run before the process is stopped with every thread's traceback "
                          "(0: no limit); make test-gpu sets it so that a hung kernel cannot hang the run")


# Children of the tests (subprocesses, spawned ranks) load tests/child_site/sitecustomize.py: the kernels by rule.
_CHILD_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_CHILD_SITE, os.environ.get("PYTHONPATH")) if p)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "device: takes the `device` fixture; runs on the device named by --device")
    name = config.getoption("--device")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise pytest.UsageError(f"--device {name!r}: not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: this machine has no CUDA device that torch {torch.__version__} "
                                f"can use (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {name}: there are only {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {name}: expected cpu or cuda[:index]")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


_real_stderr: list[TextIO] = []  # the terminal's stderr, which output capturing does not swallow


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``--test-timeout``, keep a handle on the terminal's stderr for the timeout's message: while a test
    runs, fd 2 is pytest's capture file, lost when the process is stopped."""
    if session.config.getoption("--test-timeout") <= 0:
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=False)
    try:
        _real_stderr.append(os.fdopen(os.dup(2), "w"))
    finally:
        if capture is not None:
            capture.resume_global_capture()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``--test-timeout``, a test that outlives it ends its process, faulthandler printing where each
    thread was (C-level: it fires even while a kernel holds the interpreter)."""
    seconds = item.config.getoption("--test-timeout")
    if seconds > 0:
        out = _real_stderr[0] if _real_stderr else sys.stderr
        faulthandler.dump_traceback_later(seconds, exit=True, file=out)
    try:
        yield
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    """The device named by ``--device``, with its index (``cuda`` -> ``cuda:0``) so that tensors compare equal."""
    device = torch.device(request.config.getoption("--device"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


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
    from flexmoe.experts.chooser import KernelChooser

    monkeypatch.setattr(KernelChooser, "default_timer", None)
    monkeypatch.setattr(KernelChooser, "default_cache_dir", None)
