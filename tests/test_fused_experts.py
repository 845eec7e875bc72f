"""The fused expert path (dispatch, experts and combine expert by expert, one autograd node): values and every
gradient against a dense per-row loop written here, and the layer through it against the float64 reference
(docs/architecture.md, "Fused experts")."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import flexmoe.experts.stage as expert_stage
from flexmoe import MoELayer
from flexmoe.experts import resolve_activation
from flexmoe.experts.fused import CHUNK_ROWS, expert_chunks, fused_experts, fused_supported
from flexmoe.experts.weights import ExpertWeights
from reference import ref_activation, reference_for_layer
from test_decoding import count_calls
from test_expert_kernels import FakeTimer
from test_layer import assert_close

TOL64 = 1e-10


def random_rows(num_tokens: int, num_experts: int, k: int, keep: float, seed: int,
                ) -> tuple[Tensor, Tensor, list[int]]:
    """Each token picks k distinct experts; each pair is kept with probability ``keep`` (the others dropped).
    Returns the kept rows sorted by expert: (row_token [N], row_expert [N], counts [E])."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for t in range(num_tokens):
        for e in torch.randperm(num_experts, generator=g)[:k].tolist():
            if torch.rand((), generator=g).item() < keep:
                pairs.append((e, t))
    pairs.sort()
    counts = [sum(1 for e, _ in pairs if e == x) for x in range(num_experts)]
    return (torch.tensor([t for _, t in pairs], dtype=torch.long),
            torch.tensor([e for e, _ in pairs], dtype=torch.long), counts)


def dense_reference(x: Tensor, row_token: Tensor, row_expert: Tensor, row_weight: Tensor, p: dict[str, Tensor],
                    act, glu_limit: float | None) -> Tensor:
    """y[t] = sum over rows r of t of w_r * expert(x[t]), one row at a time."""
    y = [torch.zeros_like(x[0]) for _ in range(x.shape[0])]
    for r in range(row_token.shape[0]):
        t, e = int(row_token[r]), int(row_expert[r])
        pre1 = x[t] @ p["w1"][e] + (p["b1"][e] if p.get("b1") is not None else 0)
        if p.get("w3") is not None:
            pre3 = x[t] @ p["w3"][e] + (p["b3"][e] if p.get("b3") is not None else 0)
            if glu_limit is None:
                h = act(pre1) * pre3
            else:
                h = act(torch.minimum(pre1, torch.tensor(glu_limit, dtype=x.dtype))) * (
                    torch.clamp(pre3, -glu_limit, glu_limit) + 1)
        else:
            h = act(pre1)
        out = h @ p["w2"][e] + (p["b2"][e] if p.get("b2") is not None else 0)
        y[t] = y[t] + row_weight[r] * out
    return torch.stack(y)


def make_params(num_experts: int, model_dim: int, hidden: int, glu: bool, bias: bool, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-2 if len(shape) > 2 else -1] ** 0.5
                ).requires_grad_()

    p = {"w1": leaf(num_experts, model_dim, hidden), "w2": leaf(num_experts, hidden, model_dim)}
    if glu:
        p["w3"] = leaf(num_experts, model_dim, hidden)
    if bias:
        p["b1"], p["b2"] = leaf(num_experts, hidden), leaf(num_experts, model_dim)
        if glu:
            p["b3"] = leaf(num_experts, hidden)
    return p


CASES = [  # activation, glu, bias, glu_limit
    ("gelu", False, True, None), ("relu", False, False, None), ("silu", True, False, None),
    ("silu", True, True, 0.7), ("gelu", True, True, None), ("tanh", False, True, None),
]


@pytest.mark.parametrize("activation,glu,bias,glu_limit", CASES)
@pytest.mark.parametrize("k,keep,chunk_rows", [(1, 1.0, 1), (2, 0.7, 9), (3, 1.0, CHUNK_ROWS)])
def test_fused_experts_match_a_dense_loop(activation: str, glu: bool, bias: bool, glu_limit: float | None, k: int,
                                          keep: float, chunk_rows: int, device: torch.device) -> None:
    """chunk_rows 1: one expert per chunk; 9: a few; the default: every expert in one chunk. The kernel runs in
    float64 on ``device``, the dense loop on the CPU."""
    T, E, M, H = 13, 6, 5, 7
    row_token, row_expert, counts = random_rows(T, E, k, keep, seed=k)
    p = make_params(E, M, H, glu, bias, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, M, generator=g, dtype=torch.float64, requires_grad=True)
    row_weight = torch.rand(row_token.shape[0], generator=g, dtype=torch.float64).requires_grad_()
    grad_y = torch.randn(T, M, generator=g, dtype=torch.float64)

    if activation == "tanh":  # a callable the layer does not know by name: the unit's derivative by autograd
        fn, ref_act = torch.tanh, torch.tanh
    else:
        fn, ref_act = resolve_activation(activation), ref_activation(activation)
    leaves = [x, row_weight, *p.values()]
    on_device = [t.detach().to(device).requires_grad_() for t in leaves]
    d = dict(zip(p, on_device[2:]))
    weights = ExpertWeights(d["w1"], d.get("b1"), d["w2"], d.get("b2"), d.get("w3"), d.get("b3"), fn, glu_limit)
    y = fused_experts(on_device[0], row_token.to(device), on_device[1], counts, weights, chunk_rows=chunk_rows)
    got = torch.autograd.grad(y, on_device, grad_y.to(device))
    want_y = dense_reference(x, row_token, row_expert, row_weight, p, ref_act, glu_limit)
    want = torch.autograd.grad(want_y, leaves, grad_y)
    assert_close(y, want_y, TOL64, "output")
    for name, a, b in zip(["x", "row_weight", *p], got, want):
        assert_close(a, b, TOL64, f"grad {name}")


