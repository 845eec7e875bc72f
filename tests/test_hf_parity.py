"""MoELayer against the Hugging Face ``transformers`` MoE blocks of the open families (issue 12).

Each family's block is built from a tiny config (nothing is downloaded), its uninitialised weights are filled
under a seed, the weights are copied into an :class:`MoELayer` with the family's options written out here
(:mod:`flexmoe.routing.families`; the weights go through flexmoe.hf's mapping, :mod:`flexmoe.hf.families`), and
HF's block is the reference: both run the same float32 input: the expert choices must be identical,
the outputs and every gradient (input, router, experts, shared experts and gate) equal to float32 rounding.
The balance losses are checked against HF's own loss functions.

``python tests/test_hf_parity.py`` prints the largest differences per family.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip(
    "transformers", reason="the HF parity tests need transformers (pip install -e .[hf]; CI installs it via .[test])")

from flexmoe import MoELayer  # noqa: E402
from flexmoe.hf.families import expert_weights, shared_mlp_weights  # noqa: E402

M, H, B, S = 16, 12, 2, 10  # model dim, routed expert hidden, sequences, tokens per sequence
TOL = dict(rtol=2e-5, atol=2e-6)  # for O(1) scalars (the balance losses)


def _close(ours: Tensor, ref: Tensor, name: str) -> None:
    """Equal to float32 rounding: every element within 2e-5 relative, or 1e-5 of the tensor's largest element
    (sums of products of O(1) terms cancel, so a small element carries the rounding of the large ones)."""
    torch.testing.assert_close(ours, ref, rtol=2e-5, atol=1e-5 * float(ref.detach().abs().max()),
                               msg=lambda m: f"{name}: {m}")


def _fill(module: nn.Module, seed: int, std: float = 0.5) -> None:
    """HF leaves a standalone block's weights uninitialised: draw every parameter from N(0, std^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _copy(dst: Tensor, src: Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)


def _load_experts(layer: MoELayer, experts: nn.Module) -> None:
    """HF's fused experts into the layer through flexmoe.hf's weight mapping (views of HF's parameters)."""
    for name, view in expert_weights(experts).items():
        _copy(getattr(layer.experts, name), view)


def _load_shared(layer: MoELayer, mlp: nn.Module) -> None:
    """A gate/up/down ``nn.Linear`` MLP into shared expert 0, through flexmoe.hf's mapping."""
    for name, view in shared_mlp_weights(mlp).items():
        _copy(getattr(layer.shared, name), view)


def _fused_glu_shared_pairs(block, shared_mlp, layer, out_hf, out, gx_hf, gx) -> dict:
    """HF's and our (output, gradient) pairs for a block of fused GLU experts plus one shared GLU expert."""
    ours = _fused_glu_grads(layer)
    return {"output": (out_hf, out), "grad x": (gx_hf, gx),
            "grad router": (block.gate.weight.grad, layer.router.weight.grad),
            "grad gate_up_proj": (block.experts.gate_up_proj.grad, ours["gate_up_proj"]),
            "grad down_proj": (block.experts.down_proj.grad, ours["down_proj"]),
            "grad shared gate_proj": (shared_mlp.gate_proj.weight.grad, layer.shared.w1.grad[0].T),
            "grad shared up_proj": (shared_mlp.up_proj.weight.grad, layer.shared.w3.grad[0].T),
            "grad shared down_proj": (shared_mlp.down_proj.weight.grad, layer.shared.w2.grad[0].T)}


def _fused_glu_grads(layer: MoELayer) -> dict[str, Tensor]:
    """Our experts' gradients in HF's fused layout, to compare with gate_up_proj / down_proj grads."""
    e = layer.experts
    return {"gate_up_proj": torch.cat([e.w1.grad.transpose(1, 2), e.w3.grad.transpose(1, 2)], dim=1),
            "down_proj": e.w2.grad.transpose(1, 2)}


def _run_both(hf_block: nn.Module, layer: MoELayer, seed: int = 7,
              device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run both on the same input ``[B, S, M]`` on ``device`` and backward the same random projection of the
    output. Returns (hf_out, our_out, hf_x_grad, our_x_grad)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, M, generator=g).to(device)
    proj = torch.randn(B, S, M, generator=g).to(device)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out_hf = hf_block(xs[0])
    out_hf = out_hf[0] if isinstance(out_hf, tuple) else out_hf
    out_ours = layer(xs[1])
    (out_hf * proj).sum().backward()
    (out_ours * proj).sum().backward()
    return out_hf, out_ours, xs[0].grad, xs[1].grad


