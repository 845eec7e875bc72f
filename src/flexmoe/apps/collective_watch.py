"""What a collective that waited past ``--collective-timeout`` becomes: a :class:`CollectiveTimeout` naming the
ranks that hang.

``--collective-timeout`` is the process group's timeout (:func:`flexmoe.apps.ranks.init_distributed`): gloo
raises a ``RuntimeError`` in the rank that waited. The same error type also ends a collective whose peer died (a
closed connection), at once. :func:`timeout_error` tells the two apart by how long the step ran, and for a timeout
asks the rendezvous store which ranks still answer (:func:`flexmoe.apps.ranks.unanswering_ranks`), so the error
says which rank hangs, at which step, and in which part of it.
"""

from __future__ import annotations

import time

from flexmoe.apps.ranks import unanswering_ranks

__all__ = ["CollectiveTimeout", "timeout_error"]

# The longest a failing rank waits for the others' keys in the store, past a long --collective-timeout.
MAX_ANSWER_WAIT_S = 10.0


class CollectiveTimeout(RuntimeError):
    """A collective of this rank waited longer than ``--collective-timeout``: the message names this rank, the
    step, the part of it that waited and the ranks that did not answer."""


def timeout_error(exc: RuntimeError, timeout: float | None, started: float, *, rank: int, world: int, step: int,
                  phase: str) -> CollectiveTimeout | None:
    """The :class:`CollectiveTimeout` of ``exc``, raised in 1-based step ``step`` (begun at ``time.monotonic()``
    ``started``) while this rank ran ``phase``; None where ``exc`` is not a collective that waited past
    ``timeout`` seconds (one process, no timeout, or an error that came sooner, as a dead peer's does).

    Each failing rank waits as long again as ``timeout`` (at most :data:`MAX_ANSWER_WAIT_S`) for the others'
    answers in the store; the ranks that never answer are named."""
    if world == 1 or timeout is None or time.monotonic() - started < timeout:
        return None
    silent = unanswering_ranks(f"step_{step}", min(timeout, MAX_ANSWER_WAIT_S))
    who = ("every rank answered (a slow rank or network, not a hung one)" if silent == [] else
           "the ranks that did not answer are unknown" if silent is None else
           f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of {world} did not answer")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return CollectiveTimeout(f"rank {rank}: step {step}: {phase} waited more than {timeout:g} s "
                             f"(--collective-timeout); {who} ({first})")
