"""MoELayer on one process against the plain float64 reference of tests/reference.py.

Every comparison runs the reference on float64 copies of the layer's own weights: outputs, the routing plan
(experts, slots, drops, capacity) and the gradients of the input, the router weight and every expert parameter.
The float64 layer must agree to round-off (1e-10); float32, bf16 and fp16 within the tolerances stated below.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from devices import on_cpu64
from flexmoe import MoELayer
from reference import RefResult, layer_params_f64, reference_for_layer

M, H, T, E = 8, 16, 24, 5

# Tolerances, relative to the largest |value| of the reference (outputs) or of the reference gradient.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    # bf16 has an 8-bit significand (unit round-off 2^-9 ~ 2e-3); a few roundings per element through
    # two small matmuls (M=8, H=16) and the combine stay well below 3e-2 of the output's scale.
    torch.bfloat16: 3e-2,
    # fp16: 11-bit significand (round-off 2^-12 ~ 2.4e-4), so 8x tighter than bf16.
    torch.float16: 4e-3,
}


def make_layer(*, dtype: torch.dtype = torch.float64, router_dtype: torch.dtype | None = None, seed: int = 0,
               num_experts: int = E, device: torch.device | str = "cpu", **kwargs) -> MoELayer:
    """A small layer with seeded weights (drawn on the CPU, then moved to ``device``, so every device gets the
    same ones); by default everything (routing too) in float64."""
    torch.manual_seed(seed)
    if router_dtype is None:
        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return MoELayer(M, num_experts, H, dtype=dtype, router_dtype=router_dtype, **kwargs).to(device)


def make_input(shape: tuple[int, ...] = (T, M), *, dtype: torch.dtype = torch.float64, seed: int = 1,
               device: torch.device | str = "cpu") -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)


def assert_close(got: Tensor, want: Tensor, tol: float, what: str) -> None:
    """max |got - want| <= tol * max(1, max |want|), compared on the CPU in float64."""
    got64, want64 = on_cpu64(got), on_cpu64(want)
    assert got64.shape == want64.shape, f"{what}: shape {tuple(got64.shape)} != {tuple(want64.shape)}"
    scale = max(1.0, float(want64.abs().max())) if want64.numel() else 1.0
    err = float((got64 - want64).abs().max()) if want64.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


def assert_plan_matches(moe: MoELayer, ref: RefResult) -> None:
    """The layer's RoutingPlan says what the reference did: experts, slots, drops, capacity."""
    plan = moe.last_plan
    num_tokens, k = plan.expert_index.shape
    assert plan.expert_index.tolist() == ref.expert_index
    assert plan.slot.tolist() == ref.slot
    assert plan.capacity == ref.capacity
    assert plan.tokens_per_expert.tolist() == ref.tokens_per_expert
    assert plan.counts == ref.tokens_per_expert
    assert plan.load.tolist() == ref.load
    assert plan.num_dropped == ref.num_dropped
    assert plan.dropped_fraction == pytest.approx(ref.num_dropped / (num_tokens * k))


