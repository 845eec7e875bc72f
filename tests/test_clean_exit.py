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

from flexmoe.launch import free_port

# One rank of a user's job: MoE steps with overlapped 2-D all-to-alls, the layer still alive at the end (a
# module-level model), destroy_process_group(), then a normal interpreter exit.
_RANK = r"""
import json, sys, weakref
import torch
import torch.distributed as dist
from flexmoe import MoELayer

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
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
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), port, str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    try:
        for r, proc in enumerate(procs):
            _, err = proc.communicate(timeout=120)
            assert "terminate called" not in err, err[-2000:]
            assert proc.returncode == 0, err[-2000:]
            results.append(json.loads(outs[r].read_text()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
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
