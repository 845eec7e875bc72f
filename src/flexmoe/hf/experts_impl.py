"""``"flexmoe"`` as a transformers experts implementation (docs/architecture.md, "Hugging Face models
(flexmoe.hf)").

transformers 5.x runs an MoE block's experts through ``ExpertsInterface``: a function
``fn(experts_module, hidden_states [T, M], top_k_index [T, k], top_k_weights [T, k]) -> [T, M]`` picked by
``config._experts_implementation``. :func:`flexmoe_experts_forward` is flexmoe's: HF's router has chosen, flexmoe
builds the plan from those choices (:func:`flexmoe.routing.plan.plan_from_choices`), gathers the rows
(:func:`flexmoe.dispatch`), runs :func:`flexmoe.experts.expert_ffn` on views of the module's own parameters and
combines. No weights are copied, and gradients reach HF's parameters (and, through the weights, its router).
"""

from __future__ import annotations

from torch import Tensor, nn

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import expert_ffn, resolve_activation
from flexmoe.hf.families import expert_unit, expert_weights
from flexmoe.routing.plan import plan_from_choices

__all__ = ["flexmoe_experts_forward", "register", "IMPLEMENTATION_NAME"]

IMPLEMENTATION_NAME = "flexmoe"


def flexmoe_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                            top_k_weights: Tensor) -> Tensor:
    """HF's experts call on flexmoe: ``hidden_states [T, M]``, ``top_k_index [T, k]`` (HF's expert-parallel
    sentinels ``>= num_experts`` are skipped), ``top_k_weights [T, k]`` -> ``[T, M]`` in hidden_states' dtype.

    ``self`` is the HF experts module. Accepted: the default gated unit (``act_fn(gate) * up``), non-gated experts
    and GPT-OSS's clamped unit, with or without biases, transposed or not; anything else (a custom
    ``_apply_gate``, a post-expert norm) raises ``ValueError`` naming the class.
    """
    activation, glu_limit = expert_unit(self)
    weights = expert_weights(self)  # views of self's parameters: [E, M, H], [E, H, M], ...
    num_experts = weights["w1"].shape[0]
    active = top_k_index < num_experts if getattr(self, "_is_expert_parallel", False) else None
    plan = plan_from_choices(top_k_index, top_k_weights, num_experts, active=active)
    rows = dispatch(hidden_states, plan)  # [N, M] sorted by expert
    # Matmuls of mixed dtypes fail: compute in the parameters' dtype, as HF's own implementations do.
    rows = rows.to(weights["w1"].dtype)
    out = expert_ffn(rows, plan.counts, weights["w1"], weights.get("b1"), weights["w2"], weights.get("b2"),
                     weights.get("w3"), weights.get("b3"), resolve_activation(activation), glu_limit=glu_limit)
    return combine(out, plan).to(hidden_states.dtype)


def register() -> None:
    """Register ``"flexmoe"`` in transformers' ``ExpertsInterface`` (idempotent), so that
    ``model.set_experts_implementation("flexmoe")`` or ``from_pretrained(..., experts_implementation="flexmoe")``
    runs :func:`flexmoe_experts_forward` under HF's own routing."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, flexmoe_experts_forward)


