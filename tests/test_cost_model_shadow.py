"""The cost model's price of shadowing an expert (FasterMoE), worked out by hand.

Shadowing expert x sends its weights from the owner to every rank before the forward pass (a broadcast) and
sums every rank's gradient of them back onto the owner after the backward pass (a reduce of the same bytes).
Both are charged; a model that charged only the broadcast would shadow experts that are barely hot.

The profile below makes every term but expert compute and the broadcast/reduce vanish (no overheads, memory
and all-to-all links a billion times faster than anything else), so the whole layer time is a sum the test
can write down: FFN flops over the peak, plus the tree broadcast of the weights.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexmoe.tuning.cost_model import LayerConfig, choose_shadowed, layer_time
from flexmoe.tuning.profile import ComputeSpec, LinkSpec, Profile

PEAK = 1e12  # flop/s
ALPHA = 1e-6  # s per hop of the broadcast tree
BANDWIDTH = 1e9  # B/s of the link the broadcast uses
HUGE = 1e30  # "free": memory, gathers, all-to-all
M, H = 64, 256
W = 8  # ranks, one node
TOKENS = 18432  # per rank, k = 1: W * TOKENS routed rows in all


def compute_only_profile() -> Profile:
    return Profile(
        name="compute-only", description="expert GEMMs and the broadcast link cost time, nothing else",
        compute={"float32": ComputeSpec(peak_flops=PEAK, overhead_s=0.0, half_dim=0.0)},
        memory_bandwidth_Bps=HUGE, gather_bandwidth_Bps=HUGE, scatter_bandwidth_Bps=HUGE, op_overhead_s=0.0,
        intra=LinkSpec("link", alpha_s=ALPHA, bandwidth_Bps=BANDWIDTH, a2a_alpha_s=0.0, a2a_bandwidth_Bps=HUGE),
        inter=LinkSpec("link", alpha_s=ALPHA, bandwidth_Bps=BANDWIDTH, a2a_alpha_s=0.0, a2a_bandwidth_Bps=HUGE),
        ranks_per_node=W, compute_slots_per_node=W, grad_stack_bandwidth_Bps=HUGE, overlap_efficiency=1.0,
    )


def layer(**changes: object) -> LayerConfig:
    return replace(LayerConfig(tokens=TOKENS, model_dim=M, hidden_dim=H, experts=W, k=1, capacity_factor=0.0,
                               ranks=W), **changes)


# One expert's parameters in float32: w1 [M, H], w2 [H, M], b1 [H], b2 [M].
PARAM_BYTES = (2 * M * H + H + M) * 4
# A tree broadcast over 8 ranks: log2(8) = 3 hops, then the bytes once over the link. A reduce costs the same.
BROADCAST_S = 3 * ALPHA + PARAM_BYTES / BANDWIDTH
# One row through an expert: forward x@w1 and h@w2 (2*M*H flops each), backward twice that.
ROW_S = (2 + 4) * 2 * M * H / PEAK


def test_shadow_term_is_broadcast_plus_reduce_by_hand() -> None:
    p = compute_only_profile()
    assert PARAM_BYTES == 132_352 and BROADCAST_S == pytest.approx(1.35352e-4)
    assert layer_time(p, layer(shadowed=(0,))).shadow_comm == pytest.approx(2 * BROADCAST_S)
    assert layer_time(p, layer(shadowed=(0, 3))).shadow_comm == pytest.approx(4 * BROADCAST_S)
    assert layer_time(p, layer()).shadow_comm == 0.0


def test_shadowing_changes_the_layer_time_by_hand() -> None:
    """Expert 0 gets 9x the rows of each other expert. Without shadowing its owner (rank 0) computes all of
    them and is the straggler; shadowed, every rank computes its own eighth of them next to its own expert."""
    p = compute_only_profile()
    counts = (9.0,) + (1.0,) * (W - 1)
    rows = [W * TOKENS * c / sum(counts) for c in counts]  # 147456 rows in all, 9/16 of them to expert 0
    assert rows[0] == 82944 and rows[1] == 9216
    plain = layer_time(p, layer(expert_shares=counts))
    shadowed = layer_time(p, layer(expert_shares=counts, shadowed=(0,)))
    assert plain.experts == pytest.approx(rows[0] * ROW_S)
    assert shadowed.experts == pytest.approx((rows[1] + rows[0] / W) * ROW_S)
    assert shadowed.total - plain.total == pytest.approx((rows[1] + rows[0] / W - rows[0]) * ROW_S
                                                         + 2 * BROADCAST_S, rel=1e-9, abs=1e-12)


def break_even_hotness() -> float:
    """The load h (hot expert's rows over a cold one's) at which shadowing the hot expert saves exactly its
    broadcast + reduce. With cold rows c = W*T / (W - 1 + h): saving (h*c - c - h*c/W) * ROW_S = 2 * broadcast.
    Solved for h: h * (1 - 1/W) - 1 = 2 * broadcast * (W - 1 + h) / (W*T*ROW_S); linear in h."""
    a = 2 * BROADCAST_S / (W * TOKENS * ROW_S)
    return (1 + a * (W - 1)) / ((1 - 1 / W) - a)


def test_choose_shadowed_at_the_break_even() -> None:
    p = compute_only_profile()
    h_star = break_even_hotness()
    assert 1.2 < h_star < 1.3  # the case the bug got wrong: 1.2x hot saves more than one broadcast, not two

    def chosen(h: float) -> list[int]:
        return choose_shadowed(p, layer(), [h] + [1.0] * (W - 1))

    # A 1.2x hot expert saves (1.2 * 7/8 - 1) cold loads: more than a broadcast, less than broadcast + reduce.
    cold = W * TOKENS / (W - 1 + 1.2)
    saving = (1.2 * cold * (1 - 1 / W) - cold) * ROW_S
    assert BROADCAST_S < saving < 2 * BROADCAST_S
    assert chosen(1.2) == []
    assert chosen(h_star * 0.99) == []
    assert chosen(h_star * 1.01) == [0]
    assert chosen(3.0) == [0]
    assert chosen(1.0) == []
