"""The all-to-all at scale (flexmoe.tuning.a2a_scale) and the pipelining it prices: properties that must hold,
and the constants against the published measurements they come from, worked out here by hand."""

from __future__ import annotations

import pytest

from flexmoe.tuning.a2a_scale import fit, inter_bandwidth, inter_efficiency, message_cost, scale_for
from flexmoe.tuning.cost_model import LayerConfig, a2a_2dh_time, a2a_flat_time, layer_time, pipelined_time
from flexmoe.tuning.profile import load_profile

MiB = 2**20
NDV4 = load_profile("a100-ndv4")


def test_constants_follow_from_the_published_numbers() -> None:
    s = fit()
    # Tutel appendix A.2: 7/8 of 128 MiB leave each GPU in 600 us.
    assert s.intra_bandwidth_Bps == pytest.approx(128 * MiB * 7 / 8 / 600e-6)
    # 4.4 ms more for 7 * 2048 / 8 - 7 = 1785 extra chunks.
    assert s.alpha_s == pytest.approx(4.4e-3 / 1785)
    # mscclpp's NDv4 table: 1 GiB per rank over 2 x 8 GPUs at busbw 37.80 GB/s, i.e. algbw 37.80 * 16/15 GB/s;
    # half of it crosses the network.
    t = 2**30 / (37.80e9 * 16 / 15)
    e_2 = 2**30 / 2 / t / 25e9
    assert s.inter_efficiency_2 == pytest.approx(e_2) and s.inter_efficiency_2 == pytest.approx(0.8064)
    # DeepEP remote share: 48 * 3/4, 43 * 7/8, 39 * 15/16, 39 * 31/32 GB/s over 50 GB/s, averaged.
    e_inf = (48 * 0.75 + 43 * 0.875 + 39 * 15 / 16 + 39 * 31 / 32) / 4 / 50
    assert s.inter_efficiency_many == pytest.approx(e_inf)
    e8 = e_inf + (e_2 - e_inf) / 4
    per_message = (337.8e-6 - 8 * MiB * 56 / 64 / (50e9 * e8)) / 56
    assert s.per_peer_s == pytest.approx((per_message - 4.4e-3 / 1785) / 56)
    assert s.per_peer_s > 0  # the 64-rank exchange pays more per message than the 8-peer one
    # the same table at 2 x 1 GPU: for two ranks busbw is the remote half of 1 GiB over the time
    assert s.peer_Bps == pytest.approx(2**30 / 2 / (2**30 / (15.48e9 * 2)))
    assert s.sm_share == pytest.approx(12 / 132)
    assert scale_for("a100-ndv4") == fit(25e9)
    assert scale_for("no-such-profile") is None


def test_efficiency_and_message_cost_shapes() -> None:
    s = fit()
    assert inter_efficiency(s, 1) == 1.0
    assert inter_efficiency(s, 2) == pytest.approx(s.inter_efficiency_2)
    effs = [inter_efficiency(s, n) for n in (2, 4, 16, 256)]
    assert effs == sorted(effs, reverse=True)  # more nodes at once, less of the line each
    assert message_cost(s, 2048) > message_cost(s, 256) > message_cost(s, 8)


@pytest.mark.parametrize("algorithm", [a2a_flat_time, a2a_2dh_time])
def test_monotone_in_bytes_and_peers(algorithm) -> None:
    sizes = [MiB, 16 * MiB, 256 * MiB]
    for w in (16, 512, 2048):
        times = [algorithm(NDV4, b, w, 8) for b in sizes]
        assert times == sorted(times) and times[0] < times[-1]
    for b in sizes:
        times = [algorithm(NDV4, b, w, 8) for w in (16, 64, 256, 1024, 2048)]
        assert times == sorted(times)


def test_flat_at_2048_by_hand() -> None:
    """2040 inter-node messages of S/2048 at 256 nodes' efficiency, each paying alpha(2048), against the 7 NVLink
    messages: the slower level."""
    s = fit()
    size = 256 * MiB / 2048
    inter = 2040 * (s.alpha_s + s.per_peer_s * 2048 + size / (25e9 * inter_efficiency(s, 256)))
    intra = 7 * (s.alpha_s + s.per_peer_s * 2048 + size / s.intra_bandwidth_Bps)
    assert a2a_flat_time(NDV4, 256 * MiB, 2048, 8) == pytest.approx(max(inter, intra))


def test_2dh_gains_with_scale_and_not_below_a_node() -> None:
    for b in (MiB, 256 * MiB):
        # inside one node 2DH is the flat exchange plus two re-layouts: never a gain
        assert a2a_2dh_time(NDV4, b, 8, 8) > a2a_flat_time(NDV4, b, 8, 8)
        gains = [a2a_flat_time(NDV4, b, w, 8) / a2a_2dh_time(NDV4, b, w, 8) for w in (16, 128, 512, 2048)]
        assert gains == sorted(gains)


