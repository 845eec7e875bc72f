"""Rank functions of tests/test_launch.py, run by flexmoe.launch.spawn_ranks (no torch: quick to start)."""

from __future__ import annotations

import os
import socket
import sys
import time

# How long a rank that should be killed sleeps: far beyond any start-up on a loaded machine, so a test that sees it
# killed (not finished) knows the launcher killed it.
LONG_S = 600


def report_env(tag: str) -> dict:
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
            "TORCHELASTIC_USE_AGENT_STORE")
    return {"tag": tag, **{k: os.environ[k] for k in keys}}


def master_port_is_served() -> bool:
    """Whether MASTER_PORT is already bound when this rank starts, before any rank joined a group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        except OSError:
            return True
    return False


def last_rank_fails() -> None:
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        print("about to fail", file=sys.stderr)
        raise ValueError("the last rank is broken")
    time.sleep(LONG_S)  # the others would wait for it forever


def sleep_long() -> None:
    time.sleep(LONG_S)
