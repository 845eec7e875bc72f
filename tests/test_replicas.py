"""Replicated experts (``redundant_experts=R``): the placement's pure rules, and 2- and 4-rank gloo runs against
one process holding every expert (tests/replica_worker.py)."""

from __future__ import annotations

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.launch import spawn_ranks
from flexmoe.parallel import ParallelOptions
from flexmoe.parallel.placement import ReplicaPlacement, eplb_placement, replica_rows_per_rank, split_rows


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
    # Rank loads from owned experts per copy: rank 0: 50, rank 1: 5 + 30 = 35. The copy of expert 0 can only
    # go to rank 1, the copy of expert 4 only to rank 0.
    assert eplb_placement([100, 0, 0, 0, 10, 10, 10, 10], 2, 1).replicas == ((4,), (0,))
    # Four ranks, one hot expert per rank pair: the lightest ranks take the copies of the heaviest.
    placement = eplb_placement([90, 0, 0, 0, 0, 0, 30, 0], 4, 1)
    assert sorted(placement.holders(0)) == [0, 1, 2, 3] and placement.holders(6)[0] == 3


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
    from replica_worker import HOT, ROUTINGS, train_main

    reports = _reports(world, train_main)
    for routing in ROUTINGS:
        run = reports[0][routing]
        placements = run["placements"]
        # Re-placed every 5 steps from the load window: the same on every rank, and the hot experts copied.
        assert len(placements) == 4 and all(rep[routing]["placements"] == placements for rep in reports)
        assert placements[0] != run["start"] and set(HOT) <= {e for slots in placements[0] for e in slots}, \
            (routing, run["start"], placements)


def test_training_with_replacement_equals_one_process_2_ranks():
    _check_training(2)


@pytest.mark.slow
def test_training_with_replacement_equals_one_process_4_ranks():
    _check_training(4)


@pytest.mark.slow
def test_resume_across_a_replacement_is_bit_identical(tmp_path):
    from replica_worker import resume_main

    _reports(2, resume_main, [str(tmp_path)])
