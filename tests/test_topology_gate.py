"""The topology-aware gate's pure function against a plain loop over pairs in priority order."""

import pytest
import torch

from flexmoe.routing.plan import top_k
from flexmoe.routing.topology import limit_cross_node, remote_pair_budget


def reference_limit(scores, expert_index, expert_node, node, max_remote):
    """One pair at a time, 1st choices of all tokens first; a pair over budget takes the best local expert."""
    t_count, k = expert_index.shape
    chosen = [list(map(int, row)) for row in expert_index]
    used = 0
    for j in range(k):
        for t in range(t_count):
            e = chosen[t][j]
            if int(expert_node[e]) == node:
                continue
            if used < max_remote:
                used += 1
                continue
            best, best_score = None, None
            for cand in range(scores.shape[1]):
                if int(expert_node[cand]) != node or cand in chosen[t]:
                    continue
                if best is None or float(scores[t, cand]) > best_score:
                    best, best_score = cand, float(scores[t, cand])
            chosen[t][j] = best
    return torch.tensor(chosen)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("share", [0.0, 0.1, 0.3, 1.0])
def test_limit_matches_reference_and_bound_holds(k, share):
    torch.manual_seed(k)
    num_tokens, num_experts = 40, 8
    scores = torch.softmax(torch.randn(num_tokens, num_experts, dtype=torch.float64), -1)
    expert_node = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    _, idx = top_k(scores, k)
    budget = remote_pair_budget(num_tokens, k, share)
    for node in (0, 1):
        got = limit_cross_node(scores, idx, expert_node, node, budget)
        assert torch.equal(got, reference_limit(scores, idx, expert_node, node, budget))
        assert int((expert_node[got] != node).sum()) <= budget
        assert all(len(set(row.tolist())) == k for row in got)


def test_bad_share_and_too_few_local_experts():
    with pytest.raises(ValueError, match="cross_node_share"):
        remote_pair_budget(10, 2, 1.5)
    scores = torch.rand(4, 4)
    with pytest.raises(ValueError, match="at least k=3"):
        limit_cross_node(scores, top_k(scores, 3)[1], torch.tensor([0, 0, 1, 1]), 0, 0)


# The layer's bound on 4 gloo ranks as 2 nodes, against reference_limit above: the scenario topology of
# tests/test_expert_parallel.py.


def test_layer_node_layout_errors():
    from flexmoe import MoELayer

    with pytest.raises(ValueError, match="cross_node_share"):
        MoELayer(8, 4, 8, k=2, cross_node_share=-0.1)
