"""torch.compile of MoELayer (docs/architecture.md, "Compiling the layer").

Capacity mode must compile into one graph (``fullgraph=True``), forward and backward, and give the float64
reference's outputs and gradients (tests/reference.py: Python loops, no flexmoe code). Most tests use the
``aot_eager`` backend: it traces forward and backward exactly as inductor does (dynamo, then AOT autograd) but
runs the traced ops without generating C++, so it is quick. The inductor tests (C++ kernels) are slow and need a
C++ compiler; they skip only when none is on PATH.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

from flexmoe import MoELayer
from flexmoe.experts import padded_fused_op
from flexmoe.experts import padded_op as padded_ffn_op
from flexmoe.routing import make_plan
from reference import reference_for_layer

# Dropless mode: every pair has a row (N = T * k), so the plan keeps its counts on the device and the experts'
# custom ops read them there: no count reaches the host and the layer is one graph. (Until issue 28 the counts
# reached the host once, plan_from_pairs' ``tolist``, and torch._dynamo.explain counted 3 breaks.)
DROPLESS_GRAPH_BREAKS = 0


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread: None) -> Iterator[None]:
    """Every test compiles afresh: the layers of different tests share ``forward``'s code object, and its
    recompilation limit must not carry over from one test to the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(seed: int = 0, **options: Any) -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(8, 4, 12, dtype=torch.float64, router_dtype=torch.float64, **options)


def _grads(moe: nn.Module, x: Tensor, out: Tensor, grad: Tensor) -> dict[str, Tensor]:
    moe.zero_grad(set_to_none=True)
    x.grad = None
    out.backward(grad)
    grads = {name: p.grad.clone() for name, p in moe.named_parameters() if p.grad is not None}
    assert x.grad is not None
    grads["x"] = x.grad.clone()
    return grads


def _assert_matches_reference(got: Tensor, grads: dict[str, Tensor], ref: Any, x64: Tensor,
                              params: dict[str, Tensor], *, names: tuple[str, ...] | None = None,
                              rtol: float = 1e-10, atol: float = 1e-12) -> None:
    """The compiled output and gradients (of x and of ``names``, default every reference parameter), on any device,
    equal the float64 reference's (on the CPU)."""
    torch.testing.assert_close(got.detach().cpu(), ref.y.detach(), rtol=rtol, atol=atol)
    assert x64.grad is not None
    torch.testing.assert_close(grads["x"].cpu(), x64.grad, rtol=rtol, atol=atol)
    for name in params if names is None else names:
        assert params[name].grad is not None
        torch.testing.assert_close(grads[name].cpu(), params[name].grad, rtol=rtol, atol=atol, msg=name)


def _backend_for(device: torch.device) -> str:
    """aot_eager on the CPU (quick: no C++ generated); inductor elsewhere, the GPU's own code generation
    (Triton) being what a CUDA run must check."""
    return "aot_eager" if device.type == "cpu" else "inductor"


CAPACITY_CASES = {
    "cf=1.0 with drops": (dict(k=2, capacity_factor=1.0), dict(k=2, capacity_factor=1.0)),
    "explicit capacity, batch-prioritized, score at dispatch": (
        dict(k=2, capacity=3, batch_prioritized=True, score_at="dispatch"),
        dict(k=2, capacity=3, batch_prioritized=True, score_at="dispatch")),
    "k=1 relu, unnormalized": (dict(k=1, capacity_factor=1.5, activation="relu", normalize_weights=False),
                               dict(k=1, capacity_factor=1.5, normalize_weights=False, activation="relu")),
}


# The default run keeps one case of each test (compiling takes seconds each); the others are slow.
DEFAULT_CAPACITY_CASE = "explicit capacity, batch-prioritized, score at dispatch"
DEFAULT_FAMILY_CASE = "deepseek: sigmoid, groups, bias, route scale"