def _hf_choices(router: nn.Module, x: Tensor) -> Tensor:
    """The experts HF's router picks for tokens ``[T, M]``, sorted per token: ``[T, k]``."""
    with torch.no_grad():
        out = router(x)
    return out[2].sort(dim=-1).values


def _diffs(pairs: dict[str, tuple[Tensor, Tensor]]) -> dict[str, float]:
    for name, (a, b) in pairs.items():
        _close(b, a, name)
    return {name: float((a - b).detach().abs().max()) for name, (a, b) in pairs.items()}


def _same_choices(hf_router: nn.Module, layer: MoELayer, device: torch.device | str = "cpu") -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, M, generator=g).view(-1, M).to(device)
    ours = layer.last_plan.expert_index.sort(dim=-1).values
    assert torch.equal(ours, _hf_choices(hf_router, x)), "expert choices differ from HF's"


# --------------------------------------------------------------------------------------- Mixtral family


def _mixtral_like(family: str, k: int, norm: bool, seed: int):
    E = 8
    if family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=M, intermediate_size=H, num_local_experts=E, num_experts_per_tok=k,
                            hidden_act="silu")
        block = MixtralSparseMoeBlock(cfg)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=M, moe_intermediate_size=H, num_experts=E, num_experts_per_tok=k,
                             norm_topk_prob=norm, hidden_act="silu")
        block = Qwen3MoeSparseMoeBlock(cfg)
    else:
        from transformers.models.olmoe.configuration_olmoe import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
        cfg = OlmoeConfig(hidden_size=M, intermediate_size=H, num_experts=E, num_experts_per_tok=k,
                          norm_topk_prob=norm, hidden_act="silu")
        block = OlmoeSparseMoeBlock(cfg)
    _fill(block, seed)
    layer = MoELayer(M, E, H, k=k, capacity_factor=0.0, normalize_weights=norm, glu=True, activation="silu",
                     bias=False, aux_loss_type="all_choices", group="single")
    _copy(layer.router.weight, block.gate.weight)
    _load_experts(layer, block.experts)
    return block, layer


def compare_mixtral_like(family: str, k: int = 2, norm: bool = True,
                         device: torch.device | str = "cpu") -> dict[str, float]:
    """HF's block and the layer, both on ``device``."""
    block, layer = _mixtral_like(family, k, norm, seed=11)
    block, layer = block.to(device), layer.to(device)
    out_hf, out, gx_hf, gx = _run_both(block, layer, device=device)
    _same_choices(block.gate, layer, device)
    ours = _fused_glu_grads(layer)
    return _diffs({"output": (out_hf, out), "grad x": (gx_hf, gx),
                   "grad router": (block.gate.weight.grad, layer.router.weight.grad),
                   "grad gate_up_proj": (block.experts.gate_up_proj.grad, ours["gate_up_proj"]),
                   "grad down_proj": (block.experts.down_proj.grad, ours["down_proj"])})


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", True), ("olmoe", False)])
def test_mixtral_family_matches_hf(family, norm, device):
    compare_mixtral_like(family, k=2, norm=norm, device=device)


def test_all_choices_loss_matches_hf_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    for k in (1, 2, 3):
        block, layer = _mixtral_like("mixtral", k, True, seed=20 + k)
        x = torch.randn(B, S, M, generator=torch.Generator().manual_seed(k))
        layer(x)
        logits = block.gate(x.view(-1, M))[0]
        expected = load_balancing_loss_func((logits.detach(),), num_experts=8, top_k=k)
        torch.testing.assert_close(layer.aux_loss.detach(), expected, **TOL)
    # The default ("switch") counts the 1st choice only: at k=1 both agree, at k=2 they do not.
    assert layer.aux_loss_type == "all_choices"


# -------------------------------------------------------------------------------------------- Qwen2-MoE


def compare_qwen2_moe() -> dict[str, float]:
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    E, k, HS = 8, 2, 20
    cfg = Qwen2MoeConfig(hidden_size=M, moe_intermediate_size=H, shared_expert_intermediate_size=HS, num_experts=E,
                         num_experts_per_tok=k, norm_topk_prob=False, hidden_act="silu")
    block = Qwen2MoeSparseMoeBlock(cfg)
    _fill(block, 12)
    layer = MoELayer(M, E, H, k=k, capacity_factor=0.0, normalize_weights=False, glu=True, activation="silu",
                     bias=False, shared_experts=1, shared_hidden_dim=HS, shared_gate=True, group="single")
    assert tuple(layer.shared_gate.weight.shape) == (1, M)
    _copy(layer.router.weight, block.gate.weight)
    _load_experts(layer, block.experts)
    _load_shared(layer, block.shared_expert)
    _copy(layer.shared_gate.weight, block.shared_expert_gate.weight)
    out_hf, out, gx_hf, gx = _run_both(block, layer)
    _same_choices(block.gate, layer)
    pairs = _fused_glu_shared_pairs(block, block.shared_expert, layer, out_hf, out, gx_hf, gx)
    pairs["grad shared_gate"] = (block.shared_expert_gate.weight.grad, layer.shared_gate.weight.grad)
    return _diffs(pairs)


