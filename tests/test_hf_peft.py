"""PEFT's LoRA on flexmoe's experts, and adapters around a conversion (docs/architecture.md, "Adapters on the
experts").

The reference is Hugging Face's own eager model with the LoRA delta, ``scaling * A_e^T B_e^T`` per expert, written
into its expert tensors by hand (through ``torch.func.functional_call``, so that the gradients of A and B come
back through HF's model), or, for a bare :class:`~flexmoe.MoELayer`, a dense loop over tokens and choices written
here. Every adapter that flexmoe would drop or bypass must be an error.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="flexmoe.hf needs transformers (CI installs .[test])")
peft = pytest.importorskip("peft", reason="the LoRA tests need peft (CI installs .[test])")

import flexmoe.experts.stage as expert_stage  # noqa: E402
import flexmoe.hf as fh  # noqa: E402
from flexmoe import MoELayer  # noqa: E402
from reference import RefResult, ref_ffn_expert, ref_linear_logits, reference_moe  # noqa: E402
from test_decoding import count_calls  # noqa: E402
from test_hf_convert import TOL, batches, moe_blocks, tiny_model  # noqa: E402

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]
EXPERT_TARGETS = ["experts.w1", "experts.w2", "experts.w3"]  # a flexmoe layer's expert tensors, as documented
# A converted block's: its gated pair is one parameter, gate_up (HF's gate_up_proj), as documented.
CONVERTED_TARGETS = ["experts.gate_up", "experts.w2"]
HF_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]  # HF's, as PEFT users write them for an HF model


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def lora(model: nn.Module, targets: list[str], *, random_b: bool, modules: list[str] | None = None) -> nn.Module:
    """``peft.get_peft_model`` with LoRA (r=2, alpha=4) on the parameters ``targets`` (and the modules
    ``modules``); ``random_b``: B drawn like A (nn.Linear's default), so that the adapter changes the output from
    the start."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=modules or [], target_parameters=targets,
                             init_lora_weights=not random_b)
    return peft.get_peft_model(model, config)


