"""The routing options of today's open MoE families, checked in one place.

Which layer options reproduce which family's MoE block (Hugging Face ``transformers`` 5.x, tested in
tests/test_hf_parity.py):

* Mixtral, Qwen3-MoE, OLMoE: ``score_func="softmax"``, ``normalize_weights`` = the config's
  ``norm_topk_prob`` (Mixtral: True), ``glu=True, activation="silu", bias=False``.
* Qwen2-MoE: the same plus ``shared_experts=1, shared_hidden_dim=..., shared_gate=True``.
* DeepSeek-V3 (GLM-4.5, Kimi-K2): ``score_func="sigmoid"``, ``num_expert_groups`` / ``num_limited_groups``
  (``n_group`` / ``topk_group``), ``balance="bias"`` (``e_score_correction_bias``; ``bias_update_rate=0`` keeps
  a loaded bias fixed), ``route_scale`` (``routed_scaling_factor``), ``shared_experts`` with
  ``shared_hidden_dim``.
* GPT-OSS: ``router_bias=True``, softmax renormalised over the k (= softmax of the k selected logits),
  ``glu_limit`` with ``activation=lambda g: g * sigmoid(1.702 * g)``.
* Switch Transformer: ``k=1``, ``capacity=...``, ``capacity_per="sequence"``, ``router_bias``.
* Balance losses: ``aux_loss_type="switch"`` (default, 1st choice), ``"all_choices"`` (HF's Mixtral-family
  ``load_balancing_loss_func``), ``"sequence"`` (DeepSeek-V3's sequence-wise loss; HF's Switch loss at k=1).
"""

from __future__ import annotations

import math

from torch import Tensor

from flexmoe.routing.capacity import CAPACITY_PER
from flexmoe.routing.losses import AUX_LOSS_TYPES
from flexmoe.routing.scores import SCORE_FUNCS, check_group_options
from flexmoe.validation import constant_float

__all__ = ["check_family_options", "num_sequences_of"]


def check_family_options(
    *,
    router: object,
    k: int,
    score_func: object,
    num_expert_groups: object,
    num_limited_groups: object,
    route_scale: object,
    router_bias: object,
    capacity_per: object,
    aux_loss_type: object,
    cross_node_share: object,
) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the argument for a family option out of range or unfit."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
    check_group_options(None, k, num_expert_groups, num_limited_groups)  # the layer checks them against E
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)):
        raise TypeError(f"route_scale must be a number, got {type(route_scale).__name__}")
    route_scale = constant_float(route_scale)
    if not (math.isfinite(route_scale) and route_scale > 0):
        raise ValueError(f"route_scale must be finite and > 0, got {route_scale}")
    if not isinstance(router_bias, bool):
        raise TypeError(f"router_bias must be a bool, got {type(router_bias).__name__}")
    if capacity_per not in CAPACITY_PER:
        raise ValueError(f"capacity_per must be 'call' or 'sequence', got {capacity_per!r}")
    if aux_loss_type not in AUX_LOSS_TYPES:
        raise ValueError(f"aux_loss_type must be one of {list(AUX_LOSS_TYPES)}, got {aux_loss_type!r}")
    if router_bias and router not in ("topk", "expert_choice", "base"):
        raise ValueError(f"router_bias needs the linear gate (router 'topk', 'expert_choice' or 'base'), "
                         f"got router={router!r}")
    if router in ("expert_choice", "base"):
        # These pick experts from softmax probabilities by their own rules, without per-token choices to
        # group, rescale, count per sequence or balance by loss.
        changed = {"score_func": score_func != "softmax", "num_expert_groups": num_expert_groups is not None,
                   "route_scale": route_scale != 1.0, "capacity_per": capacity_per != "call",
                   "aux_loss_type": aux_loss_type != "switch"}
        for name, on in changed.items():
            if on:
                raise ValueError(f"{name} needs a top-k router, got router={router!r}")
    if num_expert_groups is not None and cross_node_share is not None:
        raise ValueError("cross_node_share cannot be combined with num_expert_groups: the topology gate's "
                         "re-routing would ignore the group limit")


def num_sequences_of(x: Tensor, model_dim: int, capacity_per: str, aux_loss_type: str) -> int | None:
    """B for an input ``[B, S, model_dim]`` when ``capacity_per="sequence"`` or ``aux_loss_type="sequence"``
    need it, else None. Raises ``ValueError`` for another shape."""
    if capacity_per != "sequence" and aux_loss_type != "sequence":
        return None
    if x.dim() != 3:
        option = "capacity_per='sequence'" if capacity_per == "sequence" else "aux_loss_type='sequence'"
        raise ValueError(f"{option} needs x of shape [batch, seq, model_dim={model_dim}], got {tuple(x.shape)}")
    return int(x.shape[0])