def check_layer(moe: MoELayer, x: Tensor, *, tol: float | None = None, forward_kwargs: dict | None = None,
                aux_coef: float = 0.3, z_coef: float = 0.05, **ref_kwargs) -> RefResult:
    """Forward + backward of the layer and of the reference; compare outputs, plan, losses and every gradient.

    The loss is ``sum(y * g) + aux_coef * aux_loss + z_coef * z_loss`` with a fixed random ``g``, so the
    gradients through the combine weights, the experts and both router losses are all checked.
    """
    tol = TOL[x.dtype] if tol is None else tol
    x = x.clone().requires_grad_(True)
    moe.zero_grad(set_to_none=True)
    y = moe(x, **(forward_kwargs or {}))
    assert y.shape == x.shape and y.dtype == x.dtype
    g = make_input(tuple(y.shape), dtype=torch.float64, seed=99)
    loss = (y.to(torch.float64) * g.to(y.device)).sum() + aux_coef * moe.aux_loss.to(torch.float64) \
        + z_coef * moe.z_loss.to(torch.float64)
    loss.backward()

    ref, x64, params = reference_for_layer(moe, x, **ref_kwargs)
    ref_loss = (ref.y * g.reshape(ref.y.shape)).sum() + aux_coef * ref.aux_loss + z_coef * ref.z_loss
    ref_loss.backward()

    assert_plan_matches(moe, ref)
    assert_close(y.reshape(ref.y.shape), ref.y, tol, "output")
    assert_close(moe.aux_loss, ref.aux_loss, tol, "aux_loss")
    assert_close(moe.z_loss, ref.z_loss, tol, "z_loss")
    assert_close(x.grad.reshape(x64.shape), x64.grad, tol, "grad of x")
    for name, p in moe.named_parameters():
        want = params[name].grad
        want = torch.zeros_like(params[name]) if want is None else want
        got = torch.zeros_like(p) if p.grad is None else p.grad
        assert_close(got, want, tol, f"grad of {name}")
    return ref


# --- every capacity mode, k in {1, 2, 3} ------------------------------------------------------------------

# (layer kwargs, forward kwargs, reference kwargs, what the drops must look like)
CAPACITY_MODES = {
    "fixed": ({"capacity_factor": 0.75}, {}, {"capacity_factor": 0.75}, "some"),
    "fixed_roomy": ({"capacity_factor": 4.0}, {}, {"capacity_factor": 4.0}, "none"),
    "dropless": ({"capacity_factor": 0.0}, {}, {"capacity_factor": 0.0}, "none"),
    "adaptive_tight": ({"capacity_factor": -0.5}, {}, {"capacity_factor": -0.5}, "some"),
    "adaptive_loose": ({"capacity_factor": -4.0}, {}, {"capacity_factor": -4.0}, "none"),
    "explicit": ({"capacity": 3}, {}, {"capacity": 3}, "some"),
    "explicit_above_tokens": ({"capacity": 100}, {}, {"capacity": 100}, "none"),
    "forward_capacity": ({"capacity_factor": 1.25}, {"capacity": 2}, {"capacity": 2}, "some"),
    "forward_capacity_zero": ({"capacity_factor": 1.25}, {"capacity": 0}, {"capacity": 0}, "all"),
    "forward_overrides_layer_capacity": ({"capacity": 1}, {"capacity": 4}, {"capacity": 4}, "some"),
    "forward_capacity_factor": ({"capacity_factor": 1.0}, {"capacity_factor": 0.0}, {"capacity_factor": 0.0},
                                "none"),
}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("mode", list(CAPACITY_MODES))
def test_matches_reference_every_capacity_mode(k: int, mode: str, device: torch.device) -> None:
    layer_kw, fwd_kw, ref_kw, drops = CAPACITY_MODES[mode]
    moe = make_layer(k=k, seed=k, device=device, **layer_kw)
    ref = check_layer(moe, make_input(seed=10 + k, device=device), forward_kwargs=fwd_kw, k=k, **ref_kw)
    # The mode must have done what it is named for, or the comparison above proves less than it claims.
    if drops == "none":
        assert ref.num_dropped == 0
    elif drops == "all":
        assert ref.num_dropped == T * k and moe.last_plan.capacity == 0
        assert torch.count_nonzero(moe.last_plan.tokens_per_expert) == 0
    else:
        assert 0 < ref.num_dropped < T * k
    if mode.startswith("adaptive"):
        bound = math.ceil(k * abs(layer_kw["capacity_factor"]) * T / E)
        assert moe.last_plan.capacity == min(max(ref.load), bound)