def test_qwen2_moe_matches_hf():
    compare_qwen2_moe()


# ------------------------------------------------------------------------------------------ DeepSeek-V3


def compare_deepseek_v3() -> dict[str, float]:
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    E, k, groups, limited = 16, 4, 4, 2
    cfg = DeepseekV3Config(hidden_size=M, moe_intermediate_size=H, n_routed_experts=E, num_experts_per_tok=k,
                           n_group=groups, topk_group=limited, n_shared_experts=1, norm_topk_prob=True,
                           routed_scaling_factor=2.5, hidden_act="silu")
    block = DeepseekV3MoE(cfg)
    _fill(block, 13)
    g = torch.Generator().manual_seed(14)
    correction = torch.randn(E, generator=g) * 0.3
    block.gate.e_score_correction_bias.copy_(correction)
    layer = MoELayer(M, E, H, k=k, capacity_factor=0.0, normalize_weights=True, glu=True, activation="silu",
                     bias=False, score_func="sigmoid", num_expert_groups=groups, num_limited_groups=limited,
                     route_scale=2.5, balance="bias", bias_update_rate=0.0, shared_experts=1, shared_hidden_dim=H,
                     group="single")
    _copy(layer.router.weight, block.gate.weight)
    layer.expert_bias.copy_(correction)
    _load_experts(layer, block.experts)
    _load_shared(layer, block.shared_experts)
    out_hf, out, gx_hf, gx = _run_both(block, layer)
    _same_choices(block.gate, layer)
    # The correction bias changes the choice of some tokens (else this case would not test it) ...
    x = torch.randn(B, S, M, generator=torch.Generator().manual_seed(7)).view(-1, M)
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
        unbiased = _hf_choices(block.gate, x)
        block.gate.e_score_correction_bias.copy_(correction)
    assert not torch.equal(unbiased, layer.last_plan.expert_index.sort(dim=-1).values)
    # ... and bias_update_rate=0 kept it as loaded (the layer is in training mode).
    assert layer.training and torch.equal(layer.expert_bias, correction)
    return _diffs(_fused_glu_shared_pairs(block, block.shared_experts, layer, out_hf, out, gx_hf, gx))


def test_deepseek_v3_matches_hf():
    compare_deepseek_v3()


# ---------------------------------------------------------------------------------------------- GPT-OSS


def compare_gpt_oss() -> dict[str, float]:
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    E, k, limit = 8, 2, 0.8
    cfg = GptOssConfig(hidden_size=M, intermediate_size=H, num_local_experts=E, num_experts_per_tok=k,
                       swiglu_limit=limit)
    block = GptOssMLP(cfg)
    _fill(block, 15)
    alpha = cfg.swiglu_alpha
    layer = MoELayer(M, E, H, k=k, capacity_factor=0.0, normalize_weights=True, glu=True, bias=True,
                     activation=lambda g: g * torch.sigmoid(alpha * g), glu_limit=limit, router_bias=True,
                     group="single")
    _copy(layer.router.weight, block.router.weight)
    _copy(layer.router.bias, block.router.bias)
    ex = block.experts
    _load_experts(layer, ex)
    # Both clamps must bite: some gate pre-activations above the limit, some up projections outside [-L, L].
    x = torch.randn(B, S, M, generator=torch.Generator().manual_seed(7)).view(-1, M)
    with torch.no_grad():
        pre = x @ ex.gate_up_proj[0] + ex.gate_up_proj_bias[0]
    assert (pre[:, ::2] > limit).any() and (pre[:, 1::2] < -limit).any() and (pre[:, 1::2] > limit).any()
    out_hf, out, gx_hf, gx = _run_both(block, layer)
    _same_choices(block.router, layer)
    e = layer.experts
    gate_up_grad = torch.stack([e.w1.grad, e.w3.grad], dim=-1).flatten(-2)  # re-interleave gate / up columns
    gate_up_bias_grad = torch.stack([e.b1.grad, e.b3.grad], dim=-1).flatten(-2)
    return _diffs({"output": (out_hf, out), "grad x": (gx_hf, gx),
                   "grad router": (block.router.weight.grad, layer.router.weight.grad),
                   "grad router bias": (block.router.bias.grad, layer.router.bias.grad),
                   "grad gate_up_proj": (ex.gate_up_proj.grad, gate_up_grad),
                   "grad gate_up_proj_bias": (ex.gate_up_proj_bias.grad, gate_up_bias_grad),
                   "grad down_proj": (ex.down_proj.grad, e.w2.grad),
                   "grad down_proj_bias": (ex.down_proj_bias.grad, e.b2.grad)})