def _cases(names: list[str], default: str) -> list[Any]:
    return [pytest.param(n, marks=() if n == default else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("case", _cases(list(CAPACITY_CASES), DEFAULT_CAPACITY_CASE))
def test_capacity_mode_compiles_fullgraph_and_matches_the_reference(case: str, device: torch.device) -> None:
    layer_options, ref_options = CAPACITY_CASES[case]
    ref_options = dict(ref_options)  # the table is shared by the tests
    activation = ref_options.pop("activation", "gelu")
    moe = _layer(**layer_options).to(device)
    x = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, x64, params = reference_for_layer(moe, x, activation=activation, **ref_options)
    grad = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    # Off the CPU the compiled call does not pad (ExpertStage.plan_layout): it breaks the graph where
    # the counts reach the host, and must still give the reference's numbers.
    on_cpu = device.type == "cpu"
    compiled = torch.compile(moe, fullgraph=on_cpu, backend=_backend_for(device))
    x = x.to(device, copy=True).requires_grad_()
    got = compiled(x)
    grads = _grads(moe, x, got, grad.to(device))
    ref.y.backward(grad)

    plan = moe.last_plan
    assert plan is not None and plan.padded == on_cpu  # on the CPU the compiled call took the padded layout
    assert int(plan.num_dropped) == ref.num_dropped
    if "k=1" not in case:
        assert ref.num_dropped > 0  # the case exercises drops
    assert plan.capacity == ref.capacity
    assert plan.slot.tolist() == ref.slot
    assert plan.tokens_per_expert.tolist() == ref.tokens_per_expert
    _assert_matches_reference(got, grads, ref, x64, params)


@pytest.mark.slow  # 13 s
def test_dynamic_shapes_compile_once_in_capacity_mode() -> None:
    """``torch.compile(dynamic=True)``: one graph for every number of tokens, each call equal to the reference.
    Dynamo makes the float capacity_factor a symbol there; the capacity must still reach the dispatch."""
    moe = _layer(k=2, capacity_factor=1.1)
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for tokens in (20, 23, 31):
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 8, dtype=torch.float64, generator=gen)
        grad = torch.randn(tokens, 8, dtype=torch.float64, generator=gen)
        ref, x64, params = reference_for_layer(moe, x, k=2, capacity_factor=1.1)
        x = x.clone().requires_grad_()
        got = compiled(x)
        grads = _grads(moe, x, got, grad)
        ref.y.backward(grad)
        plan = moe.last_plan
        assert plan is not None and plan.padded and plan.capacity == ref.capacity
        assert int(plan.num_dropped) == ref.num_dropped
        _assert_matches_reference(got, grads, ref, x64, params)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1  # no recompilation for a new T


@pytest.mark.slow  # 27 s per case; the default suite compiles per-call capacities in the padded-op tests
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic"])
def test_per_call_capacity_options_compile_and_match_the_reference(dynamic: bool | None) -> None:
    """A compiled layer called with its own per-call ``capacity_factor`` (training at one, evaluating at
    another, as GShard does) and ``capacity``: dynamo makes a float that changes between calls symbolic, and
    the options rebuilt inside the forward for the call must still check it and turn it into a capacity. Each
    call must equal the reference at that call's options; a capacity factor costs at most one graph per
    distinct value, an integer capacity none after the first change."""
    moe = _layer(k=2, capacity_factor=1.25)
    compiled = torch.compile(moe, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls: list[dict[str, Any]] = [dict(capacity_factor=cf) for cf in (1.25, 2.0, 0.75, 2.0)]
    calls += [dict(capacity=c) for c in (3, 9, 5)]
    for i, call in enumerate(calls):
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(24, 8, dtype=torch.float64, generator=gen)
        grad = torch.randn(24, 8, dtype=torch.float64, generator=gen)
        ref, x64, params = reference_for_layer(moe, x, k=2, **call)
        x = x.clone().requires_grad_()
        got = compiled(x, **call)
        grads = _grads(moe, x, got, grad)
        ref.y.backward(grad)
        plan = moe.last_plan
        assert plan is not None and plan.capacity == ref.capacity, call
        assert int(plan.num_dropped) == ref.num_dropped, call
        _assert_matches_reference(got, grads, ref, x64, params)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    assert graphs <= 3 + 2  # cf 1.25, 2.0, 0.75 (2.0 again reuses its graph); capacity: a constant, then a symbol


FAMILY_CASES = {
    "deepseek: sigmoid, groups, bias, route scale": dict(k=2, capacity_factor=1.0, score_func="sigmoid",
                                                        num_expert_groups=2, num_limited_groups=1,
                                                        balance="bias", route_scale=2.5),
    "switch: capacity per sequence, router bias, sequence loss": dict(k=1, capacity_factor=1.0,
                                                                     capacity_per="sequence", router_bias=True,
                                                                     aux_loss_type="sequence"),
    "noise: jitter, gate noise, random 2nd expert": dict(k=2, capacity_factor=1.0, jitter=0.1, gate_noise=0.5,
                                                        second_expert="random"),
}


@pytest.mark.parametrize("case", _cases(list(FAMILY_CASES), DEFAULT_FAMILY_CASE))
def test_routing_options_compile_fullgraph_and_equal_eager(case: str) -> None:
    """The eager layer is checked against float64 references in test_routers / test_routing_families; here the
    compiled (padded) path must give its numbers, randomness included (same seed, same draws)."""
    moe = _layer(**FAMILY_CASES[case]).train()
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1], dtype=torch.float64))
    x = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    torch.manual_seed(5)
    want = moe(x)
    want_plan, want_aux = moe.last_plan, moe.aux_loss
    want_grads = _grads(moe, x, want, grad)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    got = compiled(x)
    got_plan, got_aux = moe.last_plan, moe.aux_loss
    got_grads = _grads(moe, x, got, grad)

    assert want_plan is not None and got_plan is not None and got_plan.padded and not want_plan.padded
    assert got_plan.slot.tolist() == want_plan.slot.tolist()
    assert int(got_plan.num_dropped) == want_plan.num_dropped
    assert int(got_plan.num_skipped) == want_plan.num_skipped
    torch.testing.assert_close(got_plan.load, want_plan.load)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got_aux is not None and want_aux is not None
    torch.testing.assert_close(got_aux, want_aux, rtol=1e-10, atol=1e-12)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    if moe.pending_load is not None:  # balance="bias": both training forwards counted their load
        assert moe.pending_load.tolist() == (2 * want_plan.load).tolist()


