"""Rank functions of tests/test_launch.py, run by flexmoe.launch.spawn_ranks (no torch: quick to start)."""

from __future__ import annotations

import os
import sys
import time


def report_env(tag: str) -> dict:
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS")
    return {"tag": tag, **{k: os.environ[k] for k in keys}}


def last_rank_fails() -> None:
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        print("about to fail", file=sys.stderr)
        raise ValueError("the last rank is broken")
    time.sleep(60)  # the others would wait for it forever


def sleep_long() -> None:
    time.sleep(60)