def test_forward_override_applies_to_that_call_only() -> None:
    moe = make_layer(k=2, capacity_factor=1.0)
    x = make_input()
    moe(x, capacity=0)
    assert moe.last_plan.num_dropped == T * 2
    moe(x)
    assert moe.last_plan.capacity == math.ceil(2 * 1.0 * T / E)
    assert moe.capacity is None and moe.capacity_factor == 1.0


@pytest.mark.parametrize("k", [1, 2])
def test_batch_prioritized_matches_reference(k: int, device: torch.device) -> None:
    moe = make_layer(k=k, capacity_factor=0.6, batch_prioritized=True, seed=3, device=device)
    x = make_input(seed=4, device=device)
    ref = check_layer(moe, x, k=k, capacity_factor=0.6, batch_prioritized=True)
    assert ref.num_dropped > 0
    # With drops, priority by top-1 probability keeps a different set than token order would.
    plain, _, _ = reference_for_layer(moe, x, k=k, capacity_factor=0.6)
    assert plain.slot != ref.slot


@pytest.mark.parametrize("k", [1, 2, 3])
def test_score_at_dispatch_matches_reference(k: int, device: torch.device) -> None:
    moe = make_layer(k=k, capacity_factor=0.8, score_at="dispatch", seed=5, device=device)
    ref = check_layer(moe, make_input(seed=6, device=device), k=k, capacity_factor=0.8, score_at="dispatch")
    assert ref.num_dropped > 0
    # The two placements of the score differ for a nonlinear expert with biases.
    combine_ref, _, _ = reference_for_layer(moe, make_input(seed=6), k=k, capacity_factor=0.8)
    assert not torch.allclose(combine_ref.y, ref.y)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_activations_glu_and_bias_match_reference(activation: str, glu: bool, bias: bool,
                                                  device: torch.device) -> None:
    moe = make_layer(k=2, capacity_factor=1.0, activation=activation, glu=glu, bias=bias, seed=7, device=device)
    names = {n for n, _ in moe.named_parameters()}
    assert ("experts.w3" in names) == glu and ("experts.b1" in names) == bias
    if glu:
        assert tuple(moe.experts.w3.shape) == (E, M, H)
    check_layer(moe, make_input(seed=8, device=device), k=2, capacity_factor=1.0, activation=activation, glu=glu)


@pytest.mark.parametrize("score_at", ["combine", "dispatch"])
def test_glu_with_score_at(score_at: str, device: torch.device) -> None:
    moe = make_layer(k=3, capacity_factor=0.9, glu=True, activation="silu", score_at=score_at, seed=9, device=device)
    check_layer(moe, make_input(seed=9, device=device), k=3, capacity_factor=0.9, glu=True, activation="silu",
                score_at=score_at)


@pytest.mark.parametrize("k", [1, 3])
def test_without_weight_normalization(k: int) -> None:
    moe = make_layer(k=k, capacity_factor=0.0, normalize_weights=False, seed=11)
    ref = check_layer(moe, make_input(seed=11), k=k, capacity_factor=0.0, normalize_weights=False)
    if k > 1:  # raw probabilities of the chosen experts sum to less than 1
        assert float(ref.weight.detach().sum(-1).max()) < 1.0
    assert torch.allclose(moe.last_plan.weight.detach(), ref.weight.detach(), atol=1e-12, rtol=0)


class TanhExperts(nn.Module):
    """A custom expert: expert e computes ``tanh(x * scale[e]) @ mix`` (mix shared by all experts).

    forward(x: [N, M] rows sorted by expert, counts: list[int] rows per expert) -> [N, M]. It records the
    counts it was given so the test can check them against the plan.
    """

    def __init__(self, num_experts: int, model_dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(num_experts, model_dim, dtype=torch.float64))
        self.mix = nn.Parameter(torch.randn(model_dim, model_dim, dtype=torch.float64) / math.sqrt(model_dim))
        self.seen: list[tuple[int, list[int]]] = []

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        assert isinstance(counts, list) and all(isinstance(c, int) for c in counts)
        self.seen.append((x.shape[0], list(counts)))
        outs = [torch.tanh(rows * self.scale[e]) @ self.mix for e, rows in enumerate(x.split(counts))]
        return torch.cat(outs)


