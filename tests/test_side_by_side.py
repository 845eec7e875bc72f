"""Gated experts' w1 and w3 (b1 and b3) in one storage: the joined view, its gradient, and the layout surviving
what users do to a module (flexmoe.experts.side_by_side)."""

from __future__ import annotations

import copy

import pytest
import torch

from flexmoe.experts.modules import FeedForwardExperts
from flexmoe.experts.side_by_side import side_by_side, side_by_side_halves, sit_side_by_side


def _experts(**kwargs: object) -> FeedForwardExperts:
    torch.manual_seed(0)
    return FeedForwardExperts(3, 8, 4, activation="silu", glu=True, joined_gate_up=True,
                              **kwargs)  # type: ignore[arg-type]


def _shares_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def test_gated_experts_allocate_w1_w3_and_b1_b3_side_by_side() -> None:
    experts = _experts()
    assert sit_side_by_side(experts.w1, experts.w3) and sit_side_by_side(experts.b1, experts.b3)
    assert not _shares_storage(experts.w1, experts.w2) and experts.w1.shape == experts.w3.shape == (3, 8, 4)
    # The joined view is cat([w1, w3], -1) element for element, without a copy.
    view = side_by_side(experts.w1, experts.w3)
    assert view is not None and view.data_ptr() == experts.w1.data_ptr()
    assert torch.equal(view, torch.cat([experts.w1, experts.w3], dim=-1))
    # Initialisation drew w1 and w3 apart (not the same values twice).
    assert not torch.equal(experts.w1, experts.w3)
    # Ungated experts have no pair; without joined_gate_up (the default) every parameter is contiguous (FSDP2
    # shards only those), and nothing re-lays them.
    plain = FeedForwardExperts(3, 8, 4, glu=False, joined_gate_up=True)
    assert plain.w3 is None and plain.w1.is_contiguous() and not plain.joined_gate_up
    apart = FeedForwardExperts(3, 8, 4, glu=True).double()
    assert all(p.is_contiguous() for p in apart.parameters()) and not sit_side_by_side(apart.w1, apart.w3)
    with pytest.raises(TypeError, match="joined_gate_up must be a bool"):
        FeedForwardExperts(3, 8, 4, glu=True, joined_gate_up=1)  # type: ignore[arg-type]


def test_halves_that_do_not_sit_side_by_side_get_none() -> None:
    joined = torch.randn(3, 8, 8)
    first, second = side_by_side_halves(joined)
    assert sit_side_by_side(first, second)
    assert not sit_side_by_side(second, first)  # wrong order
    assert not sit_side_by_side(first, second.clone())  # own storage
    assert not sit_side_by_side(first[:, :, :3], second[:, :, :3])  # rows 8 apart, not 6
    assert not sit_side_by_side(first, second.double())
    assert side_by_side(first.clone(), second.clone()) is None
    quarters = torch.randn(3, 8, 16)
    assert not sit_side_by_side(quarters[..., :4], quarters[..., 4:8])  # rows 16 apart, not 8


def test_the_views_gradient_reaches_both_parameters() -> None:
    """The joined view's backward against cat's (an independent reference: torch's own op)."""
    experts = _experts()
    upstream = torch.randn(3, 8, 8)
    (side_by_side(experts.w1, experts.w3) * upstream).sum().backward()  # type: ignore[operator]
    w1 = experts.w1.detach().clone().requires_grad_()
    w3 = experts.w3.detach().clone().requires_grad_()
    (torch.cat([w1, w3], dim=-1) * upstream).sum().backward()
    torch.testing.assert_close(experts.w1.grad, w1.grad, rtol=0, atol=0)
    torch.testing.assert_close(experts.w3.grad, w3.grad, rtol=0, atol=0)
    # A second backward accumulates, as for any parameter.
    (side_by_side(experts.w1, experts.w3) * upstream).sum().backward()  # type: ignore[operator]
    torch.testing.assert_close(experts.w1.grad, 2 * w1.grad, rtol=0, atol=0)
    with torch.no_grad():
        view = side_by_side(experts.w1, experts.w3)
    assert view is not None and not view.requires_grad


