"""``flexmoe train --device``: the job on an accelerator trains the same model as on the CPU (the same losses, to
the accelerator's rounding), and a device this machine lacks is one ``error:`` line.

On a machine without CUDA the accelerator case checks the refusal; on one with CUDA (``make test-gpu``) it trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexmoe_cli import child_pythonpath

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
        "--expert-hidden", "64", "--k", "2", "--batch-size", "8", "--steps", "4", "--log-every", "1",
        "--eval-every", "4", "--eval-batches", "1", "--no-plots", "--no-progress"]


def _train(out: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(out), *TINY, *argv],
                          capture_output=True, text=True, timeout=300, env=_env())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(SRC)}


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.device
def test_train_on_cuda_matches_cpu_or_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _train(tmp_path / "cuda", "--device", "cuda")
    if not torch.cuda.is_available():
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"error: --device cuda: this machine's torch {torch.__version__} has no cuda device"]
        return
    assert done.returncode == 0, done.stderr
    cpu = _train(tmp_path / "cpu", "--device", "cpu")
    assert cpu.returncode == 0, cpu.stderr
    on_cuda, on_cpu = _losses(tmp_path / "cuda"), _losses(tmp_path / "cpu")
    assert len(on_cuda) == len(on_cpu) == 4
    # fp32 everywhere; CUDA's matmuls round differently (TF32 stays off by default), routing identical at this size
    assert on_cuda == pytest.approx(on_cpu, rel=1e-4)


@pytest.mark.parametrize("device, says", [
    ("bogus", "error: --device: torch knows no device 'bogus'"),
    ("cuda:7", "error: --device cuda:7: "),
])
def test_bad_device_is_one_error_line(tmp_path: Path, device: str, says: str) -> None:
    done = _train(tmp_path / "run", "--device", device)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(says), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_backend_and_each_rank_s_device() -> None:
    from flexmoe.apps.errors import UsageError
    from flexmoe.apps.ranks import rank_device, resolve_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu) == "gloo" and resolve_backend("gloo", cuda) == "gloo"
    if torch.distributed.is_nccl_available():
        assert resolve_backend("auto", cuda) == "nccl"
    with pytest.raises(UsageError, match="--backend nccl runs on CUDA devices"):
        resolve_backend("nccl", cpu)
    with pytest.raises(UsageError, match="--backend must be one of auto, gloo, nccl"):
        resolve_backend("mpi", cpu)
    # Each rank on its node's GPU, ranks beyond the GPUs sharing them; a named device is every rank's.
    gpus = max(torch.cuda.device_count(), 1)
    assert [rank_device(cuda, r) for r in range(3)] == [torch.device("cuda", r % gpus) for r in range(3)]
    assert rank_device(torch.device("cuda", 1), 0) == torch.device("cuda", 1)
    assert rank_device(cpu, 5) == cpu


def test_nccl_without_cuda_is_one_line_before_launching(tmp_path: Path) -> None:
    done = _train(tmp_path / "run", "--nproc", "2", "--backend", "nccl")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --backend nccl runs on CUDA devices (--device cuda), not cpu: gloo carries cpu tensors"]
    assert not (tmp_path / "run").exists()


# 27 s on 2 cores: the slow step on the CPU (test_distributed's two-rank step, in the default run, compares the
# same job's losses, loads and weights); the device script runs it on CUDA (-m device).
@pytest.mark.slow
def test_two_gloo_ranks_train_as_one_process(tmp_path: Path, device: torch.device) -> None:
    """``--nproc 2 --backend gloo`` on ``device`` (both ranks on one GPU under ``--device cuda``) against one
    process on the same device: the same losses to float rounding (each rank half the batch, the experts spread,
    the gradients averaged)."""
    name = device.type  # --device cuda: each rank its local GPU, or the one GPU shared
    one = _train(tmp_path / "one", "--device", name)
    two = _train(tmp_path / "two", "--device", name, "--nproc", "2", "--backend", "gloo")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    alone, ranks = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(alone) == len(ranks) == 4
    assert ranks == pytest.approx(alone, rel=1e-4)
