"""flexmoe.hf against Hugging Face ``transformers`` itself: HF's own eager model is the reference.

Each family's tiny causal LM (2 layers, M=16, built from a local config, nothing downloaded) is converted with
:func:`flexmoe.hf.convert`, and must give HF's logits, loss and auxiliary loss, the same 20 SGD steps, the same
greedy tokens through ``generate()``, and, after :func:`flexmoe.hf.to_hf`, the same continued training and a
``save_pretrained`` directory plain ``from_pretrained`` loads. The ``"flexmoe"`` experts implementation
(:func:`flexmoe.hf.register`) must give HF eager's logits and gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from flexmoe import MoELayer  # noqa: E402
from flexmoe.hf.block import ConvertedMoeBlock  # noqa: E402

V = 64  # vocabulary
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "deepseek_v2"]
COMMON = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None,
              pad_token_id=None, bos_token_id=None, router_aux_loss_coef=0.1)
SIGMOID_GROUPED = dict(intermediate_size=20, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
                       n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                       first_k_dense_replace=1)
FAMILY_CONFIGS: dict[str, dict] = {
    "mixtral": dict(intermediate_size=12, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(intermediate_size=20, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    "qwen3_moe": dict(intermediate_size=20, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, head_dim=8),
    "olmoe": dict(intermediate_size=12, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    # Group-limited routing (4 groups of 2, the best 2 eligible) and a dense first layer beside the MoE one.
    "deepseek_v3": dict(SIGMOID_GROUPED, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, head_dim=4),
    "glm4_moe": dict(SIGMOID_GROUPED, head_dim=8),
    "deepseek_v2": dict(intermediate_size=20, moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, routed_scaling_factor=2.5, topk_method="greedy", first_k_dense_replace=1,
                        q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        head_dim=4),
    "gpt_oss": dict(intermediate_size=12, num_local_experts=4, num_experts_per_tok=2, head_dim=8, swiglu_limit=0.8,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_model(family: str, seed: int = 0, **overrides: object) -> nn.Module:
    """HF's causal LM of ``family`` from a tiny config (``overrides`` replace its keywords), HF's own
    initialisation under ``seed`` (std 0.2, so that routing is far from ties); DeepSeek-style models get a nonzero
    ``e_score_correction_bias``."""
    config = transformers.AutoConfig.for_model(family, **{**COMMON, **FAMILY_CONFIGS[family], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape, generator=g)
                                                     * 0.3)
    return model


def batches(n: int, seed: int = 3, batch: int = 2, seq: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (batch, seq), generator=g) for _ in range(n)]


def train(model: nn.Module, data: list[torch.Tensor], lr: float = 0.05) -> list[float]:
    """SGD steps on the LM loss plus HF's auxiliary loss (``output_router_logits=True``); the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    model.train()
    for ids in data:
        out = model(ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses


def moe_blocks(model: nn.Module) -> list[ConvertedMoeBlock]:
    return [m for m in model.modules() if isinstance(m, ConvertedMoeBlock)]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


# ---------------------------------------------------------------------------------------- forward parity


@pytest.mark.parametrize("family", FAMILIES + ["glm4_moe"])
def test_converted_model_computes_hf_logits_loss_and_aux_loss(family):
    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    assert model.__class__ is ref.__class__
    blocks = moe_blocks(model)
    dense_first = family in ("deepseek_v3", "glm4_moe", "deepseek_v2")
    assert len(blocks) == (1 if dense_first else 2)
    assert all(isinstance(b.moe, MoELayer) for b in blocks)
    if dense_first:
        assert not isinstance(model.model.layers[0].mlp, ConvertedMoeBlock)
    ids = batches(1)[0]
    expected = ref(ids, labels=ids, output_router_logits=True)
    got = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(got.logits, expected.logits, **TOL)
    torch.testing.assert_close(got.loss, expected.loss, **TOL)
    # HF's recorders still see the router logits: one [T, E] per MoE layer, equal to HF's.
    assert len(got.router_logits) == len(expected.router_logits) == len(blocks)
    for a, b in zip(got.router_logits, expected.router_logits):
        torch.testing.assert_close(a, b, **TOL)
    if expected.aux_loss is not None:
        assert float(expected.aux_loss.detach()) > 0
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, **TOL)


