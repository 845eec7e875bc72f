"""Replicated experts (``redundant_experts=R``): the placement's pure rules, and 2- and 4-rank gloo runs against
one process holding every expert (tests/replica_worker.py)."""

from __future__ import annotations

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.launch import spawn_ranks
from flexmoe.parallel import ParallelOptions
from flexmoe.parallel.placement import EMPTY, ReplicaPlacement, eplb_placement, replica_rows_per_rank, split_rows


def test_split_rows_keeps_local_rows_then_fills_even_quotas():
    # E=4 over W=2: rank 0 owns 0, 1; rank 1 owns 2, 3. Rank 1 copies expert 0, rank 0 copies expert 3.
    placement = ReplicaPlacement(4, ((3,), (0,)))
    assert placement.holders(0) == [0, 1] and placement.holders(3) == [1, 0]
    all_counts = [[10, 1, 0, 3], [4, 0, 2, 6]]
    sends = split_rows(all_counts, placement)
    # Expert 0: 14 rows, quotas 7 (owner rank 0) and 7 (rank 1). Rank 1 keeps its 4, rank 0 keeps 7 and sends 3.
    assert sends[0][0] == [7, 3] and sends[1][0] == [0, 4]
    # Expert 3: 9 rows, quotas 5 (owner rank 1) and 4 (rank 0). Rank 0 keeps its 3, rank 1 keeps 5, sends 1.
    assert sends[0][3] == [0, 3] and sends[1][3] == [5, 1]
    assert sends[0][1] == [1] and sends[1][2] == [2]  # unreplicated experts: all to the owner
    assert replica_rows_per_rank(all_counts, placement) == [7 + 1 + 4, 7 + 2 + 5]
    assert replica_rows_per_rank(all_counts, ReplicaPlacement.unreplicated(4, 2)) == [15, 11]


def test_eplb_replicates_the_heaviest_and_packs_onto_the_lightest_rank():
    # Expert 0 is hot (100 rows): two copies (the cap is one per rank), then expert 4 (ties: lowest id).
    # Rows 100 | 40: the copy of expert 0 goes to rank 1 (50 | 90), expert 4's to rank 0 (55 | 85).
    assert eplb_placement([100, 0, 0, 0, 10, 10, 10, 10], 2, 1).replicas == ((4,), (0,))
    # Four ranks: expert 0 (rank 0) has 90 rows, expert 6 (rank 3) 30. EPLB wants 3 more copies of expert 0
    # and one of expert 6. Two copies of 0 go to the idle ranks 1 and 2 (30 rows each); a third on rank 3
    # (30 + 22.5 > 30) and expert 6's on rank 0 would raise the busiest rank: dropped, and those slots stay
    # empty. Every rank then computes 30 rows, the mean.
    placement = eplb_placement([90, 0, 0, 0, 0, 0, 30, 0], 4, 1)
    assert placement.replicas == ((EMPTY,), (0,), (0,), (EMPTY,))
    assert replica_rows_per_rank([[90, 0, 0, 0, 0, 0, 30, 0]] + [[0] * 8] * 3, placement) == [30] * 4


@pytest.mark.parametrize("bad, match", [
    (lambda: ReplicaPlacement(4, ((0,), (1,))), "does not own"),
    (lambda: ReplicaPlacement(4, ((2, 2), (0, 1))), "distinct"),
    (lambda: ReplicaPlacement(4, ((2,), (0, 1))), "needs 1 replica slots"),
    (lambda: eplb_placement([1.0] * 4, 2, 3), r"redundant_experts must be in \[0, 2\]"),
    (lambda: eplb_placement([1.0] * 6, 4, 1), "whole experts"),
    (lambda: ParallelOptions(redundant_experts=-1), "redundant_experts"),
    (lambda: MoELayer(8, 4, 16, redundant_experts=1, group="single"), "more than one rank"),
])
def test_bad_replica_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_redundant_experts_is_not_a_call_option():
    layer = MoELayer(8, 4, 16, group="single")
    with pytest.raises(TypeError, match="redundant_experts"):
        layer(torch.randn(3, 8), redundant_experts=1)


def _reports(world: int, target, args=(), timeout: float = 240) -> list[dict]:
    ranks = spawn_ranks(world, target, list(args), timeout=timeout, check=True, what=f"{world} replica ranks")
    reports = [r.value for r in ranks]
    failures = [f"rank {rep['rank']}: {f}" for rep in reports for f in rep["failures"]]
    assert not failures, "\n".join(failures)
    return reports


