"""flexmoe.apps.collective_watch.timeout_error in one process: which RuntimeErrors it leaves alone, and the message of
one it turns into a CollectiveTimeout. Naming the hung rank among real gloo ranks is
tests/test_elastic.py::test_a_hung_rank_ends_the_others_within_the_collective_timeout_and_the_restart_resumes."""

from __future__ import annotations

import time

import pytest

from flexmoe.apps.collective_watch import CollectiveTimeout, timeout_error

PHASE = "the forward and backward pass"


@pytest.mark.parametrize("timeout, world, ran_s", [
    (None, 2, 100.0),  # no --collective-timeout: the group's default bound, nothing to name
    (4.0, 1, 100.0),   # one process: no collective to wait on
    (4.0, 2, 1.0),     # sooner than the timeout: a dead peer's closed connection, raised as it is
])
def test_an_error_that_is_no_timeout_is_left_alone(timeout: float | None, world: int, ran_s: float) -> None:
    exc = RuntimeError("Connection closed by peer")
    assert timeout_error(exc, timeout, time.monotonic() - ran_s, rank=0, world=world, step=3, phase=PHASE) is None


def test_a_collective_past_the_timeout_names_rank_step_and_phase() -> None:
    """No group joined through init_distributed here, so the silent ranks are unknown, and said so."""
    exc = RuntimeError("[gloo] Timed out waiting 4000ms for recv operation\nmore detail")
    error = timeout_error(exc, 4.0, time.monotonic() - 5.0, rank=1, world=2, step=15, phase=PHASE)
    assert isinstance(error, CollectiveTimeout) and isinstance(error, RuntimeError)
    assert str(error) == ("rank 1: step 15: the forward and backward pass waited more than 4 s (--collective-timeout); "
                          "the ranks that did not answer are unknown ([gloo] Timed out waiting 4000ms for recv "
                          "operation)")
