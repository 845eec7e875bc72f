"""Starting N local ranks: ``flexmoe train --nproc N`` and ``flexmoe bench --nproc N`` re-run themselves under
``torch.distributed.run`` (torchrun) on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

__all__ = ["free_port", "under_torchrun", "relaunch"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """Whether this process is one rank started by torchrun (which sets LOCAL_RANK for its children)."""
    return "LOCAL_RANK" in os.environ


def relaunch(nproc: int, command: str, argv: list[str]) -> int:
    """Run ``python -m flexmoe COMMAND ARGV...`` as ``nproc`` local ranks; returns torchrun's exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "flexmoe", command, *argv]
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)
