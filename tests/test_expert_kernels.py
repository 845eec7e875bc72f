"""Every expert kernel through the one interface (flexmoe.experts.kernels) against a float64 loop written here,
values and every gradient; and the KernelChooser: timing, the cache file, a forced kernel, ranks agreeing, a
failing kernel replaced by the loop."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from flexmoe import MoELayer
from flexmoe.experts import FeedForwardExperts
from flexmoe.experts.chooser import KernelChooser, _versions
from flexmoe.experts.kernels import KERNELS, RULE_KERNEL, KernelCase, kernel_named, supported_kernels
from flexmoe.experts.weights import WEIGHT_NAMES, ExpertWeights
from flexmoe.parallel.layout import HIDDEN_DIM

E, M, H = 4, 8, 16
COUNTS = {"mixed, empty experts": [3, 0, 5, 2], "one expert": [0, 0, 7, 0], "no rows": [0, 0, 0, 0]}
UNITS = {"gelu, biases": (False, True, None), "no biases": (False, False, None), "glu": (True, True, None),
         "glu clamped": (True, False, 0.5)}
GRAD_KERNELS = ("loop", "segmented", "grouped_mm")
NO_GRAD_KERNELS = ("loop", "joined_unit", "embedding_bag", "grouped_mm")


def _params(glu: bool, bias: bool, seed: int = 0) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.4

    return {"w1": r(E, M, H), "b1": r(E, H) if bias else None, "w2": r(E, H, M), "b2": r(E, M) if bias else None,
            "w3": r(E, M, H) if glu else None, "b3": r(E, H) if glu and bias else None}


def _dense_loop(rows: torch.Tensor, counts: list[int], p: dict, glu: bool, limit: float | None) -> torch.Tensor:
    """Each row through its expert, one at a time: silu-GLU (GPT-OSS's clamp with a limit) or gelu."""
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    out = []
    for x, e in zip(rows, expert_of_row):
        pre1 = x @ p["w1"][e] + (p["b1"][e] if p["b1"] is not None else 0)
        if glu:
            pre3 = x @ p["w3"][e] + (p["b3"][e] if p["b3"] is not None else 0)
            if limit is None:
                h = F.silu(pre1) * pre3
            else:
                h = F.silu(pre1.clamp(max=limit)) * (pre3.clamp(-limit, limit) + 1)
        else:
            h = F.gelu(pre1)
        out.append(h @ p["w2"][e] + (p["b2"][e] if p["b2"] is not None else 0))
    return torch.stack(out) if out else rows.new_zeros(0, M)


def _weights(p: dict, dtype: torch.dtype, glu: bool, limit: float | None, grad: bool) -> ExpertWeights:
    t = {n: (v.detach().to(dtype).requires_grad_(grad) if v is not None else None) for n, v in p.items()}
    return ExpertWeights(t["w1"], t["b1"], t["w2"], t["b2"], t["w3"], t["b3"], F.silu if glu else F.gelu, limit)


def _rounded(p: dict, dtype: torch.dtype) -> dict:
    """The float64 parameters ``p`` rounded to ``dtype`` and back: what a kernel in ``dtype`` really computes
    with, so that the float64 reference differs from it by the kernel's own rounding only."""
    return {n: (v.detach().to(dtype).double() if v is not None else None) for n, v in p.items()}


class KernelInputs(NamedTuple):
    """One parametrized kernel test's inputs: ``rows [N, M]`` sorted by expert (``counts[e]`` rows each) and the
    experts' ``weights``, both in the test's dtype, rounded from the float64 draws ``p``."""

    counts: list[int]
    p: dict
    rows: torch.Tensor
    weights: ExpertWeights


def _kernel_inputs(counts_name: str, unit: str, dtype: torch.dtype, grad: bool, params_seed: int,
                   gen: torch.Generator) -> KernelInputs:
    """The inputs of ``COUNTS[counts_name]`` and ``UNITS[unit]`` (the rows drawn from ``gen``); with ``grad``
    the rows and weights require gradients."""
    glu, bias, limit = UNITS[unit]
    counts = COUNTS[counts_name]
    p = _params(glu, bias, seed=params_seed)
    rows = torch.randn(sum(counts), M, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad)
    return KernelInputs(counts, p, rows, _weights(p, dtype, glu, limit, grad))


TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


# bf16 with the clamp is left out: a pre-activation rounded to bf16 lands on the other side of the limit than its
# float64 value now and then, and the clamp passes no gradient there (an O(1) difference, not a rounding error).
DTYPE_UNITS = [(dtype, unit) for dtype in (torch.float64, torch.float32, torch.bfloat16) for unit in UNITS
               if not (dtype == torch.bfloat16 and UNITS[unit][2] is not None)]


@pytest.mark.parametrize("dtype,unit", DTYPE_UNITS, ids=str)
@pytest.mark.parametrize("counts_name", list(COUNTS))
@pytest.mark.parametrize("name", GRAD_KERNELS)
def test_kernel_with_autograd_matches_the_dense_loop(name: str, counts_name: str, unit: str,
                                                      dtype: torch.dtype) -> None:
    """Values and the gradients of the rows and of w1, b1, w2, b2, w3, b3."""
    glu, _, limit = UNITS[unit]
    gen = torch.Generator().manual_seed(1)
    counts, p, rows, weights = _kernel_inputs(counts_name, unit, dtype, grad=True, params_seed=0, gen=gen)
    grad_out = torch.randn(sum(counts), M, generator=gen, dtype=torch.float64)
    kernel = kernel_named(name)
    reason = kernel.supports(KernelCase.of(rows, counts, weights))
    if name == "grouped_mm" and dtype == torch.float64:
        assert reason is not None and "float64" in reason  # torch's grouped GEMM has no float64 kernel
        return
    assert reason is None, reason

    got = kernel.run(rows, counts, weights)
    # The reference on the same (rounded) inputs, in float64.
    ref_p = {n: (v.requires_grad_() if v is not None else None) for n, v in _rounded(p, dtype).items()}
    ref_rows = rows.detach().double().requires_grad_()
    want = _dense_loop(ref_rows, counts, ref_p, glu, limit)
    rtol, atol = TOL[dtype]
    scale = max(1.0, float(want.detach().abs().max())) if want.numel() else 1.0
    assert got.shape == (sum(counts), M) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want.detach(), rtol=rtol, atol=atol * scale)
    if not sum(counts):
        return
    names = [n for n, v in ref_p.items() if v is not None]
    want_grads = torch.autograd.grad(want, [ref_rows] + [ref_p[n] for n in names], grad_out)
    got_grads = torch.autograd.grad(got, [rows] + [getattr(weights, n) for n in names], grad_out.to(dtype),
                                    allow_unused=True)
    for n, g, w in zip(["rows"] + names, got_grads, want_grads):
        g = torch.zeros_like(w) if g is None else g.double()
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * max(1.0, float(w.abs().max())),
                                   msg=lambda m, n=n: f"{name}: gradient of {n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("counts_name", list(COUNTS))