def lora_deltas(peft_model: nn.Module, factors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Each adapted experts module's deltas by hand from LoRA factors ``factors`` (by parameter name, as PEFT
    stores them: ``lora_A.weight [r*E, in]`` read as ``[E, r, in]``, ``lora_B.weight [out, r*E]`` as
    ``[out, r, E]``): ``{module path: {"w1": scaling * B_e A_e in the weight's layout, ...}}``, the path as in the
    plain HF model (``model.layers.0.mlp``; ``""`` for a bare layer)."""
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, peft.tuners.lora.layer.ParamWrapper):
            continue
        a, b = factors[f"{name}.lora_A.default.weight"], factors[f"{name}.lora_B.default.weight"]
        e, rows, cols = module.get_param().shape
        delta = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], -1, e), a.reshape(e, -1, a.shape[-1]))
        assert rows != cols  # which side PEFT took as the input must show in the shapes
        if delta.shape[1:] != (rows, cols):  # PEFT factored the weight as [E, in, out]
            delta = delta.transpose(1, 2)
        # The nested wrappers' names end in "moe.experts(.base_layer)*": the block's path is what comes before.
        path = name.removeprefix("base_model.model.").rpartition("experts")[0].removesuffix("moe.").removesuffix(".")
        delta = delta * module.scaling["default"]
        if module.parameter_name == "gate_up":  # [E, M, 2H]: the deltas of its halves, w1 and w3
            half = delta.shape[-1] // 2
            deltas.setdefault(path, {}).update(w1=delta[..., :half], w3=delta[..., half:])
        else:
            deltas.setdefault(path, {})[module.parameter_name] = delta
    return deltas


def hf_params_with(ref: nn.Module, deltas: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF model ``ref``'s parameters with flexmoe's expert deltas (``w1, w3: [E, M, H]``, ``w2: [E, H, M]``) added
    to its expert tensors, in HF's layout: ``gate_up_proj`` ``[E, 2H, M]`` with gate then up rows, or (transposed,
    GPT-OSS) ``[E, M, 2H]`` with interleaved gate/up columns; ``down_proj`` ``[E, M, H]`` or ``[E, H, M]``."""
    params: dict[str, torch.Tensor] = dict(ref.named_parameters())
    for path, delta in deltas.items():
        experts = ref.get_submodule(f"{path}.experts")
        if experts.is_transposed:
            assert not experts.is_concatenated  # GPT-OSS
            gate_up = torch.stack([delta["w1"], delta["w3"]], dim=-1).flatten(-2)  # [E, M, 2H] interleaved
            down = delta["w2"]
        else:
            gate_up = torch.cat([delta["w1"], delta["w3"]], dim=-1).transpose(1, 2)  # [E, 2H, M]
            down = delta["w2"].transpose(1, 2)  # [E, M, H]
        params[f"{path}.experts.gate_up_proj"] = experts.gate_up_proj + gate_up
        params[f"{path}.experts.down_proj"] = experts.down_proj + down
    return params


# ------------------------------------------------------------------------------- LoRA on the experts


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_gives_hf_logits_and_gradients_with_the_delta_added(family):
    ref = tiny_model(family)
    model = lora(fh.convert(copy.deepcopy(ref), group="single"), CONVERTED_TARGETS, random_b=True)
    ids = batches(1, seed=5)[0]
    got = model(ids, labels=ids)
    got.loss.backward()

    # The same factors as leaves of the reference, written into HF's own expert tensors.
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    leaves = {name: p.detach().clone().requires_grad_() for name, p in trained.items()}
    deltas = lora_deltas(model, leaves)
    with torch.no_grad():
        base = ref(ids).logits
    expected = torch.func.functional_call(ref, hf_params_with(ref, deltas), (ids,), {"labels": ids})
    expected.loss.backward()

    assert len(deltas) == len(moe_blocks(model)) and all(len(d) == 3 for d in deltas.values())
    assert float((expected.logits.detach() - base).abs().max()) > 0.05  # the adapter changes HF's output ...
    torch.testing.assert_close(got.logits, expected.logits, **TOL)  # ... and flexmoe's by as much
    for name, p in trained.items():
        want = leaves[name].grad
        assert want is not None and float(want.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_experts_trains_merges_and_exports(family, tmp_path):
    model = lora(fh.convert(tiny_model(family), group="single"), CONVERTED_TARGETS, random_b=False)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    ids = batches(1, seed=6)[0]
    with torch.no_grad():
        base = model(ids).logits
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.02)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert all(float(p.grad.abs().max()) > 0 for name, p in model.named_parameters() if "lora_B" in name)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # only the adapter trained
    model.eval()
    with torch.no_grad():
        adapted = model(ids).logits
        # The trained adapter, by hand on HF's expert tensors, is the reference for the merged model.
        ref = tiny_model(family).eval()
        factors = {name: p.detach() for name, p in model.named_parameters() if "lora_" in name}
        expected = torch.func.functional_call(ref, hf_params_with(ref, lora_deltas(model, factors)), (ids,)).logits
    assert float((adapted - base).abs().max()) > 1e-3
    torch.testing.assert_close(adapted, expected, **TOL)

    merged = model.merge_and_unload()
    assert not any(isinstance(m, peft.tuners.lora.layer.ParamWrapper) for m in merged.modules())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, **TOL)
    fh.to_hf(merged)
    merged.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not moe_blocks(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, **TOL)


def test_an_adapter_checkpoint_of_a_converted_model_loads_back(tmp_path):
    """PEFT's own adapter checkpoint (``save_pretrained`` of the PeftModel: the LoRA factors under flexmoe's
    module names) loads onto a freshly converted model and gives HF's logits with the deltas added by hand."""
    model = lora(fh.convert(tiny_model("qwen3_moe"), group="single"), CONVERTED_TARGETS, random_b=True)
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(fh.convert(tiny_model("qwen3_moe"), group="single"), tmp_path).eval()
    ref = tiny_model("qwen3_moe").eval()
    ids = batches(1, seed=9)[0]
    with torch.no_grad():
        factors = {name: p for name, p in loaded.named_parameters() if "lora_" in name}
        assert len(factors) == 2 * 2 * 2  # A and B, two tensors, two layers
        expected = torch.func.functional_call(ref, hf_params_with(ref, lora_deltas(loaded, factors)), (ids,))
        assert float((expected.logits - ref(ids).logits).abs().max()) > 0.05
        torch.testing.assert_close(loaded(ids).logits, expected.logits, **TOL)


def test_the_state_dict_of_an_unmerged_adapter_model_keeps_hfs_names_for_the_base_weights():
    """With LoRA on the experts not yet merged, a converted model's state dict still holds HF's own expert and
    router tensors (the unadapted weights, from below PEFT's wrapper) beside the adapter's factors, and no
    flexmoe-internal name of a base weight."""
    ref = tiny_model("mixtral")
    model = lora(fh.convert(copy.deepcopy(ref), group="single"), CONVERTED_TARGETS, random_b=True)
    state = model.state_dict()
    expected = {f"base_model.model.{key}": value for key, value in ref.state_dict().items()}
    base = {key: value for key, value in state.items() if "lora_" not in key}
    assert sorted(base) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(base[key], value, rtol=0, atol=0)
    assert sum("lora_" in key for key in state) == 2 * 2 * 2  # A and B, two tensors, two layers


def test_lora_on_the_shared_experts_and_router_of_a_converted_model_applies():
    """Qwen2-MoE: LoRA on flexmoe's shared expert (``moe.shared``) and on HF's router weight (kept as HF's module)
    changes the logits as the same deltas written into HF's shared MLP and router do."""
    ref = tiny_model("qwen2_moe").eval()
    model = lora(fh.convert(copy.deepcopy(ref), group="single"), ["shared.w1", "shared.w2", "hf_router.weight"],
                 random_b=True)
    ids = batches(1, seed=4)[0]
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, peft.tuners.lora.layer.ParamWrapper):
                continue
            delta = module.get_delta_weight("default").reshape(module.get_param().shape)
            path = name.removeprefix("base_model.model.").split(".moe.")[0]
            if module.parameter_name == "weight":  # the router's [E, M]
                params[f"{path}.gate.weight"] = params[f"{path}.gate.weight"] + delta
            elif module.parameter_name == "w1":  # [1, M, Hs]: gate_proj.weight is [Hs, M]
                params[f"{path}.shared_expert.gate_proj.weight"] = \
                    params[f"{path}.shared_expert.gate_proj.weight"] + delta[0].mT
            else:  # w2 [1, Hs, M]: down_proj.weight is [M, Hs]
                params[f"{path}.shared_expert.down_proj.weight"] = \
                    params[f"{path}.shared_expert.down_proj.weight"] + delta[0].mT
        assert sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.layer.ParamWrapper)) == 3 * 2
        expected = torch.func.functional_call(ref, params, (ids,)).logits
        assert float((expected - ref(ids).logits).abs().max()) > 0.05
        torch.testing.assert_close(model(ids).logits, expected, **TOL)