def tanh_reference(params: dict[str, Tensor]):
    return lambda e, x_t: torch.tanh(x_t * params["experts.scale"][e]) @ params["experts.mix"]


@pytest.mark.parametrize("k,capacity_factor", [(1, 0.0), (2, 0.7), (3, -0.6)])
def test_custom_expert_matches_reference(k: int, capacity_factor: float) -> None:
    torch.manual_seed(12)
    custom = TanhExperts(E, M)
    moe = make_layer(k=k, capacity_factor=capacity_factor, experts=custom, seed=13)
    assert moe.experts is custom
    check_layer(moe, make_input(seed=13), k=k, capacity_factor=capacity_factor, expert=tanh_reference)
    rows, counts = custom.seen[-1]
    assert counts == moe.last_plan.counts and sum(counts) == rows == T * k - moe.last_plan.num_dropped


@pytest.mark.parametrize("k", [1, 2])
def test_cosine_router_matches_reference(k: int, device: torch.device) -> None:
    moe = make_layer(k=k, capacity_factor=0.8, router="cosine", seed=14, device=device)
    with torch.no_grad():  # a larger spread of weights than the init so that routing is not near-uniform
        moe.router.weight.normal_()
        moe.router.log_temperature.fill_(math.log(0.5))
    assert tuple(moe.router.weight.shape) == (E, M)
    ref = check_layer(moe, make_input(seed=14, device=device), k=k, capacity_factor=0.8, router="cosine")
    assert moe.router.log_temperature.grad is not None and float(moe.router.log_temperature.grad.abs()) > 0
    assert ref.num_dropped > 0


def test_float32_layer_with_default_router_dtype(device: torch.device) -> None:
    torch.manual_seed(15)
    moe = MoELayer(M, E, H, k=2, capacity_factor=0.9).to(device)
    assert moe.router_dtype == torch.float32 and moe.experts.w1.dtype == torch.float32
    check_layer(moe, make_input(seed=15, dtype=torch.float32, device=device), k=2, capacity_factor=0.9)


# --- shapes ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(M,), (3, M), (2, 3, 4, M), (4, 1, 6, M), (0, M), (2, 0, M)])
def test_any_leading_shape(shape: tuple[int, ...]) -> None:
    moe = make_layer(k=2, capacity_factor=1.0)
    x = make_input(shape, seed=16)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=1.0)
    assert_close(y.reshape(-1, M), ref.y, TOL[torch.float64], "output")
    assert moe.last_plan.num_tokens == x.numel() // M


def test_leading_shape_is_flattened_in_token_order() -> None:
    # [2, 12, M] routed as 24 tokens in row-major order: same output as the flat batch.
    moe = make_layer(k=2, capacity_factor=0.7)
    x = make_input()
    assert torch.equal(moe(x.reshape(2, 12, M)).reshape(T, M), moe(x))


