"""flexmoe.hf.ExpertParallelTrainer at 2 gloo ranks (tests/hf_trainer_worker.py) against plain
``transformers.Trainer`` in one process on HF's own (unconverted) model and the same data: the losses, gradient
norms (clipped), evaluation and predictions agree to float32 drift; the checkpoints are HF checkpoints that plain
``from_pretrained`` loads, equal to plain Trainer's; a resumed run equals the uninterrupted one; a checkpoint
lacking an expert tensor is refused naming it; the balance metrics and aux loss are logged as computed here from
HF's router logits."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from flexmoe.launch import spawn_ranks  # noqa: E402
from hf_trainer_worker import counting_sequences, sft_main, tiny_config, train_main  # noqa: E402
from multiproc import failures_of  # noqa: E402

# 4 optimizer steps of 2 micro-batches of 8 rows (4 per rank), a checkpoint every 2; clipping at 0.5 is active
# (the norms are ~0.9).
OPTIONS = {"steps": 4, "batch": 8, "accumulate": 2, "save_steps": 2, "max_grad_norm": 0.5}


def _run(world: int, directory: Path, kind: str, options: dict | None = None) -> dict:
    """Rank 0's report of ``train_main`` (``sft_main`` without ``options``) on ``world`` ranks; fails with
    every rank's failures."""
    main, args = (train_main, [str(directory), kind, options]) if options is not None else (
        sft_main, [str(directory), kind])
    reports = [r.value for r in spawn_ranks(world, main, args, timeout=400, check=True,
                                            what=f"{main.__name__} {kind} on {world} ranks")]
    failures = failures_of(reports)
    assert not failures, "\n".join(failures)
    return reports[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Plain Trainer in one process; ExpertParallelTrainer at 2 ranks from the same plain model; the latter
    resumed from its step-2 checkpoint into a model initialised from another seed."""
    root = tmp_path_factory.mktemp("hf_trainer")
    plain = _run(1, root / "plain", "plain", OPTIONS)
    ep = _run(2, root / "ep", "ep", OPTIONS)
    resumed = _run(2, root / "ep", "ep", {**OPTIONS, "resume": "checkpoint-2", "model_seed": 7, "final": "resumed"})
    return {"root": root, "plain": plain, "ep": ep, "resumed": resumed}


def _hf_state(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def test_expert_parallel_trainer_matches_one_process(runs: dict) -> None:
    plain, ep = runs["plain"], runs["ep"]
    assert ep["experts_held"] == [2, 2], "each of the 2 ranks holds 2 of the 4 experts of both MoE blocks"
    assert sorted(ep["losses"]) == sorted(plain["losses"]) == ["1", "2", "3", "4"]
    for step, loss in plain["losses"].items():
        assert ep["losses"][step] == pytest.approx(loss, rel=1e-5), f"loss at step {step}"
        assert ep["grad_norms"][step] == pytest.approx(plain["grad_norms"][step], rel=1e-5), f"norm at {step}"
    assert min(plain["grad_norms"].values()) > OPTIONS["max_grad_norm"], "the case must clip"
    assert ep["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert ep["eval_before"] == pytest.approx(plain["eval_before"], rel=1e-5)
    assert ep["eval_before"] > ep["eval_loss"], "training lowered the evaluation loss"
    got, want = torch.tensor(ep["predictions"]), torch.tensor(plain["predictions"])
    assert got.shape == want.shape == (8, 16, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_checkpoints_are_plain_trainers(runs: dict) -> None:
    """Periodic checkpoints and save_model load with plain from_pretrained, equal to plain Trainer's; each rank
    wrote its own optimizer state."""
    root = runs["root"]
    for name in ("checkpoint-2", "checkpoint-4", "final"):
        got, want = _hf_state(root / "ep" / name), _hf_state(root / "plain" / name)
        assert sorted(got) == sorted(want)
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-4, msg=f"{name}: {key}")
    saved = sorted(p.name for p in (root / "ep" / "checkpoint-2").glob("*optimizer.pt"))
    assert saved == ["rank0-of-2-optimizer.pt", "rank1-of-2-optimizer.pt"]


def test_resume_equals_the_uninterrupted_run(runs: dict) -> None:
    root, ep, resumed = runs["root"], runs["ep"], runs["resumed"]
    for step in ("3", "4"):  # trained after the resume, from a model initialised from another seed
        assert resumed["losses"][step] == pytest.approx(ep["losses"][step], rel=1e-6, abs=0), f"loss at {step}"
        assert resumed["grad_norms"][step] == pytest.approx(ep["grad_norms"][step], rel=1e-6, abs=0)
    got, want = _hf_state(root / "ep" / "resumed"), _hf_state(root / "ep" / "final")
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-6, atol=1e-7, msg=key)


def test_resume_refuses_a_checkpoint_missing_an_expert(runs: dict, tmp_path: Path) -> None:
    """Plain Trainer would load the rest and keep the model's own expert (a non-strict load)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, TrainingArguments

    from flexmoe.hf import ExpertParallelTrainer

    broken = tmp_path / "checkpoint-2"
    shutil.copytree(runs["root"] / "plain" / "checkpoint-2", broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, report_to="none", use_cpu=True,
                             disable_tqdm=True)
    trainer = ExpertParallelTrainer(model=AutoModelForCausalLM.from_config(tiny_config()), args=args,
                                    train_dataset=counting_sequences(64))
    with pytest.raises(ValueError, match=r"expert 3's tensor of model\.layers\.1\.mlp\.experts\.down_proj"):
        trainer.train(resume_from_checkpoint=str(broken))


def test_balance_metrics_and_aux_loss_are_logged(tmp_path: Path) -> None:
    """One step on a batch of one row repeated: the logged ``moe/aux_loss`` is HF's model's aux loss on it and
    ``moe/max_over_mean`` the busiest expert's share over the mean, from HF's router logits, mean over layers."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from flexmoe.hf import ExpertParallelTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(output_router_logits=True))
    row = counting_sequences(1, seed=4)[0]
    with torch.no_grad():
        out = copy.deepcopy(model)(input_ids=row["input_ids"][None], labels=row["labels"][None])
    loads = [torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=4).double()
             for logits in out.router_logits]
    want_max_over_mean = sum(float(load.max() / load.mean()) for load in loads) / len(loads)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = ExpertParallelTrainer(model=model, args=args, train_dataset=[row] * 8)
    trainer.train()
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    assert logged["moe/aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert logged["moe/max_over_mean"] == pytest.approx(want_max_over_mean, rel=1e-6)
    assert logged["loss"] == pytest.approx(float(out.loss), rel=1e-5)


def test_refuses_what_it_cannot_train() -> None:
    from flexmoe.hf import ExpertParallelTrainer

    with pytest.raises(TypeError, match="model must be a transformers MoE model"):
        ExpertParallelTrainer(model=None)


@pytest.mark.slow
def test_expert_replicas_at_4_ranks(tmp_path: Path) -> None:
    """4 ranks as 2 expert-parallel groups of 2 (each expert on 2 ranks): the losses and clipped norms of plain
    Trainer in one process, and its checkpoint."""
    plain = _run(1, tmp_path / "plain", "plain", OPTIONS)
    ep = _run(4, tmp_path / "ep", "ep", {**OPTIONS, "ep_size": 2})
    assert ep["experts_held"] == [2, 2]
    for step, loss in plain["losses"].items():
        assert ep["losses"][step] == pytest.approx(loss, rel=1e-5), f"loss at step {step}"
        assert ep["grad_norms"][step] == pytest.approx(plain["grad_norms"][step], rel=1e-5), f"norm at {step}"
    got, want = _hf_state(tmp_path / "ep" / "final"), _hf_state(tmp_path / "plain" / "final")
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.slow
def test_sharded_beside_the_experts(tmp_path: Path) -> None:
    """A model laid out by flexmoe.sharding.parallelize (mesh ep=2: the experts over the ranks, the rest sharded
    by FSDP2 over both; and ep=2 x dp_shard=2 at 4 ranks, the experts sharded too) trains as plain Trainer in one
    process, saves HF checkpoints equal to its, and resumes equal to the uninterrupted run (an evaluation before
    training leaves units gathered: both survive it)."""
    plain = _run(1, tmp_path / "plain", "plain", OPTIONS)
    sharded = {**OPTIONS, "mesh": {"ep": 2, "dp_shard": 1}}
    ep = _run(2, tmp_path / "ep", "ep", sharded)
    resumed = _run(2, tmp_path / "ep", "ep", {**sharded, "resume": "checkpoint-2", "model_seed": 7,
                                               "final": "resumed"})
    for step, loss in plain["losses"].items():
        assert ep["losses"][step] == pytest.approx(loss, rel=1e-5), f"loss at step {step}"
        assert ep["grad_norms"][step] == pytest.approx(plain["grad_norms"][step], rel=1e-5), f"norm at {step}"
        assert resumed["losses"][step] == pytest.approx(ep["losses"][step], rel=1e-6, abs=0), f"resumed {step}"
    wide = _run(4, tmp_path / "wide", "ep", {**OPTIONS, "mesh": {"ep": 2, "dp_shard": 2}})  # experts sharded too
    for step, loss in plain["losses"].items():
        assert wide["losses"][step] == pytest.approx(loss, rel=1e-5), f"4 ranks: loss at step {step}"
    for got_dir, want_dir, tol in (("ep/checkpoint-2", "plain/checkpoint-2", 1e-4), ("ep/final", "plain/final", 1e-4),
                                   ("ep/resumed", "ep/final", 1e-7), ("wide/final", "plain/final", 1e-4)):
        got, want = _hf_state(tmp_path / got_dir), _hf_state(tmp_path / want_dir)
        assert sorted(got) == sorted(want)
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, rtol=tol, atol=tol, msg=f"{got_dir}: {key}")


@pytest.mark.slow
def test_bf16_autocast_and_gradient_checkpointing(tmp_path: Path) -> None:
    """bf16 autocast and gradient checkpointing at 2 ranks against plain Trainer in one process with both: the
    losses agree to bf16 rounding."""
    options = {**OPTIONS, "bf16": True, "checkpointing": True}
    plain = _run(1, tmp_path / "plain", "plain", options)
    ep = _run(2, tmp_path / "ep", "ep", options)
    for step, loss in plain["losses"].items():
        assert ep["losses"][step] == pytest.approx(loss, rel=2e-2), f"loss at step {step}"
    assert plain["losses"]["4"] < plain["losses"]["1"]


def test_trl_sft_trainer_on_expert_parallelism(tmp_path: Path) -> None:
    """TRL's SFTTrainer with ExpertParallelTrainer mixed in, at 2 ranks of 4 rows, against plain SFTTrainer in one
    process accumulating 2 micro-batches of 4 rows: the same losses. Runs where ``trl`` is installed (``pip install
    trl``; not a dependency of flexmoe)."""
    pytest.importorskip("trl")
    plain, ep = _run(1, tmp_path / "plain", "plain"), _run(2, tmp_path / "ep", "ep")
    assert sorted(plain["losses"]) == ["1", "2", "3"]
    for step, loss in plain["losses"].items():
        assert ep["losses"][step] == pytest.approx(loss, rel=1e-5), f"loss at step {step}"
    assert ep["moe_logged"]