def test_deepseek_v3_correction_bias_is_carried_and_steers_routing():
    ref = tiny_model("deepseek_v3").eval()
    gate = ref.model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias.clone()
    model = fh.convert(copy.deepcopy(ref), group="single")
    (block,) = moe_blocks(model)
    assert block.moe.balance == "bias" and block.moe.bias_update_rate == 0.0
    assert torch.equal(block.moe.expert_bias, bias)
    assert block.moe.num_expert_groups == 4 and block.moe.num_limited_groups == 2
    ids = batches(1)[0]
    with torch.no_grad():
        logits = model(ids).logits
        choices = block.moe.last_plan.expert_index.clone()
        # The bias changes some tokens' experts, so this family's test exercises it.
        block.moe.expert_bias.zero_()
        model(ids)
        assert not torch.equal(choices, block.moe.last_plan.expert_index)
        # A changed bias goes back into HF's buffer.
        block.moe.expert_bias.copy_(bias * 2)
    fh.to_hf(model)
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias * 2)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
        torch.testing.assert_close(model(ids).logits, logits, **TOL)


def test_single_block_converts_and_comes_back():
    ref = tiny_model("qwen2_moe").eval()
    block = copy.deepcopy(ref.model.layers[0].mlp)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = block(x)
    converted = fh.convert(block, group="single")
    assert isinstance(converted, ConvertedMoeBlock) and converted.family == "qwen2_moe"
    with torch.no_grad():
        torch.testing.assert_close(converted(x), expected, **TOL)
    back = fh.to_hf(converted)
    assert type(back).__name__ == "Qwen2MoeSparseMoeBlock"
    with torch.no_grad():
        torch.testing.assert_close(back(x), expected, rtol=0, atol=0)


def test_converted_blocks_take_the_models_mode_and_give_it_back():
    """A model in eval (as from_pretrained returns it) converts into blocks in eval: Mixtral's router jitter
    (training only) stays off, so the logits are HF's eval logits; the mode set on the converted model is the one
    to_hf's blocks come back in."""
    ref = tiny_model("mixtral", router_jitter_noise=0.5).eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    assert [m.training for m in model.modules()] == [False] * len(list(model.modules()))
    ids = batches(1, seed=6)[0]
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(model(ids).logits, expected, **TOL)
        torch.testing.assert_close(model(ids).logits, expected, **TOL)
    model.train()
    fh.to_hf(model)
    assert all(m.training for m in model.modules())
    trained_mode = fh.convert(tiny_model("mixtral").train(), group="single")
    assert all(m.training for m in moe_blocks(trained_mode)[0].modules())


def test_gpt_oss_decoding_call_returns_hf_router_scores_without_a_plan(monkeypatch):
    """GPT-OSS's block returns ``(hidden_states, router_scores)``: an eval no-grad call returns HF's output and
    scores, on the plan-free decoding path (the loop kernel: auto takes the read-free path at 4 experts) without
    building the plan the call leaves for later, and on the default choice."""
    import flexmoe.decoding
    import flexmoe.layer

    block = tiny_model("gpt_oss").eval().model.layers[0].mlp
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(2))
    builds = []
    for module in (flexmoe.layer, flexmoe.decoding):
        real = module.build_plan
        monkeypatch.setattr(module, "build_plan", lambda *a, real=real, **kw: builds.append(1) or real(*a, **kw))
    with torch.no_grad():
        expected = block(x)
        for kernel in ("loop", "auto"):
            converted = fh.convert(copy.deepcopy(block), group="single", expert_kernel=kernel)
            builds.clear()
            out, scores = converted(x)
            assert builds == ([] if kernel == "loop" else [1]), kernel
            torch.testing.assert_close(out, expected[0], **TOL)
            torch.testing.assert_close(scores, expected[1], **TOL)