# The padded plan's real rows only (flexmoe::padded_experts): E=8 and E=64, with and without biases and the
# gated unit, a capacity small enough that some experts overflow while others get nothing.
PADDED_OP_CASES = {
    "E=8 bias gelu": dict(num_experts=8, tokens=8, k=2, capacity=2),
    "E=8 no bias, glu silu": dict(num_experts=8, tokens=8, k=2, capacity=2, bias=False, glu=True,
                                  activation="silu"),
    "E=64 bias, glu silu": dict(num_experts=64, tokens=30, k=2, capacity=1, glu=True, activation="silu"),
    "E=64 no bias relu": dict(num_experts=64, tokens=30, k=3, capacity=1, bias=False, activation="relu"),
}


_CXX = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
needs_cxx = pytest.mark.skipif(_CXX is None, reason="inductor on CPU compiles C++: no g++, c++ or clang++ on PATH")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.slow, needs_cxx])])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "E=64 no bias relu" else c
                                  for c in PADDED_OP_CASES])  # 10 s each at E=64: one of them in the default run
def test_padded_op_computes_the_real_rows_and_matches_eager_and_the_reference(case: str, backend: str) -> None:
    _check_padded_case(case, backend, "flexmoe::padded_experts")


@pytest.fixture
def fused_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused op's rule, without its measured sizes and dtype: the small float64 cases take it."""
    monkeypatch.setattr(padded_fused_op, "fused_size_rule", lambda *sizes: True)
    monkeypatch.setattr(padded_fused_op, "FUSED_DTYPES", (torch.float32, torch.float64))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.slow, needs_cxx])])
@pytest.mark.parametrize("case", list(PADDED_OP_CASES))
def test_fused_padded_op_matches_eager_and_the_reference(case: str, backend: str, fused_everywhere: None) -> None:
    """Compiled training with many small experts runs dispatch, the FFN and combine in one custom op
    (flexmoe::padded_fused_experts, eager's fused experts over the padded plan)."""
    _check_padded_case(case, backend, "flexmoe::padded_fused_experts")


