"""The Hugging Face MoE blocks the ``--hf`` bench times (:mod:`flexmoe.apps.bench.hf`): the families and shapes,
each family's block built from a ``transformers`` config (nothing is downloaded) with its weights drawn under a
seed, the switch between HF's experts implementations, and the check that two cases compute the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.apps.bench.config import LayerSizes
from flexmoe.layer import MoELayer

__all__ = ["FAMILY_NAMES", "BUILT_IN", "HFShape", "SHAPES", "shapes_of", "hf_config", "fill_weights",
           "build_hf_block", "set_experts_implementation", "converted_layer", "block_output", "assert_same"]

FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
BUILT_IN = ("eager", "grouped_mm", "batched_mm")  # HF's experts implementations that run on any device


@dataclass(frozen=True, kw_only=True)
class HFShape(LayerSizes):
    """One block shape, named: T tokens (one sequence), model dim M, E routed experts of hidden size H, top-k (by
    default a fine-grained block: E=64 of H=256, k=8). ``groups`` / ``limited_groups``: DeepSeek-V3's ``n_group``
    / ``topk_group`` (1 / 1: no group limit). The name is the one positional argument."""

    name: str = field(kw_only=False)
    experts: int = 64
    k: int = 8
    hidden_dim: int = 256
    groups: int = 1
    limited_groups: int = 1

    def describe(self) -> str:
        groups = f" {self.groups} groups (best {self.limited_groups})" if self.groups > 1 else ""
        return (f"T={self.tokens} M={self.model_dim} E={self.experts} k={self.k} H={self.hidden_dim}{groups}")


SHAPES: dict[str, HFShape] = {
    "fine": HFShape("fine"),
    "coarse": HFShape("coarse", experts=8, k=2, hidden_dim=1024),
    "deepseek": HFShape("deepseek", groups=8, limited_groups=4),
}


def shapes_of(family: str) -> list[str]:
    """The shapes a family is measured at: the DeepSeek-like one is DeepSeek-V3's routing, so that family only."""
    return ["fine", "coarse", "deepseek"] if family == "deepseek_v3" else ["fine", "coarse"]



def hf_config(family: str, shape: HFShape, **extra: Any) -> Any:
    """The transformers config of ``family`` with the MoE sizes of ``shape`` (``extra``: more config fields)."""
    M, E, k, H = shape.model_dim, shape.experts, shape.k, shape.hidden_dim
    common = dict(hidden_size=M, num_experts_per_tok=k, hidden_act="silu", **extra)
    if family == "mixtral":
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=H, num_local_experts=E, **common)
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(moe_intermediate_size=H, shared_expert_intermediate_size=H, num_experts=E,
                              norm_topk_prob=False, **common)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(moe_intermediate_size=H, num_experts=E, norm_topk_prob=True, **common)
    if family == "olmoe":
        from transformers import OlmoeConfig
        return OlmoeConfig(intermediate_size=H, num_experts=E, norm_topk_prob=False, **common)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        return DeepseekV3Config(moe_intermediate_size=H, n_routed_experts=E, n_group=shape.groups,
                                topk_group=shape.limited_groups, n_shared_experts=1, norm_topk_prob=True,
                                routed_scaling_factor=2.5, **common)
    if family == "gpt_oss":
        from transformers import GptOssConfig
        common.pop("hidden_act")
        return GptOssConfig(intermediate_size=H, num_local_experts=E, **common)
    raise ValueError(f"family must be one of {list(FAMILY_NAMES)}, got {family!r}")


def _block_class(family: str) -> type[nn.Module]:
    import transformers.models as m
    return {"mixtral": m.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
            "qwen2_moe": m.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
            "qwen3_moe": m.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
            "olmoe": m.olmoe.modeling_olmoe.OlmoeSparseMoeBlock,
            "deepseek_v3": m.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
            "gpt_oss": m.gpt_oss.modeling_gpt_oss.GptOssMLP}[family]


def fill_weights(module: nn.Module, seed: int) -> None:
    """Draw every parameter under ``seed`` (HF leaves a block built from a config uninitialised): matrices
    N(0, 1/last dim), so that activations stay O(1) and the router's logits spread; vectors N(0, 0.1^2).
    DeepSeek-V3's ``e_score_correction_bias`` buffers too, so that the selection bias changes some choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            std = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in sorted(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def build_hf_block(family: str, shape: HFShape, seed: int = 0) -> nn.Module:
    """``family``'s sparse-MoE block at ``shape``, weights filled under ``seed``, in training mode."""
    block = _block_class(family)(hf_config(family, shape))
    fill_weights(block, seed)
    return block.train()


def set_experts_implementation(block: nn.Module, name: str) -> nn.Module:
    """Make ``block``'s experts run HF's experts implementation ``name`` (the experts read their config's
    ``_experts_implementation`` at every call; a standalone block has no model to ``set_experts_implementation``
    on). Returns ``block``."""
    experts: Any = block.experts
    experts.config._experts_implementation = name
    return block


def converted_layer(block: nn.Module) -> MoELayer:
    """The :class:`~flexmoe.MoELayer` inside a block :func:`flexmoe.hf.convert` returned."""
    moe = getattr(block, "moe", None)
    if not isinstance(moe, MoELayer):
        raise TypeError(f"expected a converted block holding an MoELayer, got {type(block).__name__}")
    return moe


def block_output(out: Tensor | tuple[Tensor, ...]) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # GPT-OSS's block returns (hidden_states, router_scores)


def assert_same(name: str, got: Tensor, want: Tensor, what: str) -> None:
    """Equal to float32 rounding: within 1e-4 relative, or 1e-4 of the largest element."""
    scale = float(want.detach().abs().max())
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
    except AssertionError as exc:
        raise RuntimeError(f"{name} computed another {what} than HF eager, so its timing would mean nothing: "
                           f"{str(exc).splitlines()[0:3]}") from None