@pytest.mark.parametrize("name", NO_GRAD_KERNELS)
def test_kernel_without_autograd_matches_the_dense_loop(name: str, counts_name: str, unit: str,
                                                         dtype: torch.dtype) -> None:
    glu, _, limit = UNITS[unit]
    counts, p, rows, weights = _kernel_inputs(counts_name, unit, dtype, grad=False, params_seed=2,
                                              gen=torch.Generator().manual_seed(3))
    kernel = kernel_named(name)
    with torch.no_grad():
        reason = kernel.supports(KernelCase.of(rows, counts, weights))
        if name == "grouped_mm" and dtype == torch.float64:
            assert reason is not None
            return
        if name == "embedding_bag" and not sum(counts):
            assert reason == "no rows"
            return
        assert reason is None, reason
        got = kernel.run(rows, counts, weights)
    want = _dense_loop(rows.double(), counts, _rounded(p, dtype), glu, limit)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_kernels_say_why_they_do_not_run_a_case() -> None:
    p = _params(glu=False, bias=True)
    rows = torch.randn(5, M, requires_grad=True)
    weights = _weights(p, torch.float32, False, None, grad=True)
    training = KernelCase.of(rows, [2, 3, 0, 0], weights)
    assert "autograd" in KERNELS["embedding_bag"].supports(training)
    assert "autograd" in KERNELS["joined_unit"].supports(training)
    with torch.no_grad():
        inference = KernelCase.of(rows, [2, 3, 0, 0], weights)
    assert "no autograd" in KERNELS["segmented"].supports(inference)
    mixed = KernelCase.of(rows.double(), [2, 3, 0, 0], weights)
    assert "dtype" in KERNELS["segmented"].supports(mixed)
    assert [k.name for k in supported_kernels(mixed)] == ["loop"]
    with pytest.raises(ValueError, match="expert_kernel must be 'auto' or one of"):
        kernel_named("fastest")


