"""The no-grad evaluation path (decoding): a call that builds no plan gives the reference's numbers, and the plan
it leaves to be read later is the one the full path would have built (docs/architecture.md, "Decoding")."""

from __future__ import annotations

import pytest
import torch

import flexmoe.decoding as decoding_module
import flexmoe.layer as layer_module
from flexmoe import MoELayer
from flexmoe.dispatch import sum_choices_by_token
from flexmoe.experts.row_kernels import looped_expert_ffn
from flexmoe.experts.weights import ExpertWeights
from flexmoe.routing.capacity import HOST_ORDER_MAX_PAIRS, order_pairs_on_host
from flexmoe.routing.plan import all_finite
from reference import reference_for_layer
from test_layer import M, T, assert_close, assert_plan_matches, make_input, make_layer

TOL64 = 1e-10


def count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str, calls: list[int] | None = None,
                ) -> list[int]:
    """Counts the calls of ``module.<name>`` for the rest of the test (one entry per call; into ``calls`` when
    given, to count the same function reached through several modules)."""
    calls = [] if calls is None else calls
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def count_plan_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the layer's calls of build_plan (one entry per call): the full path's, and the one a call served
    without a plan defers (flexmoe.decoding)."""
    calls = count_calls(monkeypatch, layer_module, "build_plan")
    return count_calls(monkeypatch, decoding_module, "build_plan", calls)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("options", [{"capacity_factor": 0.0}, {"capacity_factor": 4.0},
                                     {"capacity_factor": 0.0, "score_at": "dispatch"},
                                     {"capacity_factor": 0.0, "normalize_weights": False}])
def test_no_grad_call_matches_reference_and_defers_the_plan(monkeypatch: pytest.MonkeyPatch, k: int,
                                                            options: dict) -> None:
    moe = make_layer(k=k, seed=3, **options).eval()
    x = make_input(seed=4)
    builds = count_plan_builds(monkeypatch)
    with torch.no_grad():
        y = moe(x)
    assert builds == []  # served without a plan
    ref, _, _ = reference_for_layer(moe, x, k=k, **options)
    assert_close(y, ref.y, TOL64, "output")
    assert_plan_matches(moe, ref)  # the plan, built now from the call's logits
    assert builds == [1]
    assert_close(moe.aux_loss, ref.aux_loss, TOL64, "aux_loss")
    assert_close(moe.z_loss, ref.z_loss, TOL64, "z_loss")
    assert builds == [1]  # built once


def test_over_capacity_takes_the_full_path_and_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = make_layer(k=2, capacity_factor=0.5, seed=5).eval()
    x = make_input(seed=6)
    builds = count_plan_builds(monkeypatch)
    with torch.no_grad():
        y = moe(x)
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=0.5)
    assert ref.num_dropped > 0 and builds == [1]
    assert_close(y, ref.y, TOL64, "output")
    assert_plan_matches(moe, ref)


def test_one_token_and_leading_shapes() -> None:
    moe = make_layer(k=2, capacity_factor=0.0, seed=7).eval()
    for shape in [(1, M), (M,), (2, 1, M)]:
        x = make_input(shape, seed=8)
        with torch.no_grad():
            y = moe(x)
        ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=0.0)
        assert y.shape == x.shape
        assert_close(y.reshape(ref.y.shape), ref.y, TOL64, f"output for {shape}")


@pytest.mark.parametrize("options", [
    {"score_func": "sigmoid", "num_expert_groups": 4, "num_limited_groups": 2, "route_scale": 2.5,
     "balance": "bias", "shared_experts": 1},
    {"router": "cosine", "glu": True, "activation": "silu", "shared_experts": 2, "shared_gate": True},
])
def test_family_options_equal_the_full_path(options: dict) -> None:
    """Options the dense reference does not model: the no-grad call equals the full path of the same layer (the
    full path is checked against the families' references in test_routing_families.py)."""
    moe = make_layer(k=3, capacity_factor=0.0, num_experts=8, seed=9, **options).eval()
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8, dtype=moe.expert_bias.dtype))
    x = make_input(seed=10)
    with torch.no_grad():
        fast = moe(x)
        fast_plan = moe.last_plan
    full = moe(x)  # grad enabled: the full path
    assert_close(fast, full, TOL64, "output")
    assert torch.equal(fast_plan.expert_index, moe.last_plan.expert_index)
    assert torch.equal(fast_plan.slot, moe.last_plan.slot)
    assert_close(fast_plan.aux_loss, moe.last_plan.aux_loss, TOL64, "aux_loss")