# --- low precision --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,capacity_factor", [(1, 1.0), (2, 0.0), (3, 0.8)])
def test_low_precision_against_float64_reference(dtype: torch.dtype, k: int, capacity_factor: float,
                                                 device: torch.device) -> None:
    """bf16/fp16 parameters and input; routing in float32 (the default); reference in float64 with the same
    (rounded) weights. Routing decisions must be identical; values within TOL[dtype] of the reference scale."""
    moe = make_layer(dtype=dtype, router_dtype=torch.float32, k=k, capacity_factor=capacity_factor, seed=17,
                     device=device)
    assert moe.experts.w1.dtype == dtype
    check_layer(moe, make_input(seed=18, dtype=dtype, device=device), k=k, capacity_factor=capacity_factor)
    assert moe.last_plan.weight.dtype == torch.float32


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_autocast_returns_input_dtype(x_dtype: torch.dtype) -> None:
    torch.manual_seed(19)
    moe = MoELayer(M, E, H, k=2, capacity_factor=1.0)
    x = make_input(seed=19, dtype=x_dtype).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(x)
    assert y.dtype == x_dtype and y.shape == x.shape
    # Routing stays float32 under autocast; the expert math runs in bf16, hence the bf16 tolerance.
    assert moe.last_plan.weight.dtype == torch.float32
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=1.0)
    assert moe.last_plan.expert_index.tolist() == ref.expert_index
    assert_close(y, ref.y, TOL[torch.bfloat16], "output under autocast")
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == x_dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in moe.parameters())


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("kernel", ["loop", "joined_unit", "embedding_bag", "grouped_mm"])
def test_experts_autocast_off_computes_in_parameter_dtype(kernel: str, grad: bool) -> None:
    """``experts_autocast=False`` (what ``flexmoe.hf.convert`` sets for HF's grouped_mm experts): under autocast
    the routed experts compute in their float32 parameters' dtype, whatever the kernel, so the layer gives its
    float32 output exactly (routing is float32 either way); with the default they compute in bf16."""
    x = make_input(seed=23, dtype=torch.float32)
    outputs = {}
    for autocast in (True, False):
        torch.manual_seed(23)
        moe = MoELayer(M, E, H, k=2, capacity_factor=0.0, glu=True, activation="silu", expert_kernel=kernel,
                       experts_autocast=autocast)
        moe.train(grad)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x)
        with torch.set_grad_enabled(grad):
            plain = moe(x)
        assert y.dtype == torch.float32
        outputs[autocast] = (y, plain)
    y_off, plain = outputs[False]
    torch.testing.assert_close(y_off, plain, rtol=1e-6, atol=1e-6)
    y_on, _ = outputs[True]
    assert (y_on - plain).abs().max() > 1e-4  # bf16 matmuls: the option is what made the difference


def test_router_dtype_float32_under_bf16_model() -> None:
    """A bf16 model routes in float32: probabilities match the float64 reference to float32 precision,
    which bf16 routing (errors ~1e-2) could not."""
    moe = make_layer(dtype=torch.bfloat16, router_dtype=torch.float32, k=2, capacity_factor=0.0, seed=20)
    assert moe.router.weight.dtype == torch.bfloat16
    x = make_input(seed=20, dtype=torch.bfloat16)
    moe(x)
    plan = moe.last_plan
    assert plan.probs_topk.dtype == torch.float32 and plan.weight.dtype == torch.float32
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=0.0)
    probs_ref = torch.stack([ref.probs[t, ref.expert_index[t]] for t in range(T)])
    assert_close(plan.probs_topk, probs_ref, 1e-6, "float32 routing probabilities")
    # A bf16 router is allowed when asked for, and is then visibly coarser.
    moe_bf16 = make_layer(dtype=torch.bfloat16, router_dtype=torch.bfloat16, k=2, capacity_factor=0.0, seed=20)
    moe_bf16(x)
    assert moe_bf16.last_plan.probs_topk.dtype == torch.bfloat16


def test_float32_layer_accepts_bf16_input() -> None:
    torch.manual_seed(21)
    moe = MoELayer(M, E, H, k=2, capacity_factor=1.0)
    x = make_input(seed=21, dtype=torch.bfloat16)
    y = moe(x)
    assert y.dtype == torch.bfloat16
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity_factor=1.0)
    assert_close(y, ref.y, TOL[torch.bfloat16], "output")


