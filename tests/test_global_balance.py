"""aux_loss_type="global": the balance loss of the whole data-parallel batch, accumulated over micro-batches,
against a float64 reference written here (one process over every rank's tokens)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import flexmoe
from flexmoe import MoELayer
from flexmoe.launch import spawn_ranks
from global_balance_worker import MICRO_BATCHES, NUM_EXPERTS, STEPS, K, build_layer, run_rank, tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_step(weight: torch.Tensor, micro_batches: list[torch.Tensor]) -> tuple[list[float], torch.Tensor]:
    """One step in float64 and one process: micro-batch i's loss ``E * sum_e f_e P_e`` with f_e the share of all
    k choices of micro-batches 1..i that went to e and P_e the mean probability of e over micro-batch i; the
    gradient of ``sum_i loss_i / n`` with respect to the router ``weight: [E, M]``."""
    w = weight.detach().double().requires_grad_(True)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.float64)
    losses, total = [], torch.zeros((), dtype=torch.float64)
    for x in micro_batches:
        probs = torch.softmax(x.double() @ w.T, dim=-1)  # [T, E]
        chosen = probs.topk(K, dim=-1).indices  # no ties in random float64 scores
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=NUM_EXPERTS).double()
        loss = NUM_EXPERTS * ((counts / counts.sum()) * probs.mean(dim=0)).sum()
        losses.append(float(loss.detach()))
        total = total + loss / len(micro_batches)
    total.backward()
    assert w.grad is not None
    return losses, w.grad


def test_one_process_micro_batches_match_the_reference() -> None:
    layer = build_layer("single").train()
    for step in range(STEPS):
        batches = [tokens_of(step, micro, 0) for micro in range(MICRO_BATCHES)]
        layer.zero_grad()
        got = []
        for x in batches:
            layer(x)
            (layer.aux_loss / MICRO_BATCHES).backward()
            got.append(float(layer.aux_loss.detach()))
        want, want_grad = reference_step(layer.router.weight, batches)
        assert got == pytest.approx(want, rel=1e-6)
        torch.testing.assert_close(layer.router.weight.grad.double(), want_grad, rtol=1e-5, atol=1e-7)
        assert flexmoe.reset_global_balance(layer) == 1


def test_without_reset_the_counts_keep_accumulating() -> None:
    """The step boundary is the training loop's call: without reset_global_balance the next micro-batch still
    counts the earlier ones (so a loop that forgets the call gets another loss, never the same silently)."""
    layer = build_layer("single").train()
    first, second = tokens_of(0, 0, 0), tokens_of(0, 1, 0)
    layer(first)
    layer(second)
    accumulated = float(layer.aux_loss.detach())
    flexmoe.reset_global_balance(layer)
    layer(second)
    alone = reference_step(layer.router.weight, [second])[0][0]
    assert float(layer.aux_loss.detach()) == pytest.approx(alone, rel=1e-6)
    assert float(layer.aux_loss.detach()) != pytest.approx(accumulated, rel=1e-4)


def test_evaluation_is_the_call_alone() -> None:
    layer = build_layer("single").eval()
    x = tokens_of(0, 0, 0)
    with torch.no_grad():
        layer(x)
        layer(x)  # no accumulation outside training
    assert float(layer.aux_loss.detach()) == pytest.approx(reference_step(layer.router.weight, [x])[0][0], rel=1e-6)


def test_global_needs_a_top_k_router() -> None:
    with pytest.raises(ValueError, match="aux_loss_type needs a top-k router"):
        MoELayer(8, 4, 8, router="expert_choice", aux_loss_type="global")
    with pytest.raises(ValueError, match="aux_loss_type must be one of"):
        MoELayer(8, 4, 8, aux_loss_type="globl")


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["data-parallel", "expert-parallel"])
def test_two_ranks_equal_one_process_over_every_rank_s_tokens(expert_parallel: bool) -> None:
    ranks = spawn_ranks(2, run_rank, [expert_parallel], timeout=120, what="global balance with 2 ranks")
    reference = build_layer("single")
    for step in range(STEPS):
        batches = [torch.cat([tokens_of(step, micro, r) for r in range(2)]) for micro in range(MICRO_BATCHES)]
        want, want_grad = reference_step(reference.router.weight, batches)
        for rank in ranks:
            assert rank.value["losses"][step] == pytest.approx(want, rel=1e-6), f"rank {rank.rank} step {step}"
            got_grad = torch.tensor(rank.value["grads"][step], dtype=torch.float64)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)


def test_training_job_runs_with_the_global_loss(tmp_path) -> None:
    """`flexmoe train --aux-loss-type global --micro-batches 2` builds its layers with the global loss and logs it
    (a fresh router's balance loss is near 1 per layer)."""
    from flexmoe.apps import train_command as train

    out = tmp_path / "run"
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    argv = ["--out", str(out), "--steps", "3", "--log-every", "1", "--eval-every", "3", "--eval-batches", "1",
            "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--num-experts", "4",
            "--expert-hidden", "32", "--batch-size", "8", "--micro-batches", "2", "--aux-loss-type", "global",
            "--no-progress", "--no-plots"]
    assert train.run(parser.parse_args(argv)) == 0
    assert json.loads((out / "config.json").read_text())["model"]["aux_loss_type"] == "global"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(0.9 < r["balance_loss"] < 2.0 for r in records)  # one MoE layer
