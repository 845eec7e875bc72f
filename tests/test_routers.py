"""Routers beyond top-k, against plain float64 loops written here (never flexmoe's code against itself).

* expert choice: every expert's load is exactly C; outputs and gradients equal a loop over experts;
* BASE: the auction's assignment is exactly balanced, equals exhaustive search on tiny cases and beats greedy;
  the training layer equals a loop over the exhaustive optimum; at evaluation tokens go to their best experts;
* balance="bias": the load imbalance falls over steps on a skewed input, the bias selects, the probabilities weigh;
* shared experts: every token gets their output on top of the routed one;
* second_expert="random": skip frequencies follow min(1, 2 p2 / (p1 + p2)); evaluation dispatches everything;
* invalid combinations fail naming the argument.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flexmoe import MoELayer
from flexmoe.routing.balanced import balanced_assignment
from reference import (
    layer_params_f64,
    ref_ffn_expert,
    ref_linear_logits,
    ref_softmax,
    ref_top_k,
    ref_z_loss,
    reference_for_layer,
)

M, H = 8, 16
TOL = 1e-10  # float64 layer against float64 loops: round-off only


def make_layer(num_experts: int, *, seed: int = 0, **kwargs) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(M, num_experts, H, dtype=torch.float64, router_dtype=torch.float64, **kwargs)


def make_input(num_tokens: int, *, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, M, generator=g, dtype=torch.float64)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    got, want = got.detach().to(torch.float64), want.detach().to(torch.float64)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g}"


def loop_probs(x64: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, E], probs [T, E]) with the reference's loops, differentiable in x64 and the router weight."""
    logits = ref_linear_logits(x64, params["router.weight"])
    return logits, torch.stack([ref_softmax(logits[t]) for t in range(logits.shape[0])])


def backward_and_compare(moe: MoELayer, x: torch.Tensor, y: torch.Tensor, ref_y: torch.Tensor,
                         x64: torch.Tensor, params: dict, *, z_ref: torch.Tensor | None = None) -> None:
    """Same loss on both sides (a fixed random projection of y, plus the z-loss); compare every gradient."""
    g = make_input(y.shape[0], seed=99)
    loss = (y * g).sum() + (0.1 * moe.z_loss if z_ref is not None else 0.0)
    loss.backward()
    ref_loss = (ref_y * g).sum() + (0.1 * z_ref if z_ref is not None else 0.0)
    ref_loss.backward()
    assert_close(y, ref_y, "output")
    assert_close(x.grad, x64.grad, "grad of x")
    for name, p in moe.named_parameters():
        want = params[name].grad if params[name].grad is not None else torch.zeros_like(params[name])
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        assert_close(got, want, f"grad of {name}")


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


# --- expert choice ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer_kw, want_c", [
    ({"k": 2, "capacity_factor": 1.0}, math.ceil(2 * 1.0 * 12 / 4)),
    ({"k": 1, "capacity_factor": 0.5}, math.ceil(1 * 0.5 * 12 / 4)),
    ({"k": 2, "capacity": 3}, 3),
    ({"k": 2, "capacity": 50}, 12),  # C above the token count: every expert takes every token
])
@pytest.mark.parametrize("score_at", ["combine", "dispatch"])
def test_expert_choice_loads_outputs_and_gradients(layer_kw: dict, want_c: int, score_at: str) -> None:
    num_tokens, num_experts = 12, 4
    moe = make_layer(num_experts, router="expert_choice", score_at=score_at, seed=3, **layer_kw)
    x = leaf(make_input(num_tokens, seed=4))
    y = moe(x)
    plan = moe.last_plan
    assert plan.kind == "expert_choice"
    assert plan.counts == [want_c] * num_experts and plan.load.tolist() == [want_c] * num_experts

    # The loop: expert e ranks all tokens by p[t, e] (ties: lower token first) and takes the first C.
    params = layer_params_f64(moe)
    x64 = leaf(x.detach())
    logits, probs = loop_probs(x64, params)
    expert = ref_ffn_expert({n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("experts.")})
    taken_by = [[] for _ in range(num_tokens)]
    for e in range(num_experts):
        order = sorted(range(num_tokens), key=lambda t: (-float(probs[t, e].detach()), t))
        for rank, t in enumerate(order[:want_c]):
            taken_by[t].append(e)
            assert int(plan.slot[t, e]) == rank
    rows = []
    for t in range(num_tokens):
        y_t = x64.new_zeros(M)
        for e in taken_by[t]:
            w = probs[t, e]
            y_t = y_t + (w * expert(e, x64[t]) if score_at == "combine" else expert(e, w * x64[t]))
        rows.append(y_t)
    assert int((plan.slot >= 0).sum()) == want_c * num_experts
    assert plan.num_dropped == sum(1 for t in range(num_tokens) if not taken_by[t])
    backward_and_compare(moe, x, y, torch.stack(rows), x64, params, z_ref=ref_z_loss(logits))
    assert float(moe.aux_loss.detach()) == 0.0