def _check_calls(world: int) -> None:
    from replica_worker import HOT, calls_main

    reports = _reports(world, calls_main)
    for case, rep in reports[0]["rows"].items():
        # Every rank computed the rows the placement's split names (checked on each rank), and under the hot
        # placement the busiest rank computes fewer rows than the static layout's busiest.
        assert sum(rep["rows"]) == sum(rep["static_rows"]), case
        if case.endswith("/hot"):
            assert all(set(HOT) & set(s) for s in rep["slots"]), case
            assert max(rep["rows"]) < max(rep["static_rows"]), (case, rep)


def test_replicated_forward_and_gradients_equal_one_process_2_ranks():
    _check_calls(2)


@pytest.mark.slow
def test_replicated_forward_and_gradients_equal_one_process_4_ranks():
    _check_calls(4)


def _check_training(world: int) -> None:
    from replica_worker import ROUTINGS, train_main

    reports = _reports(world, train_main)
    for routing in ROUTINGS:
        run = reports[0][routing]
        placements = run["placements"]
        # Re-placed every 5 steps from the load window, the same on every rank; from then on the busiest rank
        # computes fewer rows than the static layout's busiest would (the same calls' counts).
        assert len(placements) == 4 and all(rep[routing]["placements"] == placements for rep in reports)
        assert placements[0] != run["start"], (routing, placements)
        assert sum(run["busiest"][5:]) < sum(run["static_busiest"][5:]), (routing, run)


def test_training_with_replacement_equals_one_process_2_ranks():
    _check_training(2)


@pytest.mark.slow
def test_training_with_replacement_equals_one_process_4_ranks():
    _check_training(4)


@pytest.mark.slow
def test_resume_across_a_replacement_is_bit_identical(tmp_path):
    from replica_worker import resume_main

    _reports(2, resume_main, [str(tmp_path)])


def test_cost_model_prices_the_busiest_rank_of_a_replicated_placement():
    from flexmoe.tuning.cost_model import LayerConfig, choose_placement, ffn_times, layer_time, price_placements
    from flexmoe.tuning.profile import load_profile

    profile = load_profile("a100-ndv4")
    config = LayerConfig(tokens=1000, model_dim=256, hidden_dim=512, experts=4, k=1, capacity_factor=0.0,
                         ranks=2, token_exchange=False)
    prices = price_placements(profile, config, [60, 20, 10, 10], redundant=1)
    # EPLB with rank 0 owning experts 0, 1: expert 0 gets a copy on rank 1; expert 1's copy has no rank (its
    # own cannot, rank 1's slot is taken), rank 0's slot stays empty. Rows (2 ranks x 1000 tokens, shares
    # 0.6/0.2/0.1/0.1): static rank 0 computes 1200 + 400; replicated, rank 0 600 (half of expert 0) + 400 and
    # rank 1 200 + 200 + 600: the straggler is the one whose three expert calls take longer.
    assert prices["replicated"][1] == ((EMPTY,), (0,))

    def compute(rows: list[int]) -> float:
        return sum(sum(ffn_times(profile, n, 256, 512, "float32")) for n in rows)

    shares = (0.6, 0.2, 0.1, 0.1)
    static = layer_time(profile, LayerConfig(**{**config.__dict__, "expert_shares": shares}))
    replicated = layer_time(profile, LayerConfig(**{**config.__dict__, "expert_shares": shares,
                                                    "replicas": ((EMPTY,), (0,))}))
    straggler = max(compute([600, 400]), compute([200, 200, 600]))
    assert replicated.experts - static.experts == pytest.approx(straggler - compute([1200, 400]))
    assert replicated.weights_comm > 0 and static.weights_comm == 0
    # 64 experts on 64 GPUs, k = 8, three experts with 3.2x the mean load: shadowing one costs a broadcast to
    # 64 ranks and the model shadows none; two replica slots per rank win. An even load: the static layout.
    wide = LayerConfig(tokens=4096, model_dim=2048, hidden_dim=768, experts=64, k=8, capacity_factor=0.0,
                       ranks=64, dtype="bfloat16")
    skewed = [3.2, 3.2, 3.2] + [1.0] * 61
    assert choose_placement(profile, wide, skewed, 2) == "replicated"
    assert choose_placement(profile, wide, [1.0] * 64, 2) == "static"