# ------------------------------------------------------------------------------ adapters and convert


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_attention_before_convert_carries_over(family):
    hf = lora(tiny_model(family), ["q_proj.weight"], random_b=True)
    ids = batches(1, seed=2)[0]
    with torch.no_grad():
        expected = hf(ids).logits
        plain = tiny_model(family)(ids).logits
    model = fh.convert(hf, group="single")
    assert model is hf and moe_blocks(model)
    assert float((expected - plain).abs().max()) > 0.05
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_hf_experts_before_convert_is_refused_with_the_way_that_works(family):
    hf = lora(tiny_model(family), HF_TARGETS, random_b=True)
    with pytest.raises(ValueError, match=r"mlp\.experts.*merge_and_unload\(\).*target_parameters="):
        fh.convert(hf, group="single")
    assert not moe_blocks(hf)  # nothing replaced
    ids = batches(1, seed=2)[0]
    with torch.no_grad():
        expected = hf(ids).logits
    # The first way the message names: merge, then convert the merged model.
    merged = fh.convert(hf.merge_and_unload(), group="single")
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, **TOL)


def test_adapters_inside_a_block_are_refused_by_convert_and_to_hf():
    # A torch parametrization on HF's experts (convert would copy the parametrized value and drop the rest).
    hf = tiny_model("mixtral")
    experts = hf.model.layers[0].mlp.experts
    torch.nn.utils.parametrize.register_parametrization(experts, "down_proj", _Doubled())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts'.*parametrization"):
        fh.convert(hf, group="single")
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock.*carry an adapter"):
        fh.convert(hf.model.layers[0].mlp, group="single")
    # LoRA (target_modules) on Qwen2-MoE's shared expert MLP. Both halves of the gated pair: PEFT >= 0.22 refuses
    # gate_proj alone on a transformers-5 Qwen2-MoE (it reads the name as half of the routed experts' gate_up_proj).
    hf = lora(tiny_model("qwen2_moe"), [], random_b=True, modules=["gate_proj", "up_proj"])
    with pytest.raises(ValueError, match=r"shared_expert\.gate_proj.*merge_and_unload"):
        fh.convert(hf, group="single")
    # An unmerged adapter on a converted model (here on the second layer only): to_hf would drop it, and refuses
    # before giving back any block.
    model = lora(fh.convert(tiny_model("olmoe"), group="single"), ["model.layers.1.mlp.moe.experts.w2"],
                 random_b=True)
    with pytest.raises(ValueError, match=r"olmoe block.*moe\.experts.*merge_and_unload\(\)"):
        fh.to_hf(model)
    assert len(moe_blocks(model)) == 2


