"""How each Hugging Face MoE block maps onto a :class:`~flexmoe.MoELayer` (docs/architecture.md, "Hugging Face
models (flexmoe.hf)").

A family is known by its block's class name. For each, :class:`Family` says which submodule is the router, which
are the shared expert and its gate, and :meth:`Family.layer_options` reads the MoELayer options that reproduce the
block from the block's own attributes (its router's ``top_k``, ``norm_topk_prob``, ``n_group``, ...), so a single
block converts without its model's config. The routing options follow :mod:`flexmoe.routing.families`.
:class:`SwitchFamily` is Switch Transformers' (top-1 with a capacity per sequence, one ``nn.Linear`` pair per
expert).

The experts' weights: every transformers 5.x experts module decorated with ``use_experts_implementation`` stores
``gate_up_proj`` (``[E, 2H, M]``, or ``[E, M, 2H]`` when ``is_transposed``; gate then up halves when
``is_concatenated``, else interleaved gate/up columns as GPT-OSS), ``down_proj`` (``[E, M, H]`` or ``[E, H, M]``)
and, with ``has_bias``, ``gate_up_proj_bias [E, 2H]`` / ``down_proj_bias [E, M]``. :func:`expert_weights` returns
flexmoe's ``w1, w3: [E, M, H]``, ``w2: [E, H, M]``, ``b1, b3: [E, H]``, ``b2: [E, M]`` as *views* of those
parameters: reading them costs no copy and their gradients reach HF's parameters, and writing into them (under
``no_grad``) writes HF's parameters, which is how weights go back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.experts import resolve_activation

__all__ = ["Family", "SwitchFamily", "FAMILIES", "family_of", "StoredExperts", "stored_experts", "expert_weights",
           "expert_sources", "copy_into_views", "expert_unit", "experts_implementation",
           "implementation_named_by", "shared_mlp_weights",
           "shared_mlp_sources"]

# HF's activation names that flexmoe has under a name of its own (same function); others pass as a callable.
_ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu"}


def _gpt_oss_glu(gate: Tensor, alpha: float) -> Tensor:
    """GPT-OSS's gate activation ``g * sigmoid(alpha * g)`` (flexmoe's glu_limit does the clamping)."""
    return gate * torch.sigmoid(alpha * gate)


def experts_implementation(experts: Any) -> str | None:
    """The name of the implementation HF's experts module runs (``config._experts_implementation``:
    "grouped_mm", "batched_mm", "eager", "flexmoe", ...; None where it has no config: its own forward)."""
    return implementation_named_by(getattr(experts, "config", None))


def implementation_named_by(config: Any) -> str | None:
    """The experts implementation ``config`` names (:func:`experts_implementation`; None for no config or no name).
    Read from the config's own attributes where this transformers keeps it there: a converted block asks at every
    call, and the config's ``__getattribute__`` (attribute maps, per-layer checks) costs that call measurable host
    time."""
    if config is None:
        return None
    try:
        stored = object.__getattribute__(config, "__dict__").get("_experts_implementation_internal", _ABSENT)
    except AttributeError:  # a config object without instance attributes (slots)
        stored = _ABSENT
    name = getattr(config, "_experts_implementation", None) if stored is _ABSENT else stored
    return name if isinstance(name, str) else None


_ABSENT = object()


def expert_unit(experts: Any) -> tuple[str | Callable[[Tensor], Tensor], float | None]:
    """``(activation, glu_limit)`` of an HF experts module, as flexmoe's ``ExpertOptions`` take them.

    Known by what the module computes and holds, never by its class name (PEFT's ``target_parameters`` runs the
    module as a parametrized subclass, ``ParametrizedGptOssExperts``): its gated unit is the function its class
    resolves ``_apply_gate`` to. transformers' default ``act_fn(gate) * up`` over concatenated halves, or
    GPT-OSS's clamped unit over interleaved columns (with the module's ``alpha`` and ``limit``); a non-gated module
    (``has_gate=False``) applies its activation alone. Anything else (another ``_apply_gate``, a post-expert
    norm, a layout the unit does not read) raises ``ValueError`` naming the class: flexmoe would compute another
    function.
    """
    name = type(experts).__name__
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"{name} normalizes each expert's output (has_post_expert_norm); flexmoe's experts do not")
    if getattr(experts, "has_gate", True):
        gate_unit = getattr(type(experts), "_apply_gate", None)
        concatenated = getattr(experts, "is_concatenated", True)
        if gate_unit is _gpt_oss_apply_gate() and not concatenated:
            return functools.partial(_gpt_oss_glu, alpha=float(experts.alpha)), float(experts.limit)
        if gate_unit is not _default_apply_gate():
            raise ValueError(f"{name} has its own gated unit (_apply_gate); flexmoe knows transformers' default "
                             f"act_fn(gate) * up and GPT-OSS's clamped unit (on interleaved columns) only")
        if not concatenated:
            raise ValueError(f"{name} interleaves gate and up columns with the default gated unit; flexmoe knows "
                             f"that layout for GPT-OSS's unit only")
    hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
    if isinstance(hidden_act, str) and hidden_act in _ACTIVATION_NAMES:
        return _ACTIVATION_NAMES[hidden_act], None
    act_fn = getattr(experts, "act_fn", None)
    if not callable(act_fn):
        raise ValueError(f"{name} has no act_fn to read its activation from")
    return act_fn, None


def _default_apply_gate() -> Callable[..., Tensor] | None:
    """transformers' default gated unit, ``act_fn(gate) * up`` over the concatenated halves."""
    from transformers.integrations import moe

    return getattr(moe, "_default_apply_gate", None)  # absent in some future transformers: then nothing matches


