"""A rank that dies or hangs costs a restart, not the run: real torchrun agents (``--max-restarts``) and
``flexmoe train --nproc N --max-restarts R`` over real gloo ranks on 127.0.0.1.

Each fault is injected with ``--inject-fault KIND:RANK:STEP`` (:mod:`flexmoe.apps.faults`: a real SIGKILL of the
rank, or a sleep inside the step) on the workers' first start only; the restarted workers resume from the newest
complete checkpoint. The reference is the same command run without a fault: the finished run must equal it bit
for bit (every tensor of the final checkpoint, every logged loss, the final validation loss). A restart on fewer
ranks is compared with the uninterrupted run on the first number of ranks: equal up to the checkpoint it resumed
from, equal to rounding after it (the sums over ranks round differently).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmoe.apps.cli import main
from flexmoe.apps.faults import Fault, parse_fault
from flexmoe.launch import free_port

# A tiny MoE GPT: 30 steps of 2 ranks take seconds; checkpoints at steps 10, 20 and 30.
TRAIN_ARGS = ["--steps", "30", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--num-experts", "4",
              "--expert-hidden", "32", "--block-size", "16", "--batch-size", "8", "--eval-every", "10",
              "--eval-batches", "1", "--ckpt-every", "10", "--log-every", "1", "--no-plots", "--no-progress",
              "--resume"]
TIMEOUT_S = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(out: Path, nproc: int, max_restarts: int, *extra: str,
             static: bool = False) -> subprocess.CompletedProcess:
    """``torchrun ... -m flexmoe train --out OUT`` on this machine: with ``static``, torchrun's default static
    rendezvous (what a user who names no rendezvous gets), else ``--standalone`` (c10d on a free port)."""
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    rdzv = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())] if static else ["--standalone"]
    cmd = [*launcher, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *rdzv,
           "-m", "flexmoe", "train", "--out", str(out), *TRAIN_ARGS, *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the run's final checkpoint (step 30), in global form."""
    return load_file(str(run / "checkpoints" / "step_000030" / "model.safetensors"))


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_run(got: Path, want: Path) -> None:
    """``got`` finished exactly as ``want``: every final tensor, every logged loss and the final val loss."""
    a, b = final_weights(got), final_weights(want)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [(r["step"], r["train_loss"]) for r in metrics(got)] == [(r["step"], r["train_loss"]) for r in metrics(want)]
    assert [r["step"] for r in metrics(got)] == list(range(1, 31))
    sa, sb = (json.loads((run / "summary.json").read_text()) for run in (got, want))
    assert sa["steps"] == sb["steps"] == 30
    assert sa["final_val_loss"] == sb["final_val_loss"]


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run on 2 ranks, never interrupted."""
    out = tmp_path_factory.mktemp("elastic") / "reference"
    ok(torchrun(out, 2, 0))
    return out


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path: Path, reference: Path) -> None:
    """kill -9 of rank 1 at step 15 under torchrun's default (static) rendezvous: the agent restarts both ranks,
    which resume from step 10's checkpoint and finish bit for bit as the uninterrupted run."""
    out = tmp_path / "killed"
    log = ok(torchrun(out, 2, 1, "--inject-fault", "kill:1:15", static=True))
    assert "fault: rank 1 is killed (SIGKILL) at step 15" in log
    assert "exitcode: -9" in log  # torchrun saw the rank die of SIGKILL
    assert f"resumed from {out}/checkpoints/step_000010 at step 10" in log
    assert_same_run(out, reference)


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path: Path, reference: Path) -> None:
    """Rank 0 (the writer) killed after writing step 20's files and before the checkpoint is complete: the restart
    never loads the half-written one, resumes from step 10's, and ends as the uninterrupted run; nothing of the
    half-written checkpoint is left."""
    out = tmp_path / "killed-in-save"
    log = ok(torchrun(out, 2, 1, "--inject-fault", "kill-in-save:0:20"))
    assert "fault: rank 0 is killed (SIGKILL) at step 20" in log
    assert f"resumed from {out}/checkpoints/step_000010 at step 10" in log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest.json", "step_000020", "step_000030"]
    assert_same_run(out, reference)


@pytest.mark.slow
def test_a_hung_rank_ends_the_others_within_the_collective_timeout_and_the_restart_resumes(
        tmp_path: Path, reference: Path) -> None:
    """Rank 1 sleeps inside step 15: rank 0's all-to-all gives up after --collective-timeout 4 s with an error
    naming rank 1, the step and the operation; torchrun restarts both, and the run ends as the uninterrupted one."""
    out = tmp_path / "hung"
    log = ok(torchrun(out, 2, 1, "--inject-fault", "hang:1:15", "--collective-timeout", "4"))
    error = re.search(r"CollectiveTimeout: (.*)", log)
    assert error is not None, log[-5000:]
    assert error.group(1).startswith("rank 0: step 15: the forward and backward pass")
    assert "waited more than 4 s (--collective-timeout); rank 1 of 2 did not answer" in error.group(1)
    # Bounded: torchrun saw rank 0 fail (its log line's local time) within the timeout and as long again to name
    # the rank that does not answer, plus seconds of slack on 2 shared cores.
    hung = re.search(r"fault: rank 1 hangs at step 15 \(hang, time ([0-9.]+)\)", log)
    failed = re.search(r"E\d{4} (\d\d):(\d\d):(\d\d\.\d+) .* failed \(exitcode: 1\) local_rank: 0", log)
    assert hung is not None and failed is not None, log[-5000:]
    local = time.localtime(float(hung.group(1)))
    hung_s = local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + float(hung.group(1)) % 1
    failed_s = int(failed.group(1)) * 3600 + int(failed.group(2)) * 60 + float(failed.group(3))
    assert 4.0 <= (failed_s - hung_s) % 86400 < 4.0 + 4.0 + 20.0
    assert f"resumed from {out}/checkpoints/step_000010 at step 10" in log
    assert_same_run(out, reference)