def test_gpt_oss_picks_hf_routers_experts_where_their_scores_underflow_to_equal() -> None:
    """HF's GPT-OSS router takes the top-k of the logits: where the softmax of distinct logits underflows to equal
    zeros, the converted block still picks HF's experts (``select_by="logits"``), on every path, and returns HF's
    output and router scores."""
    from flexmoe.apps.bench.hf_blocks import converted_layer

    block = tiny_model("gpt_oss").model.layers[0].mlp
    with torch.no_grad():
        block.router.weight.zero_()
        block.router.bias.copy_(torch.tensor([0.0, -200.0, -400.0, -300.0]))  # softmax: [1, 0, 0, 0]
    x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_indices = block.router(x.reshape(-1, 16))[2]
        expected = block(x)
    assert hf_indices.tolist() == [[0, 1]] * 5
    for kernel in ("loop", "auto", "grouped_mm"):
        for grad in (False, True):
            converted = fh.convert(copy.deepcopy(block), group="single", expert_kernel=kernel)
            with torch.set_grad_enabled(grad):
                out, scores = converted(x)
            assert converted_layer(converted).last_plan.expert_index.tolist() == hf_indices.tolist(), (kernel, grad)
            torch.testing.assert_close(out, expected[0], **TOL)
            torch.testing.assert_close(scores, expected[1], **TOL)


# ------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("family", FAMILIES)
def test_training_matches_hf_before_and_after_to_hf(family):
    ref = tiny_model(family)
    model = fh.convert(copy.deepcopy(ref), group="single")
    data = batches(23, seed=5)
    # 20 steps from the same weights and batches: the same losses as HF's eager model.
    torch.testing.assert_close(train(model, data[:20]), train(ref, data[:20]), rtol=1e-4, atol=1e-5)
    # Exported back, the model continues exactly as HF's own.
    fh.to_hf(model)
    assert not moe_blocks(model)
    torch.testing.assert_close(train(model, data[20:]), train(ref, data[20:]), rtol=1e-4, atol=1e-5)
    ref_state = ref.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_save_pretrained(family, tmp_path):
    model = fh.convert(tiny_model(family), group="single")
    train(model, batches(3, seed=7))
    ids = batches(1, seed=8)[0]
    model.eval()
    with torch.no_grad():
        trained = model(ids).logits
    fh.to_hf(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not moe_blocks(loaded)
    exported = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained, **TOL)
    # The same checkpoint loaded straight onto flexmoe's experts implementation.
    fh.register()
    on_flexmoe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="flexmoe").eval()
    assert on_flexmoe.config._experts_implementation == "flexmoe"
    with torch.no_grad():
        torch.testing.assert_close(on_flexmoe(ids).logits, trained, **TOL)


# ------------------------------------------------------------------------------------------ generation


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_kv_cache_gives_hf_tokens(family):
    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    prompt = batches(1, seed=9, batch=1, seq=5)[0]
    kwargs = dict(max_new_tokens=6, do_sample=False, use_cache=True, attention_mask=torch.ones_like(prompt))
    expected = ref.generate(prompt, **kwargs)
    assert expected.shape == (1, 11)
    assert torch.equal(model.generate(prompt, **kwargs), expected)


# ----------------------------------------------------------------------------- experts implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_flexmoe_experts_implementation_gives_eager_logits_and_gradients(family):
    fh.register()
    fh.register()  # idempotent
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    model.set_experts_implementation("flexmoe")
    assert model.config._experts_implementation == "flexmoe"
    ids = batches(1, seed=11)[0]
    expected = ref(ids, labels=ids, output_router_logits=True)
    got = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(got.logits, expected.logits, **TOL)
    expected.loss.backward()
    got.loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        if ref_grads[name] is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-5 * float(ref_grads[name].abs().max()),
                                   msg=name)
    assert any("experts" in name and p.grad is not None for name, p in model.named_parameters())


