"""FasterMoE's shadowing and smart schedule (issue 5).

The shadowing policies, unit-tested without processes. The multi-rank cases (outputs and gradients against one
process holding all experts, skewed and uniform routing, the error cases) are the ``fastermoe_*`` scenarios of
tests/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from flexmoe.parallel import (
    ExpertLayout,
    ShadowContext,
    ShadowExperts,
    ShadowTopExperts,
    pairwise_peers,
    rows_per_rank,
)
from flexmoe.tuning import CostModelShadowPolicy, load_profile, resolve_shadow

# ------------------------------------------------------------------------------------- policies (no processes)


def _context(world: int = 4, experts: int = 8) -> ShadowContext:
    return ShadowContext(ExpertLayout(experts, world, 1024), model_dim=512, hidden_dim=1024, k=2,
                         dtype=torch.float32)


def _counts(world: int, per_expert: list[int]) -> list[list[int]]:
    """Every rank routes the same rows per expert."""
    return [list(per_expert) for _ in range(world)]


SKEWED = [4096, 4096] + [1366] * 6  # two experts get half of the 2 * 4096 (token, choice) pairs per rank
UNIFORM = [1024] * 8


@pytest.mark.parametrize("profile", [None, "a100-ndv4"])
def test_cost_model_policy_shadows_hot_experts_only_when_skewed(profile) -> None:
    policy = CostModelShadowPolicy(profile=profile)
    ctx = _context()
    assert policy.choose(_counts(4, SKEWED), ctx) == [0, 1]
    assert policy.choose(_counts(4, UNIFORM), ctx) == []
    assert policy.choose(_counts(1, SKEWED), _context(world=1)) == []  # one rank: nothing to balance
    assert CostModelShadowPolicy(profile=profile, max_shadowed=1).choose(_counts(4, SKEWED), ctx) == [0]


def test_default_policy_and_its_description() -> None:
    policy = resolve_shadow(True)
    assert isinstance(policy, CostModelShadowPolicy)
    assert "CostModelShadowPolicy(profile=" in policy.describe()
    assert resolve_shadow(False) is None
    with pytest.raises(TypeError, match="shadow must be"):
        resolve_shadow("yes")
    # Profiles by object or name describe the same.
    p = load_profile("a100-ndv4")
    assert CostModelShadowPolicy(p).describe() == CostModelShadowPolicy("a100-ndv4").describe()


def test_explicit_policies_and_loads() -> None:
    ctx = _context()
    counts = _counts(4, [5, 9, 1, 9, 0, 0, 0, 2])
    assert ShadowTopExperts(2).choose(counts, ctx) == [1, 3]  # ties: lower id first
    assert ShadowExperts([3, 1]).choose(counts, ctx) == [3, 1]
    layout = ExpertLayout(8, 4, 1024)
    assert rows_per_rank(counts, layout) == [56, 40, 0, 8]
    # Shadowing expert 1: each of the 4 ranks keeps its own 9 rows of it.
    assert rows_per_rank(counts, layout, [1]) == [20 + 9, 40 + 9, 9, 8 + 9]


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_pairwise_peers_cover_every_pair_once(world: int) -> None:
    for rank in range(world):
        sends = [pairwise_peers(rank, world, s)[0] for s in range(world)]
        recvs = [pairwise_peers(rank, world, s)[1] for s in range(world)]
        assert sorted(sends) == sorted(recvs) == list(range(world))
        assert sends[0] == recvs[0] == rank
        for s in range(world):  # my step-s partner receives from me at the same step
            assert pairwise_peers(sends[s], world, s)[1] == rank