@pytest.mark.slow
def test_flexmoe_nproc_max_restarts_restarts_a_killed_rank(tmp_path: Path, reference: Path) -> None:
    """``flexmoe train --nproc 2 --max-restarts 1`` (no torchrun): the launcher starts both ranks again, resuming,
    and the run ends as the uninterrupted one."""
    out = tmp_path / "nproc"
    cmd = [sys.executable, "-m", "flexmoe", "train", "--nproc", "2", "--max-restarts", "1", "--out", str(out),
           *TRAIN_ARGS, "--inject-fault", "kill:1:15"]
    log = ok(subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    assert "restart 1 of 1: starting the 2 ranks again" in log
    assert f"resumed from {out}/checkpoints/step_000010 at step 10" in log
    assert_same_run(out, reference)


@pytest.mark.slow
def test_without_restarts_left_the_killed_run_fails(tmp_path: Path) -> None:
    """The restart budget is the launcher's: with ``--max-restarts 0`` the same kill ends the job (non-zero)."""
    out = tmp_path / "no-restarts"
    cmd = [sys.executable, "-m", "flexmoe", "train", "--nproc", "2", "--max-restarts", "0", "--out", str(out),
           *TRAIN_ARGS, "--inject-fault", "kill:1:15"]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "restart 1" not in proc.stdout
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--fsdp"]], ids=["expert-parallel", "fsdp"])
def test_a_restart_on_fewer_ranks_reshards_and_goes_on(tmp_path: Path, layout: list[str]) -> None:
    """4 ranks, one killed at step 15 with no restart left (its "node" is lost); the job started again on the 2
    ranks left, with the same command line, cuts the newest checkpoint (step 10) for 2 ranks by itself and
    finishes. Up to step 10 it is the uninterrupted 4-rank run exactly; after it, to rounding (sums over 2 ranks
    instead of 4). The metrics record each step's world size and the change."""
    want, out = tmp_path / "four", tmp_path / "four-then-two"
    ok(torchrun(want, 4, 0, *layout))
    lost = torchrun(out, 4, 0, *layout, "--inject-fault", "kill:3:15")
    assert lost.returncode != 0
    log = ok(torchrun(out, 2, 1, *layout))
    checkpoint = "dcp-step_000010" if layout else "step_000010"
    assert f"resumed from {out}/checkpoints/{checkpoint} at step 10" in log
    assert "world size changed from 4 to 2 ranks: resumed at step 10" in log
    got, ref = metrics(out), metrics(want)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 31))
    assert [r["world_size"] for r in got] == [4] * 10 + [2] * 20
    assert got[10]["world_size_changed"] == {"from": 4, "to": 2, "resumed_at_step": 10}
    assert all("world_size_changed" not in r for r in got[:10] + got[11:])
    assert [r["train_loss"] for r in got[:10]] == [r["train_loss"] for r in ref[:10]]
    assert [r["train_loss"] for r in got[10:]] == pytest.approx([r["train_loss"] for r in ref[10:]], rel=1e-4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["final_val_loss"] == pytest.approx(json.loads((want / "summary.json").read_text())
                                                      ["final_val_loss"], rel=1e-4)


def test_inject_fault_takes_kind_rank_step() -> None:
    assert parse_fault("hang:1:15") == Fault("hang", 1, 15)
    assert parse_fault("kill-in-save:0:20") == Fault("kill-in-save", 0, 20)
    for bad in ("hang:1", "boom:0:3", "kill:-1:3", "kill:0:0", "kill:a:3", "kill:0:3:4"):
        with pytest.raises(ValueError, match=f"--inject-fault takes KIND:RANK:STEP .*got '{bad}'"):
            parse_fault(bad)


def test_bad_fault_flags_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "run")
    for flags, said in ((["--inject-fault", "kill:one:3"], "--inject-fault takes KIND:RANK:STEP"),
                        (["--collective-timeout", "0"], "argument --collective-timeout: must be a finite number > 0")):
        with pytest.raises(SystemExit) as exited:  # argparse's own exit, through the type of the flag
            main(["train", "--out", out, *flags])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
    assert main(["train", "--out", out, "--max-restarts", "1"]) == 2
    assert "--max-restarts 1 restarts the ranks of --nproc N (N >= 2)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