def test_2dh_gain_beyond_the_message_count_ratio() -> None:
    """Small chunks at 2,048 GPUs: 2040 messages against 7 + 255 caps the gain at 7.8x if every message cost the
    same; the per-peer cost (2,048 peers against 8 and 256) takes it past 8x."""
    gain = a2a_flat_time(NDV4, MiB, 2048, 8) / a2a_2dh_time(NDV4, MiB, 2048, 8)
    assert gain > 8.0


def test_pipelining_beyond_the_old_cap() -> None:
    """Compute and transfer balanced (dispatch + combine = compute): d chunks hide the transfer, the compute
    beside it runs 1 + 12/132 slower. The old fixed 85% overlap capped the gain at 2 / (2 - 0.85) = 1.74x."""
    slow = 12 / 132
    total = 1.0  # seconds of compute, and of transfer
    d = 32
    serial = pipelined_time(total / 2, total, total / 2, 1)
    piped = pipelined_time(total / 2 / d, total / d, total / 2 / d, d, 1.0, 0.0, slow)
    by_hand = 2 * total / d + (d - 1) * max(total / d, total / d * (1 + slow))
    assert piped == pytest.approx(by_hand)
    assert serial / piped > 1.74
    with pytest.raises(ValueError, match="compute_slowdown"):
        pipelined_time(1, 1, 1, 2, compute_slowdown=-0.1)


def tutel_config(w: int, **changes) -> LayerConfig:
    """Tutel's helloworld.py defaults at the README chart's commit, on w GPUs."""
    base = dict(tokens=16384, model_dim=2048, hidden_dim=2048, experts=2 * w, k=2, capacity_factor=1.0,
                dtype="float32", ranks=w, padded_a2a=True, token_exchange=False)
    base.update(changes)
    return LayerConfig(**base)  # type: ignore[arg-type]


def test_step_never_faster_than_its_compute() -> None:
    for w in (16, 256, 2048):
        for a2a in ("flat", "2dh"):
            for d in (1, 4):
                b = layer_time(NDV4, tutel_config(w, a2a=a2a, overlap_degree=d))
                assert b.total >= b.experts + b.router_plan + b.dispatch_combine


def test_2dh_on_two_nodes_by_hand() -> None:
    """16 GPUs: 7 NVLink messages of S/8 among 8 peers, then one message of S/2 to the single peer on the other
    node, which one NCCL peer carries at 15.48 GB/s (below the 0.81 x 25 GB/s the NIC gets from 8 peers), plus two
    re-layouts of S read and written."""
    s = fit()
    size = 256 * MiB
    intra = 7 * (s.alpha_s + s.per_peer_s * 8 + size / 8 / s.intra_bandwidth_Bps)
    inter = s.alpha_s + s.per_peer_s * 2 + size / 2 / 15.48e9
    relayout = 2 * (2 * size / NDV4.memory_bandwidth_Bps + 2 * NDV4.op_overhead_s)
    assert a2a_2dh_time(NDV4, size, 16, 8) == pytest.approx(intra + inter + relayout)
    assert inter_bandwidth(s, 2, 8) == pytest.approx(25e9 * s.inter_efficiency_2)  # 8 peers fill the share
    assert inter_bandwidth(s, 2, 1) == pytest.approx(15.48e9)
    assert inter_bandwidth(s, 2, 1) < inter_bandwidth(s, 2, 8)


def test_the_orderings_tutel_states_in_words() -> None:
    """What Tutel's appendix A.5 says of its figures 18 and 19 (NCCL alltoall_perf on NDv4, 64 to 2,048 GPUs),
    the only part of those figures published as text: at 1 MiB per GPU 2DH is faster than linear from the
    smallest scale measured (64 GPUs) on; at 32 and 256 MiB the NCCL-API 2DH is slower at 64 GPUs (its extra
    copies) and overtakes linear as the GPUs grow. The model was fitted to none of these."""
    def gain(size: float, w: int) -> float:
        return a2a_flat_time(NDV4, size, w, 8) / a2a_2dh_time(NDV4, size, w, 8)

    scales = (64, 128, 256, 512, 1024, 2048)
    assert all(gain(MiB, w) > 1.0 for w in scales)
    for size in (32 * MiB, 256 * MiB):
        assert gain(size, 64) < 1.0
        assert gain(size, 2048) > 1.0
        gains = [gain(size, w) for w in scales]
        assert gains == sorted(gains)  # one crossover, then 2DH keeps gaining