def test_flexmoe_experts_forward_skips_hf_expert_parallel_sentinels_and_checks_indices():
    """HF's own expert parallelism marks pairs of other ranks' experts with index E; they contribute nothing.
    Reference: a dense loop over tokens and choices on the module's weights."""
    from flexmoe.hf.experts_impl import flexmoe_experts_forward

    experts = tiny_model("mixtral").model.layers[0].mlp.experts  # E=4, gate_up_proj [4, 24, 16]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g)
    index = torch.tensor([[0, 4], [1, 2], [4, 4], [3, 0], [2, 1]])
    weight = torch.rand(5, 2, generator=g)
    experts._is_expert_parallel = True
    got = flexmoe_experts_forward(experts, x, index, weight)
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(index[t, j])
            if e == 4:
                continue
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weight[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], torch.zeros(16))
    experts._is_expert_parallel = False
    with pytest.raises(ValueError, match="expert_index must lie in"):
        flexmoe_experts_forward(experts, x, index, weight)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_flexmoe_experts_forward_decoding_call_matches_a_dense_loop(family):
    """A no-grad call of a few pairs (rows ordered on the host, no plan): HF eager's experts on the same choices,
    token by token, are the reference; an index outside [0, E) is still refused."""
    from flexmoe.hf.experts_impl import flexmoe_experts_forward

    model = tiny_model(family)
    experts = model.model.layers[0].mlp.experts
    eager = copy.deepcopy(experts)
    eager.config._experts_implementation = "eager"
    num_experts = experts.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 3):
        x = torch.randn(tokens, experts.gate_up_proj.shape[1 if family == "gpt_oss" else 2], generator=g)
        index = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(tokens)])
        weight = torch.rand(tokens, 2, generator=g)
        with torch.no_grad():
            got = flexmoe_experts_forward(experts, x, index, weight)
            want = torch.stack([eager(x[t : t + 1], index[t : t + 1], weight[t : t + 1])[0] for t in range(tokens)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), pytest.raises(ValueError, match="expert_index must lie in"):
        flexmoe_experts_forward(experts, x, torch.full_like(index, num_experts), weight)


def test_flexmoe_experts_implementation_refuses_a_unit_it_does_not_know():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_post_expert_norm=True)
    class NormedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.randn(4, 8, 6))
            self.down_proj = nn.Parameter(torch.randn(4, 6, 4))
            self.act_fn = nn.SiLU()

    fh.register()
    config = transformers.PretrainedConfig()
    config._experts_implementation = "flexmoe"
    experts = NormedExperts(config)
    index = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="NormedExperts.*has_post_expert_norm"):
        experts(torch.randn(2, 6), index, torch.full((2, 2), 0.5))


# --------------------------------------------------------------------------------------------- errors