def test_experts_without_rows_get_zero_gradients_and_tokens_without_rows_zero_output() -> None:
    T, E, M, H = 6, 4, 3, 5
    p = make_params(E, M, H, glu=False, bias=True, seed=1)
    row_token = torch.tensor([0, 2, 2, 4])  # experts 0 and 3 have no rows; tokens 1, 3, 5 none
    row_expert = torch.tensor([1, 1, 2, 2])
    counts = [0, 2, 2, 0]
    x = torch.randn(T, M, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    y = fused_experts(x, row_token, w, counts,
                      ExpertWeights(p["w1"], p["b1"], p["w2"], p["b2"], None, None, resolve_activation("gelu")))
    assert y[[1, 3, 5]].abs().max() == 0
    y.square().sum().backward()
    for name in ("w1", "b1", "w2", "b2"):
        assert p[name].grad[[0, 3]].abs().max() == 0, name
        assert p[name].grad[[1, 2]].abs().max() > 0, name
    want = dense_reference(x.detach(), row_token, row_expert, w.detach(), {n: t.detach() for n, t in p.items()},
                           ref_activation("gelu"), None)
    assert_close(y, want, TOL64, "output")


def test_expert_chunks_hold_whole_consecutive_experts() -> None:
    counts = [3, 0, 2, 5, 0, 0, 1, 4]
    assert expert_chunks(counts, 4) == [(0, 5, [(0, 0, 3), (2, 3, 2)]), (5, 5, [(3, 0, 5)]),
                                        (10, 5, [(6, 0, 1), (7, 1, 4)])]
    assert expert_chunks(counts, 100) == [(0, 15, [(0, 0, 3), (2, 3, 2), (3, 5, 5), (6, 10, 1), (7, 11, 4)])]
    assert expert_chunks([0, 0, 2, 0], 1) == [(0, 2, [(2, 0, 2)])]
    assert expert_chunks([0, 0], 1) == []


def test_counts_must_cover_the_rows() -> None:
    p = make_params(2, 3, 4, glu=False, bias=False, seed=0)
    with pytest.raises(ValueError, match="counts must sum"):
        fused_experts(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64),
                      [1, 2], ExpertWeights(p["w1"], None, p["w2"], None, None, None, torch.tanh))


def test_fused_runs_in_training_with_one_dtype_and_device() -> None:
    p = make_params(4, 8, 16, glu=False, bias=True, seed=0)
    weights = ExpertWeights(p["w1"], p["b1"], p["w2"], p["b2"], None, None, torch.nn.functional.gelu)
    x = torch.zeros(10, 8, dtype=torch.float64, requires_grad=True)
    assert fused_supported(x, weights)  # any dtype: which route is faster is measured, not assumed
    with torch.no_grad():
        assert not fused_supported(x, weights)  # no autograd: its gain is the backward
    assert not fused_supported(x.float(), weights)  # mixed dtypes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_supported(x, weights)


@pytest.mark.parametrize("faster", ["fused", "rows"])
def test_expert_parallel_receiver_fuses_where_measured_faster(faster: str) -> None:
    """The receiving rank of the token exchange takes the fused experts where its chooser holds them faster, and
    the same numbers either way (against a float64 dense loop)."""
    from flexmoe.experts import FeedForwardExperts
    from flexmoe.experts.chooser import KernelChooser
    from flexmoe.parallel.token_exchange import _weighted_experts, receiver_fuses

    torch.manual_seed(0)
    timer = FakeTimer({"fused": 1.0, "rows": 2.0} if faster == "fused" else {"fused": 2.0, "rows": 1.0})
    experts = FeedForwardExperts(3, 6, 5, kernels=KernelChooser(timer=timer), dtype=torch.float64)
    received = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    row_token, counts = torch.tensor([0, 2, 6, 1, 3, 5, 2]), [3, 0, 4]
    row_weight = torch.rand(7, dtype=torch.float64)
    assert receiver_fuses(received, row_token, row_weight, counts, experts) == (faster == "fused")
    # The plain experts' kernel is decided first, then the two routes are timed, once per bucket.
    assert timer.calls[-2:] == ["fused", "rows"] and {"loop", "segmented"} <= set(timer.calls[:-2])
    timed = len(timer.calls)
    assert receiver_fuses(received, row_token, row_weight, counts, experts) == (faster == "fused")
    assert len(timer.calls) == timed
    with torch.no_grad():
        assert not receiver_fuses(received, row_token, row_weight, counts, experts)  # no autograd: plain experts
    got = _weighted_experts(received, row_token, row_weight, counts, experts)
    params = {n: t.detach() for n, t in experts.named_parameters()}
    row_expert = torch.tensor([0, 0, 0, 2, 2, 2, 2])
    want = dense_reference(received.detach(), row_token, row_expert, row_weight, params, ref_activation("gelu"),
                           None)
    assert_close(got, want, TOL64, "output")


