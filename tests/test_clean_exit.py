"""Multi-rank gloo jobs end with exit code 0, every time, without "terminate called without an active exception".

The abort came from a gloo worker thread releasing the tensors of its last finished collective while the
interpreter was shutting down: releasing a tensor that Python created needs the GIL, and a thread asking for
it during shutdown is killed, through C++ frames that may not unwind. It happens only when a process group
outlives the interpreter's shutdown, which it did whenever an MoELayer was alive: the layer held the group
(and its 2-D sub-groups), so ``destroy_process_group()`` could not free them. Now the layer holds them by
weak reference, ``destroy_process_group()`` frees them and joins their worker threads while Python still runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmoe.launch import spawn_ranks

# One rank of a user's job: MoE steps with overlapped 2-D all-to-alls, the layer still alive at the end (a
# module-level model), destroy_process_group(), then a normal interpreter exit.
_RANK = r"""
import json, sys, weakref
import torch
import torch.distributed as dist
from flexmoe import MoELayer

dist.init_process_group("gloo")  # the rendezvous from the environment (flexmoe.launch.spawn_ranks)
rank, world = dist.get_rank(), dist.get_world_size()
out = f"{sys.argv[1]}.{rank}"
torch.manual_seed(0)
moe = MoELayer(16, 2 * world, 32, k=2, overlap_degree=2, a2a="2dh", ranks_per_node=1)
x = torch.randn(64, 16, requires_grad=True)
for _ in range(3):
    moe(x).sum().backward()
groups = [weakref.ref(dist.group.WORLD)] + [ref for ref in moe.ep_group._subgroups.values()]
dist.destroy_process_group()
alive = sum(ref() is not None for ref in groups)
json.dump({"groups": len(groups), "alive_after_destroy": alive}, open(out, "w"))
try:
    moe(x)
    json.dump({"groups": len(groups), "alive_after_destroy": alive, "used_after_destroy": "no error"}, open(out, "w"))
except RuntimeError as exc:
    pass
"""


def run_job(tmp_path: Path, world: int = 2) -> list[dict]:
    results = []
    for rank in spawn_ranks(world, ["-c", _RANK, str(tmp_path / "rank")], timeout=120, check=False):
        assert "terminate called" not in rank.stderr, rank.stderr[-2000:]
        assert rank.ok, f"rank {rank.rank} exited with {rank.exit_code}: {rank.stderr[-2000:]}"
        results.append(json.loads((tmp_path / f"rank.{rank.rank}").read_text()))
    return results


def test_destroy_process_group_frees_the_groups_of_a_live_layer(tmp_path: Path) -> None:
    for report in run_job(tmp_path):
        assert report["groups"] >= 1  # the world (at 2 ranks the 2-D all-to-all's groups are the world too)
        assert report["alive_after_destroy"] == 0
        assert "used_after_destroy" not in report  # a layer used after destroy says so, no crash


@pytest.mark.slow
def test_two_rank_train_job_exits_cleanly_five_times_in_a_row(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(5):
        out = subprocess.run([sys.executable, "-m", "flexmoe", "train", "--nproc", "2", "--steps", "5",
                              "--out", str(tmp_path / f"run{i}"), "--n-layer", "2", "--a2a", "2dh",
                              "--eval-batches", "1", "--no-plots", "--no-progress"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert "terminate called" not in out.stderr, out.stderr[-2000:]
        assert out.returncode == 0, out.stderr[-2000:]
