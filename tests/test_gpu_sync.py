"""Issue 41, item 1 on the device: the layer's calls on the path a CUDA device takes (``expert_kernel="grouped_mm"``
in bf16) read nothing from the device, checked with ``torch.cuda.set_sync_debug_mode("error")`` around the calls.

Under that mode every operation that makes the host wait for the device (``item``, ``tolist``, ``nonzero``, a
device-to-host copy, a copy from pageable host memory) raises, so a read anywhere in a training forward, its
backward or a no-grad decoding call fails the test on CUDA. Every case is also checked against a float64 reference
written in the tests (the routing families' loop reference, HF's own eager blocks), on whatever ``--device`` names:
on the CPU the same calls run and are held to the same references; the host reads themselves are counted on the CPU
by the operation counter (``flexmoe bench --host-reads``, tests/test_host_reads.py).

The inputs, the loss's projection and the warm-up call (one-time set-up: the kernels' and allocator's first use) come
before the checked calls, and every comparison after them: only the layer's calls are inside the check.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation  # noqa: E402
from test_routing_families import BASE, CASES, _build, _gpt_oss_act, _pairs, _params, _silu, reference  # noqa: E402

# bf16 rows of 16 elements: 32-byte strides, which torch._grouped_mm takes (it needs 16-byte aligned ones).
MODEL_DIM = HIDDEN = 16
READ_FREE = dict(expert_kernel="grouped_mm", dtype=torch.bfloat16, router_dtype=torch.float32)


@contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, any operation in the block that waits for the device raises RuntimeError (after one check that the
    mode is on: a deliberate read must raise). Elsewhere the block just runs."""
    if device.type != "cuda":
        yield
        return
    probe = torch.ones(1, device=device)
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            probe.item()  # the check itself is on
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def bf16_close(got: Tensor, want: Tensor, what: str) -> None:
    """bf16 (8 bits of mantissa) against float64: within 2% or 2% of the largest element of ``want``. A wrong
    routing or a missing term misses by far more."""
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got.detach().double().cpu(), want.detach(), rtol=2e-2, atol=2e-2 * scale,
                               msg=lambda m: f"{what}: {m}")


def assert_clamps_well_posed(x: Tensor, p: dict, choices: list[list[int]], limit: float) -> None:
    """The clamped GLU's bf16 gradient is comparable with the float64 reference's only where every routed
    pre-activation lies clear of the clamp bounds (``gate = L``, ``up = +-L``); some must lie beyond them (else
    the clamps go untested).

    bf16 keeps 8 significant bits: the layer rounds ``x @ w`` and then ``x @ w + b``, each by up to 2^-9 of its
    size. A pre-activation closer to a bound than that may land on either side of it, or on it (torch 2.13's
    clamp passes the gradient there, 2.15's passes none), and its whole gradient term is then in or out by
    chance: the seed-5 inputs with L = 0.3 had a gate of 0.29967 that bf16 made 0.30078 = bf16(0.3).
    x: ``[B, S, M]`` float64 (bf16 values); p: the reference parameters; choices: ``[T][k]`` the routed experts.
    """
    tokens = x.detach().reshape(-1, x.shape[-1])
    experts = {name: value.detach() for name, value in p["experts"].items()}
    beyond = 0
    for t, chosen in enumerate(choices):
        for e in chosen:
            for w, b, bounds in (("w1", "b1", (limit,)), ("w3", "b3", (limit, -limit))):
                product = tokens[t] @ experts[w][e]
                pre = product + experts[b][e]
                rounding = 2.0 ** -8 * (product.abs() + pre.abs())  # twice the two roundings' bound
                for bound in bounds:
                    near = ((pre - bound).abs() <= rounding).nonzero().flatten().tolist()
                    assert not near, (f"token {t}, expert {e}: {w}'s pre-activations {pre[near].tolist()} are within "
                                      f"bf16 rounding of the clamp bound {bound}; choose inputs clear of it")
                beyond += int((pre.abs() > limit).sum())
    assert beyond > 0, "no routed pre-activation reaches the clamp: the inputs leave glu_limit untested"


def _reference_params(layer: nn.Module) -> dict:
    """The layer's parameters (bf16, on its device) as float64 CPU leaves of the loop reference."""
    def f64(value: object) -> object:
        if isinstance(value, dict):
            return {k: f64(v) for k, v in value.items()}
        assert isinstance(value, Tensor)
        return value.detach().double().requires_grad_(value.requires_grad)

    return {k: f64(v) for k, v in _params(layer).items()}  # type: ignore[arg-type]


# The forced kernel must run every call checked here: its "does not run ... the loop runs" warning fails the test.
FORCED_KERNEL_RUNS = pytest.mark.filterwarnings("error:expert_kernel=:RuntimeWarning")