def test_grouped_mm_is_not_refused_by_device_type() -> None:
    """Off the CPU the grouped GEMM runs in bf16 (what torch's CUDA kernel takes): a case on a device named
    'cuda' is judged by its dtype and strides, never refused for being CUDA."""
    case = KernelCase(device_type="cuda", dtype=torch.bfloat16, needs_grad=True, compiling=False, autocast=False,
                      rows=64, experts=8, active=8, model_dim=64, hidden=128, glu=False, uniform=True,
                      grouped_layout=True, bag_layout=True)
    assert KERNELS["grouped_mm"].supports(case) is None
    assert KERNELS["segmented"].supports(case) is None and KERNELS["loop"].supports(case) is None


# ---- the chooser ------------------------------------------------------------------------------------------


class FakeTimer:
    """Seconds per kernel name, and every call counted."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self, name: str, run: object) -> float:
        self.calls.append(name)
        return self.seconds.get(name, 10.0)


def _call(grad: bool = True) -> tuple[torch.Tensor, list[int], ExpertWeights, dict]:
    p = _params(glu=True, bias=True, seed=4)
    rows = torch.randn(10, M, generator=torch.Generator().manual_seed(5))
    return rows, [3, 0, 5, 2], _weights(p, torch.float32, True, None, grad=grad), p


def _assert_matches_reference(got: torch.Tensor, rows: torch.Tensor, counts: list[int], p: dict) -> None:
    want = _dense_loop(rows.double(), counts, _rounded(p, torch.float32), True, None)
    torch.testing.assert_close(got.detach().double(), want, rtol=2e-5, atol=2e-5)


def test_the_fastest_is_chosen_and_a_cached_choice_is_reused_without_timing(tmp_path: Path) -> None:
    rows, counts, weights, p = _call()
    path = tmp_path / "kernels.json"
    timer = FakeTimer({"loop": 3.0, "segmented": 1.0, "grouped_mm": 2.0})
    chooser = KernelChooser(cache_path=path, timer=timer)
    _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)
    bucket = KernelCase.of(rows, counts, weights).bucket()
    assert chooser.decisions[bucket] == "segmented"
    assert sorted(timer.calls) == ["grouped_mm", "loop", "segmented"]
    chooser.run(rows[:9], [3, 0, 4, 2], weights)  # the same bucket (9 rows: N16): no timing
    assert len(timer.calls) == 3
    saved = json.loads(path.read_text())
    assert saved["versions"] == _versions() and saved["choices"][bucket] == "segmented"

    later = FakeTimer({"loop": 1.0})  # a later process, with other times: the cache decides, untimed
    again = KernelChooser(cache_path=path, timer=later)
    assert again.kernel_for(KernelCase.of(rows, counts, weights), rows, counts, weights).name == "segmented"
    _assert_matches_reference(again.run(rows, counts, weights), rows, counts, p)
    assert later.calls == []


def test_a_cache_of_another_version_is_ignored_and_rewritten(tmp_path: Path) -> None:
    rows, counts, weights, _ = _call()
    bucket = KernelCase.of(rows, counts, weights).bucket()
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"versions": {"torch": "1.0", "flexmoe": "0.0.1"}, "choices": {bucket: "segmented"},
                                "seconds": {}}))
    timer = FakeTimer({"loop": 1.0, "segmented": 2.0, "grouped_mm": 3.0})
    chooser = KernelChooser(cache_path=path, timer=timer)
    assert chooser.kernel_for(KernelCase.of(rows, counts, weights), rows, counts, weights).name == "loop"
    assert len(timer.calls) == 3
    assert json.loads(path.read_text())["versions"] == _versions()


def test_without_a_timer_the_rule_runs_the_loop() -> None:
    rows, counts, weights, p = _call()
    chooser = KernelChooser(timer=None)
    assert chooser.kernel_for(KernelCase.of(rows, counts, weights), rows, counts, weights).name == "loop"
    _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)


def test_a_tie_on_equal_times_keeps_the_rule_kernel(tmp_path: Path) -> None:
    """Every candidate timed alike: the rule's kernel (the loop), in memory and in the cache file, whichever order
    the candidates come in."""
    rows, counts, weights, p = _call()
    case = KernelCase.of(rows, counts, weights)
    assert len(supported_kernels(case)) > 1
    timer = FakeTimer({k.name: 1.0 for k in supported_kernels(case)})
    chooser = KernelChooser(cache_path=tmp_path / "kernels.json", timer=timer)
    _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)
    assert len(timer.calls) >= len(supported_kernels(case))  # timed, not decided by the rule for want of a timer
    assert chooser.decisions[case.bucket()] == RULE_KERNEL
    assert json.loads((tmp_path / "kernels.json").read_text())["choices"][case.bucket()] == RULE_KERNEL
    # The rule last among equal times (a min() over the names alone would take the first).
    assert KernelChooser(timer=None)._decide("b", {"segmented": 1.0, "grouped_mm": 1.0, RULE_KERNEL: 1.0}) \
        == RULE_KERNEL
    assert KernelChooser(timer=None)._decide("b", {"segmented": 0.5, RULE_KERNEL: 1.0}) == "segmented"


def test_a_tie_on_equal_times_keeps_the_rule_route() -> None:
    """The expert stage's routes timed alike: the rule's route ("rows"), though "fused" comes first."""
    ran: list[str] = []
    routes = {"fused": lambda: ran.append("fused"), "rows": lambda: ran.append("rows")}
    chooser = KernelChooser(timer=FakeTimer({"fused": 2.0, "rows": 2.0}))
    assert chooser.choose_route("route/b", routes, rule="rows") == "rows"
    assert chooser.decisions["route/b"] == "rows" and chooser.timings["route/b"] == {"fused": 2.0, "rows": 2.0}
    faster = KernelChooser(timer=FakeTimer({"fused": 1.0, "rows": 2.0}))
    assert faster.choose_route("route/b", routes, rule="rows") == "fused"  # the timing does decide otherwise


class Spy:
    """A kernel that records its calls and runs another."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.name, self.calls = kernel, kernel.name, 0  # type: ignore[attr-defined]

    def supports(self, case: KernelCase) -> str | None:
        return self.kernel.supports(case)  # type: ignore[attr-defined]

    def run(self, rows: torch.Tensor, counts: list[int], weights: ExpertWeights) -> torch.Tensor:
        self.calls += 1
        return self.kernel.run(rows, counts, weights)  # type: ignore[attr-defined]