def test_plan_keeps_the_bias_of_its_call() -> None:
    moe = make_layer(k=2, capacity_factor=0.0, balance="bias", seed=11).eval()
    moe.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0, -0.5], dtype=moe.expert_bias.dtype))
    x = make_input(seed=12)
    with torch.no_grad():
        moe(x)
        biased = moe.last_plan.expert_index.clone()  # read right away
        moe(x)
        moe.expert_bias.zero_()  # changed after the call, before its plan is read
        assert torch.equal(moe.last_plan.expert_index, biased)
        moe(x)
        assert not torch.equal(moe.last_plan.expert_index, biased)  # the bias does change this routing


def test_errors_are_those_of_the_full_path() -> None:
    moe = make_layer(k=2, capacity_factor=0.0, seed=13).eval()
    bad = make_input(seed=14)
    bad[3, 0] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="NaN or infinity"):
        moe(bad)
    sequence = make_layer(k=2, capacity_factor=0.0, aux_loss_type="sequence", seed=15).eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"aux_loss_type='sequence' needs x of shape"):
        sequence(make_input(seed=16))


def test_float32_decoding_shape_matches_float64_reference() -> None:
    """E=16, k=4 float32 at one token per call, the shape decoding runs at (scaled down)."""
    torch.manual_seed(17)
    moe = MoELayer(M, 16, 32, k=4, capacity_factor=0.0).eval()
    for step in range(3):
        x = make_input((1, M), seed=20 + step, dtype=torch.float32)
        with torch.no_grad():
            y = moe(x)
        ref, _, _ = reference_for_layer(moe, x, k=4, capacity_factor=0.0)
        assert_close(y, ref.y, 2e-5, f"output at step {step}")
    assert moe.last_plan.counts == ref.tokens_per_expert


def test_training_mode_and_grad_take_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = make_layer(k=2, capacity_factor=0.0, seed=18)
    builds = count_plan_builds(monkeypatch)
    with torch.no_grad():
        moe.train()(make_input(seed=19))
    moe.eval()(make_input(seed=19))
    assert builds == [1, 1]
    assert T * 2 == sum(moe.last_plan.counts)


# ---- calls of a few pairs: rows ordered on the host, combined by one gather and one batched matmul --------------


@pytest.mark.parametrize(("tokens", "k"), [(1, 8), (3, 5), (8, 8), (16, 4)])
@pytest.mark.parametrize("options", [{}, {"score_at": "dispatch"}, {"normalize_weights": False}])
def test_few_pairs_call_matches_reference(monkeypatch: pytest.MonkeyPatch, tokens: int, k: int,
                                          options: dict) -> None:
    assert tokens * k <= HOST_ORDER_MAX_PAIRS  # the host-ordered path
    moe = make_layer(k=k, capacity_factor=0.0, num_experts=12, seed=30 + k, **options).eval()
    x = make_input((tokens, M), seed=31 + tokens)
    builds = count_plan_builds(monkeypatch)
    with torch.no_grad():
        y = moe(x)
    assert builds == []
    ref, _, _ = reference_for_layer(moe, x, k=k, capacity_factor=0.0, **options)
    assert_close(y, ref.y, TOL64, "output")
    assert_plan_matches(moe, ref)