def _gpt_oss_apply_gate() -> Callable[..., Tensor]:
    """GPT-OSS's gated unit (clamped, ``alpha``, interleaved columns): the function, whatever class holds it."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    return GptOssExperts._apply_gate


@dataclass(frozen=True)
class StoredExperts:
    """An HF experts module's tensors as HF stores them, and how to read them.

    ``up``: ``gate_up_proj`` (gated) or ``up_proj``, ``[E, out, M]`` (``[E, M, out]`` when ``transposed``), out
    = 2H gated (gate then up halves when ``concatenated``, else interleaved gate/up columns) or H;
    ``down``: ``down_proj``, ``[E, M, H]`` (``[E, H, M]`` transposed); ``up_bias [E, out]``,
    ``down_bias [E, M]`` or None. ``gated``: the unit is ``act(gate) * up`` over the two halves of ``up``'s
    output.
    """

    up: Tensor
    up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    transposed: bool
    gated: bool
    concatenated: bool

    @property
    def hidden_dim(self) -> int:
        """H, the experts' hidden size."""
        return int(self.down.shape[1] if self.transposed else self.down.shape[2])

    def in_out(self, w: Tensor) -> Tensor:
        """``up`` or ``down`` as ``[E, in, out]`` (flexmoe's layout): a view, transposed unless HF's already is."""
        return w if self.transposed else w.transpose(1, 2)

    def halves(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up parts ``[..., H]`` of a gated ``[..., 2H]`` (the up projection's output, its bias or
        its ``[E, M, 2H]`` weight): views, and ``split`` / ``unbind`` pass one gradient back (slices would each
        write theirs into a zero-filled copy)."""
        if self.concatenated:
            gate, up = t.split(self.hidden_dim, dim=-1)
            return gate, up
        gate, up = t.unflatten(-1, (self.hidden_dim, 2)).unbind(-1)
        return gate, up


def stored_experts(experts: Any) -> StoredExperts:
    """The tensors of an HF experts module as it stores them (:class:`StoredExperts`); no copy, no view.

    Raises ``ValueError`` naming the class when the module does not keep fused 3-D expert tensors.
    """
    name = type(experts).__name__
    has_gate = bool(getattr(experts, "has_gate", True))
    has_bias = bool(getattr(experts, "has_bias", False))
    up_name = "gate_up_proj" if has_gate else "up_proj"
    if not hasattr(experts, "down_proj") or not hasattr(experts, up_name):
        raise ValueError(f"{name} does not store its experts as fused 3-D tensors (gate_up_proj / down_proj)")
    return StoredExperts(up=getattr(experts, up_name),
                         up_bias=getattr(experts, f"{up_name}_bias") if has_bias else None,
                         down=experts.down_proj, down_bias=experts.down_proj_bias if has_bias else None,
                         transposed=bool(getattr(experts, "is_transposed", False)), gated=has_gate,
                         concatenated=bool(getattr(experts, "is_concatenated", True)))


def expert_weights(experts: Any) -> dict[str, Tensor]:
    """flexmoe's expert tensors as views of an HF experts module's parameters.

    Returns ``w1, w2`` and, as the module has them, ``w3`` (gated experts) and ``b1, b2, b3`` (biases):
    ``w1, w3: [E, M, H]``, ``w2: [E, H, M]``, ``b1, b3: [E, H]``, ``b2: [E, M]``.
    """
    stored = stored_experts(experts)
    weights: dict[str, Tensor] = {"w2": stored.in_out(stored.down)}
    if stored.down_bias is not None:
        weights["b2"] = stored.down_bias
    up = stored.in_out(stored.up)  # [E, M, 2H] gated, else [E, M, H]
    if not stored.gated:
        weights["w1"] = up
        if stored.up_bias is not None:
            weights["b1"] = stored.up_bias
        return weights
    weights["w1"], weights["w3"] = stored.halves(up)
    if stored.up_bias is not None:
        weights["b1"], weights["b3"] = stored.halves(stored.up_bias)
    return weights


def expert_sources(experts: Any) -> dict[str, list[Tensor]]:
    """For each of :func:`expert_weights`' names, the HF parameter it is a view of (``w1`` and ``w3`` both of
    ``gate_up_proj``, ``b1`` and ``b3`` of its bias), as a one-item list: what a ``requires_grad`` flag belongs
    to."""
    stored = stored_experts(experts)
    sources = {"w1": [stored.up], "w2": [stored.down]}
    if stored.gated:
        sources["w3"] = [stored.up]
    if stored.up_bias is not None:
        sources.update({"b1": [stored.up_bias], **({"b3": [stored.up_bias]} if stored.gated else {})})
    if stored.down_bias is not None:
        sources["b2"] = [stored.down_bias]
    return sources


def copy_into_views(views: dict[str, Tensor], weights: dict[str, Tensor]) -> None:
    """Write ``weights[name]`` into each view of ``views`` (views of HF's parameters; call under ``no_grad``)."""
    for name, view in views.items():
        view.copy_(weights[name])


def shared_mlp_weights(mlp: Any) -> dict[str, Tensor]:
    """A gate/up/down ``nn.Linear`` MLP (HF's shared expert) as shared expert 0's ``w1, w3: [1, M, Hs]``,
    ``w2: [1, Hs, M]``, views of the Linear weights."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(mlp, proj, None)
        if not isinstance(layer, nn.Linear) or layer.bias is not None:
            raise ValueError(f"{type(mlp).__name__}.{proj} must be an nn.Linear without bias to be a flexmoe "
                             f"shared expert")
    return {name: weight.T.unsqueeze(0) for name, weight in shared_mlp_sources(mlp).items()}


def shared_mlp_sources(mlp: Any) -> dict[str, Tensor]:
    """The ``nn.Linear`` weight each of :func:`shared_mlp_weights`' names is a view of."""
    return {"w1": mlp.gate_proj.weight, "w3": mlp.up_proj.weight, "w2": mlp.down_proj.weight}


@dataclass(frozen=True)
class Family:
    """One HF MoE block class and how it maps onto MoELayer.

    name: the family's short name (``"mixtral"``, ...). router: the block's router attribute. shared: the
    shared-expert MLP attribute, or None. shared_gate: the shared expert's sigmoid gate (an ``nn.Linear(M, 1)``),
    or None. returns_router_scores: the block returns ``(hidden_states, router_scores)`` (GPT-OSS).
    router_logits_at: where the logits are in the tuple the router returns (Switch: 2).
    score_func: "softmax", or "sigmoid" with DeepSeek-V3's group-limited routing and correction bias.
    normalize: whether the k weights are renormalized (None: the router's ``norm_topk_prob``).
    scaled: the weights are multiplied by the router's ``routed_scaling_factor``.
    score_precision: the dtype of the logits HF computes its scores and weights from (:meth:`score_dtype`):
    "logits" (their own: under autocast the router's linear map makes them bf16; flexmoe then, as HF's Qwen
    routers, takes the softmax in float32 and rounds the weights to bf16, and DeepSeek-V3's sigmoid is bf16),
    "float32" (HF upcasts them first and keeps float32 weights: Mixtral, DeepSeek-V2) or "router" (the router's
    ``dtype`` attribute: Switch's ``router_dtype``). select_by: what HF's router takes the top-k of ("scores", or
    "logits": GPT-OSS), the layer's ``select_by``.
    """

    name: str
    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    returns_router_scores: bool = False
    score_func: str = "softmax"
    normalize: bool | None = None
    scaled: bool = False
    score_precision: str = "logits"
    router_logits_at: int = 0
    select_by: str = "scores"

    def score_dtype(self, router: Any) -> torch.dtype | None:
        """The dtype the router's logits are scored in, as HF's block scores them (None: the logits' own)."""
        if self.score_precision == "float32":
            return torch.float32
        if self.score_precision == "router":
            return router.dtype
        return None

    def layer_options(self, block: Any) -> dict[str, Any]:
        """The MoELayer keywords (besides model_dim, num_experts, hidden_dim) that reproduce ``block``."""
        router = getattr(block, self.router)
        experts = block.experts
        activation, glu_limit = expert_unit(experts)
        weights = expert_weights(experts)
        method = getattr(router, "topk_method", "greedy")
        if method != "greedy":  # DeepSeek-V2's "group_limited_greedy" rates a group by its best score
            raise ValueError(f"{type(block).__name__} routes with topk_method={method!r}; flexmoe reproduces "
                             f"'greedy' (and DeepSeek-V3's groups, rated by their two best scores)")
        options: dict[str, Any] = {
            "k": int(router.top_k),
            "capacity_factor": 0.0,  # dropless, as HF
            "normalize_weights": bool(router.norm_topk_prob) if self.normalize is None else self.normalize,
            "glu": "w3" in weights,
            "bias": "b1" in weights,
            "activation": activation,
            "glu_limit": glu_limit,
            "aux_loss_type": "all_choices",  # HF's load_balancing_loss_func counts every choice
            "router_dtype": None,  # HF's router runs under the caller's autocast; score_dtype does the rest
            "ties": "topk",  # HF's routers pick with torch.topk, and bf16 logits (autocast) tie often
            "select_by": self.select_by,
            # HF's grouped_mm experts (its default where torch has _grouped_mm) cast their input to the weights'
            # dtype and call torch._grouped_mm, which autocast does not recast: under autocast they compute in
            # the parameters' dtype; "eager" and "batched_mm" (F.linear, bmm) compute in autocast's.
            "experts_autocast": experts_implementation(experts) != "grouped_mm",
        }
        if self.scaled:
            options["route_scale"] = float(router.routed_scaling_factor)
        if self.score_func == "sigmoid":  # DeepSeek-V3 / GLM-4.5: flexmoe.routing.families
            options.update(score_func="sigmoid", num_expert_groups=int(router.num_group),
                           num_limited_groups=int(router.topk_group), balance="bias", bias_update_rate=0.0)
        jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        if jitter > 0:
            options["jitter"] = jitter
        if self.shared is not None:
            shared = shared_mlp_weights(getattr(block, self.shared))
            options.update(shared_experts=1, shared_hidden_dim=int(shared["w1"].shape[-1]))
            if self.shared_gate is not None:
                options["shared_gate"] = True
        resolve_activation(activation)
        return options

    def sizes(self, block: Any) -> tuple[int, int, int]:
        """``(model_dim, num_experts, hidden_dim)`` of ``block``'s routed experts."""
        w1 = self.read_experts(block.experts)["w1"]
        return int(w1.shape[1]), int(w1.shape[0]), int(w1.shape[2])

    def read_experts(self, experts: Any) -> dict[str, Tensor]:
        """flexmoe's expert tensors (``w1: [E, M, H]``, ...) of HF's experts module: :func:`expert_weights`."""
        return expert_weights(experts)

    def write_experts(self, experts: Any, weights: dict[str, Tensor]) -> None:
        """Copy flexmoe's expert tensors (all E experts) into HF's experts module (call under ``no_grad``)."""
        copy_into_views(expert_weights(experts), weights)

    def expert_sources(self, experts: Any) -> dict[str, list[Tensor]]:
        """For each of :meth:`read_experts`' names, the HF parameters it is read from (:func:`expert_sources`):
        the layer tensor's ``requires_grad`` is theirs, and goes back to them."""
        return expert_sources(experts)

    def expert_dropout(self, block: Any) -> float:
        """The dropout probability inside HF's experts (applied in training; flexmoe's experts have none)."""
        return 0.0


@dataclass(frozen=True)
class SwitchFamily(Family):
    """Switch Transformers' ``SwitchTransformersSparseMLP``: ``router`` (``SwitchTransformersTop1Router``: a
    ``classifier`` Linear, top-1 by ``argmax`` of the softmax, ``expert_capacity`` tokens per expert and sequence
    in token order, the rest dropped: their MLP output is 0 and the residual carries them), and ``experts``, a
    ModuleDict ``expert_{i}`` of non-gated ``wi: Linear(M, H)``, ``act``, ``dropout``, ``wo: Linear(H, M)``
    without biases. HF's router module stays the gate (its jitter, dtype and recorded logits are its own)."""

    def layer_options(self, block: Any) -> dict[str, Any]:
        router = block.router
        return {
            "k": 1,
            "capacity": int(router.expert_capacity),
            "capacity_per": "sequence",
            "normalize_weights": False,
            "glu": False,
            "bias": False,
            "activation": _switch_activation(block.experts["expert_0"].act),
            "aux_loss_type": "sequence",  # HF's Switch balance loss (per sequence) at k=1
            "router_dtype": None,
            "ties": "lower",  # torch.argmax takes the first of equal probabilities
        }

    def sizes(self, block: Any) -> tuple[int, int, int]:
        hidden_dim, model_dim = _switch_units(block.experts)[0].wi.weight.shape  # no stacked copy, as read would
        return int(model_dim), int(block.experts.num_experts), int(hidden_dim)

    def read_experts(self, experts: Any) -> dict[str, Tensor]:
        """``w1: [E, M, H]``, ``w2: [E, H, M]`` stacked from each expert's ``wi`` / ``wo`` (copies)."""
        units = _switch_units(experts)
        return {"w1": torch.stack([u.wi.weight.T for u in units]), "w2": torch.stack([u.wo.weight.T for u in units])}

    def write_experts(self, experts: Any, weights: dict[str, Tensor]) -> None:
        for e, unit in enumerate(_switch_units(experts)):
            unit.wi.weight.copy_(weights["w1"][e].T)
            unit.wo.weight.copy_(weights["w2"][e].T)

    def expert_sources(self, experts: Any) -> dict[str, list[Tensor]]:
        """``w1``: every expert's ``wi.weight``, ``w2``: every ``wo.weight``, in expert order."""
        units = _switch_units(experts)
        return {"w1": [u.wi.weight for u in units], "w2": [u.wo.weight for u in units]}

    def expert_dropout(self, block: Any) -> float:
        return float(block.experts["expert_0"].dropout.p)


def _switch_units(experts: Any) -> list[Any]:
    """Switch's experts ``expert_0 .. expert_{E-1}``, each checked to be the non-gated unit flexmoe computes."""
    units = [experts[f"expert_{e}"] for e in range(int(experts.num_experts))]
    for e, unit in enumerate(units):
        for proj in ("wi", "wo"):
            layer = getattr(unit, proj, None)
            if not isinstance(layer, nn.Linear) or layer.bias is not None:
                raise ValueError(f"{type(experts).__name__}.expert_{e}.{proj} must be an nn.Linear without bias to "
                                 f"be a flexmoe expert")
    return units


def _switch_activation(act: Any) -> str | Callable[[Tensor], Tensor]:
    """flexmoe's name for a Switch expert's activation module (``ACT2FN[dense_act_fn]``), or the module itself."""
    if isinstance(act, nn.ReLU):
        return "relu"
    if not callable(act):
        raise ValueError(f"the Switch experts' activation {type(act).__name__} is not callable")
    return act


FAMILIES: dict[str, Family] = {
    "MixtralSparseMoeBlock": Family("mixtral", normalize=True, score_precision="float32"),
    "Qwen2MoeSparseMoeBlock": Family("qwen2_moe", shared="shared_expert", shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": Family("qwen3_moe"),
    "Qwen3NextSparseMoeBlock": Family("qwen3_next", shared="shared_expert", shared_gate="shared_expert_gate"),
    "OlmoeSparseMoeBlock": Family("olmoe"),
    "DeepseekV2Moe": Family("deepseek_v2", shared="shared_experts", normalize=False, scaled=True,
                            score_precision="float32"),
    "DeepseekV3MoE": Family("deepseek_v3", shared="shared_experts", score_func="sigmoid", scaled=True),
    "Glm4MoeMoE": Family("glm4_moe", shared="shared_experts", score_func="sigmoid", scaled=True),
    # HF takes the top-k of the logits (the order of their softmax) and a softmax in their dtype over those.
    "GptOssMLP": Family("gpt_oss", router="router", returns_router_scores=True, normalize=True, select_by="logits"),
    "SwitchTransformersSparseMLP": SwitchFamily("switch_transformers", router="router", score_precision="router",
                                                router_logits_at=2),
}


def family_of(block: nn.Module) -> Family | None:
    """The :class:`Family` of an HF MoE block (by its class name), or None."""
    return FAMILIES.get(type(block).__name__)