def test_a_forced_kernel_runs_through_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(KERNELS["joined_unit"])
    monkeypatch.setitem(KERNELS, "joined_unit", spy)
    torch.manual_seed(0)
    forced = MoELayer(M, E, H, k=2, expert_kernel="joined_unit").eval()
    plain = MoELayer(M, E, H, k=2).eval()
    plain.load_state_dict(forced.state_dict())
    x = torch.randn(6, M)
    with torch.no_grad():
        got, want = forced(x), plain(x)
    assert spy.calls == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expert_kernel must be 'auto' or one of"):
        MoELayer(M, E, H, expert_kernel="fastest")
    with pytest.raises(TypeError, match="expert_kernel must be a str"):
        MoELayer(M, E, H, expert_kernel=3)


def test_a_forced_kernel_that_cannot_run_a_case_warns_and_runs_the_loop() -> None:
    rows, counts, weights, p = _call(grad=True)
    chooser = KernelChooser("embedding_bag")
    with pytest.warns(RuntimeWarning, match=r"expert_kernel='embedding_bag' does not run .*\(autograd"):
        got = chooser.run(rows, counts, weights)
    _assert_matches_reference(got, rows, counts, p)


class Broken:
    name = "segmented"

    def supports(self, case: KernelCase) -> str | None:
        return None

    def run(self, rows: torch.Tensor, counts: list[int], weights: ExpertWeights) -> torch.Tensor:
        raise RuntimeError("this kernel is broken")