def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the layer's calls of fused_experts (the layers of these tests force it: expert_route="fused")."""
    return count_calls(monkeypatch, expert_stage, "fused_experts")


@pytest.mark.parametrize("options", [{"k": 2, "capacity_factor": 0.0}, {"k": 3, "capacity_factor": 1.0},
                                     {"k": 1, "capacity_factor": 0.0, "activation": "silu", "glu": True}])
def test_float32_layer_trains_through_the_fused_path_like_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                                        options: dict) -> None:
    M, E, H, T = 16, 12, 8, 40
    torch.manual_seed(0)
    moe = MoELayer(M, E, H, dtype=torch.float32, expert_route="fused", **options)
    x = torch.randn(T, M, requires_grad=True)
    calls = fused_calls(monkeypatch)
    y = moe(x)
    assert calls == [1]
    grad_y = torch.randn(T, M)
    (y * grad_y).sum().backward()
    routing = {n: options[n] for n in ("k", "capacity_factor")}
    ref, x64, params = reference_for_layer(moe, x, activation=options.get("activation", "gelu"),
                                           glu=options.get("glu", False), **routing)
    if options["capacity_factor"] > 0:
        assert ref.num_dropped > 0  # the case drops pairs
    (ref.y * grad_y.double()).sum().backward()
    tol = 2e-5
    assert_close(y, ref.y, tol, "output")
    assert_close(x.grad, x64.grad, tol, "grad x")
    for name, p in moe.named_parameters():
        assert_close(p.grad, params[name].grad, tol, f"grad {name}")


def test_layer_under_activation_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    moe = MoELayer(16, 8, 8, k=2, capacity_factor=0.0, expert_route="fused")
    x = torch.randn(30, 16, requires_grad=True)
    calls = fused_calls(monkeypatch)
    y = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    y.square().sum().backward()
    assert len(calls) == 2  # the forward, then its recomputation in backward
    grads = [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]
    x.grad = None
    moe.zero_grad()
    moe64 = MoELayer(16, 8, 8, k=2, capacity_factor=0.0, dtype=torch.float64)
    moe64.load_state_dict(moe.state_dict())
    x64 = x.detach().double().requires_grad_()
    moe64(x64).square().sum().backward()  # the rule's route: the three stages
    for got, want in zip(grads, [x64.grad] + [p.grad for p in moe64.parameters()]):
        assert_close(got, want, 1e-5, "gradient")


def test_a_training_call_takes_it_where_its_chooser_measured_it_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first call times both routes (forward + backward); that call and the next take the faster, fused;
    against the same layer in float64 on the rule's route, the three stages. A call of more rows than the CPU's
    read-free rule takes (expert_stage.CPU_READ_FREE_MAX_ROWS): smaller float32 training calls are not timed."""
    from flexmoe.experts.chooser import KernelChooser

    timer = FakeTimer({"fused": 1.0, "rows": 2.0})
    monkeypatch.setattr(KernelChooser, "default_timer", timer)
    calls = count_calls(monkeypatch, expert_stage, "fused_experts")
    torch.manual_seed(2)
    moe = MoELayer(32, 16, 8, k=4, capacity_factor=0.0)
    num_tokens = expert_stage.CPU_READ_FREE_MAX_ROWS // 4 + 1
    x = torch.randn(num_tokens, 32, requires_grad=True)
    grad_y = torch.randn(num_tokens, 32)
    (moe(x) * grad_y).sum().backward()
    assert calls == [1] and timer.calls.count("fused") == timer.calls.count("rows") == 1
    monkeypatch.setattr(KernelChooser, "default_timer", None)
    moe64 = MoELayer(32, 16, 8, k=4, capacity_factor=0.0, dtype=torch.float64)
    moe64.load_state_dict(moe.state_dict())
    x64 = x.detach().double().requires_grad_()
    (moe64(x64) * grad_y.double()).sum().backward()
    assert calls == [1]
    assert_close(x.grad, x64.grad, 1e-5, "grad x")