def test_gpt_oss_matches_hf():
    compare_gpt_oss()


# ----------------------------------------------------------------------------------------------- Switch


def compare_switch() -> dict[str, float]:
    from transformers.models.switch_transformers.configuration_switch_transformers import SwitchTransformersConfig
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        SwitchTransformersSparseMLP,
        load_balancing_loss_func,
    )
    E, capacity = 4, 3
    cfg = SwitchTransformersConfig(d_model=M, d_ff=H, num_experts=E, expert_capacity=capacity, router_bias=True,
                                   dropout_rate=0.0, dense_act_fn="relu", router_jitter_noise=0.0)
    block = SwitchTransformersSparseMLP(cfg)
    _fill(block, 16)
    layer = MoELayer(M, E, H, k=1, capacity=capacity, capacity_per="sequence", router_bias=True, bias=False,
                     activation="relu", aux_loss_type="sequence", group="single")
    _copy(layer.router.weight, block.router.classifier.weight)
    _copy(layer.router.bias, block.router.classifier.bias)
    for i in range(E):
        _copy(layer.experts.w1[i], block.experts[f"expert_{i}"].wi.weight.T)
        _copy(layer.experts.w2[i], block.experts[f"expert_{i}"].wo.weight.T)
    out_hf, out, gx_hf, gx = _run_both(block, layer)
    # Same expert per token and the same tokens dropped: HF's kept one-hot mask against our kept pairs.
    x = torch.randn(B, S, M, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        kept_hf, _, logits = block.router(x)
    plan = layer.last_plan
    kept_ours = torch.zeros(B * S, E, dtype=kept_hf.dtype)
    kept_ours[plan.row_token, plan.row_expert] = 1
    assert torch.equal(kept_ours, kept_hf.view(-1, E))
    assert torch.equal(plan.expert_index[:, 0], logits.view(-1, E).argmax(-1))
    assert plan.num_dropped > 0, "the capacity must drop tokens for this case to test it"
    # Per sequence, not per call: one capacity over the call would keep other tokens.
    call_cap = MoELayer(M, E, H, k=1, capacity=capacity, router_bias=True, bias=False, group="single")
    call_cap.load_state_dict(layer.state_dict())
    with torch.no_grad():
        call_cap(x)
    assert call_cap.last_plan.num_dropped != plan.num_dropped
    # HF's Switch balance loss (per sequence, then averaged) is our "sequence" loss at k=1.
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(layer.aux_loss.detach(), load_balancing_loss_func(probs, logits.argmax(-1)), **TOL)
    diffs = {"output": (out_hf, out), "grad x": (gx_hf, gx),
             "grad router": (block.router.classifier.weight.grad, layer.router.weight.grad),
             "grad router bias": (block.router.classifier.bias.grad, layer.router.bias.grad)}
    for i in range(E):
        diffs[f"grad wi[{i}]"] = (block.experts[f"expert_{i}"].wi.weight.grad, layer.experts.w1.grad[i].T)
        diffs[f"grad wo[{i}]"] = (block.experts[f"expert_{i}"].wo.weight.grad, layer.experts.w2.grad[i].T)
    return _diffs(diffs)


def test_switch_matches_hf():
    compare_switch()


if __name__ == "__main__":
    results = {"mixtral": compare_mixtral_like("mixtral"), "qwen3_moe": compare_mixtral_like("qwen3_moe"),
               "olmoe": compare_mixtral_like("olmoe", norm=False), "qwen2_moe": compare_qwen2_moe(),
               "deepseek_v3": compare_deepseek_v3(), "gpt_oss": compare_gpt_oss(), "switch": compare_switch()}
    for family, diffs in results.items():
        out = diffs.pop("output")
        print(f"{family:12s} output {out:.2e}  grads (max) {max(diffs.values()):.2e}")