def test_a_kernel_that_fails_at_run_time_falls_back_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KERNELS, "segmented", Broken())
    rows, counts, weights, p = _call()
    chooser = KernelChooser(timer=FakeTimer({"segmented": 0.1, "loop": 1.0}))
    chooser.decisions[KernelCase.of(rows, counts, weights).bucket()] = "segmented"
    with pytest.warns(RuntimeWarning, match=r"'segmented' failed .*this kernel is broken\); the loop runs"):
        got = chooser.run(rows, counts, weights)
    _assert_matches_reference(got, rows, counts, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once replaced, the bucket runs the loop without another warning
        _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)


def test_a_layer_times_its_first_call_and_a_new_layer_reads_the_cache(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"loop": 2.0, "segmented": 1.0, "grouped_mm": 3.0, "rows": 1.0, "fused": 2.0})
    monkeypatch.setattr(KernelChooser, "default_timer", timer)
    torch.manual_seed(0)
    layer = MoELayer(M, E, H, k=2, kernel_cache=str(tmp_path))
    layer(torch.randn(8, M)).sum().backward()
    assert set(layer.experts.kernels.decisions.values()) == {"segmented", "rows"}
    assert len(list(tmp_path.glob("kernels-*.json"))) == 1
    calls = len(timer.calls)
    fresh = MoELayer(M, E, H, k=2, kernel_cache=str(tmp_path))
    fresh.load_state_dict(layer.state_dict())
    fresh(torch.randn(8, M)).sum().backward()
    assert len(timer.calls) == calls  # the new layer took the file's choice
    assert set(fresh.experts.kernels.decisions.values()) == {"segmented", "rows"}



def test_a_call_under_autocast_runs_the_loop_in_autocast_dtype_and_keeps_the_measured_kernel() -> None:
    """A bucket measured without autocast (segmented the fastest), then called under ``torch.autocast``, which
    only the loop runs: the loop runs it, untimed and without a warning, its output in autocast's dtype with the
    values of a float64 loop over bf16-rounded inputs; the next call without autocast runs the measured kernel
    again, and a chooser whose first call is under autocast still times the call without it."""
    rows, counts, weights, p = _call()
    timer = FakeTimer({"loop": 3.0, "segmented": 1.0, "grouped_mm": 2.0})
    chooser = KernelChooser(timer=timer)
    chooser.run(rows, counts, weights)
    assert chooser.last_kernel == "segmented" and len(timer.calls) == 3
    want = _dense_loop(rows.to(torch.bfloat16).double(), counts, _rounded(p, torch.bfloat16), True, None)
    rtol, atol = TOL[torch.bfloat16]
    for first in (False, True):  # measured first, then autocast; a fresh chooser: autocast first
        chooser = chooser if not first else KernelChooser(timer=FakeTimer(timer.seconds))
        with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("error")
            got = chooser.run(rows, counts, weights)
        assert chooser.last_kernel == "loop" and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol * float(want.abs().max()))
        plain = chooser.run(rows, counts, weights)
        assert chooser.last_kernel == "segmented" and plain.dtype == torch.float32, first
        _assert_matches_reference(plain, rows, counts, p)
    assert len(timer.calls) == 3  # the first chooser never timed again


class ScriptedTimer:
    """Each kernel's seconds, one value per call in turn (the warm-up round first), and every call recorded."""

    def __init__(self, seconds: dict[str, list[float]]) -> None:
        self.seconds, self.calls = {n: list(v) for n, v in seconds.items()}, []

    def __call__(self, name: str, run: object) -> float:
        self.calls.append(name)
        return self.seconds[name][sum(1 for n in self.calls if n == name) - 1]


# A cheap warm-up round (0.102 s in all: under _CHEAP_ROUND_SECONDS), then three rounds. segmented has the fastest
# round (4 ms) and the slowest (30 ms); grouped_mm's fastest time is its warm-up, which does not count.
ROUNDS = {"loop": [0.05, 0.010, 0.011, 0.012], "segmented": [0.05, 0.030, 0.004, 0.030],
          "grouped_mm": [0.002, 0.008, 0.020, 0.020]}


