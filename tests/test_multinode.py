"""torchrun's multi-node launch: two agents on this machine, one per "node", rendezvous over c10d on 127.0.0.1.

The two agents must form one job (world size = nodes x ranks per node), the MoE layers must take their
ranks per node from torchrun (LOCAL_WORLD_SIZE) so that ``a2a="2dh"`` and ``cross_node_share`` see two
nodes, and the job must train exactly as the same number of ranks on one node does (the 2-D hierarchical
all-to-all moves the same rows as the flat one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmoe.launch import free_port

# A small model, so 20 steps of 4 ranks on 2 shared cores take seconds.
TRAIN_ARGS = ["--steps", "20", "--batch-size", "8", "--n-layer", "2", "--n-embd", "64", "--n-head", "2",
              "--block-size", "32", "--expert-hidden", "64", "--eval-every", "10", "--eval-batches", "2",
              "--ckpt-every", "20", "--no-plots", "--no-progress"]
TIMEOUT_S = 420


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_two_nodes(out: Path, per_node: int, extra: list[str]) -> list[subprocess.CompletedProcess]:
    """``flexmoe train`` as two torchrun agents (``--nnodes 2``) that meet at a c10d rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(torchrun("--nnodes", "2", "--nproc_per_node", str(per_node), "--rdzv_backend", "c10d",
                                  "--rdzv_endpoint", endpoint, "--rdzv_id", f"multinode-{out.name}",
                                  "--max_restarts", "0", "-m", "flexmoe", "train", "--out", str(out),
                                  *TRAIN_ARGS, *extra),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    done = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=TIMEOUT_S)
            done.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, stderr))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return done


def run_one_node(out: Path, nproc: int, extra: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "flexmoe", "train", "--nproc", str(nproc), "--out", str(out),
                           *TRAIN_ARGS, *extra], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train_loss"]) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1, 2])
def test_two_torchrun_agents_train_as_one_job(tmp_path: Path, per_node: int) -> None:
    world = 2 * per_node
    extra = ["--a2a", "2dh"]
    agents = run_two_nodes(tmp_path / "two-nodes", per_node, extra)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
        assert "terminate called" not in agent.stderr
    log = "".join(a.stdout for a in agents)
    assert f"{world} ranks on 2 node(s) of {per_node}" in log

    run = tmp_path / "two-nodes"
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert config["world_size"] == summary["world_size"] == world
    assert config["ranks_per_node"] == summary["ranks_per_node"] == per_node
    assert config["model"]["a2a"] == "2dh" and summary["steps"] == 20

    # The same ranks on one node (flat all-to-all inside it) take the same steps.
    reference = run_one_node(tmp_path / "one-node", world, [])
    assert reference.returncode == 0, reference.stderr[-3000:]
    ref_config = json.loads((tmp_path / "one-node" / "config.json").read_text())
    assert ref_config["ranks_per_node"] == world
    got, want = losses(run), losses(tmp_path / "one-node")
    assert [s for s, _ in got] == [s for s, _ in want] == [10, 20]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-4)


@pytest.mark.slow
def test_cross_node_share_sees_the_two_nodes(tmp_path: Path) -> None:
    """With cross_node_share on two nodes of two ranks the topology gate bounds the off-node pairs, so the job
    takes other routing decisions than one node of four ranks, where every expert is on the node."""
    extra = ["--a2a", "2dh", "--cross-node-share", "0.0"]
    agents = run_two_nodes(tmp_path / "two-nodes", 2, extra)
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-3000:]
    reference = run_one_node(tmp_path / "one-node", 4, extra)
    assert reference.returncode == 0, reference.stderr[-3000:]
    two, one = losses(tmp_path / "two-nodes"), losses(tmp_path / "one-node")
    assert one and two and all(abs(a - b) > 1e-4 for (_, a), (_, b) in zip(one, two))