@pytest.mark.parametrize("change", ["double", "to-dtype", "deepcopy", "load_state_dict", "assign"])
def test_the_layout_survives_what_users_do_to_a_module(change: str) -> None:
    experts = _experts()
    values = {name: tensor.detach().clone() for name, tensor in experts.state_dict().items()}
    w1_param = experts.w1
    if change == "double":
        experts = experts.double()
    elif change == "to-dtype":
        experts = experts.to(torch.bfloat16).to(torch.float32)
    elif change == "deepcopy":
        experts = copy.deepcopy(experts)
    elif change == "load_state_dict":
        other = _experts()
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)
        experts.load_state_dict(other.state_dict())
        values = {name: tensor.detach().clone() for name, tensor in other.state_dict().items()}
    else:  # assign: the loaded tensors replace the parameters, their layout broken until the next _apply
        experts.load_state_dict({name: t.clone() for name, t in experts.state_dict().items()}, assign=True)
        assert not sit_side_by_side(experts.w1, experts.w3)
        experts.lay_gated_pairs_side_by_side()
    assert sit_side_by_side(experts.w1, experts.w3) and sit_side_by_side(experts.b1, experts.b3)
    if change in ("double", "to-dtype", "load_state_dict"):
        assert experts.w1 is w1_param  # the same parameter object (an optimizer holding it still holds it)
    for name, tensor in experts.state_dict().items():
        torch.testing.assert_close(tensor.float(), values[name].float(), rtol=1e-2 if change == "to-dtype" else 0,
                                   atol=1e-2 if change == "to-dtype" else 0)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_converted_block_with_joined_gate_up_computes_hf_s_function(family: str) -> None:
    """``flexmoe.hf.convert`` lays w1 and w3 side by side by default (``joined_gate_up``, HF's gate_up_proj
    layout); on the read-free path (the grouped kernel viewing w1|w3): HF's output and input gradient (HF's own
    block, grouped_mm experts, is the reference), the same weight gradients as ``joined_gate_up=False``'s copy,
    and HF's state dict back. 64 experts of M=64, H=32: the joined weight is viewed, not copied (w1 is 512 KiB)."""
    import flexmoe.hf
    from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation
    from flexmoe.experts.grouped_op import SIDE_BY_SIDE_MIN_BYTES

    shape = HFShape("count", tokens=5, model_dim=64, experts=64, k=4, hidden_dim=32, groups=1, limited_groups=1)
    hf = set_experts_implementation(build_hf_block(family, shape, 0), "grouped_mm")
    joined = flexmoe.hf.convert(copy.deepcopy(hf), expert_kernel="grouped_mm")
    apart = flexmoe.hf.convert(copy.deepcopy(hf), expert_kernel="grouped_mm", joined_gate_up=False)
    experts, apart_experts = joined.moe.experts, apart.moe.experts
    assert sit_side_by_side(experts.w1, experts.w3) and not sit_side_by_side(apart_experts.w1, apart_experts.w3)
    assert experts.w1.numel() * experts.w1.element_size() >= SIDE_BY_SIDE_MIN_BYTES
    for name, tensor in hf.state_dict().items():
        assert torch.equal(joined.state_dict()[name], tensor), name
    torch.manual_seed(1)
    x = torch.randn(1, 5, 64)
    grads = {}
    for name, block in (("hf", hf), ("joined", joined), ("apart", apart)):
        xi = x.clone().requires_grad_()
        out = block_output(block(xi))
        out.backward(torch.ones_like(out))
        grads[name] = (out.detach(), xi.grad)
    for got in (grads["joined"], grads["apart"]):
        torch.testing.assert_close(got[0], grads["hf"][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], grads["hf"][1], rtol=1e-5, atol=1e-6)
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        got, want = getattr(experts, name), getattr(apart_experts, name)
        if want is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def _dense_reference(x: torch.Tensor, experts: FeedForwardExperts, expert_of_row: list[int]) -> torch.Tensor:
    """Each row through its expert by plain float64 matmuls: silu(x w1 + b1) * (x w3 + b3) @ w2 + b2."""
    out = []
    for row, e in zip(x.double(), expert_of_row, strict=True):
        w1, w3, w2 = experts.w1[e].double(), experts.w3[e].double(), experts.w2[e].double()
        b1, b3, b2 = experts.b1[e].double(), experts.b3[e].double(), experts.b2[e].double()
        hidden = torch.nn.functional.silu(row @ w1 + b1) * (row @ w3 + b3)
        out.append(hidden @ w2 + b2)
    return torch.stack(out)