def test_a_cheap_warm_up_is_followed_by_rounds_and_each_candidate_keeps_its_fastest() -> None:
    """time_in_rounds: after a warm-up round that costs under _CHEAP_ROUND_SECONDS, three interleaved rounds, each
    candidate's time its fastest of those three (the minimum written here); a costly warm-up is the measurement
    alone. Through the chooser: the kernel of the fastest round wins, though it also had the slowest."""
    from flexmoe.experts.chooser import time_in_rounds

    timer = ScriptedTimer(ROUNDS)
    runs = {name: (lambda: None) for name in ROUNDS}
    assert time_in_rounds(timer, runs) == {"loop": 0.010, "segmented": 0.004, "grouped_mm": 0.008}
    assert timer.calls == ["loop", "segmented", "grouped_mm"] * 4  # interleaved: round by round
    costly = ScriptedTimer({"loop": [0.15, 1.0], "segmented": [0.1, 1.0]})
    assert time_in_rounds(costly, {"loop": lambda: None, "segmented": lambda: None}) == \
        {"loop": 0.15, "segmented": 0.1}
    assert costly.calls == ["loop", "segmented"]

    rows, counts, weights, p = _call()
    case = KernelCase.of(rows, counts, weights)
    assert sorted(k.name for k in supported_kernels(case)) == sorted(ROUNDS)
    chooser = KernelChooser(timer=ScriptedTimer(ROUNDS))
    _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)
    assert chooser.decisions[case.bucket()] == "segmented"
    assert chooser.timings[case.bucket()] == {"loop": 0.010, "segmented": 0.004, "grouped_mm": 0.008}


@pytest.mark.parametrize("frozen", [False, True], ids=["trained experts", "frozen experts"])
def test_a_timed_training_run_includes_the_rows_gradient(frozen: bool) -> None:
    """timed_call on rows that want a gradient times the backward to the rows too (a copy of them: nothing lands
    in ``rows.grad``): its run returns the gradients of the rows and of every weight that wants one, the rows'
    first, equal to a float64 loop's; with frozen experts the rows' is the only one, and the chooser still
    times such a call."""
    from flexmoe.experts.chooser import timed_call

    rows, counts, _, p = _call()
    rows.requires_grad_()
    weights = _weights(p, torch.float32, True, None, grad=not frozen)
    ref_rows = rows.detach().double().requires_grad_()
    ref_p = {n: (v.requires_grad_() if v is not None else None) for n, v in _rounded(p, torch.float32).items()}
    want_out = _dense_loop(ref_rows, counts, ref_p, True, None)
    names = [] if frozen else [n for n in WEIGHT_NAMES if ref_p[n] is not None]
    want = torch.autograd.grad(want_out.sum(), [ref_rows] + [ref_p[n] for n in names])
    got = timed_call(KERNELS["loop"], rows, counts, weights)()
    assert isinstance(got, tuple) and len(got) == 1 + len(names)
    for name, g, w in zip(["rows", *names], got, want):
        assert g is not None and g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert rows.grad is None and all(t.grad is None for t in weights.present())
    seen: list[tuple] = []
    chooser = KernelChooser(timer=lambda name, run: (seen.append((name, run())), 1.0)[1])
    _assert_matches_reference(chooser.run(rows, counts, weights), rows, counts, p)
    assert {name for name, _ in seen} == {k.name for k in supported_kernels(KernelCase.of(rows, counts, weights))}
    assert all(grads[0].shape == rows.shape for _, grads in seen)


def test_timing_a_training_call_leaves_the_parameters_gradients_alone() -> None:
    rows, counts, weights, _ = _call()
    KernelChooser(timer=lambda name, run: (run(), 1.0)[1]).run(rows, counts, weights)
    assert all(t.grad is None for t in weights.present())


@pytest.mark.slow
def test_two_ranks_agree_on_the_choice_though_their_timers_disagree() -> None:
    from flexmoe.launch import spawn_ranks
    from kernel_chooser_worker import rank_main

    ranks = spawn_ranks(2, rank_main, [], timeout=180, check=True, what="kernel choice over 2 gloo ranks")
    values = [r.value for r in ranks]
    assert not [f for v in values for f in v["failures"]], "\n".join(f for v in values for f in v["failures"])
    assert values[0]["calibrated"] == values[1]["calibrated"]
    assert set(values[0]["calibrated"].values()) == {"loop"}  # summed: loop 6 s, segmented 7 s
    assert values[0]["shared"] == values[1]["shared"] == {"cpu/float32/train/E4/M8/H16/ffn/N16/A4": "segmented"}
    assert not values[1]["shared_times_calls"] and not values[0]["layer_times_calls"]


