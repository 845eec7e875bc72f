"""Issue 39: the Hugging Face bridge against what HF's own model test suites ask of it, HF's own model the reference.

* The registered ``"flexmoe"`` experts implementation compiles with ``torch.compile(fullgraph=True)`` (HF's
  ``test_generate_compile_model_forward_fullgraph``) and gives HF eager's logits, compiled and not, with and
  without gradients.
* ``convert`` computes DeepSeek-V3 / GLM-4.5 configs whose k exceeds the experts of the eligible groups (HF's own
  DeepSeek-V3 test config: 8 experts, 2 groups, 1 eligible, k=8): HF's router then also picks masked experts.
* HF's ``init_weights()`` initialises the converted experts and buffers of a model built on ``meta``.
* ``set_experts_implementation`` on a converted model says, in one line, that it does not reach the converted
  blocks.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import Tensor, nn

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from test_hf_convert import COMMON, FAMILY_CONFIGS, batches, moe_blocks, tiny_model  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread: None) -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model: nn.Module, ids: Tensor, forward: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = (model if forward is None else forward)(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), _grads(model)


# ------------------------------------------------------------------ 1. the "flexmoe" implementation compiled


COMPILE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


def _compile_families() -> list[Any]:
    return [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow) for f in COMPILE_FAMILIES]


@pytest.mark.parametrize("family", _compile_families())
def test_flexmoe_experts_implementation_compiles_fullgraph_and_gives_hf_logits(family: str) -> None:
    """The model's forward compiled with ``fullgraph=True`` (a host read of a routed value would be a graph
    break, an error here) under ``"flexmoe"`` gives the logits of HF's eager experts on the same weights, without
    and with gradients (then every parameter's gradient is HF's); eager, a one-token no-grad call (flexmoe's
    decoding shortcut) and a training call still give HF's."""
    fh.register()
    ref = tiny_model(family).eval()
    ref.set_experts_implementation("eager")
    model = copy.deepcopy(ref)
    model.set_experts_implementation("flexmoe")
    ids = batches(1)[0]
    with torch.no_grad():
        model(ids)  # transformers installs its output recorders on a first call, outside what dynamo traces
        want = ref(ids).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(ids).logits, want, **TOL)
        # Eager, one token: flexmoe's decoding path (rows ordered on the host).
        torch.testing.assert_close(model(ids[:1, :1]).logits, ref(ids[:1, :1]).logits, **TOL)
    want_loss, want_grads = _loss_and_grads(ref, ids)
    for forward in (compiled, model):  # compiled training, then eager training
        loss, grads = _loss_and_grads(model, ids, forward)
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert set(grads) == set(want_grads)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------- 2. group-limited routing with k above the eligible


# (experts, groups, eligible groups, k): HF's own DeepSeek-V3 test config (k = E, one group of 4 eligible), and a
# k between the eligible experts (2) and E, where HF's top-k picks 3 of the 6 masked experts.
MASKED_PICKS = [(8, 2, 1, 8), (8, 4, 1, 5)]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("experts,groups,eligible,k", MASKED_PICKS)
def test_group_limited_routing_with_k_above_the_eligible_experts_is_hf(family: str, experts: int, groups: int,
                                                                        eligible: int, k: int) -> None:
    """HF's router takes its top-k over scores with the experts outside the chosen groups at ``-inf``: when k
    exceeds the eligible experts it picks masked ones too, weighted by their real scores. The converted model
    gives HF's logits, loss and, after one SGD step (every gradient), HF's parameters."""
    overrides = dict(n_routed_experts=experts, n_group=groups, topk_group=eligible, num_experts_per_tok=k)
    ref = tiny_model(family, **overrides)
    model = fh.convert(copy.deepcopy(ref), group="single")
    (block,) = moe_blocks(model)
    assert (block.moe.num_expert_groups, block.moe.num_limited_groups, block.moe.k) == (groups, eligible, k)
    ids = batches(1)[0]
    hf_block = ref.model.layers[1].mlp
    # The same choices as HF's router, token by token (as sets: HF's top-k is unsorted), masked experts included.
    with torch.no_grad():
        hidden = ref.model.embed_tokens(ids)  # any tokens: the choice is the router's alone
        _, _, hf_index = hf_block.gate(hidden)
        layer = fh.convert(copy.deepcopy(hf_block), group="single").moe.eval()
        layer(hidden)
        ours = layer.last_plan.expert_index
    assert hf_index.shape == ours.shape == (ids.numel(), k) and k > eligible * experts // groups
    assert torch.equal(ours.sort(dim=-1).values, hf_index.sort(dim=-1).values)
    for m in (ref, model):
        m.train()
    want_loss, _ = _loss_and_grads(ref, ids)
    loss, _ = _loss_and_grads(model, ids)
    torch.testing.assert_close(loss, want_loss, **TOL)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    want_state = ref.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, want_state[name], rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------- 3. HF's init_weights() on a converted model