def test_simulate_prices_placements_on_a_load_trace(tmp_path, capsys):
    import json

    from flexmoe.apps.cli import main
    from flexmoe.apps.simulate_placement import read_load_trace, stretch_load

    # The trace's cumulative curve, stretched: half the load on a third of the experts stays so at 6 experts.
    assert stretch_load([0.25, 0.5, 0.25], 6) == pytest.approx([0.25, 0.25, 0.125, 0.125, 0.125, 0.125])
    trace = tmp_path / "metrics.jsonl"
    trace.write_text("\n".join(json.dumps({"step": s, "expert_load": [[30, 10, 10, 10], [10, 30, 10, 10]]})
                               for s in (10, 20)) + "\n" + json.dumps({"step": 30, "val_loss": 1.0}) + "\n")
    assert read_load_trace(trace) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])  # each layer sorted, averaged
    # A sharply skewed trace (one expert in 16 takes 40% of the rows) for the table.
    trace.write_text(json.dumps({"expert_load": [[60] + [6] * 15]}) + "\n")
    assert main(["simulate", "--load-trace", str(trace), "--gpus", "8,16", "--k", "8"]) == 0
    table = capsys.readouterr().out
    lines = [line.split() for line in table.splitlines() if line[:4].strip() in ("64", "128", "256")]
    assert [(int(c[0]), int(c[1])) for c in lines] == [(64, 8), (64, 16), (128, 8), (128, 16), (256, 8), (256, 16)]
    for cells in lines:  # the busiest rank's share falls with replicas, toward 1 / EP; the choice is the fastest
        assert 1 / int(cells[2]) - 1e-9 <= float(cells[-1]) < float(cells[-2])
        times = dict(zip(("static", "shadowing", "replicated"), map(float, cells[3:6])))
        assert times[cells[6]] == min(times.values())
    assert "assumptions:" in table
    (tmp_path / "empty.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert main(["simulate", "--load-trace", str(tmp_path / "empty.jsonl")]) != 0
    assert "no expert_load records" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--redundant-experts", "2"], "needs --nproc 2 or more"),
    (["--replace-every", "5"], "needs --redundant-experts"),
])
def test_train_refuses_replicas_it_cannot_run(tmp_path, capsys, flags, message):
    from flexmoe.apps.cli import main

    code = main(["train", "--out", str(tmp_path / "run"), "--steps", "1", "--no-plots", "--no-progress", *flags])
    assert code != 0 and message in capsys.readouterr().err


@pytest.mark.slow
def test_train_job_logs_the_placement_with_two_ranks(tmp_path):
    import json

    from flexmoe.apps.cli import main

    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "10", "--nproc", "2", "--redundant-experts", "2",
                 "--replace-every", "5", "--log-every", "5", "--eval-every", "1000", "--eval-batches", "1",
                 "--n-layer", "2", "--n-embd", "64", "--expert-hidden", "64", "--no-plots", "--no-progress"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    placements = [r["placement"] for r in records if "placement" in r]
    assert len(placements) == 2
    for p in placements:  # one MoE layer of 2 ranks x 2 slots; shares of the busiest rank between 1/2 and 1
        assert len(p["replicas"]) == 1 and [len(s) for s in p["replicas"][0]] == [2, 2]
        for key in ("busiest_share_static", "busiest_share", "busiest_share_replaced"):
            assert 0.5 <= p[key][0] <= 1.0


@pytest.mark.slow
def test_train_job_resumed_across_a_replacement_is_bit_identical(tmp_path):
    import json

    from flexmoe.apps.cli import main

    out = tmp_path / "run"
    flags = ["--nproc", "2", "--redundant-experts", "2", "--replace-every", "2", "--log-every", "1",
             "--ckpt-every", "3", "--eval-every", "1000", "--eval-batches", "1", "--n-layer", "2", "--n-embd", "64",
             "--expert-hidden", "64", "--no-plots", "--no-progress"]
    assert main(["train", "--out", str(out), "--steps", "6", *flags]) == 0
    straight = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Back to the checkpoint of step 3 (between the re-placements of steps 2 and 4), then on to step 6.
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"step": 3, "path": "step_000003"}))
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--nproc", "2", "--no-progress"]) == 0
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "train_loss", "expert_load", "placement")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in straight]