def _check_padded_case(case: str, backend: str, op: str) -> None:
    """The compiled layer (which must run ``op``) against the eager layer and the float64 reference."""
    options = dict(PADDED_OP_CASES[case])
    num_experts, tokens = options.pop("num_experts"), options.pop("tokens")
    torch.manual_seed(0)
    moe = MoELayer(8, num_experts, 12, dtype=torch.float64, router_dtype=torch.float64, **options)
    x = torch.randn(tokens, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(tokens, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_options = {n: options[n] for n in ("k", "capacity") if n in options}
    ref, x64, params = reference_for_layer(moe, x, activation=str(options.get("activation", "gelu")),
                                           glu=bool(options.get("glu")), **ref_options)
    ref.y.backward(grad)
    loads = ref.load
    assert max(loads) > ref.capacity and 0 in loads  # some experts overflow, some get no row

    want = moe(x)
    want_grads = _grads(moe, x, want, grad)
    with torch.profiler.profile() as prof:
        got = torch.compile(moe, fullgraph=True, backend=backend)(x)
        got_grads = _grads(moe, x, got, grad)
    assert op in {e.key for e in prof.key_averages()}
    assert moe.last_plan is not None and moe.last_plan.padded
    tol = dict(rtol=1e-10, atol=1e-12) if backend == "aot_eager" else dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got, want, **tol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **tol, msg=name)
    _assert_matches_reference(got, got_grads, ref, x64, params, **tol)


def test_unnamed_activation_keeps_the_batched_matmuls_and_matches_the_reference() -> None:
    """The op takes activations by name: a callable one runs the padded block through the batched matmuls
    (padding rows computed and never combined), with the same numbers."""
    def tanh_gate(h: Tensor) -> Tensor:
        return h * torch.tanh(h)

    torch.manual_seed(0)
    moe = MoELayer(8, 8, 12, k=2, capacity=2, activation=tanh_gate, dtype=torch.float64, router_dtype=torch.float64)
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = moe(x)
    want_grads = _grads(moe, x, want, grad)
    torch._dynamo.reset()
    assert _padded_rows_seen(moe, x) == []  # the op never ran
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    got_grads = _grads(moe, x, got, grad)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)


# Each op's function that receives the per-unit counts of real rows (called only inside that op).
UNIT_ROWS_READERS = {"flexmoe::padded_experts": (padded_ffn_op, "padded_segments"),
                     "flexmoe::padded_fused_experts": (padded_fused_op, "padded_chunks")}


@contextmanager
def _op_calls(op: str) -> Iterator[list[tuple[list[int], int]]]:
    """Inside the block, every call of ``op`` (forward and backward) adds its ``(unit_rows, capacity)`` to the
    list: its per-unit count of real rows, and its layout (PACKED for packed rows)."""
    module, name = UNIT_ROWS_READERS[op]
    calls: list[tuple[list[int], int]] = []
    original = getattr(module, name)

    def spy(unit_rows: list[int], capacity: int, num_experts: int) -> Any:
        calls.append((list(unit_rows), capacity))
        return original(unit_rows, capacity, num_experts)

    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def _padded_rows_seen(moe: MoELayer, x: Tensor, op: str = "flexmoe::padded_experts") -> list[int]:
    """The rows ``op`` computes in one compiled call (its per-unit count of real rows)."""
    with _op_calls(op) as calls:
        torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    return [n for unit_rows, _ in calls for n in unit_rows]


@pytest.mark.parametrize("op", list(UNIT_ROWS_READERS))
def test_dropless_counts_of_zero_and_one_compile_once(op: str, request: pytest.FixtureRequest) -> None:
    """Dropless with many experts: which experts get 0 or 1 rows changes from call to call. Traced as Python ints,
    each such count was a value dynamo specializes on (a recompilation nearly every call, until its limit sent
    the rest of the forward back to eager); the experts' custom op now reads them on the device, in the packed
    layout. Six calls, each equal to the float64 reference, compile no graph after the second call (automatic
    dynamic's one recompilation)."""
    if op == "flexmoe::padded_fused_experts":
        request.getfixturevalue("fused_everywhere")
    with _op_calls(op) as calls:
        torch.manual_seed(0)
        moe = MoELayer(8, 12, 6, k=3, capacity_factor=0.0, dtype=torch.float64, router_dtype=torch.float64)
        compiled = torch.compile(moe, backend="aot_eager")
        graphs, few_rows = [], set()
        for seed in range(6):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
            grad = torch.randn(6, 8, dtype=torch.float64, generator=gen)
            ref, x64, params = reference_for_layer(moe, x, k=3, capacity_factor=0.0)
            got = compiled(x)
            grads = _grads(moe, x, got, grad)
            ref.y.backward(grad)
            _assert_matches_reference(got, grads, ref, x64, params)
            plan = moe.last_plan
            assert plan is not None and not plan.padded
            few_rows.add(tuple(e for e, n in enumerate(plan.counts) if n <= 1))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        assert len(few_rows) >= 4  # the calls differ in their experts with 0 or 1 rows
        assert graphs[-1] == graphs[1], graphs
    assert calls and {capacity for _, capacity in calls} == {padded_ffn_op.PACKED}  # forward and backward


