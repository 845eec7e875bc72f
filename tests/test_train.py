"""The training job: loss goes down, run directory contents, --compare-dense, --target-loss, exact resume."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch._dynamo

from flexmoe.apps import cli, generate, reshard, train_command
from flexmoe_cli import check_usage_error

TINY_FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
              "--expert-hidden", "32", "--batch-size", "8", "--warmup", "5", "--lr", "1e-2", "--no-progress"]

# Tiny models run fastest on one thread (the fixture one_thread of tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread")


# Runs `flexmoe train` through the module's own add_arguments/run, as the CLI does.
RUNNER = (
    "import argparse, sys\n"
    "from flexmoe.apps import train_command\n"
    "p = argparse.ArgumentParser(); train_command.add_arguments(p)\n"
    "sys.exit(train_command.run(p.parse_args(sys.argv[1:])))\n"
)


def _run(module, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.run(parser.parse_args(argv))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_lowers_loss_and_writes_run_directory(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert _run(train_command, ["--out", str(out), "--steps", "40", "--log-every", "5", "--eval-every", "20",
                        "--ckpt-every", "20", "--eval-batches", "2", *TINY_FLAGS]) == 0
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(5, 45, 5))
    for r in records:
        assert {"step", "train_loss", "balance_loss", "drop_rate", "tokens_per_s", "expert_load"} <= set(r)
        assert len(r["expert_load"]) == 1 and len(r["expert_load"][0]) == 4  # one MoE layer of 4 experts
    vals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in vals] == [20, 40]
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.5
    assert vals[-1]["val_loss"] < 5.0  # ln(256) = 5.55 at the start
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["num_experts"] == 4 and config["train"]["steps"] == 40
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] == vals[-1]["val_loss"]
    for png in ("loss.png", "expert_load.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoints" / "step_000040" / "model.safetensors").is_file()

    # generate samples from the checkpoint, reshard converts it offline.
    capsys.readouterr()
    assert _run(generate, ["--run", str(out), "--tokens", "40", "--prompt", "ROMEO:"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text) >= 40
    assert _run(reshard, [str(out), "--world-size", "2", "--out", str(tmp_path / "r2")]) == 0
    assert (tmp_path / "r2" / "model-rank00001-of-00002.safetensors").is_file()
    assert "(2 ranks)" in capsys.readouterr().out
    assert _run(generate, ["--run", str(tmp_path / "r2"), "--tokens", "40", "--prompt", "ROMEO:"]) == 0
    assert capsys.readouterr().out == text  # the resharded checkpoint is the same model


def test_compare_dense_and_target_loss(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert _run(train_command, ["--out", str(out), "--steps", "30", "--eval-every", "10", "--eval-batches", "2",
                        "--compare-dense", "--target-loss", "4.5", "--stop-at-target", *TINY_FLAGS]) == 0
    payload = json.loads((out / "compare.json").read_text())
    for name in ("moe", "dense"):
        assert isinstance(payload[name]["final_val_loss"], float)
        target = payload[name]["target"]
        assert target["val_loss"] <= 4.5 and target["tokens"] == target["step"] * 8 * 32
        assert target["wall_time_s"] > 0
        assert payload[name]["steps"] == target["step"] < 30  # --stop-at-target stopped the run there
    # Equal active compute: the MoE model adds only its router and the k-fold output bias per token.
    extra = payload["moe"]["active_params"] - payload["dense"]["active_params"]
    assert 0 < extra <= 32 * 4 + 32
    assert payload["lower_val_loss"] in ("moe", "dense")
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "| moe |" in (out / "compare.md").read_text()
    assert (out / "dense" / "metrics.jsonl").is_file()


def _popen(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["--out", str(out), "--steps", str(steps), "--ckpt-every", "25", "--eval-every", "50",
            "--eval-batches", "1", "--log-every", "1", "--no-plots", *TINY_FLAGS, *extra]
    return subprocess.Popen([sys.executable, "-c", RUNNER, *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # 3 runs of the job (70 s on 2 cores); test_cli's signal tests cover resume in the default suite
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path: Path) -> None:
    steps = 300
    ref = _popen(tmp_path / "ref", steps)
    victim = _popen(tmp_path / "victim", steps)
    latest = tmp_path / "victim" / "checkpoints" / "latest.json"
    deadline = time.time() + 60
    while time.time() < deadline and victim.poll() is None:
        if latest.is_file() and json.loads(latest.read_text())["step"] >= 50:
            break
        time.sleep(0.01)
    assert victim.poll() is None, "the run ended before it could be killed"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = max(r["step"] for r in _metrics(tmp_path / "victim"))
    assert killed_at < steps
    assert ref.wait() == 0, ref.stderr.read()

    resumed = _popen(tmp_path / "victim", steps, "--resume")
    assert resumed.wait() == 0, resumed.stderr.read()
    a, b = _metrics(tmp_path / "ref"), _metrics(tmp_path / "victim")
    assert [r["step"] for r in b] == list(range(1, steps + 1))
    for ra, rb in zip(a, b):
        # Bit-for-bit: every logged loss after the resume equals the uninterrupted run's.
        assert (ra["step"], ra["train_loss"], ra.get("val_loss")) == (rb["step"], rb["train_loss"], rb.get("val_loss"))
        assert ra["expert_load"] == rb["expert_load"]


def test_launch_argv_round_trips() -> None:
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    args = parser.parse_args(["--out", "x", "--steps", "7", "--nproc", "2", "--compare-dense", "--k", "1"])
    argv = train_command.forward_argv(args)
    assert "--nproc" not in argv
    again = parser.parse_args(argv)
    assert (again.out, again.steps, again.compare_dense, again.k, again.nproc) == ("x", 7, True, 1, 1)


def test_resume_from_corrupted_checkpoint_fails_clearly(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--out", str(out), "--steps", "4", "--ckpt-every", "2", "--eval-every", "4", "--eval-batches", "1",
            "--no-plots", *TINY_FLAGS]
    assert _run(train_command, argv) == 0
    weights = out / "checkpoints" / "step_000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    capsys.readouterr()
    assert cli.main(["train", *argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert str(weights) in err and "truncated: tensor '" in err


@pytest.mark.slow  # 17 s
def test_compiled_run_equals_eager_and_its_checkpoint_resumes_eager(tmp_path: Path, capsys) -> None:
    """--compile trains the same model: the eager run is the reference, step by step. A compiled run's
    checkpoint keeps the eager parameter names (nn.Module.compile, in place), so an eager --resume continues
    it; aot_eager keeps the test fast (the same graphs as inductor's, run by eager kernels)."""
    flags = ["--log-every", "1", "--eval-every", "3", "--ckpt-every", "3", "--eval-batches", "2", *TINY_FLAGS]
    assert _run(train_command, ["--out", str(tmp_path / "eager"), "--steps", "6", *flags]) == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    mixed = ["--out", str(tmp_path / "mixed"), "--steps", "3", "--compile", "aot_eager", *flags]
    assert _run(train_command, mixed) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # it did compile
    assert "under torch.compile (backend aot_eager)" in capsys.readouterr().out
    assert json.loads((tmp_path / "mixed" / "config.json").read_text())["train"]["compile"] == "aot_eager"
    assert _run(train_command, ["--out", str(tmp_path / "mixed"), "--resume", "--steps", "6", *flags]) == 0
    want, got = _metrics(tmp_path / "eager"), _metrics(tmp_path / "mixed")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(want, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6), a["step"]
        assert (a.get("val_loss") is None) == (b.get("val_loss") is None)
        if a.get("val_loss") is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5, abs=1e-6), a["step"]