def test_lora_on_a_converted_models_shared_expert_adapts_its_output() -> None:
    """A converted Qwen2-MoE's shared expert is ``moe.shared`` (``w1, w3: [1, M, H]``, ``w2: [1, H, M]``), targeted
    with ``target_parameters`` as the routed experts are. Reference: HF's model with each LoRA delta added by hand
    to the shared expert's ``gate_proj``/``up_proj``/``down_proj`` (``[out, in]``, the transposes)."""
    hf = tiny_model("qwen2_moe")
    model = lora(fh.convert(copy.deepcopy(hf), group="single"), ["shared.w1", "shared.w3", "shared.w2"],
                 random_b=True)
    hf_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    wrappers = [(n, m) for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.layer.ParamWrapper)]
    assert sorted(m.parameter_name for _, m in wrappers) == sorted(["w1", "w3", "w2"] * hf.config.num_hidden_layers)
    with torch.no_grad():
        for name, wrapper in wrappers:
            a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight  # [r, in], [out, r]
            delta = wrapper.scaling["default"] * (b @ a)  # [out, in] of the stored [M, H] (w1, w3) or [H, M] (w2)
            assert delta.shape == wrapper.get_param().shape[1:]
            layer = name.removeprefix("base_model.model.").split(".mlp.")[0]
            linear = hf.get_submodule(f"{layer}.mlp.shared_expert.{hf_names[wrapper.parameter_name]}")
            linear.weight += delta.T  # nn.Linear's weight is [out_features, in_features], the stored matrix's T
    ids = batches(1)[0]
    with torch.no_grad():
        expected, got = hf(ids).logits, model(ids).logits
        assert (got - tiny_model("qwen2_moe")(ids).logits).abs().max() > 1e-3  # the adapter does change the output
    torch.testing.assert_close(got, expected, **TOL)


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


# --------------------------------------------------------------------------- every path of the layer


def bare_lora_layer(**options) -> tuple[nn.Module, MoELayer, torch.Tensor]:
    """A bare MoELayer (float32, SwiGLU, k=2, dropless unless ``options`` say otherwise) with LoRA (random B)
    on its experts, the layer itself, and tokens ``[24, 8]``."""
    torch.manual_seed(0)
    moe = MoELayer(8, 4, 16, k=2, glu=True, activation="silu", bias=False, **{"capacity_factor": 0.0, **options})
    return lora(moe, EXPERT_TARGETS, random_b=True), moe, torch.randn(24, 8, generator=torch.Generator().manual_seed(1))