# --- tie-breaking ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3])
def test_ties_go_to_the_lower_expert_index(k: int) -> None:
    moe = make_layer(k=k, capacity_factor=0.0, num_experts=6, seed=22)
    with torch.no_grad():
        moe.router.weight.zero_()  # every logit 0: a full tie
    x = make_input(seed=22)
    check_layer(moe, x, k=k, capacity_factor=0.0)
    assert moe.last_plan.expert_index.tolist() == [list(range(k))] * T
    # Experts 1, 3 and 4 share one weight row: ties among them, none with the others. Small integers in x and
    # the weights keep every logit exact in float32, whatever order the matmul kernel sums in (otherwise equal
    # rows can differ in the last bit and the "tie" is decided by rounding).
    gen = torch.Generator().manual_seed(22)
    x = torch.randint(-3, 4, x.shape, generator=gen).to(x.dtype)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randint(-3, 4, moe.router.weight.shape, generator=gen))
        moe.router.weight[3] = moe.router.weight[1]
        moe.router.weight[4] = moe.router.weight[1]
    ref = check_layer(moe, x, k=k, capacity_factor=0.0)
    for row in ref.expert_index:
        picked = [e for e in row if e in (1, 3, 4)]
        assert picked == [1, 3, 4][: len(picked)]
    assert any(1 in row for row in ref.expert_index)


# --- exploration noise ----------------------------------------------------------------------------------

NOISE = {"jitter": 0.3, "gate_noise": 1.0, "router_input_dropout": 0.5}


@pytest.mark.parametrize("name", list(NOISE))
def test_noise_only_in_training(name: str) -> None:
    noisy = make_layer(k=2, capacity_factor=1.0, seed=23, **{name: NOISE[name]})
    clean = make_layer(k=2, capacity_factor=1.0, seed=23)
    clean.load_state_dict(noisy.state_dict())
    x = make_input(seed=23)
    noisy.eval()
    y_eval = noisy(x)
    assert torch.equal(y_eval, noisy(x))
    assert torch.equal(y_eval, clean.eval()(x))
    ref, _, _ = reference_for_layer(noisy, x, k=2, capacity_factor=1.0)
    assert_close(y_eval, ref.y, TOL[torch.float64], "eval output")

    noisy.train()
    torch.manual_seed(0)
    y_train = noisy(x)
    assert not torch.allclose(y_train, y_eval)
    torch.manual_seed(0)
    assert torch.equal(noisy(x), y_train)  # reproducible under a seed
    torch.manual_seed(1)
    assert not torch.equal(noisy(x), y_train)
    # Training a noisy layer must not leave it noisy in eval.
    noisy.eval()
    assert torch.equal(noisy(x), y_eval)