def test_expert_choice_some_tokens_untaken_get_zero() -> None:
    moe = make_layer(4, router="expert_choice", k=1, capacity=1, seed=5)
    x = make_input(10, seed=6)
    y = moe(x)
    plan = moe.last_plan
    untaken = (plan.slot < 0).all(dim=1)
    assert plan.num_dropped == int(untaken.sum()) >= 6
    assert torch.equal(y[untaken], torch.zeros_like(y[untaken]))


# --- BASE: the assignment -----------------------------------------------------------------------------------

def exhaustive_best(scores: torch.Tensor, k: int) -> float:
    """The best total score over every assignment with k experts per token and loads floor/ceil(T*k/E)."""
    num_tokens, num_experts = scores.shape
    lo, r = divmod(num_tokens * k, num_experts)
    hi = lo + (1 if r else 0)
    best = -math.inf
    for choice in itertools.product(itertools.combinations(range(num_experts), k), repeat=num_tokens):
        load = [0] * num_experts
        for c in choice:
            for e in c:
                load[e] += 1
        if all(lo <= n <= hi for n in load):  # the sum is T*k, so exactly r experts get the ceil
            best = max(best, sum(float(scores[t, e]) for t, c in enumerate(choice) for e in c))
    return best


def greedy_total(scores: torch.Tensor) -> float:
    """k=1 greedy pass: tokens in order, each to its best expert that still has room (E divides T)."""
    num_tokens, num_experts = scores.shape
    room = [num_tokens // num_experts] * num_experts
    total = 0.0
    for t in range(num_tokens):
        for e in sorted(range(num_experts), key=lambda e: -float(scores[t, e])):
            if room[e] > 0:
                room[e] -= 1
                total += float(scores[t, e])
                break
    return total


def check_balanced(x: torch.Tensor, k: int) -> None:
    num_tokens, num_experts = x.shape
    lo, r = divmod(num_tokens * k, num_experts)
    assert x.sum(dim=1).tolist() == [k] * num_tokens
    loads = sorted(x.sum(dim=0).tolist())
    assert loads == [lo] * (num_experts - r) + [lo + 1] * r, loads


@pytest.mark.parametrize("num_tokens, num_experts, k", [(6, 3, 1), (6, 3, 2), (5, 3, 1), (5, 4, 2), (4, 4, 3),
                                                         (7, 2, 1), (5, 3, 2)])
def test_base_assignment_is_balanced_and_optimal_on_tiny_cases(num_tokens: int, num_experts: int, k: int) -> None:
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        scores = torch.randn(num_tokens, num_experts, generator=g, dtype=torch.float64)
        x = balanced_assignment(scores, k)
        check_balanced(x, k)
        assert float(scores[x].sum()) == pytest.approx(exhaustive_best(scores, k), abs=1e-9)


def test_base_assignment_beats_greedy() -> None:
    better = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        # Skewed scores (every token prefers expert 0), where greedy must force late tokens to bad experts.
        scores = torch.randn(64, 4, generator=g, dtype=torch.float64) + torch.tensor([2.0, 1.0, 0.0, 0.0],
                                                                                     dtype=torch.float64)
        x = balanced_assignment(scores, 1)
        check_balanced(x, 1)
        auction, greedy = float(scores[x].sum()), greedy_total(scores)
        assert auction >= greedy - 1e-9
        better += auction > greedy + 1e-6
    assert better >= 3


def test_base_assignment_ties_and_equal_rows() -> None:
    x = balanced_assignment(torch.zeros(8, 4), 2)  # every assignment is optimal; it must still be balanced
    check_balanced(x, 2)


# --- BASE: the layer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2])
def test_base_layer_training_matches_exhaustive_reference(k: int) -> None:
    num_tokens, num_experts = 6, 3
    moe = make_layer(num_experts, router="base", k=k, capacity_factor=0.5, seed=7).train()
    x = leaf(make_input(num_tokens, seed=8))
    y = moe(x)
    plan = moe.last_plan
    assert plan.kind == "base" and plan.num_dropped == 0
    assert plan.counts == [num_tokens * k // num_experts] * num_experts  # capacity_factor is not used

    params = layer_params_f64(moe)
    x64 = leaf(x.detach())
    logits, probs = loop_probs(x64, params)
    # The optimum by exhaustive search over the logits (BASE's affinity scores).
    best, best_choice = -math.inf, None
    for choice in itertools.product(itertools.combinations(range(num_experts), k), repeat=num_tokens):
        load = [0] * num_experts
        for c in choice:
            for e in c:
                load[e] += 1
        if all(n == num_tokens * k // num_experts for n in load):
            total = sum(float(logits[t, e].detach()) for t, c in enumerate(choice) for e in c)
            if total > best:
                best, best_choice = total, choice
    expert = ref_ffn_expert({n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("experts.")})
    rows = []
    for t in range(num_tokens):
        chosen = best_choice[t]
        assert sorted(plan.expert_index[t].tolist()) == list(chosen)
        norm = sum(probs[t, e] for e in chosen) if k > 1 else 1.0
        rows.append(sum(probs[t, e] / norm * expert(e, x64[t]) for e in chosen))
    backward_and_compare(moe, x, y, torch.stack(rows), x64, params, z_ref=ref_z_loss(logits))


def test_base_layer_eval_routes_to_best_experts_dropless() -> None:
    moe = make_layer(4, router="base", k=2, capacity_factor=0.5, seed=9).eval()
    x = leaf(make_input(16, seed=10))
    y = moe(x)
    ref, x64, params = reference_for_layer(moe, x, k=2, capacity_factor=0.0)
    assert moe.last_plan.expert_index.tolist() == ref.expert_index
    assert moe.last_plan.num_dropped == 0
    backward_and_compare(moe, x, y, ref.y, x64, params)


# --- balance="bias" -----------------------------------------------------------------------------------------

RATE = 0.005


def skewed_layer(balance: str, rate: float = RATE) -> MoELayer:
    """8 experts; the router strongly prefers experts 0 and 1 for inputs along the first axis."""
    moe = make_layer(8, k=2, capacity_factor=0.0, balance=balance, bias_update_rate=rate, seed=11)
    with torch.no_grad():
        moe.router.weight.mul_(0.3)
        moe.router.weight[:2, 0] = 0.8
    return moe


def skewed_input(step: int) -> torch.Tensor:
    x = make_input(256, seed=1000 + step)
    x[:, 0] += 1.5
    return x


def imbalance(load: list[int]) -> float:
    return max(load) / (sum(load) / len(load))


def test_bias_balancing_reduces_imbalance_and_keeps_unbiased_weights() -> None:
    moe = skewed_layer("bias").train()
    assert "expert_bias" not in dict(moe.named_parameters()) and "expert_bias" in moe.state_dict()
    history = []
    for step in range(50):
        bias_before = moe.expert_bias.clone()
        x = skewed_input(step)
        moe(x)
        moe.update_expert_bias()  # once per (optimizer) step
        plan = moe.last_plan
        history.append(imbalance(plan.load.tolist()))
        if step in (0, 49):
            # The loop: select by p + bias, weigh by p (normalized over the two), update by the sign rule.
            params = layer_params_f64(moe)
            with torch.no_grad():
                _, probs = loop_probs(x, params)
            load = [0] * 8
            for t in range(x.shape[0]):
                chosen = ref_top_k([float(probs[t, e] + bias_before[e]) for e in range(8)], 2)
                assert plan.expert_index[t].tolist() == chosen
                norm = float(probs[t, chosen[0]] + probs[t, chosen[1]])
                want = torch.tensor([float(probs[t, e]) / norm for e in chosen], dtype=torch.float64)
                assert_close(plan.weight[t], want, "combine weight")
                for e in chosen:
                    load[e] += 1
            mean = sum(load) / 8
            want_bias = [float(bias_before[e]) + RATE * ((mean > load[e]) - (mean < load[e])) for e in range(8)]
            assert_close(moe.expert_bias, torch.tensor(want_bias, dtype=torch.float64), "bias update")
    # Loads are noisy batch to batch (and the sign rule oscillates around balance): average a few steps.
    first, last = sum(history[:5]) / 5, sum(history[-10:]) / 10
    assert first > 2.5, history[:5]  # the input is skewed, or the test proves nothing
    assert last < 0.6 * first, (first, last)

    # Without the bias the same input stays skewed; in eval the bias is used but not updated.
    plain = skewed_layer("aux").train()
    plain(skewed_input(49))
    assert imbalance(plain.last_plan.load.tolist()) > 0.8 * first
    frozen = moe.expert_bias.clone()
    moe.eval()
    moe(skewed_input(50))
    moe.update_expert_bias()
    assert torch.equal(moe.expert_bias, frozen)


def hand_load(moe: MoELayer, x: torch.Tensor, bias: torch.Tensor, k: int = 2) -> list[int]:
    """Pairs per expert of one batch, selected by hand: the k largest ``p + bias`` per token (dropless)."""
    with torch.no_grad():
        _, probs = loop_probs(x, layer_params_f64(moe))
    load = [0] * moe.num_experts
    for t in range(x.shape[0]):
        for e in ref_top_k([float(probs[t, e] + bias[e]) for e in range(moe.num_experts)], k):
            load[e] += 1
    return load


def sign_rule(bias: torch.Tensor, load: list[int], rate: float) -> torch.Tensor:
    mean = sum(load) / len(load)
    return torch.tensor([float(bias[e]) + rate * ((mean > n) - (mean < n)) for e, n in enumerate(load)],
                        dtype=torch.float64)


def test_bias_is_updated_once_per_step_from_the_load_summed_over_micro_batches() -> None:
    """Two micro-batches, then one update: the sign rule on the summed load, counted by hand. Forward alone
    never moves the bias."""
    moe = skewed_layer("bias").train()
    moe.expert_bias.copy_(torch.tensor([0.01, -0.02, 0.0, 0.03, 0.0, 0.0, -0.01, 0.02]))
    before = moe.expert_bias.clone()
    other = make_input(64, seed=101)
    other[:, 0] -= 1.5  # skewed away from experts 0 and 1
    micro = [skewed_input(100), other]
    want_load = [0] * 8
    for x in micro:
        moe(x).sum().backward()
        assert torch.equal(moe.expert_bias, before), "forward moved the bias"
        want_load = [a + b for a, b in zip(want_load, hand_load(moe, x, before))]
    assert moe.pending_load.tolist() == want_load
    # The summed load gives another update than the last micro-batch's alone (else the test proves little).
    last_only = sign_rule(before, hand_load(moe, micro[1], before), RATE)
    assert not torch.allclose(last_only, sign_rule(before, want_load, RATE))
    moe.update_expert_bias()
    assert_close(moe.expert_bias, sign_rule(before, want_load, RATE), "bias after one update")
    assert moe.pending_load.tolist() == [0] * 8
    # A second update with no forward in between leaves the bias (no load: every sign is 0).
    after = moe.expert_bias.clone()
    moe.update_expert_bias()
    assert torch.equal(moe.expert_bias, after)


@pytest.mark.parametrize("reentrant", [False, True])
def test_bias_load_is_counted_once_under_activation_checkpointing(reentrant: bool) -> None:
    """The recomputation in backward does not count the micro-batch again."""
    from torch.utils.checkpoint import checkpoint

    moe = skewed_layer("bias").train()
    before = moe.expert_bias.clone()
    x = skewed_input(7).requires_grad_(True)
    checkpoint(moe, x, use_reentrant=reentrant).sum().backward()
    assert x.grad is not None
    want_load = hand_load(moe, x.detach(), before)
    assert moe.pending_load.tolist() == want_load
    moe.update_expert_bias()
    assert_close(moe.expert_bias, sign_rule(before, want_load, RATE), "bias after checkpointed step")


def test_update_expert_biases_updates_every_bias_layer_of_a_model() -> None:
    from flexmoe import update_expert_biases

    torch.manual_seed(0)
    model = torch.nn.Sequential(skewed_layer("bias"), skewed_layer("aux"), torch.nn.Sequential(skewed_layer("bias")))
    model.train()
    x = skewed_input(3)
    before = [m.expert_bias.clone() for m in (model[0], model[2][0])]
    loads = [hand_load(model[0], x, before[0])]
    h = model[0](x)
    h = model[1](h)
    loads.append(hand_load(model[2][0], h.detach(), before[1]))
    model[2](h)
    assert update_expert_biases(model) == 2
    for layer, b, load in zip((model[0], model[2][0]), before, loads):
        assert_close(layer.expert_bias, sign_rule(b, load, RATE), "bias of each layer")


# --- shared experts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("num_shared", [1, 2])
def test_shared_experts_add_their_output_for_every_token(num_shared: int, glu: bool) -> None:
    moe = make_layer(4, k=2, capacity_factor=0.5, shared_experts=num_shared, glu=glu, activation="silu", seed=12)
    assert moe.shared.num_experts == num_shared and moe.shared.hidden_dim == H
    x = leaf(make_input(12, seed=13))
    y = moe(x)
    assert moe.last_plan.num_dropped > 0  # dropped tokens still get the shared experts' output
    ref, x64, params = reference_for_layer(moe, x, k=2, capacity_factor=0.5, glu=glu, activation="silu")
    shared = ref_ffn_expert({n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("shared.")},
                            "silu", glu)
    ref_y = ref.y + torch.stack([sum(shared(s, x64[t]) for s in range(num_shared)) for t in range(12)])
    backward_and_compare(moe, x, y, ref_y, x64, params)


def test_shared_experts_alone_when_every_token_is_dropped() -> None:
    moe = make_layer(4, k=1, shared_experts=1, seed=14)
    x = make_input(5, seed=15)
    y = moe(x, capacity=0)
    shared = ref_ffn_expert({n.split(".", 1)[1]: p for n, p in layer_params_f64(moe).items()
                             if n.startswith("shared.")})
    assert_close(y, torch.stack([shared(0, x[t]) for t in range(5)]), "shared only")


# --- second_expert="random" ---------------------------------------------------------------------------------

def test_random_second_expert_follows_its_probability() -> None:
    num_tokens = 20000
    moe = make_layer(4, k=2, capacity_factor=0.0, second_expert="random", seed=16).train()
    x = make_input(num_tokens, seed=17)
    torch.manual_seed(123)
    with torch.no_grad():
        moe(x)
    plan = moe.last_plan
    # Keep probability per token from the router weight (vectorized float64 math, not flexmoe's).
    probs = torch.softmax(x @ moe.router.weight.detach().t(), dim=-1)
    top2 = probs.sort(dim=1, descending=True).values[:, :2]
    keep = (2 * top2[:, 1] / top2.sum(dim=1)).clamp(max=1.0)
    kept = plan.slot[:, 1] >= 0
    assert plan.slot[:, 0].ge(0).all(), "the 1st choice is always dispatched"
    assert plan.num_skipped == int((~kept).sum()) and plan.num_dropped == 0
    assert sum(plan.counts) == num_tokens + int(kept.sum())
    # Within bins of the keep probability, the kept count is a sum of Bernoulli(q_t): 5 binomial stds.
    for lo, hi in [(0.0, 0.5), (0.5, 0.8), (0.8, 1.01)]:
        in_bin = (keep >= lo) & (keep < hi)
        q = keep[in_bin]
        assert q.numel() > 500, (lo, hi, q.numel())
        std = float((q * (1 - q)).sum().sqrt())
        assert abs(int(kept[in_bin].sum()) - float(q.sum())) <= 5 * std + 1, (lo, hi)
    # Seeded: the same decisions again.
    torch.manual_seed(123)
    with torch.no_grad():
        moe(x)
    assert torch.equal(moe.last_plan.slot[:, 1] >= 0, kept)
    # Evaluation dispatches every choice.
    moe.eval()
    with torch.no_grad():
        moe(x)
    assert moe.last_plan.num_skipped == 0 and bool((moe.last_plan.slot >= 0).all())


def test_random_second_expert_outputs_and_gradients() -> None:
    num_tokens = 16
    moe = make_layer(4, k=2, capacity_factor=1.0, second_expert="random", seed=18).train()
    x = leaf(make_input(num_tokens, seed=19))
    torch.manual_seed(5)
    y = moe(x)
    plan = moe.last_plan
    assert 0 < plan.num_skipped < num_tokens
    # The loop: top-2 per token; the 2nd pair is dispatched where 2 * p2 / (p1 + p2) > u_t, u drawn as the
    # layer draws it (one float64 uniform per token from torch's generator, seeded the same); slots in
    # priority order among dispatched pairs, capacity C = ceil(2 * 1.0 * T / E).
    torch.manual_seed(5)
    u = torch.rand(num_tokens, dtype=torch.float64)
    params = layer_params_f64(moe)
    x64 = leaf(x.detach())
    logits, probs = loop_probs(x64, params)
    expert = ref_ffn_expert({n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("experts.")})
    cap = math.ceil(2 * 1.0 * num_tokens / 4)
    chosen = [ref_top_k([float(v) for v in probs[t].detach()], 2) for t in range(num_tokens)]
    active = []
    for t in range(num_tokens):
        p1, p2 = float(probs[t, chosen[t][0]].detach()), float(probs[t, chosen[t][1]].detach())
        active.append([True, min(1.0, 2 * p2 / (p1 + p2)) > float(u[t])])
    assert plan.num_skipped == sum(not a[1] for a in active)
    next_slot = [0] * 4
    rows = [x64.new_zeros(M) for _ in range(num_tokens)]
    for c in range(2):
        for t in range(num_tokens):
            if not active[t][c]:
                continue
            e = chosen[t][c]
            if next_slot[e] < cap:
                w = probs[t, e] / (probs[t, chosen[t][0]] + probs[t, chosen[t][1]])
                rows[t] = rows[t] + w * expert(e, x64[t])
            next_slot[e] += 1
    assert plan.expert_index.tolist() == chosen
    backward_and_compare(moe, x, y, torch.stack(rows), x64, params, z_ref=ref_z_loss(logits))


# --- topology gate from the layer (one process; the multi-rank bound is in test_topology_gate.py) -----------

def test_cross_node_share_on_one_process_is_a_no_op() -> None:
    moe = make_layer(4, k=2, cross_node_share=0.0, seed=20)
    x = make_input(12, seed=21)
    plain = make_layer(4, k=2, seed=20)
    assert torch.equal(moe(x), plain(x))


# --- invalid options ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, name", [
    ({"router": "nope"}, ValueError, "router"),
    ({"router": "expert_choice", "capacity_factor": 0.0}, ValueError, "capacity_factor"),
    ({"router": "expert_choice", "capacity_factor": -1.0}, ValueError, "capacity_factor"),
    ({"balance": "loss"}, ValueError, "balance"),
    ({"balance": "bias", "router": "base"}, ValueError, "balance"),
    ({"balance": "bias", "router": "expert_choice"}, ValueError, "balance"),
    ({"bias_update_rate": -0.1}, ValueError, "bias_update_rate"),
    ({"bias_update_rate": "fast"}, TypeError, "bias_update_rate"),
    ({"shared_experts": -1}, ValueError, "shared_experts"),
    ({"shared_experts": 1.0}, TypeError, "shared_experts"),
    ({"second_expert": "sample"}, ValueError, "second_expert"),
    ({"second_expert": "random", "k": 1}, ValueError, "second_expert"),
    ({"second_expert": "random", "k": 3}, ValueError, "second_expert"),
    ({"second_expert": "random", "router": "base"}, ValueError, "second_expert"),
    ({"cross_node_share": 1.5}, ValueError, "cross_node_share"),
    ({"cross_node_share": 0.5, "router": "expert_choice"}, ValueError, "cross_node_share"),
])
def test_invalid_options_name_the_argument(kwargs: dict, error: type, name: str) -> None:
    kwargs = {"k": 2, **kwargs}
    with pytest.raises(error, match=name):
        MoELayer(M, 4, H, **kwargs)


def test_expert_choice_with_explicit_capacity_accepts_any_capacity_factor() -> None:
    moe = MoELayer(M, 4, H, router="expert_choice", capacity_factor=0.0, capacity=2)
    moe(torch.randn(6, M))
    assert moe.last_plan.counts == [2] * 4


# The multi-rank case (bias from the global load; expert choice, BASE and shared experts under expert
# parallelism) is the scenario routing_ep of tests/test_expert_parallel.py.


def test_bias_with_topology_gate_and_random_second_expert_together() -> None:
    """build_plan's changed-pairs path: select by p + bias, re-route past the cross-node budget (by p + bias),
    weigh by p; the 2nd choices then thinned at random (in training)."""
    from flexmoe.routing import RoutingOptions
    from flexmoe.routing.build import build_plan
    from flexmoe.routing.topology import TopologyGate
    from test_topology_gate import reference_limit

    g = torch.Generator().manual_seed(30)
    logits = torch.randn(40, 6, generator=g, dtype=torch.float64)
    bias = torch.tensor([0.3, 0.0, -0.2, 0.1, 0.0, 0.05], dtype=torch.float64)
    gate = TopologyGate((0, 0, 0, 1, 1, 1), 0, 0.25)
    for training in (False, True):
        torch.manual_seed(31)
        plan = build_plan(logits, RoutingOptions(k=2, capacity_factor=0.0, capacity=None, second_expert="random"),
                          training=training, selection_bias=bias, topology=gate)
        probs = torch.stack([ref_softmax(logits[t]) for t in range(40)])
        scores = probs + bias
        chosen = torch.tensor([ref_top_k([float(v) for v in scores[t]], 2) for t in range(40)])
        want = reference_limit(scores, chosen, torch.tensor(gate.expert_node), 0, int(0.25 * 40 * 2))
        assert plan.expert_index.tolist() == want.tolist()
        for t in range(40):
            p = [float(probs[t, e]) for e in want[t].tolist()]
            assert plan.weight[t].tolist() == pytest.approx([v / sum(p) for v in p], abs=1e-12)
        assert (plan.num_skipped > 0) == training
        assert sum(plan.counts) == 80 - plan.num_skipped and plan.num_dropped == 0


@pytest.mark.parametrize("route_scale", [1.0, 2.5])
def test_renormalized_softmax_weights_are_the_softmax_of_the_chosen_logits(route_scale: float) -> None:
    """The weights of every softmax plan builder (make_plan, read_free_plan, decoding) for normalize_weights, k > 1:
    ``softmax(logits)[chosen] / sum`` by a plain float64 loop, value and gradient to the logits (the backward goes
    through the chosen logits only)."""
    from flexmoe.routing.options import RoutingOptions
    from flexmoe.routing.plan import make_plan
    from flexmoe.routing.read_free import read_free_plan

    torch.manual_seed(0)
    logits = (3 * torch.randn(6, 8)).requires_grad_()
    upstream = torch.randn(6, 3)
    want_logits = logits.detach().double().requires_grad_()
    rows = []
    plan = make_plan(logits, 3, capacity_factor=0.0, route_scale=route_scale)
    for t in range(6):
        probs = [math.exp(v) for v in want_logits[t].tolist()]
        chosen = sorted(range(8), key=lambda e: -probs[e])[:3]
        assert plan.expert_index[t].tolist() == chosen
        p = torch.softmax(want_logits[t], dim=0)[chosen]
        rows.append(route_scale * p / p.sum())
    want = torch.stack(rows)
    (want * upstream.double()).sum().backward()
    options = RoutingOptions(k=3, capacity_factor=0.0, route_scale=route_scale)
    read_free = read_free_plan(logits, options)
    # Bit for bit: expert-parallel ranks (read-free) and one process (make_plan) must agree exactly.
    assert torch.equal(read_free.weight, plan.weight)
    for built in (plan, read_free):
        torch.testing.assert_close(built.weight.double(), want.detach(), rtol=1e-6, atol=1e-7)
        logits.grad = None
        (built.weight * upstream).sum().backward(retain_graph=True)
        torch.testing.assert_close(logits.grad.double(), want_logits.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(built.probs_topk.double(), torch.softmax(want_logits, 1).gather(
            1, built.expert_index).detach(), rtol=1e-6, atol=1e-7)