# How many calls it takes until no graph is added: expert choice and BASE after their first call, though BASE's
# counts differ from call to call (plan_from_pairs reads them and lays out the rows eagerly; traced, as torch 2.15
# does, each new pattern of counts was a graph). Adaptive capacity compiles a few more: its first graph holds the
# kept counts as constants (automatic dynamic makes them symbolic in the second), and a call without drops takes
# a branch of its own (`every_pair_has_row`); in this sequence the first such call is call 6 of 12, and call 7 is
# another.
@pytest.mark.parametrize("options, settled", [(dict(router="expert_choice", k=2, capacity_factor=1.0), 1),
                                              (dict(router="base", k=1, capacity_factor=0.0), 1),
                                              (dict(k=2, capacity_factor=-1.0, glu=True, activation="silu"), 6)],
                         ids=["expert choice", "BASE", "adaptive capacity, glu"])
def test_unpadded_plans_compile_through_the_packed_op_and_equal_eager(options: dict[str, Any], settled: int) -> None:
    """Expert choice, BASE and adaptive capacity keep their unpadded plans under compile; the built-in experts
    then run flexmoe::padded_experts over the packed rows, with eager's outputs and gradients, call after call;
    after the first ``settled`` calls no graph is added (BASE's auction runs eagerly: traced, it compiled once
    per round of the auction)."""
    calls_made = 12 if settled > 2 else 4
    with _op_calls("flexmoe::padded_experts") as calls:
        torch.manual_seed(0)
        moe = MoELayer(8, 6, 12, dtype=torch.float64, router_dtype=torch.float64, **options)
        compiled = torch.compile(moe, backend="aot_eager")
        graphs, dropped, counts = [], [], set()
        for seed in range(calls_made):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(10, 8, dtype=torch.float64, generator=gen, requires_grad=True)
            grad = torch.randn(10, 8, dtype=torch.float64, generator=gen)
            want = moe(x)
            want_grads = _grads(moe, x, want, grad)
            got = compiled(x)
            got_grads = _grads(moe, x, got, grad)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            for param in want_grads:
                torch.testing.assert_close(got_grads[param], want_grads[param], rtol=1e-10, atol=1e-12, msg=param)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            plan = moe.last_plan
            assert plan is not None
            dropped.append(plan.num_dropped > 0)
            counts.add(tuple(plan.counts))
        assert graphs[-1] == graphs[settled - 1], graphs
    if options.get("router") != "expert_choice":  # whose experts take C tokens each, every call
        assert len(counts) >= 3, counts  # the graphs settled over calls of different row counts
    if settled > 2:  # after settling, the adaptive calls took both branches again
        assert True in dropped[settled:] and False in dropped[settled:], dropped
    assert calls and {capacity for _, capacity in calls} == {padded_ffn_op.PACKED}