class RecordingRouter(nn.Module):
    """A custom router (linear, float64) that keeps its last input to show what the noise touched."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, M, dtype=torch.float64) / math.sqrt(M))
        self.last_input: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.last_input = x.detach().clone()
        return x @ self.weight.T


class RecordingExperts(TanhExperts):
    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        self.last_input = x.detach().clone()
        return super().forward(x, counts)


@pytest.mark.parametrize("name", ["jitter", "router_input_dropout"])
def test_router_input_noise_does_not_reach_the_experts(name: str) -> None:
    torch.manual_seed(24)
    router, experts = RecordingRouter(), RecordingExperts(E, M)
    moe = MoELayer(M, E, H, k=2, capacity_factor=0.0, router=router, experts=experts,
                   router_dtype=torch.float64, **{name: NOISE[name]})
    x = make_input(seed=24)
    moe.train()
    moe(x)
    seen = router.last_input
    assert not torch.equal(seen, x)
    if name == "jitter":  # multiplicative U(1 - eps, 1 + eps)
        ratio = seen / x
        assert float(ratio.min()) >= 1 - NOISE[name] - 1e-12 and float(ratio.max()) <= 1 + NOISE[name] + 1e-12
    else:  # each feature either dropped or kept (and rescaled by one common factor)
        kept = seen != 0
        assert 0 < int(kept.sum()) < seen.numel()
        ratio = seen[kept] / x[kept]
        assert torch.allclose(ratio, ratio[0].expand_as(ratio))
    # The experts get the clean tokens (score_at="combine": unscaled rows of x).
    plan = moe.last_plan
    assert torch.equal(experts.last_input, x[plan.row_token])


# --- determinism ----------------------------------------------------------------------------------------

def test_deterministic_under_a_seed() -> None:
    a = make_layer(k=2, capacity_factor=0.8, jitter=0.1, gate_noise=0.5, seed=25)
    b = make_layer(k=2, capacity_factor=0.8, jitter=0.1, gate_noise=0.5, seed=25)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    x = make_input(seed=25)
    for mode in ("train", "eval"):
        getattr(a, mode)(), getattr(b, mode)()
        torch.manual_seed(3)
        ya = a(x)
        ya.sum().backward()
        torch.manual_seed(3)
        yb = b(x)
        yb.sum().backward()
        assert torch.equal(ya, yb)
        assert a.last_plan.slot.tolist() == b.last_plan.slot.tolist()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa.grad, pb.grad)
    c = make_layer(k=2, capacity_factor=0.8, seed=26)
    assert not torch.equal(c.router.weight, a.router.weight)


# --- the losses and the plan after forward --------------------------------------------------------------

def test_losses_are_the_design_formulas() -> None:
    """aux_loss = E * sum_e f_e P_e (f from 1st choices), z_loss = mean logsumexp^2, both written out here
    again without the reference's helpers, and differentiable w.r.t. the router weight."""
    moe = make_layer(k=2, capacity_factor=1.0, seed=27)
    x = make_input(seed=27)
    moe(x)
    logits = x @ moe.router.weight.detach().T
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    first = probs.argmax(-1)
    f = torch.tensor([float((first == e).sum()) / T for e in range(E)], dtype=torch.float64)
    expected_aux = E * float((f * probs.mean(0)).sum())
    expected_z = float((torch.log(torch.exp(logits).sum(-1)) ** 2).mean())
    assert float(moe.aux_loss.detach()) == pytest.approx(expected_aux, rel=1e-12)
    assert float(moe.z_loss.detach()) == pytest.approx(expected_z, rel=1e-12)
    assert moe.aux_loss.requires_grad and moe.z_loss.requires_grad
    # A perfectly uniform router gives aux_loss == 1 and z_loss == log(E)^2.
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(x)
    assert float(moe.aux_loss.detach()) == pytest.approx(1.0, rel=1e-12)
    assert float(moe.z_loss.detach()) == pytest.approx(math.log(E) ** 2, rel=1e-12)


@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: most probabilities underflow to 0 in float32
def test_z_loss_from_the_softmax_keeps_value_and_gradient_not_the_logits(scale: float) -> None:
    """router_z_loss(logits, probs) (the softmax router's form, lse = l_j - log p_j at the largest logit) against
    logsumexp written out here in float64: value and gradient; and autograd keeps no [T, E] tensor of its own."""
    from flexmoe.routing.losses import router_z_loss
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(64, 256, generator=gen, dtype=torch.float64) * scale
    ref_logits = base.clone().requires_grad_()
    m = ref_logits.max(-1, keepdim=True).values.detach()
    ref = ((m.squeeze(1) + torch.log(torch.exp(ref_logits - m).sum(-1))) ** 2).mean()
    ref.backward()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-4)):
        logits = base.to(dtype).clone().requires_grad_()
        saved: list[tuple[int, ...]] = []

        def pack(t: torch.Tensor, saved: list[tuple[int, ...]] = saved) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            probs = torch.softmax(logits, dim=-1)
            z = router_z_loss(logits, probs)
        assert saved.count((64, 256)) == 1  # the softmax's own output; not the logits
        z.backward()
        assert float(z.detach()) == pytest.approx(float(ref.detach()), rel=tol)
        assert logits.grad is not None and ref_logits.grad is not None
        torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=tol, atol=tol * 1e-3)


