"""``flexmoe train --optimizer muon``: the MoE GPT and a Hugging Face model train with MuonWithAdamW, save its
state in their checkpoints and resume exactly; a resumed run keeps its optimizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexmoe.apps import cli
from flexmoe_cli import child_pythonpath

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
        "--expert-hidden", "32", "--batch-size", "8", "--warmup", "5", "--lr", "1e-2", "--log-every", "1",
        "--eval-every", "4", "--eval-batches", "1", "--ckpt-every", "4", "--no-progress", "--no-plots"]


# --warmup 5: the runs cut at step 4 are still warming up there, where the learning rate does not depend on
# --steps (the cosine decay after it does), so the cut run and the whole one step alike.


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _saved_groups(out: Path, step: int) -> list[dict]:
    meta = json.loads((out / "checkpoints" / f"step_{step:06d}" / "meta.json").read_text())
    return meta["optimizer"]["param_groups"]


def test_the_gpt_trains_with_muon_and_resumes_as_the_uninterrupted_run(tmp_path: Path) -> None:
    assert cli.main(["train", "--out", str(tmp_path / "whole"), "--steps", "8", "--optimizer", "muon", *TINY]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "adamw"), "--steps", "8", *TINY]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "cut"), "--steps", "4", "--optimizer", "muon", *TINY]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "cut"), "--steps", "8", "--resume", *TINY]) == 0
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 8 and whole[-1] < whole[0] - 0.5
    assert _losses(tmp_path / "cut") == whole
    assert _losses(tmp_path / "adamw")[1:] != whole[1:]  # the first step's loss is before any update
    groups = _saved_groups(tmp_path / "whole", 8)
    assert [g["use_muon"] for g in groups].count(True) >= 1 and groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    muon_names = {n for g in groups if g["use_muon"] for n in g["params"]}
    assert "blocks.1.mlp.experts.w1" in muon_names and "tok_emb.weight" not in muon_names
    assert "head.weight" not in muon_names


def test_a_resumed_run_keeps_its_optimizer(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(["train", "--out", str(out), "--steps", "4", "--optimizer", "muon", *TINY]) == 0
    assert cli.main(["train", "--out", str(out), "--steps", "8", "--resume", "--optimizer", "adamw", *TINY]) == 2
    assert "--optimizer adamw differs" in capsys.readouterr().err


@pytest.mark.slow
def test_a_hugging_face_model_trains_with_muon_its_gated_pair_as_two_matrices(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the HF job needs transformers (pip install -e .[hf])")
    flags = ["--hf-arch", "mixtral", "--optimizer", "muon", "--batch-size", "4", "--block-size", "32", "--warmup",
             "5", "--lr", "1e-2", "--log-every", "1", "--eval-every", "4", "--eval-batches", "1", "--ckpt-every",
             "4", "--no-progress", "--no-plots"]
    assert cli.main(["train", "--out", str(tmp_path / "whole"), "--steps", "8", *flags]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "cut"), "--steps", "4", *flags]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "cut"), "--steps", "8", "--resume", *flags[:2]]) == 0
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 8 and whole[-1] < whole[0]
    assert _losses(tmp_path / "cut") == whole
    groups = _saved_groups(tmp_path / "whole", 8)
    pairs = [g for g in groups if g.get("last_dim_parts") == 2]
    assert pairs and all(g["use_muon"] for g in pairs)
    head = {n for g in groups if not g["use_muon"] for n in g["params"]}
    assert "hf.lm_head.weight" in head and "hf.model.embed_tokens.weight" in head


@pytest.mark.slow
def test_fsdp_with_muon_resumes_from_its_dcp_checkpoint_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """flexmoe train --nproc 2 --ep 2 --fsdp --optimizer muon logs the replicated run's losses (wrap_ddp, experts
    over the ranks); its momentum buffers (DTensors for the sharded part, plain tensors for each rank's experts)
    go into the DCP checkpoint at step 3, and the run resumed from it logs the uninterrupted run's losses."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(Path(__file__).resolve().parents[1] / "src")}
    flags = [*TINY, "--nproc", "2", "--ep", "2", "--fsdp", "--optimizer", "muon", "--warmup", "3", "--ckpt-every",
             "3"]  # the last of a flag given twice wins

    def train(out: Path, *argv: str) -> None:
        done = subprocess.run([sys.executable, "-m", "flexmoe", "train", "--out", str(out), *argv],
                              capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    train(tmp_path / "whole", "--steps", "6", *flags)
    train(tmp_path / "replicated", "--steps", "6", *[f for f in flags if f != "--fsdp"])  # wrap_ddp + EP
    assert _losses(tmp_path / "replicated") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-5)
    train(tmp_path / "cut", "--steps", "3", *flags)
    assert (tmp_path / "cut" / "checkpoints" / "dcp-step_000003").is_dir()
    train(tmp_path / "cut", "--steps", "6", "--resume", "--nproc", "2", "--no-progress")
    whole = _losses(tmp_path / "whole")
    assert len(whole) == 6 and _losses(tmp_path / "cut") == whole