def test_order_pairs_on_host_is_the_stable_sort_by_expert() -> None:
    """Reference: Python's sort of the choice-major pairs ``c * T + t`` by (expert, pair index)."""
    g = torch.Generator().manual_seed(40)
    num_experts = 6
    for _ in range(20):
        tokens, k = int(torch.randint(1, 10, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        choices = torch.randint(0, num_experts, (tokens, k), generator=g).tolist()  # repeats allowed
        order = order_pairs_on_host(choices, num_experts)

        def expert_of(p: int, tokens: int = tokens, choices: list = choices) -> int:
            return choices[p % tokens][p // tokens]

        want = sorted(range(tokens * k), key=lambda p: (expert_of(p), p))
        assert order.row_pair == want
        assert order.row_token == [p % tokens for p in want]
        assert order.counts == [sum(row.count(e) for row in choices) for e in range(num_experts)]
        assert order.pair_row == [want.index(c * tokens + t) for t in range(tokens) for c in range(k)]
    for bad in (-1, num_experts):
        with pytest.raises(ValueError, match="expert_index must lie in"):
            order_pairs_on_host([[0, bad]], num_experts)


def test_sum_choices_by_token_matches_a_dense_loop() -> None:
    g = torch.Generator().manual_seed(41)
    tokens, k, width = 4, 3, 5
    rows = torch.randn(tokens * k, width, generator=g, dtype=torch.float64)
    pair_row = torch.randperm(tokens * k, generator=g)
    weight = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    want = torch.zeros(tokens, width, dtype=torch.float64)
    unweighted = torch.zeros(tokens, width, dtype=torch.float64)
    for t in range(tokens):
        for c in range(k):
            want[t] += weight[t, c] * rows[pair_row[t * k + c]]
            unweighted[t] += rows[pair_row[t * k + c]]
    assert_close(sum_choices_by_token(rows, pair_row, weight, tokens), want, TOL64, "weighted")
    assert_close(sum_choices_by_token(rows, pair_row, None, tokens), unweighted, TOL64, "unweighted")
    # Its gradients (embedding_bag's backward) against the loop's: rows get grad_out[t] * weight, weights the dot
    # product of grad_out[t] with the pair's row.
    grad_out = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    rows.requires_grad_(True)
    weight.requires_grad_(True)
    sum_choices_by_token(rows, pair_row, weight, tokens).backward(grad_out)
    want_rows, want_weight = torch.zeros_like(rows), torch.zeros_like(weight)
    for t in range(tokens):
        for c in range(k):
            want_rows[pair_row[t * k + c]] += weight[t, c].detach() * grad_out[t]
            want_weight[t, c] = (grad_out[t] * rows[pair_row[t * k + c]].detach()).sum()
    assert_close(rows.grad, want_rows, TOL64, "grad of rows")
    assert_close(weight.grad, want_weight, TOL64, "grad of weight")


@pytest.mark.parametrize("glu", [False, True])
def test_no_grad_expert_loop_matches_a_dense_loop(glu: bool) -> None:
    """The loop over active experts (one hidden-unit call for all rows) against each row through its expert."""
    g = torch.Generator().manual_seed(42)
    counts, width, hidden = [2, 0, 3, 0, 1], 6, 7

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    w1, b1, w2, b2 = rand(5, width, hidden), rand(5, hidden), rand(5, hidden, width), rand(5, width)
    w3, b3 = (rand(5, width, hidden), rand(5, hidden)) if glu else (None, None)
    rows = rand(sum(counts), width)
    experts_of_rows = [e for e, n in enumerate(counts) for _ in range(n)]
    want = torch.stack([
        (torch.nn.functional.gelu(x @ w1[e] + b1[e]) * ((x @ w3[e] + b3[e]) if glu else 1.0)) @ w2[e] + b2[e]
        for x, e in zip(rows, experts_of_rows)])
    with torch.no_grad():
        got = looped_expert_ffn(rows, counts, ExpertWeights(w1, b1, w2, b2, w3, b3, torch.nn.functional.gelu))
    assert_close(got, want, TOL64, "expert rows")


def test_all_finite_is_exact() -> None:
    big = torch.full((4,), 3e38, dtype=torch.float32)  # a plain sum would overflow to inf
    assert all_finite(big) and all_finite(-big) and all_finite(torch.zeros(0))
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = big.clone()
        t[2] = bad
        assert not all_finite(t)


def test_pair_sums_with_missing_pairs_match_a_dense_loop() -> None:
    """Combine's sum over pairs when some have no row (dropped): each token sums only its pairs that have one, a
    token with none gets zeros, and an inf in one row stays in the tokens that use that row (a stand-in row
    with weight 0 for the missing pairs would have turned it into NaN elsewhere). Forward and gradients."""
    from flexmoe.dispatch import _sum_pair_rows

    g = torch.Generator().manual_seed(43)
    tokens, k, width, num_rows = 6, 3, 4, 11
    pairs = torch.randperm(tokens * k, generator=g).view(tokens, k)
    pairs = torch.where(pairs < num_rows, pairs, torch.full_like(pairs, num_rows))  # 7 pairs without a row
    pairs[2] = num_rows  # token 2 keeps nothing
    rows = torch.randn(num_rows, width, generator=g, dtype=torch.float64)
    weight = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    want = torch.zeros(tokens, width, dtype=torch.float64)
    want_unweighted = torch.zeros(tokens, width, dtype=torch.float64)
    for t in range(tokens):
        for c in range(k):
            if pairs[t, c] < num_rows:
                want[t] += weight[t, c] * rows[pairs[t, c]]
                want_unweighted[t] += rows[pairs[t, c]]
    rows_in, weight_in = rows.clone().requires_grad_(), weight.clone().requires_grad_()
    got = _sum_pair_rows(rows_in, pairs, weight_in, every_pair_has_row=False)
    assert_close(got, want, TOL64, "weighted")
    assert_close(_sum_pair_rows(rows, pairs, None, every_pair_has_row=False), want_unweighted, TOL64, "unweighted")
    grad_out = torch.randn(tokens, width, generator=g, dtype=torch.float64)
    got.backward(grad_out)
    want_rows = torch.zeros_like(rows)
    want_weight = torch.zeros_like(weight)
    for t in range(tokens):
        for c in range(k):
            if pairs[t, c] < num_rows:
                want_rows[pairs[t, c]] += weight[t, c] * grad_out[t]
                want_weight[t, c] = (grad_out[t] * rows[pairs[t, c]]).sum()
    assert_close(rows_in.grad, want_rows, TOL64, "grad of rows")
    assert_close(weight_in.grad, want_weight, TOL64, "grad of weight")
    # An inf in row 0 reaches only the tokens that use row 0.
    uses_row0 = (pairs == 0).any(1)
    poisoned = rows.clone()
    poisoned[0, 0] = float("inf")
    out = _sum_pair_rows(poisoned, pairs, weight, every_pair_has_row=False)
    assert bool(torch.isfinite(out[~uses_row0]).all()) and bool(torch.isinf(out[uses_row0, 0]).all())


@pytest.mark.parametrize("autocast", [False, True])
def test_half_precision_decoding_rounds_as_the_full_path(autocast: bool) -> None:
    """bf16 experts (a bf16 layer, or float32 under bf16 autocast), k=4: the call without a plan rounds each
    weighted row and each add of the combine as the full path does (and HF's blocks), so the two are equal to the
    bit; an embedding_bag sum (float32 inside, rounded once) differed in the last bf16 place. Both stay within
    bf16 rounding of the float64 dense loop."""
    dtype = torch.float32 if autocast else torch.bfloat16
    torch.manual_seed(41)
    moe = MoELayer(M, 12, 32, k=4, capacity_factor=0.0, dtype=dtype)
    x = make_input((8, M), seed=42, dtype=dtype)
    outputs = []
    for training in (False, True):  # eval: no plan; training mode: the full path
        moe.train(training)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs.append(moe(x))
    assert outputs[0].dtype == outputs[1].dtype
    assert torch.equal(outputs[0], outputs[1])
    ref, _, _ = reference_for_layer(moe.eval(), x, k=4, capacity_factor=0.0)
    assert_close(outputs[0].double(), ref.y.double(), 3e-2, "output")


@pytest.mark.parametrize("options", [{}, {"normalize_weights": False}])
def test_last_weight_is_the_plans_weight_without_building_it(monkeypatch: pytest.MonkeyPatch, options: dict) -> None:
    """``last_weight``: the ``[T, k]`` weights of the last call, read without building the plan a no-grad
    evaluation call defers (GPT-OSS's converted block returns them at every step); equal to the float64 dense
    reference's weights, and to the plan's once it is built, on both paths."""
    moe = make_layer(k=3, capacity_factor=0.0, num_experts=8, seed=50, **options).eval()
    assert moe.last_weight is None
    x = make_input(seed=51)
    builds = count_plan_builds(monkeypatch)
    with torch.no_grad():
        moe(x)
    served = moe.last_weight
    assert builds == []
    ref, _, _ = reference_for_layer(moe, x, k=3, capacity_factor=0.0, **options)
    assert_close(served, ref.weight, TOL64, "weights")
    assert torch.equal(served, moe.last_plan.weight)
    moe.train()(x)  # the full path
    assert moe.last_weight is moe.last_plan.weight
    assert_close(moe.last_weight, ref.weight, TOL64, "weights on the full path")