def test_unsupported_blocks_and_models_are_named():
    class OddMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    with pytest.raises(ValueError, match="OddMoeBlock"):
        fh.convert(nn.Sequential(nn.Linear(4, 4), OddMoeBlock()))
    with pytest.raises(ValueError, match="Sequential.*contains none"):
        fh.convert(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="Linear is not a supported"):
        fh.convert(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no flexmoe block"):
        fh.to_hf(nn.Sequential(nn.Linear(4, 4)))
    converted = fh.convert(tiny_model("olmoe"), group="single")
    with pytest.raises(ValueError, match="converted already"):
        fh.convert(converted)
    for not_a_model in ("mixtral", None):  # a model id, not a model: named, not an AttributeError deep inside
        with pytest.raises(TypeError, match=f"model must be an nn.Module .*got {type(not_a_model).__name__}"):
            fh.convert(not_a_model)
        with pytest.raises(TypeError, match=f"model must be an nn.Module .*got {type(not_a_model).__name__}"):
            fh.to_hf(not_a_model)


def test_bad_options_are_named_and_leave_the_model_untouched():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="capacity_factr"):
        fh.convert(model, capacity_factr=1.0)
    with pytest.raises(ValueError, match=r"\['activation'\].*family"):
        fh.convert(model, activation="relu")
    with pytest.raises((ValueError, TypeError), match="capacity_factor"):
        fh.convert(model, capacity_factor="big")
    with pytest.raises(TypeError, match="group must be a process group, None or 'single', got int"):
        fh.convert(model, group=2)  # not "torch.distributed is not initialized", which would hide the mistake
    assert not moe_blocks(model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_deepseek_v2_group_limited_greedy_is_refused():
    model = tiny_model("deepseek_v2")
    model.model.layers[1].mlp.gate.topk_method = "group_limited_greedy"
    with pytest.raises(ValueError, match="DeepseekV2Moe.*group_limited_greedy"):
        fh.convert(model)


def test_a_capacity_drops_tokens_as_documented():
    ref = tiny_model("mixtral").eval()
    model = fh.convert(copy.deepcopy(ref), group="single", capacity_factor=0.5)
    ids = batches(1)[0]
    with torch.no_grad():
        got = model(ids).logits
        expected = ref(ids).logits
    assert all(b.moe.last_plan.num_dropped > 0 for b in moe_blocks(model))
    assert not torch.allclose(got, expected, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
def test_two_ranks_keep_their_own_experts_and_to_hf_gathers_them():
    from hf_ep_worker import rank_main
    from multiproc import check_ranks_pass

    check_ranks_pass(2, rank_main, [["mixtral", "deepseek_v3", "gpt_oss"]],
                     what="flexmoe.hf with 2 expert-parallel ranks")


def qwen3_next_block() -> nn.Module:
    """Qwen3-Next's MoE block alone (its whole model needs its linear-attention kernels), 8 experts, weights
    N(0, 0.25) under a seed."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = Qwen3NextConfig(hidden_size=16, moe_intermediate_size=12, shared_expert_intermediate_size=20,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3NextSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


def test_qwen3_next_block_converts():
    """Qwen3-Next's MoE block is Qwen2-MoE's shape."""
    block = qwen3_next_block()
    converted = fh.convert(copy.deepcopy(block), group="single")
    assert converted.family == "qwen3_next" and converted.moe.num_shared_experts == 1
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True) for _ in range(2)]
    expected, got = block(xs[0]), converted(xs[1])
    torch.testing.assert_close(got, expected, **TOL)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, **TOL)


# ------------------------------------------------------------------------------------------- autocast

BF16_TOL = dict(rtol=2e-2, atol=2e-2)  # a few bf16 roundings of O(1) values


@pytest.mark.parametrize("family", FAMILIES + ["glm4_moe"])
def test_autocast_bf16_routes_as_hf(family):
    """Under ``torch.autocast(bfloat16)`` HF's router makes bf16 logits (DeepSeek's explicit float32 casts
    included: autocast recasts its linear map), which tie and round as float32 ones do not. Each MoE block, fed
    the input HF's own block saw, must choose HF's experts for every token (HF's router output is the reference)
    and give its output to bf16 rounding; the model's logits too. An explicit ``router_dtype=torch.float32``
    routes in float32 instead: the choices then follow float32 logits."""
    from flexmoe.hf.families import family_of

    ref = tiny_model(family).eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    hf_blocks = [m for m in ref.modules() if family_of(m) is not None]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (input, output, HF's choices) per block
    for block in hf_blocks:
        router = getattr(block, family_of(block).router)
        choices: list[torch.Tensor] = []
        router.register_forward_hook(lambda m, args, out, into=choices: into.append(out[2]))
        block.register_forward_hook(
            lambda m, args, out, into=choices: seen.append((args[0], out[0] if isinstance(out, tuple) else out,
                                                            into[-1])))
    ids = batches(1, seed=13, batch=8, seq=64)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref(ids)
        assert all(c.dtype == torch.int64 for _, _, c in seen) and len(seen) == len(moe_blocks(model))
        for block, (x, out_hf, chosen_hf) in zip(moe_blocks(model), seen):
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            ours = block.moe.last_plan.expert_index
            assert torch.equal(ours.sort(dim=-1).values, chosen_hf.sort(dim=-1).values), \
                f"{int((ours.sort(-1).values != chosen_hf.sort(-1).values).any(-1).sum())} tokens differ"
            torch.testing.assert_close(out.float(), out_hf.float(), **BF16_TOL)
        small = batches(1, seed=14)[0]
        torch.testing.assert_close(model(small).logits.float(), ref(small).logits.float(), **BF16_TOL)
    # The option still chooses float32 routing: HF's router then runs outside autocast, making float32 logits.
    in_float32 = fh.convert(copy.deepcopy(ref), group="single", router_dtype=torch.float32)
    logits_dtypes: list[torch.dtype] = []
    for block in (moe_blocks(model)[0], moe_blocks(in_float32)[0]):
        block.moe.router.hf_router.register_forward_hook(lambda m, args, out: logits_dtypes.append(out[0].dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            block(seen[0][0])
    assert logits_dtypes == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_autocast_experts_compute_in_hf_implementations_dtype(implementation):
    """Under autocast HF's experts compute in the dtype their implementation does: ``grouped_mm`` (the default)
    in the weights' dtype (``torch._grouped_mm`` is no autocast op, its input is cast to the weights'),
    ``batched_mm`` in bf16. The converted model's experts follow (``experts_autocast``), whatever the kernel: its
    logits are HF's, where bf16 against float32 experts had flipped a bf16 routing tie downstream (max 0.46)."""
    ref = tiny_model("olmoe").eval()
    ref.set_experts_implementation(implementation)
    small = batches(1, seed=14)[0]
    for kernel in ("loop", "joined_unit"):
        model = fh.convert(copy.deepcopy(ref), group="single", expert_kernel=kernel)
        assert moe_blocks(model)[0].moe.expert_options.experts_autocast == (implementation != "grouped_mm")
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.testing.assert_close(model(small).logits.float(), ref(small).logits.float(), rtol=1e-5,
                                       atol=1e-5)


# ---------------------------------------------------------------------------------------------- Switch

SWITCH_CONFIG = dict(vocab_size=V, d_model=16, d_ff=12, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
                     num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4, expert_capacity=3,
                     router_bias=True, router_jitter_noise=0.0, dropout_rate=0.0, router_z_loss_coef=0.1,
                     router_aux_loss_coef=0.1, tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
                     eos_token_id=None, bos_token_id=None)


def tiny_switch(seed: int = 0, **overrides) -> nn.Module:
    """HF's Switch Transformers encoder-decoder from a tiny config (one sparse layer in the encoder and one in
    the decoder, 4 experts, a capacity of 3 tokens per expert and sequence, so that sequences of 12 drop some)."""
    config = transformers.SwitchTransformersConfig(**{**SWITCH_CONFIG, **overrides})
    torch.manual_seed(seed)
    return transformers.SwitchTransformersForConditionalGeneration(config)


def switch_train(model: nn.Module, data: list[torch.Tensor], lr: float = 0.05) -> list[float]:
    """SGD steps on Switch's loss (LM loss plus HF's z-loss and balance loss, ``output_router_logits=True``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    losses = []
    for ids in data:
        out = model(input_ids=ids, labels=ids.flip(-1), output_router_logits=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return losses


def test_switch_converts_with_its_capacity_router_and_losses():
    ref = tiny_switch().eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    blocks = moe_blocks(model)
    assert [b.family for b in blocks] == ["switch_transformers"] * 2
    assert all(b.moe.k == 1 and b.moe.capacity == 3 and b.moe.capacity_per == "sequence" for b in blocks)
    ids = batches(1)[0]
    with torch.no_grad():
        expected = ref(input_ids=ids, labels=ids.flip(-1), output_router_logits=True)
        got = model(input_ids=ids, labels=ids.flip(-1), output_router_logits=True)
    # The capacity drops tokens in both stacks, so the test covers HF's treatment of them (MLP output 0).
    assert all(b.moe.last_plan.num_dropped > 0 for b in blocks)
    torch.testing.assert_close(got.logits, expected.logits, **TOL)
    for name in ("loss", "encoder_z_loss", "encoder_aux_loss", "decoder_z_loss", "decoder_aux_loss"):
        assert float(getattr(expected, name)) > 0, name
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), **TOL, msg=name)
    # HF's recorder still sees its router: the logits [B, S, E] of each sparse layer.
    for name in ("encoder_router_logits", "decoder_router_logits"):
        (a,), (b,) = getattr(got, name), getattr(expected, name)
        assert a.shape == (2, 12, 4)
        torch.testing.assert_close(a, b, **TOL)
    # Under autocast HF's classifier makes bf16 logits whatever its router_dtype; the encoder's sparse block, fed
    # HF's block input, keeps HF's experts and tokens and gives its output to bf16 rounding.
    hf_block, (block, _) = ref.encoder.block[1].layer[1].mlp, blocks
    seen = []
    hf_block.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref(input_ids=ids, labels=ids.flip(-1))
        (x, out_hf), = seen
        kept_hf, _, logits_hf = hf_block.router(x)
        out = block(x)
    assert logits_hf.dtype == torch.bfloat16
    plan = block.moe.last_plan
    kept = torch.zeros_like(kept_hf).view(-1, 4)
    kept[plan.row_token, plan.row_expert] = 1
    assert torch.equal(kept, kept_hf.view(-1, 4))
    torch.testing.assert_close(out, out_hf, **BF16_TOL)


@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_switch_trains_as_hf_and_goes_back_with_its_weights(jitter):
    """Training steps equal HF's; with jitter too, as HF's router module draws its own noise (in place on the
    MLP's input, so HF's experts see it as well) from the same generator state."""
    ref = tiny_switch(seed=1, router_jitter_noise=jitter)
    model = fh.convert(copy.deepcopy(ref), group="single")
    data = batches(9, seed=4)
    torch.manual_seed(5)
    ours = switch_train(model, data[:6])
    torch.manual_seed(5)
    torch.testing.assert_close(ours, switch_train(ref, data[:6]), rtol=1e-4, atol=1e-5)
    fh.to_hf(model)
    assert not moe_blocks(model)
    assert type(model.encoder.block[1].layer[1].mlp).__name__ == "SwitchTransformersSparseMLP"
    ref_state = ref.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)
    torch.manual_seed(6)
    ours = switch_train(model, data[6:])
    torch.manual_seed(6)
    torch.testing.assert_close(ours, switch_train(ref, data[6:]), rtol=1e-4, atol=1e-5)


def test_switch_generates_hf_tokens():
    ref = tiny_switch(seed=2).eval()
    model = fh.convert(copy.deepcopy(ref), group="single")
    prompt = batches(1, seed=9, batch=2, seq=12)[0]
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    expected = ref.generate(prompt, **kwargs)
    assert expected.shape == (2, 7)
    assert torch.equal(model.generate(prompt, **kwargs), expected)


@pytest.mark.slow
def test_switch_over_two_ranks_keeps_its_own_experts_and_to_hf_gathers_them():
    from hf_ep_worker import switch_rank_main
    from multiproc import check_ranks_pass

    check_ranks_pass(2, switch_rank_main, [], what="Switch over 2 expert-parallel ranks")


def test_switch_expert_dropout_is_refused_in_training():
    model = fh.convert(tiny_switch(dropout_rate=0.1), group="single")
    ids = batches(1)[0]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # evaluation has no dropout
    model.train()
    with pytest.raises(ValueError, match=r"dropout \(p=0.1\).*dropout_rate=0.0"):
        model(input_ids=ids, labels=ids)


def test_qwen3_next_block_routes_as_hf_under_autocast():
    """Qwen3-Next's block under autocast: HF's choices, its output to bf16 rounding."""
    block = qwen3_next_block()
    converted = fh.convert(copy.deepcopy(block), group="single")
    chosen: list[torch.Tensor] = []
    block.gate.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
    x = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = block(x), converted(x)
    ours = converted.moe.last_plan.expert_index
    assert torch.equal(ours.sort(dim=-1).values, chosen[0].sort(dim=-1).values)
    # Sums of O(10) bf16 products: within a few bf16 roundings of the output's scale.
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-2 * scale)


def test_setting_the_experts_implementation_after_conversion_warns_once_and_keeps_flexmoe_experts():
    """model.set_experts_implementation after convert changes the config the converted blocks share with the
    model: they say so in one warning (the blocks read the config at every call, through a shortcut into its
    attributes) and compute as before."""
    import warnings

    model = fh.convert(tiny_model("qwen3_moe")).eval()
    ids = batches(1, seed=3)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing changed yet: no warning
        before = model(ids).logits
    model.set_experts_implementation("batched_mm")
    with pytest.warns(UserWarning, match="experts_implementation='batched_mm' does not apply"):
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)