def test_calibrate_kernels_writes_the_cache_a_layer_then_reads(tmp_path: Path) -> None:
    """``flexmoe calibrate --kernels``: each shape timed for real (tiny here), the choices written to the cache
    file, where a chooser without a timer finds them."""
    from flexmoe.apps.calibrate import calibrate_kernels
    from flexmoe.experts.chooser import default_cache_path

    chosen = calibrate_kernels(str(tmp_path), shapes=((8, 4, 16, 2, True), (2, 4, 16, 2, False)), model_dim=8)
    assert len(chosen) == 2 and set(chosen.values()) <= set(KERNELS)
    assert json.loads(default_cache_path(tmp_path).read_text())["choices"] == chosen
    reader = KernelChooser(cache_path=default_cache_path(tmp_path), timer=None)
    for bucket, kernel in chosen.items():
        assert reader._cached(bucket) == kernel


@pytest.mark.parametrize("needs_grad_weights", [True, False])
def test_loop_with_no_rows_stays_on_the_graph(needs_grad_weights: bool) -> None:
    """Every expert empty (a rank that received no rows): the zeros stay connected to the rows and the weights, so
    a backward still runs what made the rows (the exchange every rank's backward must run: without it, the ranks of
    a converted HF model under parallelize at ep=2 hung) and the weights get zero gradients, not none (AdamW
    skips a parameter without one, where one process holding every expert updates it)."""
    from flexmoe.experts.row_kernels import looped_expert_ffn

    source = torch.randn(3, 4, requires_grad=True)
    rows = source[:0] * 2  # [0, 4], made by an op whose backward must run
    w = ExpertWeights(torch.randn(2, 4, 5, requires_grad=needs_grad_weights), None,
                      torch.randn(2, 5, 4, requires_grad=needs_grad_weights), None, None, None, torch.relu, None)
    out = looped_expert_ffn(rows, [0, 0], w)
    assert out.shape == (0, 4) and out.grad_fn is not None
    out.sum().backward()
    assert source.grad is not None and torch.equal(source.grad, torch.zeros(3, 4))
    if needs_grad_weights:
        assert w.w1.grad is not None and torch.equal(w.w1.grad, torch.zeros(2, 4, 5))
        assert w.w2.grad is not None and torch.equal(w.w2.grad, torch.zeros(2, 5, 4))


@pytest.mark.parametrize("glu,bias,joined", [(False, True, False), (True, False, False), (True, True, False),
                                             (True, True, True)])
def test_weight_names_are_the_experts_parameters_in_the_weights_order(glu: bool, bias: bool, joined: bool) -> None:
    """WEIGHT_NAMES, the one list every module that gathers, broadcasts or cuts the experts' tensors by name goes
    through, names ExpertWeights.tensors() in order, the built-in experts' state dict (their parameters; joined
    experts register gate_up in place of w1 | w3, gate_up_bias in place of b1 | b3), and the expert-parallel
    layout's hidden dimensions."""
    experts = FeedForwardExperts(E, M, H, glu=glu, bias=bias, joined_gate_up=joined)
    weights = experts.weights()
    for name, tensor in zip(WEIGHT_NAMES, weights.tensors(), strict=True):
        assert tensor is getattr(weights, name)
        assert tensor is getattr(experts, name)
    present = [n for n in ("w1", "w2", "w3", "b1", "b2", "b3") if getattr(experts, n) is not None]
    assert list(experts.state_dict()) == present
    joined_names = {"w1": "gate_up", "w3": "gate_up", "b1": "gate_up_bias", "b3": "gate_up_bias"} if joined else {}
    assert [n for n, _ in experts.named_parameters()] == list(dict.fromkeys(joined_names.get(n, n) for n in present))
    assert set(HIDDEN_DIM) == set(WEIGHT_NAMES)