def bare_reference(model: nn.Module, moe: MoELayer, x: torch.Tensor,
                   capacity_factor: float = 0.0) -> tuple[RefResult, dict[str, torch.Tensor]]:
    """The float64 reference (tests/reference.py) on the base weights plus the LoRA deltas by hand, and the
    float64 LoRA factors (leaves, their gradients filled by ``backward`` of ``sum(y)``)."""
    factors = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters() if "lora_" in name}
    (delta,) = lora_deltas(model, factors).values()
    params = {n: moe.experts.get_base_layer().get_parameter(n).detach().double() + delta[n] for n in ("w1", "w2", "w3")}
    logits = ref_linear_logits(x.double(), moe.router.weight.detach().double())
    want = reference_moe(x.double(), logits, ref_ffn_expert(params, "silu", glu=True), k=2,
                         capacity_factor=capacity_factor)
    want.y.backward(torch.ones_like(want.y))
    return want, factors


def assert_lora_grads(model: nn.Module, factors: dict[str, torch.Tensor], what: str) -> None:
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(p.grad.double(), factors[name].grad, rtol=1e-4, atol=1e-5, msg=f"{what} {name}")


def test_lora_applies_on_every_path_of_a_bare_layer(monkeypatch):
    """LoRA on a bare layer's experts against the float64 reference run on ``w + delta``: training through the
    default path and through the fused experts, a call overriding a parallel option (another strategy object),
    and a no-grad evaluation call (decoding's path without a plan); LoRA's gradients against the reference's."""
    model, moe, x = bare_lora_layer()
    want, factors = bare_reference(model, moe, x)
    fused_calls = count_calls(monkeypatch, expert_stage, "fused_experts")
    for case in ("default", "other strategy", "fused"):
        if case == "fused":
            # The fused experts forced, as expert_route="fused" does (the chooser times nothing in tests).
            monkeypatch.setattr(moe._built_experts.kernels, "route", "fused")
        model.zero_grad()
        y = model(x, overlap_degree=2) if case == "other strategy" else model(x)
        assert len(fused_calls) == (1 if case == "fused" else 0), case
        torch.testing.assert_close(y.double(), want.y, rtol=1e-5, atol=1e-5, msg=case)
        y.backward(torch.ones_like(y))
        assert_lora_grads(model, factors, case)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x[:3]).double(), want.y[:3], rtol=1e-5, atol=1e-5)
    # The adapter changes the output (the base layer's is another).
    with torch.no_grad(), model.disable_adapter():
        assert float((model(x[:3]).double() - want.y[:3]).abs().max()) > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", [0.0, 2.0])
def test_compiled_layer_with_lora_matches_the_reference(capacity_factor):
    """``torch.compile`` of an adapted layer (PEFT registers its parametrization inside the compiled call),
    dropless and in capacity mode (padded custom ops): the reference's output and LoRA gradients."""
    model, moe, x = bare_lora_layer(capacity_factor=capacity_factor)
    want, factors = bare_reference(model, moe, x, capacity_factor=capacity_factor)
    y = torch.compile(model)(x)
    torch.testing.assert_close(y.double(), want.y, rtol=1e-5, atol=1e-5)
    y.backward(torch.ones_like(y))
    assert_lora_grads(model, factors, "compiled")


def test_a_replaced_or_wrapped_custom_experts_module_is_an_error():
    moe = MoELayer(8, 4, 16, k=2, glu=True)
    x = torch.randn(6, 8)
    moe.experts = copy.deepcopy(moe.experts)
    with pytest.raises(ValueError, match="MoELayer.experts was replaced by a FeedForwardExperts"):
        moe(x)

    class LinearExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
            return torch.cat([r @ w for r, w in zip(rows.split(counts), self.w)])

    custom = lora(MoELayer(8, 4, 16, k=2, experts=LinearExperts()), ["experts.w"], random_b=True)
    with pytest.raises(ValueError, match="custom experts module LinearExperts"):
        custom(x)


