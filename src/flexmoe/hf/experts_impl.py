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

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

from flexmoe.dispatch import combine, dispatch, sum_choices_by_token
from flexmoe.experts import expert_ffn, resolve_activation
from flexmoe.experts.chooser import KernelChooser
from flexmoe.experts.grouped_op import grouped_experts_ffn
from flexmoe.experts.row_kernels import joined_outputs
from flexmoe.experts.weights import ExpertWeights, gated_unit, needs_grad
from flexmoe.hf.families import StoredExperts, expert_unit, stored_experts
from flexmoe.routing.capacity import HOST_ORDER_MAX_PAIRS, order_pairs_on_host
from flexmoe.routing.plan import plan_from_choices

__all__ = ["flexmoe_experts_forward", "stored_experts_ffn", "register", "IMPLEMENTATION_NAME"]

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
    stored = stored_experts(self)
    num_experts = stored.up.shape[0]
    expert_parallel = getattr(self, "_is_expert_parallel", False)
    if torch.compiler.is_compiling() and not expert_parallel:
        return _compiled_forward(hidden_states, top_k_index, top_k_weights, stored, resolve_activation(activation),
                                 glu_limit)
    if (not expert_parallel and top_k_index.dim() == 2 and top_k_weights.shape == top_k_index.shape
            and top_k_index.numel() <= HOST_ORDER_MAX_PAIRS
            and not needs_grad(hidden_states, top_k_weights, stored.up, stored.up_bias, stored.down,
                               stored.down_bias)):
        return _few_pairs_forward(hidden_states, top_k_index, top_k_weights, stored, resolve_activation(activation),
                                  glu_limit, kernels_of(self))
    active = top_k_index < num_experts if expert_parallel else None
    plan = plan_from_choices(top_k_index, top_k_weights, num_experts, active=active)
    rows = dispatch(hidden_states, plan)  # [N, M] sorted by expert
    # Matmuls of mixed dtypes fail: compute in the parameters' dtype, as HF's own implementations do.
    rows = rows.to(stored.up.dtype)
    out = stored_experts_ffn(rows, plan.counts, stored, resolve_activation(activation), glu_limit,
                             kernels_of(self))
    return combine(out, plan).to(hidden_states.dtype)


def _compiled_forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, stored: StoredExperts,
                      activation: Callable[[Tensor], Tensor], glu_limit: float | None) -> Tensor:
    """:func:`flexmoe_experts_forward` traced by ``torch.compile``: no routed value reaches the host, so that
    ``fullgraph=True`` holds (as the compiled :class:`~flexmoe.MoELayer`'s dropless path, docs/architecture.md,
    "Compiling the layer"). The plan keeps its counts on the device (:func:`plan_from_choices` while compiling,
    ``N = T * k`` rows), and the experts' matmuls are the ``flexmoe::grouped_linear`` op that reads them there
    (:func:`~flexmoe.experts.grouped_op.grouped_experts_ffn`; off the CPU in bf16, ``torch._grouped_mm`` with
    device offsets), on views of HF's fused tensors with the unit traced between them.
    ``hidden_states [T, M]``, ``top_k_index`` / ``top_k_weights [T, k]`` -> ``[T, M]``."""
    plan = plan_from_choices(top_k_index, top_k_weights, stored.up.shape[0])
    rows = dispatch(hidden_states, plan).to(stored.up.dtype)  # [T * k, M] sorted by expert
    weights = ExpertWeights(stored.in_out(stored.up), stored.up_bias, stored.in_out(stored.down), stored.down_bias,
                            None, None, _unit(stored, activation, glu_limit))
    out = grouped_experts_ffn(rows, plan.tokens_per_expert, weights)
    return combine(out, plan).to(hidden_states.dtype)


def _few_pairs_forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, stored: StoredExperts,
                       activation: Callable[[Tensor], Tensor], glu_limit: float | None,
                       kernels: KernelChooser) -> Tensor:
    """:func:`flexmoe_experts_forward` for a decoding call (no autograd, one process, at most
    ``HOST_ORDER_MAX_PAIRS`` pairs): the rows are ordered on the host and combined by one gather and one batched
    matmul, as :class:`~flexmoe.MoELayer` decodes (docs/architecture.md, "Decoding"); no plan is built.
    ``hidden_states [T, M]``, ``top_k_index`` / ``top_k_weights [T, k]`` -> ``[T, M]``."""
    num_tokens = top_k_index.shape[0]
    order = order_pairs_on_host(top_k_index.tolist(), stored.up.shape[0])
    row_token, pair_row, _ = order.index_tensors(hidden_states.device)
    rows = hidden_states.index_select(0, row_token).to(stored.up.dtype)  # [N, M] sorted by expert
    out = stored_experts_ffn(rows, order.counts, stored, activation, glu_limit, kernels)
    return sum_choices_by_token(out, pair_row, top_k_weights.to(out.dtype), num_tokens).to(hidden_states.dtype)