def test_compile_flag_rejects_an_unknown_backend(tmp_path: Path) -> None:
    check_usage_error("train", "--out", str(tmp_path / "run"), "--steps", "1", "--compile", "no-such-backend",
                      says="--compile: torch.compile has no backend 'no-such-backend'")
    assert not (tmp_path / "run").exists()  # rejected before anything is written


def test_learning_rate_warms_up_linearly_then_follows_the_cosine() -> None:
    """set_lr of 1-based step s against the schedule written out here: lr * s / warmup for the first warmup steps
    (the first step already learns), then min_lr + (lr - min_lr) (1 + cos(pi p)) / 2 with p the fraction of the
    decay steps done before step s."""
    import math

    from flexmoe.apps.train_config import TrainConfig
    from flexmoe.apps.train_step import set_lr

    lr, min_lr, warmup, steps = 1e-3, 1e-4, 4, 12
    tcfg = TrainConfig(lr=lr, min_lr=min_lr, warmup=warmup, steps=steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    got = []
    for s in range(1, steps + 1):
        got.append(set_lr(optimizer, s, tcfg))
        assert optimizer.param_groups[0]["lr"] == got[-1]
    want = [lr * s / warmup for s in range(1, warmup + 1)]
    want += [min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (s - 1 - warmup) / (steps - warmup))) / 2
             for s in range(warmup + 1, steps + 1)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[warmup - 1] == pytest.approx(lr) and got[warmup] == pytest.approx(lr)  # the peak, held one step