@pytest.mark.parametrize("op", list(UNIT_ROWS_READERS))
def test_padded_op_with_capacity_per_sequence_matches_eager(op: str, request: pytest.FixtureRequest) -> None:
    """Switch's per-sequence capacity: each (expert, sequence) unit's real rows lead its block of C rows; the
    fused op adds each expert's weight gradients over its units."""
    if op == "flexmoe::padded_fused_experts":
        request.getfixturevalue("fused_everywhere")
    torch.manual_seed(0)
    moe = MoELayer(8, 8, 12, k=2, capacity_factor=1.0, capacity_per="sequence", glu=True, activation="silu",
                   dtype=torch.float64, router_dtype=torch.float64)
    x = torch.randn(3, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(3, 10, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = moe(x)
    want_plan = moe.last_plan
    want_grads = _grads(moe, x, want, grad)
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    got_grads = _grads(moe, x, got, grad)
    assert want_plan is not None and want_plan.num_dropped > 0
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-12, msg=name)
    # The op saw, per (expert, sequence), that unit's kept pairs: the eager plan's counts, sequence by sequence.
    torch._dynamo.reset()
    seen = _padded_rows_seen(moe, x, op)
    per_unit = [0] * 24
    for t, (experts, slots) in enumerate(zip(want_plan.expert_index.tolist(), want_plan.slot.tolist())):
        for e, slot in zip(experts, slots):
            if slot >= 0:
                per_unit[e * 3 + t // 10] += 1
    assert seen == per_unit and sum(seen) == sum(want_plan.counts)


class ScaledIdentityExperts(nn.Module):
    """A custom expert (the ``forward(x, counts)`` protocol): expert e multiplies its rows by ``scale[e]``."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.arange(1.0, num_experts + 1, dtype=torch.float64))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        return torch.cat([rows * s for rows, s in zip(x.split(counts), self.scale.unbind(0))])


def test_custom_experts_compile_with_static_counts() -> None:
    torch.manual_seed(0)
    moe = MoELayer(8, 4, 12, k=2, capacity_factor=1.0, experts=ScaledIdentityExperts(4), dtype=torch.float64,
                   router_dtype=torch.float64)
    x = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref, x64, params = reference_for_layer(
        moe, x, k=2, capacity_factor=1.0,
        expert=lambda p: (lambda e, row: row * p["experts.scale"][e]))
    grad = torch.randn(20, 8, dtype=torch.float64)
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    grads = _grads(moe, x, got, grad)
    ref.y.backward(grad)
    assert moe.last_plan is not None and moe.last_plan.counts == [moe.last_plan.capacity] * 4
    _assert_matches_reference(got, grads, ref, x64, params, names=("experts.scale",))


@pytest.mark.slow
def test_capacity_zero_compiles_and_drops_everything() -> None:
    moe = _layer(k=2, capacity=0, shared_experts=1)
    x = torch.randn(5, 8, dtype=torch.float64)
    got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert moe.last_plan is not None and int(moe.last_plan.num_dropped) == 10
    assert moe.shared is not None
    torch.testing.assert_close(got, moe.shared(x, [5]), rtol=1e-12, atol=1e-12)  # only the shared expert


def test_compiled_nonfinite_input_fails_loudly() -> None:
    moe = _layer(k=2, capacity_factor=1.0)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 8, dtype=torch.float64)
    compiled(x)
    x[2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="router logits contain NaN or infinity"):
        compiled(x)


@pytest.mark.parametrize("options, breaks", [
    (dict(capacity_factor=1.25), 0),
    (dict(capacity=4), 0),
    (dict(capacity_factor=0.0), DROPLESS_GRAPH_BREAKS),
    (dict(capacity_factor=0.0, activation=torch.tanh), DROPLESS_GRAPH_BREAKS),
])
def test_graph_breaks(options: dict[str, Any], breaks: int) -> None:
    """Capacity mode and dropless: none (no routed value reaches the host)."""
    moe = _layer(k=2, **options)
    x = torch.randn(20, 8, dtype=torch.float64)
    explained = torch._dynamo.explain(moe)(x)
    assert explained.graph_break_count == breaks, [str(b.reason)[:200] for b in explained.break_reasons]


def test_plan_with_counts_on_device_reads_them_only_when_asked() -> None:
    """The dropless plan the compiled layer makes (counts_on_device) holds the same rows as the eager one; its
    counts and capacity stay on the device until read, then are the reference's. A capacity, or anything that
    could drop or skip a pair, is refused by name."""
    logits = torch.randn(15, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    eager = make_plan(logits, 2, capacity_factor=0.0)
    plan = make_plan(logits, 2, capacity_factor=0.0, counts_on_device=True)
    assert plan.host_counts is None and plan.host_capacity is None and plan.num_experts == 5
    for name in ("row_token", "row_choice", "row_weight", "tokens_per_expert", "slot"):
        torch.testing.assert_close(getattr(plan, name), getattr(eager, name), msg=name)
    assert plan.every_pair_has_row and plan.num_dropped == 0
    want = torch.bincount(logits.topk(2, dim=1).indices.reshape(-1), minlength=5).tolist()
    assert plan.counts == want and plan.capacity == max(want) and plan.host_counts == want
    for options in (dict(capacity_factor=1.0), dict(capacity_factor=0.0, capacity=3),
                    dict(capacity_factor=0.0, padded=True),
                    dict(capacity_factor=0.0, capacity_per="sequence", num_sequences=3)):
        with pytest.raises(ValueError, match="counts_on_device needs a dropless plan"):
            make_plan(logits, 2, counts_on_device=True, **options)


def _clamped_tanh_glu_expert(limit: float) -> Callable[[dict[str, Tensor]], Callable[[int, Tensor], Tensor]]:
    """The float64 reference expert of ``activation=torch.tanh, glu=True, glu_limit=limit``, written out:
    ``tanh(min(x w1 + b1, L)) * (clamp(x w3 + b3, -L, L) + 1) w2 + b2``."""
    def build(p: dict[str, Tensor]) -> Callable[[int, Tensor], Tensor]:
        def expert(e: int, row: Tensor) -> Tensor:
            gate = row @ p["experts.w1"][e] + p["experts.b1"][e]
            up = row @ p["experts.w3"][e] + p["experts.b3"][e]
            h = torch.tanh(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1)
            return h @ p["experts.w2"][e] + p["experts.b2"][e]
        return expert
    return build


DROPLESS_CASES = {
    "gelu, the fused FFN op": (dict(k=2), dict(names=("experts.w1",))),
    "callable activation, clamped GLU, grouped matmuls": (
        dict(k=3, activation=torch.tanh, glu=True, glu_limit=0.5),
        dict(expert=_clamped_tanh_glu_expert(0.5), names=("experts.w1", "experts.w3", "experts.b2"))),
}


@pytest.mark.parametrize("case", list(DROPLESS_CASES))
def test_dropless_compiles_fullgraph_and_matches_the_reference(case: str, device: torch.device) -> None:
    """Dropless, ``fullgraph=True``, forward and backward: each of three calls with other routings equals the
    float64 reference, and one graph serves them all (no count is a value dynamo specializes on, none reaches the
    host). The plan read afterwards has the counts the reference routed."""
    options, checked = DROPLESS_CASES[case]
    moe = _layer(capacity_factor=0.0, **options).to(device)
    compiled = torch.compile(moe, fullgraph=True, backend=_backend_for(device))
    graphs, before = [], torch._dynamo.utils.counters["stats"]["unique_graphs"]  # dynamo.reset keeps the counter
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(20, 8, dtype=torch.float64, generator=gen).to(device).requires_grad_()
        grad = torch.randn(20, 8, dtype=torch.float64, generator=gen).to(device)
        ref_options = {n: v for n, v in checked.items() if n == "expert"}
        ref, x64, params = reference_for_layer(moe, x, k=options["k"], capacity_factor=0.0, **ref_options)
        got = compiled(x)
        grads = _grads(moe, x, got, grad)
        ref.y.backward(grad.cpu())
        plan = moe.last_plan
        assert plan is not None and not plan.padded and plan.counts == ref.tokens_per_expert
        _assert_matches_reference(got, grads, ref, x64, params, names=checked["names"])
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)
    assert graphs == [1, 1, 1], graphs


def test_dropless_under_autocast_compiles_fullgraph_and_equals_eager() -> None:
    """Under autocast the experts' matmuls run in bf16 (flexmoe::grouped_linear, the unit traced between them):
    the compiled dropless layer gives the eager layer's bf16 output and gradients (eager runs the per-expert
    loop, autocast casting each matmul)."""
    torch.manual_seed(0)
    moe = MoELayer(16, 6, 24, k=2, capacity_factor=0.0, glu=True, activation="silu")
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = moe(x)
    want_grads = _grads(moe, x, want, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    got_grads = _grads(moe, x, got, grad)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-2, atol=1e-2, msg=name)


def test_dropless_on_a_gpu_like_device_compiles_to_grouped_mm_with_device_offsets(monkeypatch) -> None:
    """Where torch's grouped GEMM takes the matmuls (a GPU in bf16; here the CPU made to pass for one), the
    compiled dropless layer runs them by ``torch._grouped_mm`` with the row ends on the device, and by none of
    flexmoe's custom ops, which read the counts on the host: the graph holds no such op, and the output and
    gradients equal the eager layer's."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    import flexmoe.experts.grouped_op as grouped_linear_op
    import flexmoe.experts.stage as expert_stage

    def like_a_gpu(device_type: str, dtype: torch.dtype, w_shape: Any) -> bool:
        return dtype == torch.bfloat16 and w_shape[-2] % 8 == 0 and w_shape[-1] % 8 == 0

    monkeypatch.setattr(expert_stage, "uses_device_offsets", like_a_gpu)
    monkeypatch.setattr(grouped_linear_op, "uses_device_offsets", like_a_gpu)
    torch.manual_seed(0)
    moe = MoELayer(16, 6, 24, k=2, capacity_factor=0.0, glu=True, activation="silu", dtype=torch.bfloat16)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = moe(x)
    want_grads = _grads(moe, x, want, grad)
    recorder = EagerAndRecordGraphs()
    torch._dynamo.reset()
    got = torch.compile(moe, fullgraph=True, backend=recorder)(x)
    got_grads = _grads(moe, x, got, grad)
    (graph,) = recorder.graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any("_grouped_mm" in t for t in targets), targets
    assert not any("flexmoe" in t for t in targets), targets
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=2e-2, atol=5e-2, msg=name)