def kernels_of(module: nn.Module) -> KernelChooser:
    """The kernel chooser of an HF experts module (made on its first call, kept on the module): each module's
    calls are timed and cached like a :class:`~flexmoe.MoELayer`'s experts."""
    kernels = getattr(module, "_flexmoe_kernels", None)
    if not isinstance(kernels, KernelChooser):
        kernels = KernelChooser.for_options("auto", None)
        module.__dict__["_flexmoe_kernels"] = kernels  # a plain attribute: not a submodule, not in the state
    return kernels


def stored_experts_ffn(rows: Tensor, counts: list[int], stored: StoredExperts,
                       activation: Callable[[Tensor], Tensor], glu_limit: float | None = None,
                       kernels: KernelChooser | None = None) -> Tensor:
    """:func:`flexmoe.experts.expert_ffn` on an HF experts module's tensors as HF stores them: ``rows [N, M]``
    sorted by expert, ``counts [E]`` -> ``[N, M]``.

    The gate and up projections stay one matmul over HF's fused ``gate_up_proj`` per expert (its output split
    after), two matmuls per expert instead of three. Under autograd the loop unbinds HF's tensors as stored, so
    each expert's weight gradient comes back in the parameter's own layout: unbinding flexmoe's
    ``[E, M, H]`` views of them (:func:`expert_weights`) costs, per step, a stack of transposed pieces, a
    zero-filled ``[E, M, 2H]`` per half and a layout-changing copy when the gradient is accumulated.
    Without autograd ``kernels`` (None: the loop over the active experts) picks the kernel, as for the layer's
    experts, on the ``[E, in, out]`` views (free without gradients).
    """
    unit = _unit(stored, activation, glu_limit)
    up, down = stored.in_out(stored.up), stored.in_out(stored.down)  # [E, M, out], [E, H, M]
    if not needs_grad(rows, stored.up, stored.up_bias, stored.down, stored.down_bias):
        # The rule's hidden size is H (a narrow view: the same strides as the fused matrix it stands for).
        weights = ExpertWeights(up, stored.up_bias, down, stored.down_bias, None, None, unit)
        return expert_ffn(rows, counts, weights, kernels)
    num_experts = len(counts)

    def each(t: Tensor | None) -> list[Tensor | None]:
        return list(t.unbind(0)) if t is not None else [None] * num_experts

    ups, downs = stored.up.unbind(0), stored.down.unbind(0)

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # w: one expert's matrix as HF stores it
        if stored.transposed:  # [in, out]
            return torch.addmm(b, x, w) if b is not None else x @ w
        return torch.nn.functional.linear(x, w, b)  # [out, in]

    outputs = []
    for x, w_up, b_up, w_down, b_down in zip(rows.split(counts), ups, each(stored.up_bias), downs,
                                             each(stored.down_bias)):
        if x.shape[0]:
            outputs.append(linear(unit(linear(x, w_up, b_up)), w_down, b_down))
    return joined_outputs(outputs, rows, rows.shape[-1])


def _unit(stored: StoredExperts, activation: Callable[[Tensor], Tensor],
          glu_limit: float | None) -> Callable[[Tensor], Tensor]:
    """The hidden unit on the up projection's output ``[n, out]`` -> ``[n, H]``: the activation, or for gated
    experts the gated unit over the two halves of the fused projection (:func:`_gated`)."""
    if stored.gated:
        return functools.partial(_gated, stored=stored, activation=activation, glu_limit=glu_limit)
    return activation


def _gated(projected: Tensor, *, stored: StoredExperts, activation: Callable[[Tensor], Tensor],
           glu_limit: float | None) -> Tensor:
    """The gated unit on the fused up projection's output ``[n, 2H]`` -> ``[n, H]``."""
    gate, up = stored.halves(projected)
    return gated_unit(gate, up, activation, glu_limit)


def register() -> None:
    """Register ``"flexmoe"`` in transformers' ``ExpertsInterface`` (idempotent), so that
    ``model.set_experts_implementation("flexmoe")`` or ``from_pretrained(..., experts_implementation="flexmoe")``
    runs :func:`flexmoe_experts_forward` under HF's own routing."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION_NAME, flexmoe_experts_forward)