@pytest.mark.parametrize("kernel", ["loop", "segmented", "grouped_mm", "embedding_bag", "joined_unit"])
@pytest.mark.parametrize("change", ["none", "data-replaced", "edited-through-data", "swapped-parameter"])
def test_kernels_read_the_laid_out_gate_up_only_while_it_is_w1_and_w3(kernel: str, change: str) -> None:
    """Without autograd every kernel reads ``w1 | w3`` (``b1 | b3``) as the one laid-out tensor
    (``ExpertWeights.laid_out_gate_up``), and only while the parameters are still its halves: after ``.data`` is
    replaced (its own storage), after an edit through ``.data`` (which bumps no version counter: the same storage,
    so the laid-out tensor sees it), and with another tensor in the parameter's place
    (``torch.func.functional_call``), the output is the experts' function of the values they hold then, against
    a float64 loop written here."""
    experts = _experts()
    experts.kernels = type(experts.kernels).for_options(kernel, None)
    torch.manual_seed(1)
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), 8)
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    replacement = torch.randn(3, 8, 4)
    call_params: dict[str, torch.Tensor] = {}
    if change == "data-replaced":
        experts.w3.data = replacement.clone()
    elif change == "edited-through-data":
        experts.w1.data.mul_(-2.0)
        experts.b3.data.add_(0.5)
    elif change == "swapped-parameter":
        call_params = {"w3": replacement.clone()}
    with torch.no_grad():
        weights = experts.weights()
        laid_out = weights.laid_out_gate_up(x)
        if change in ("none", "edited-through-data"):
            assert laid_out is not None and laid_out[0] is experts.gate_up and laid_out[1] is experts.gate_up_bias
        elif change == "data-replaced":
            assert laid_out is None
        out = torch.func.functional_call(experts, call_params, (x, counts)) if call_params else experts(x, counts)
    reference_experts = experts
    if call_params:
        reference_experts = copy.deepcopy(experts)
        with torch.no_grad():
            reference_experts.w3.copy_(call_params["w3"])
    want = _dense_reference(x, reference_experts, expert_of_row)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_experts, num_tokens", [(8, 64), (64, 64), (8, 1)])
def test_a_converted_block_decodes_on_its_laid_out_gate_up_without_a_copy(family: str, num_experts: int,
                                                                          num_tokens: int) -> None:
    """A converted block's eval forward without autograd (T=64: the read-free path's grouped GEMMs, at E=64 too
    now that its weights need no copy; T=1: its gathered weights, one gather of w1 | w3) reads w1 | w3 where they
    lie: no ``cat`` dispatched, HF's output (HF's own block is the reference). After ``w3.data`` is replaced it
    computes with the new values (a block converted with ``joined_gate_up=False`` and given the same values is
    the reference), and a deep copy records its own laid-out tensors, not the original's."""
    import flexmoe.hf
    from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation
    from flexmoe.apps.bench.host_reads import OpCounter

    shape = HFShape("count", tokens=num_tokens, model_dim=64, experts=num_experts, k=4, hidden_dim=32, groups=1,
                    limited_groups=1)
    hf = set_experts_implementation(build_hf_block(family, shape, 0), "grouped_mm").eval()
    block = flexmoe.hf.convert(copy.deepcopy(hf)).eval()
    experts = block.moe.experts
    assert experts.joined_gate_up and experts.gate_up is not None
    assert experts.gate_up.data_ptr() == experts.w1.data_ptr()
    x = torch.randn(1, num_tokens, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), OpCounter() as counted:
        out = block_output(block(x))
    assert counted.host_reads == [] and counted.by_name["aten.cat.default"] == 0, counted.by_name
    if num_tokens == 1:  # the gathered route: w1 | w3 and w2 gathered once each (GPT-OSS: b1 | b3 and b2 too)
        assert counted.by_name["aten.index_select.default"] == (4 if family == "gpt_oss" else 2), counted.by_name
    with torch.no_grad():
        torch.testing.assert_close(out, block_output(hf(x)), rtol=1e-5, atol=1e-6)

    twin = copy.deepcopy(block)
    twin_experts = twin.moe.experts
    assert twin_experts.gate_up is not None and twin_experts.gate_up.data_ptr() == twin_experts.w1.data_ptr()
    assert twin_experts.gate_up.data_ptr() != experts.gate_up.data_ptr()

    apart = flexmoe.hf.convert(copy.deepcopy(hf), joined_gate_up=False).eval()
    new_w3 = torch.randn(experts.w3.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    experts.w3.data = new_w3.clone()
    with torch.no_grad():
        apart.moe.experts.w3.copy_(new_w3)
        torch.testing.assert_close(block_output(block(x)), block_output(apart(x)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block_output(twin(x)), out, rtol=0, atol=0)  # the copy kept its values