# ---- inductor: the real backend, C++ kernels ---------------------------------------------------------------


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("options", [dict(k=2, capacity_factor=1.0),
                                     dict(k=2, capacity=3, glu=True, activation="silu", score_at="dispatch")])
def test_inductor_capacity_mode_matches_the_reference(options: dict[str, Any]) -> None:
    moe = _layer(**options)
    x = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_options = {n: options[n] for n in ("k", "capacity_factor", "capacity", "score_at") if n in options}
    ref, x64, params = reference_for_layer(moe, x, activation=options.get("activation", "gelu"),
                                           glu=bool(options.get("glu")), **ref_options)
    grad = torch.randn(20, 8, dtype=torch.float64)
    got = torch.compile(moe, fullgraph=True)(x)
    grads = _grads(moe, x, got, grad)
    ref.y.backward(grad)
    _assert_matches_reference(got, grads, ref, x64, params, rtol=1e-9, atol=1e-11)


# ---- the bench suite's "compile" group ---------------------------------------------------------------------


def test_compile_suite_group_counts_the_dropless_graph_breaks() -> None:
    from flexmoe.apps.bench.compile import DROPLESS_GRAPH_BREAKS as SUITE_TARGET
    from flexmoe.apps.bench.suite import SuiteSettings, run_suite_checks, suite_checks

    checks = suite_checks(["compile"])
    assert [c.group for c in checks] == ["compile"] * 4
    assert [c.target for c in checks] == [1.0, 1.0, 1.0, DROPLESS_GRAPH_BREAKS]
    assert SUITE_TARGET == DROPLESS_GRAPH_BREAKS
    (result,) = run_suite_checks(checks[-1:], SuiteSettings(show=False))
    assert result["value"] == DROPLESS_GRAPH_BREAKS and result["met"], result