# ---------------------------------------------------------------------- the registered implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_flexmoe_implementation_takes_lora_on_hf_experts_with_eager_logits_and_gradients(family):
    """LoRA on HF's expert tensors runs the experts module as a parametrized subclass (``ParametrizedGptOssExperts``
    ...) inside PEFT's forward: the registered implementation must recognise it and give HF eager's numbers."""
    fh.register()
    ref = lora(tiny_model(family), HF_TARGETS, random_b=True)
    model = copy.deepcopy(ref)
    model.base_model.model.set_experts_implementation("flexmoe")
    ids = batches(1, seed=12)[0]
    expected = ref(ids, labels=ids)
    got = model(ids, labels=ids)
    with torch.no_grad(), ref.disable_adapter():
        assert float((ref(ids).logits - expected.logits).abs().max()) > 0.05
    torch.testing.assert_close(got.logits, expected.logits, **TOL)
    expected.loss.backward()
    got.loss.backward()
    want = {name: p.grad for name, p in ref.named_parameters() if p.requires_grad}
    assert want and all("lora_" in name for name in want)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-5 * float(want[name].abs().max()),
                                       msg=name)


def test_flexmoe_implementation_takes_a_parametrized_gpt_oss_experts_module():
    """A torch parametrization kept on GPT-OSS's experts (class ``ParametrizedGptOssExperts``): HF eager's logits."""
    fh.register()
    ref = tiny_model("gpt_oss").eval()
    for layer in ref.model.layers:
        torch.nn.utils.parametrize.register_parametrization(layer.mlp.experts, "gate_up_proj", _Doubled())
    assert type(ref.model.layers[0].mlp.experts).__name__ == "ParametrizedGptOssExperts"
    model = copy.deepcopy(ref)
    model.set_experts_implementation("flexmoe")
    ids = batches(1, seed=13)[0]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, **TOL)


@pytest.mark.slow
def test_lora_on_experts_over_two_ranks_matches_one_process():
    """Each of 2 gloo ranks holds half the experts and its slice of the adapter: outputs and LoRA gradients equal
    one process's, through the token exchange, the pairwise schedule, gathered weights (r=0), a shadowed expert
    (its weights broadcast) and with a rank whose experts get no rows (it must still join the backward exchange,
    through the adapter's weights); a converted Mixtral gives the single-process logits and, merged, exports the
    same HF tensors (tests/peft_ep_worker.py)."""
    from flexmoe.launch import spawn_ranks
    from peft_ep_worker import rank_main

    ranks = spawn_ranks(2, rank_main, [], timeout=240, check=True, what="LoRA on experts over 2 ranks")
    failures = [f"rank {r.value['rank']}: {f}" for r in ranks for f in r.value["failures"]]
    assert not failures, "\n".join(failures)
    assert [r.value["rank"] for r in ranks] == [0, 1]


def test_lora_targeting_w1_w3_of_a_converted_model_warns_that_gate_up_is_the_parameter():
    """A converted block's gated pair is one parameter, gate_up: the plain experts' targets experts.w1 and
    experts.w3 match nothing (PEFT adapts only experts.w2 and says nothing), so the first call warns, naming the
    target that works; with gate_up targeted no such warning."""
    ids = batches(1, seed=3)[0]
    for targets, warns in ((EXPERT_TARGETS, True), (CONVERTED_TARGETS, False)):
        model = lora(fh.convert(tiny_model("mixtral"), group="single"), targets, random_b=True)
        adapted = {m.parameter_name for m in model.modules() if isinstance(m, peft.tuners.lora.layer.ParamWrapper)}
        assert adapted == ({"w2"} if warns else {"gate_up", "w2"})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(ids)
        messages = [str(w.message) for w in caught if "target 'experts.gate_up'" in str(w.message)]
        assert bool(messages) == warns, messages