@FORCED_KERNEL_RUNS
@pytest.mark.parametrize("name", list(CASES))
def test_layer_training_and_decoding_calls_read_nothing(name: str, device: torch.device) -> None:
    """Every routing family of the loop reference (softmax, sigmoid, groups, selection bias, route scale, shared
    experts, the clamped GLU; dropless and capacity mode): a training forward and its backward, then a no-grad
    decoding call (one token per sequence), bf16 on the grouped kernel, without a host read on CUDA."""
    opt = {**BASE, **CASES[name]}
    opt["act_ref"] = _gpt_oss_act if opt["activation"] == "gpt_oss" else _silu
    if opt["shared_hidden"] is not None:
        opt["shared_hidden"] = 8  # the shared experts run the grouped kernel too: aligned rows
    layer = _build(opt, model_dim=MODEL_DIM, hidden=HIDDEN, **READ_FREE).to(device)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, MODEL_DIM, generator=g).bfloat16()
    proj = torch.randn(2, 6, MODEL_DIM, generator=g)
    xl, proj_d = x.to(device, copy=True).requires_grad_(True), proj.to(device)

    def loss_of(y: Tensor) -> Tensor:
        return (y.float() * proj_d).sum() + 0.37 * layer.aux_loss.float()

    loss_of(layer(xl)).backward()  # warm-up, outside the check
    layer.zero_grad(set_to_none=True)
    xl.grad = None
    with no_host_sync(device):
        y = layer(xl)
        loss_of(y).backward()
    layer.eval()
    last = xl.detach()[:, -1:]  # [B, 1, M]: one token per sequence
    with torch.no_grad():
        layer(last)  # warm-up of the decoding call
        with no_host_sync(device):
            y_decode = layer(last)

    p = _reference_params(layer)
    xr = x.double().requires_grad_(True)
    y_ref, aux_ref, choices, kept = reference(xr, p, opt)
    ((y_ref * proj.double()).sum() + 0.37 * aux_ref).backward()
    if opt["limit"] is not None:
        assert_clamps_well_posed(xr, p, choices, opt["limit"])
    bf16_close(y, y_ref, "output")
    bf16_close(xl.grad, xr.grad, "input gradient")
    for what, (ours, ref) in _pairs(layer, p).items():
        assert ours is not None and ref is not None, what
        bf16_close(ours, ref, what)
    with torch.no_grad():
        y_decode_ref, _, _, _ = reference(x[:, -1:].double(), p, opt)
    bf16_close(y_decode, y_decode_ref, "decoding output")


# A DeepSeek-like block (8 experts in 4 groups, the best 2) serves every family; only DeepSeek-V3 reads the groups.
BLOCK = HFShape("sync", tokens=12, model_dim=MODEL_DIM, experts=8, k=2, hidden_dim=HIDDEN, groups=4,
                limited_groups=2)
BLOCK_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss"]


@FORCED_KERNEL_RUNS
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_converted_block_calls_read_nothing(family: str, device: torch.device) -> None:
    """A converted HF block in bf16 on the grouped kernel (the router in float32): a training forward and
    backward, then a no-grad decoding call, without a host read on CUDA; against HF's own eager block in float64
    on the same (bf16-rounded) weights."""
    hf_block = build_hf_block(family, BLOCK, seed=1).bfloat16()
    converted = fh.convert(copy.deepcopy(hf_block), expert_kernel="grouped_mm", router_dtype=torch.float32)
    converted = converted.to(device)
    reference_block = set_experts_implementation(hf_block.double(), "eager")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, BLOCK.tokens // 2, MODEL_DIM, generator=g).bfloat16()
    proj = torch.randn(x.shape, generator=g)
    xl, proj_d = x.to(device, copy=True).requires_grad_(True), proj.to(device)

    (block_output(converted(xl)).float() * proj_d).sum().backward()  # warm-up, outside the check
    converted.zero_grad(set_to_none=True)
    xl.grad = None
    with no_host_sync(device):
        y = block_output(converted(xl))
        (y.float() * proj_d).sum().backward()
    converted.eval()
    last = xl.detach()[:, -1:]
    with torch.no_grad():
        converted(last)
        with no_host_sync(device):
            y_decode = block_output(converted(last))

    xr = x.double().requires_grad_(True)
    y_ref = block_output(reference_block(xr))
    (y_ref * proj.double()).sum().backward()
    bf16_close(y, y_ref, "output")
    bf16_close(xl.grad, xr.grad, "input gradient")
    reference_block.eval()
    with torch.no_grad():
        bf16_close(y_decode, block_output(reference_block(x[:, -1:].double())), "decoding output")