INIT_FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]


def _meta_converted(family: str) -> nn.Module:
    """``family``'s tiny model built on ``meta``, converted, given real storage by ``to_empty`` and every
    floating tensor set to NaN (what uninitialised memory may hold), as ``from_pretrained``'s meta path leaves
    tensors that no checkpoint fills."""
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS[family]})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    fh.convert(model, group="single")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    return model


def _hf_initialised(family: str) -> nn.Module:
    """HF's own model of ``family`` on ``meta``, ``to_empty``, NaN-filled and ``init_weights()``: the reference."""
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS[family]})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    model.init_weights()
    return model


def _assert_normal(t: Tensor, std: float, name: str) -> None:
    """``t`` looks drawn from N(0, std^2): its mean and std within 5 standard errors (n samples: std / sqrt(n) for
    the mean, about std / sqrt(2n) for the std)."""
    n, t = t.numel(), t.detach()
    assert abs(float(t.mean())) < 5 * std / math.sqrt(n), f"{name}: mean {float(t.mean())}"
    assert abs(float(t.std()) - std) < 5 * std / math.sqrt(2 * n), f"{name}: std {float(t.std())}, want {std}"


def _check_initialised(model: nn.Module, family: str) -> None:
    std = FAMILY_CONFIGS.get(family, {}).get("initializer_range", COMMON["initializer_range"])
    reference = _hf_initialised(family)
    hf_state = reference.state_dict()
    state = model.state_dict()  # HF's names and layout
    assert set(state) == set(hf_state)
    for name, tensor in state.items():
        assert torch.isfinite(tensor).all(), f"{name} left uninitialised"
        hf = hf_state[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # HF's experts: N(0, initializer_range^2)
            _assert_normal(tensor, std, name)
            assert abs(float(tensor.std()) - float(hf.std())) < 10 * std / math.sqrt(2 * hf.numel()), name
        elif hf.numel() > 1 and bool((hf == hf.flatten()[0]).all()):  # constant inits (biases, norms): equal
            torch.testing.assert_close(tensor, hf, rtol=0, atol=0, msg=name)
    for block in moe_blocks(model):
        if block.moe.expert_bias is not None:  # DeepSeek-V3's e_score_correction_bias: zeros, as HF's
            assert torch.equal(block.moe.expert_bias, torch.zeros_like(block.moe.expert_bias))
        for name in ("w1", "w2", "w3"):
            _assert_normal(getattr(block.moe.experts, name), std, name)


@pytest.mark.parametrize("family", INIT_FAMILIES)
def test_init_weights_initialises_converted_experts_as_hf(family: str) -> None:
    model = _meta_converted(family)
    model.init_weights()
    _check_initialised(model, family)


def test_apply_init_weights_of_a_converted_meta_model_initialises_its_experts() -> None:
    """The older idiom ``model.apply(model._init_weights)`` (the outer model's ``_init_weights``) too."""
    model = _meta_converted("deepseek_v3")
    model.apply(model._init_weights)
    _check_initialised(model, "deepseek_v3")


def test_to_hf_gives_back_hf_init_weights_and_a_converted_model_still_trains() -> None:
    ref = tiny_model("qwen3_moe")
    model = fh.convert(copy.deepcopy(ref), group="single")
    assert "_init_weights" in model.model.__dict__
    ids = batches(1)[0]
    torch.testing.assert_close(_loss_and_grads(model, ids)[0], _loss_and_grads(ref, ids)[0], **TOL)
    fh.to_hf(model)
    assert "_init_weights" not in model.model.__dict__ and "_init_weights" not in model.__dict__


# -------------------------------------------------------------- 4. set_experts_implementation on a converted model


def test_set_experts_implementation_on_a_converted_model_says_it_does_not_apply() -> None:
    ref = tiny_model("qwen3_moe").eval()
    model = fh.convert(copy.deepcopy(ref), group="single").eval()
    ids = batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said while the implementation is the one converted under
        with torch.no_grad():
            model(ids)
    model.set_experts_implementation("eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = model(ids).logits
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == len(moe_blocks(model)) == 2
    assert all("\n" not in m and "'eager'" in m and "flexmoe.hf.to_hf" in m for m in messages), messages
    with torch.no_grad():  # the converted blocks still compute HF's function
        torch.testing.assert_close(got, ref(ids).logits, **TOL)