@pytest.mark.slow
@needs_cxx
def test_compiled_vs_eager_measures_a_ratio() -> None:
    from flexmoe.apps.bench.compile import compiled_vs_eager
    from flexmoe.apps.bench.config import BenchConfig

    m = compiled_vs_eager(BenchConfig(tokens=64, model_dim=16, hidden_dim=32, experts=4, steps=2, warmup=0))
    assert m.unit == "x eager" and 0 < m.value < float("inf")
    assert m.details["eager_s"] > 0 and m.details["compiled_s"] > 0


@pytest.mark.parametrize("case", _cases(list(CAPACITY_CASES), "cf=1.0 with drops"))
def test_capacity_mode_compiled_as_off_the_cpu_matches_the_reference(case: str, monkeypatch) -> None:
    """What a compiled capacity-mode call does off the CPU, run here: no padding (the counts reach the host) and
    dispatch / combine by autograd's own gather and scatter-add (flexmoe.dispatch._traced_off_cpu), the path
    that replaced the pair-gather functions whose traced backward gave zero gradients on CUDA."""
    import importlib

    from torch._dynamo.testing import EagerAndRecordGraphs

    from flexmoe.experts.stage import ExpertStage, PlanLayout

    dispatch_module = importlib.import_module("flexmoe.dispatch")  # the package's ``dispatch`` is the function

    monkeypatch.setattr(ExpertStage, "plan_layout", lambda *args, **kwargs: PlanLayout())
    monkeypatch.setattr(dispatch_module, "_traced_off_cpu", lambda x: torch.compiler.is_compiling())
    layer_options, ref_options = CAPACITY_CASES[case]
    ref_options = dict(ref_options)
    activation = ref_options.pop("activation", "gelu")
    moe = _layer(**layer_options)
    x = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref, x64, params = reference_for_layer(moe, x, activation=activation, **ref_options)
    grad = torch.randn(20, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    recorder = EagerAndRecordGraphs()
    torch._dynamo.reset()
    got = torch.compile(moe, backend=recorder)(x)
    grads = _grads(moe, x, got, grad)
    ref.y.backward(grad)
    assert moe.last_plan is not None and not moe.last_plan.padded
    calls = [str(n.target) for g in recorder.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert not any("autograd_function_apply" in c for c in calls), calls  # neither _Dispatch nor _Combine traced
    _assert_matches_reference(got, grads, ref, x64, params)
