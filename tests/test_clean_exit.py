"""Multi-rank gloo jobs end with exit code 0, every time, without "terminate called without an active exception".

The abort came from a gloo worker thread releasing the tensors of its last finished collective while the
interpreter was shutting down: releasing a tensor that Python created needs the GIL, and a thread asking for
it during shutdown is killed, through C++ frames that may not unwind. It happens only when a process group
outlives the interpreter's shutdown, which it did whenever an MoELayer was alive: the layer held the group
(and its 2-D sub-groups), so ``destroy_process_group()`` could not free them. Now the layer holds them by
weak reference, ``destroy_process_group()`` frees them and joins their worker threads while Python still runs.

Two more holders kept the world group past ``destroy_process_group()``: ``torch.distributed.nn.functional``,
whose default arguments bind ``group.WORLD`` when it is imported (DDP's constructor imports it after the group
exists; flexmoe now imports it first), and Tutel's scripts, which never destroy the group the compat layer
creates for them (the compat layer now does, at exit).
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


def _gloo_threads() -> str:
    """Code for a rank: ``gloo_threads()``, how many of this process's threads are gloo's (Linux /proc)."""
    return (
        "import os\n"
        "def gloo_threads():\n"
        "    names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]\n"
        "    return sum('gloo' in name for name in names)\n"
    )


# A user's job with DDP: flexmoe imported first (as in the README), the group created, a model wrapped in DDP
# (whose constructor imports torch.distributed.nn.functional), freed, then destroy_process_group().
_DDP_RANK = _gloo_threads() + r"""
import gc, json, sys, weakref
import flexmoe
import torch
import torch.distributed as dist
from flexmoe.sharding import wrap_ddp

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), flexmoe.MoELayer(16, 2 * world, 32, k=2))
ddp = wrap_ddp(model)
x = torch.randn(64, 16)
for _ in range(2):
    ddp(x).sum().backward()
threads_while_running = gloo_threads()
world_group = weakref.ref(dist.group.WORLD)
del ddp, model
gc.collect()
dist.destroy_process_group()
json.dump({"threads_while_running": threads_while_running, "world_alive": world_group() is not None,
           "threads_after_destroy": gloo_threads()}, open(f"{sys.argv[1]}.{rank}", "w"))
"""


def test_ddp_does_not_keep_the_world_group_past_destroy(tmp_path: Path) -> None:
    for rank in spawn_ranks(2, ["-c", _DDP_RANK, str(tmp_path / "rank")], timeout=120, check=False):
        assert rank.ok, f"rank {rank.rank} exited with {rank.exit_code}: {rank.stderr[-2000:]}"
        report = json.loads((tmp_path / f"rank.{rank.rank}").read_text())
        assert report["threads_while_running"] >= 2  # the check sees gloo's threads when they exist
        assert not report["world_alive"]
        assert report["threads_after_destroy"] == 0


# A Tutel script through the compat layer: it never destroys the group. The first exit handler (registered
# before the compat layer's, so it runs after it) reports what is left.
_TUTEL_RANK = _gloo_threads() + r"""
import atexit, json, os, sys
import torch
import torch.distributed as dist

out = f"{sys.argv[1]}.{os.environ['RANK']}"


def report():
    json.dump({"initialized": dist.is_initialized(), "threads": gloo_threads()}, open(out, "w"))


atexit.register(report)
from flexmoe.compat.tutel import moe as tutel_moe, system

env = system.init_data_model_parallel(backend="gloo")
layer = tutel_moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=16,
                            experts={"type": "ffn", "count_per_node": 2, "hidden_size_per_expert": 32})
x = torch.randn(4, 8, 16)
for _ in range(2):
    layer(x).sum().backward()
with open(out, "w") as f:
    json.dump({"threads_while_running": gloo_threads()}, f)
del env, layer
"""


def test_tutel_scripts_get_their_group_destroyed_at_exit(tmp_path: Path) -> None:
    for rank in spawn_ranks(2, ["-c", _TUTEL_RANK, str(tmp_path / "rank")], timeout=120, check=False):
        assert "terminate called" not in rank.stderr, rank.stderr[-2000:]
        assert rank.ok, f"rank {rank.rank} exited with {rank.exit_code}: {rank.stderr[-2000:]}"
        report = json.loads((tmp_path / f"rank.{rank.rank}").read_text())
        assert report == {"initialized": False, "threads": 0}
