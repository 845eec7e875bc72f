"""The small Hugging Face model configurations ``flexmoe train --hf-arch NAME`` trains.

One per family, each a few layers of width 64 with 8 experts (top-2) over the byte vocabulary (256), sized like
the default MoE GPT so that a run takes minutes on 2 CPU cores. They are keyword arguments of the family's
``transformers`` configuration class (``AutoConfig.for_model(NAME, **keywords)``); everything not given keeps
that class's default. Every family that has HF's auxiliary balance loss computes it
(``output_router_logits=True``) with ``router_aux_loss_coef=0.01``; DeepSeek-V3 balances with its bias instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HF_ARCHS", "NOT_OFFERED", "small_config_keywords", "small_config"]

# What every family shares: the byte vocabulary, 4 layers of width 64, 4 query heads over 2 key/value heads.
# The special tokens are bytes too (HF's defaults point past a 256-token vocabulary); the embeddings are untied
# so that every parameter is its own tensor in a checkpoint.
_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
_AUX_LOSS: dict[str, Any] = dict(output_router_logits=True, router_aux_loss_coef=0.01)

_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, **_AUX_LOSS),
    "qwen2_moe": dict(intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **_AUX_LOSS),
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                      head_dim=16, norm_topk_prob=True, **_AUX_LOSS),
    "olmoe": dict(intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **_AUX_LOSS),
    # 8 routed experts in 4 groups, each token's experts from its best 2 groups; one shared expert; the
    # multi-head latent attention at small ranks, one key/value head per query head as DeepSeek-V3's own config
    # has (transformers' compiled SDPA path repeats MLA's keys by heads / kv heads: with 2 it got 8 for 4 queries);
    # plain rotary embeddings (the default config asks for YaRN).
    "deepseek_v3": dict(num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
                        num_experts_per_tok=2,
                        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                        routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                    sliding_window=64, **_AUX_LOSS),
}

HF_ARCHS: tuple[str, ...] = tuple(_FAMILIES)

# Families flexmoe.hf converts that the job does not train, and why.
NOT_OFFERED: dict[str, str] = {
    "switch_transformers": "Switch Transformers is an encoder-decoder (its loss needs decoder inputs and labels "
                           "apart from the encoder's), and the job trains causal LMs on one token stream; "
                           "flexmoe.hf.convert converts it for a loop of your own",
}


def small_config_keywords(arch: str) -> dict[str, Any]:
    """The configuration keywords of family ``arch`` (one of :data:`HF_ARCHS`)."""
    if arch not in _FAMILIES:
        raise ValueError(f"arch must be one of {', '.join(HF_ARCHS)}, got {arch!r}")
    return {**_COMMON, **_FAMILIES[arch]}


def small_config(arch: str) -> Any:
    """The ``transformers`` configuration object of family ``arch`` (needs ``transformers``)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, **small_config_keywords(arch))