def test_drop_counts_are_reported() -> None:
    moe = make_layer(k=2, capacity=2, seed=28)
    x = make_input(seed=28)
    y = moe(x)
    plan = moe.last_plan
    ref, _, _ = reference_for_layer(moe, x, k=2, capacity=2)
    assert plan.num_dropped == ref.num_dropped == T * 2 - sum(ref.tokens_per_expert) > 0
    assert plan.dropped_fraction == pytest.approx(plan.num_dropped / (T * 2))
    assert plan.tokens_per_expert.tolist() == [min(n, 2) for n in ref.load]
    assert plan.capacity == 2
    # A token whose every choice was dropped comes out as exactly zero (the residual path carries it).
    all_dropped = [t for t in range(T) if all(s < 0 for s in ref.slot[t])]
    assert all_dropped, "the test needs a fully dropped token"
    assert torch.count_nonzero(y[all_dropped]) == 0


def test_last_plan_and_losses_refresh_every_forward() -> None:
    moe = make_layer(k=2, capacity_factor=1.0)
    assert moe.last_plan is None and moe.aux_loss is None and moe.z_loss is None
    moe(make_input(seed=1))
    first = moe.last_plan
    moe(make_input((10, M), seed=2))
    assert moe.last_plan is not first and moe.last_plan.num_tokens == 10


def test_parameters_have_the_documented_shapes() -> None:
    moe = make_layer(k=2, glu=True)
    shapes = {n: tuple(p.shape) for n, p in moe.named_parameters()}
    assert shapes["router.weight"] == (E, M)
    assert shapes["experts.w1"] == (E, M, H) and shapes["experts.w3"] == (E, M, H)
    assert shapes["experts.w2"] == (E, H, M)
    assert shapes["experts.b1"] == (E, H) and shapes["experts.b2"] == (E, M)
    params = layer_params_f64(moe)
    assert set(params) == set(shapes)


def test_capacity_zero_with_one_pair_drops_it() -> None:
    """T * k <= 2 pairs and no row at all: dispatch and combine must not gather from an empty row block."""
    moe = make_layer(k=1, capacity=0)
    x = make_input((1, M)).requires_grad_()
    y = moe(x)
    y.sum().backward()
    assert moe.last_plan is not None and moe.last_plan.num_dropped == 1
    assert torch.equal(y, torch.zeros_like(y)) and x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no-grad"])
def test_a_layer_copies_and_pickles_after_a_call(grad: bool) -> None:
    """deepcopy (an EMA copy, a frozen copy for evaluation) and pickle work after a call that autograd recorded:
    the last call's plan and weights, tensors of that call's graph, stay with the original and the copy starts
    without them. The copy computes what the original computes (a dense loop over tokens, written here)."""
    import copy
    import pickle

    torch.manual_seed(0)
    layer = MoELayer(16, 8, 8, k=2, capacity_factor=0.0, glu=True, activation="silu", bias=False)
    with torch.set_grad_enabled(grad):
        layer(torch.randn(32, 16))
    assert layer.last_plan is not None
    x = torch.randn(5, 16)
    with torch.no_grad():
        logits = x @ layer.router.weight.t()
        probs = torch.softmax(logits, -1)
        want = torch.zeros(5, 16)
        for t in range(5):
            top = torch.topk(probs[t], 2).indices.tolist()
            weight = probs[t, top] / probs[t, top].sum()
            for w, e in zip(weight, top):
                h = F.silu(x[t] @ layer.experts.w1[e]) * (x[t] @ layer.experts.w3[e])
                want[t] += w * (h @ layer.experts.w2[e])
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied.last_plan is None and copied.last_weight is None
        with torch.no_grad():
            torch.testing.assert_close(copied(x), want, rtol=1e-5, atol=1e-5)
        assert copied.last_plan is not None
    assert layer.last_plan is not None and layer.last_weight is not None
