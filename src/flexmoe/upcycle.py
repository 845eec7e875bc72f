"""Sparse upcycling: a dense model's MLPs become MoE layers computing the same function (docs/architecture.md,
"Upcycling").

The dense MLP ``y = W2 act(W1 x + b1) + b2`` (gated: ``W2 (act(W1 x) * (W3 x)) + b2``) has H hidden units.
Granularity g cuts them into g slices of H/g consecutive units, so ``y = sum_s y_s + b2`` with ``y_s`` the
output of slice s. The E = g * m experts are m copies of each slice: expert e holds slice ``e mod g``.

The router starts at zero, so every expert has the same score and every token picks the same k experts: the
stable top-k (``ties="lower"``) takes experts 0 .. k-1, which hold each slice k/g times when g divides k. Each of
them has the same combine weight c:

* normalised routing (``normalize_weights``, k > 1): c = 1/k;
* softmax-then-top-k without normalisation: c = 1/E (the softmax of E equal logits); sigmoid scores: c = 1/2;
* times ``route_scale``.

So the layer's output is ``c * (k/g) * sum_s y_s`` (plus the biases): equal to the dense MLP when each expert's
output is scaled by ``sigma = g / (k * c)``, which is what the upcycled experts hold (their ``W2`` and ``b2``
times sigma, ``b2`` split as ``b2 / g`` over the g slices a token picks k/g times each). With normalised
routing sigma = g: exact in floating point for g a power of two.

Equality is impossible when g does not divide k (the equal weights would count some slices more often than
others), when g does not divide E or H, and whenever a token can lose an expert: a capacity below the load (all
T tokens go to the same k experts at first, so a capacity factor must be 0 or at least E/k), noise on the
logits, GShard's random second expert, group-limited routing, the topology gate, or ``torch.topk``'s
unspecified tie order. Those are refused with a ``ValueError`` saying why.

The router still learns: its weights are zero, not its gradient. With normalised routing the weight of chosen
expert j moves with ``w_j (dL/dw_j - sum_i w_i dL/dw_i)``, non-zero as soon as the chosen slices differ (g > 1);
the balance loss ``E * sum_e f_e P_e`` pushes the k over-used experts' logits down in every case (g = 1 too).

:func:`upcycle` replaces gate/up/down MLPs (Hugging Face's Llama, Mistral, Qwen2, Qwen3, ...) by gated
:class:`~flexmoe.MoELayer` s, and lets a model that knows its own MLPs do it (``upcycle_mlps``: the application
models, :mod:`flexmoe.apps.models.moe_model`); :func:`flexmoe.hf.upcycle_into_twin` gives a Hugging Face model its
MoE twin's blocks instead (Mixtral / Qwen3-MoE, converted).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import shard_expert_state
from flexmoe.validation import check_int

__all__ = ["upcycle", "is_gated_mlp", "upcycled_gated_mlp", "check_upcycle_shape", "check_upcycle_routing",
           "expert_scale", "slice_experts"]


def upcycle(model: nn.Module, *, num_experts: int, k: int, granularity: int = 1, **options: Any) -> nn.Module:
    """Turn every dense MLP of ``model`` into an MoE layer whose initial output equals the MLP's; in place,
    returns ``model``.

    num_experts: E, a multiple of ``granularity``; k: experts per token, a multiple of ``granularity``;
    granularity: g, each expert is 1/g of the MLP's hidden units (Megatron's granular upcycling), E/g copies of
    each slice. The router's weights start at zero (the module docstring has the math).

    Which MLPs: a model with a method ``upcycle_mlps(num_experts=, k=, granularity=, **options)`` upcycles its own
    (the application models' GPT and ViT: options are fields of their config, ``model.cfg`` describes the
    result); any other model has each gate/up/down MLP (``gate_proj``, ``up_proj``, ``down_proj`` linears and
    ``act_fn``: Hugging Face's Llama, Mistral, Qwen2, Qwen3, ...) replaced by a gated :class:`~flexmoe.MoELayer`;
    options are MoELayer keywords (``capacity_factor`` default 0: dropless; ``group`` as for any MoELayer). For a
    Hugging Face model in its MoE twin's own form (Mixtral / Qwen3-MoE blocks, HF's state-dict names) see
    :func:`flexmoe.hf.upcycle_into_twin`.

    Raises ``ValueError`` for sizes or options under which the output cannot equal the dense model's, and for a
    model with no dense MLP this function knows.
    """
    num_experts = check_int("num_experts", num_experts, 1)
    k = check_int("k", k, 1)
    granularity = check_int("granularity", granularity, 1)
    own = getattr(model, "upcycle_mlps", None)
    if callable(own):
        result: nn.Module = own(num_experts=num_experts, k=k, granularity=granularity, **options)
        return result
    mlps = [(name, m) for name, m in model.named_modules() if is_gated_mlp(m)]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no dense MLP upcycle() knows (a gate_proj / up_proj / "
                         f"down_proj MLP, or a model with upcycle_mlps())")
    given = sorted(set(options) & _MLP_DECIDES)
    if given:
        raise ValueError(f"upcycle() takes {given} from the dense MLP; leave them out")
    options = {"capacity_factor": 0.0, **options}
    check_upcycle_routing(options, num_experts, k)
    # Every layer built before any is swapped in: a refusal leaves the model as it was.
    layers = [(name, upcycled_gated_mlp(mlp, num_experts, k, granularity, options)) for name, mlp in mlps]
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return model


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a gate/up/down MLP, ``down(act_fn(gate(x)) * up(x))`` (Llama-style)."""
    return callable(getattr(module, "act_fn", None)) and all(
        isinstance(getattr(module, proj, None), nn.Linear) for proj in ("gate_proj", "up_proj", "down_proj"))


# What the dense MLP decides (the experts' unit and shape); upcycle() refuses them as options.
_MLP_DECIDES = frozenset({"glu", "bias", "activation", "glu_limit", "shared_experts", "shared_hidden_dim",
                          "shared_gate", "experts", "device", "dtype"})
# Activations the experts have by name (the fused paths take these), by Hugging Face's config name.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu"}


def upcycled_gated_mlp(mlp: Any, num_experts: int, k: int, granularity: int, options: dict[str, Any]) -> MoELayer:
    """The gated :class:`~flexmoe.MoELayer` (glu, the MLP's activation and biases, its dtype and device) of E
    slices of gate/up/down MLP ``mlp``, router at zero; under expert parallelism (``options["group"]``) holding
    this rank's experts only."""
    hidden = mlp.gate_proj.out_features
    check_upcycle_shape(num_experts, k, granularity, hidden)
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    with_bias = [p.bias is not None for p in projections]
    if any(with_bias) != all(with_bias):
        raise ValueError(f"{type(mlp).__name__}: gate_proj, up_proj and down_proj must all have biases or none")
    hidden_act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    activation = _ACTIVATIONS.get(hidden_act, mlp.act_fn) if isinstance(hidden_act, str) else mlp.act_fn
    weight = mlp.gate_proj.weight
    layer = MoELayer(weight.shape[1], num_experts, hidden // granularity, k=k, glu=True, bias=all(with_bias),
                     activation=activation, device=weight.device, dtype=weight.dtype, **options)
    routing = layer.routing_options
    scale = expert_scale(num_experts, k, granularity, normalize_weights=routing.normalize_weights,
                         score_func=routing.score_func, route_scale=routing.route_scale)
    dense = {"w1": mlp.gate_proj.weight.T, "w3": mlp.up_proj.weight.T, "w2": mlp.down_proj.weight.T}
    if all(with_bias):
        dense.update(b1=mlp.gate_proj.bias, b3=mlp.up_proj.bias, b2=mlp.down_proj.bias)
    experts = slice_experts(dense, num_experts, granularity, scale)
    if layer.ep_group.distributed:
        experts = shard_expert_state(experts, layer.layout, layer.ep_group.rank)
    router: Any = layer.router  # the linear top-k router (check_upcycle_routing)
    with torch.no_grad():
        for name, value in experts.items():
            getattr(layer.experts, name).copy_(value)
        router.weight.zero_()
        if router.bias is not None:
            router.bias.zero_()
    return layer


def check_upcycle_shape(num_experts: int, k: int, granularity: int, hidden_dim: int) -> None:
    """``ValueError`` unless E experts, k per token and granularity g can reproduce an MLP of ``hidden_dim``."""
    if k > num_experts:
        raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
    if num_experts % granularity:
        raise ValueError(f"num_experts={num_experts} must be a multiple of granularity={granularity}: the experts "
                         f"are E/g copies of each of the g slices of the MLP")
    if k % granularity:
        raise ValueError(f"k={k} must be a multiple of granularity={granularity}: at the start every expert scores "
                         f"the same and the k chosen ones weigh the same, so they reproduce the MLP only if they "
                         f"hold each of its g slices equally often (k/g times)")
    if hidden_dim % granularity:
        raise ValueError(f"granularity={granularity} must divide the MLP's hidden size {hidden_dim}")


def check_upcycle_routing(options: dict[str, Any], num_experts: int, k: int) -> None:
    """``ValueError`` for routing options (MoELayer keywords present in ``options``) under which a token could lose
    one of its k experts at the start, or pick them in another order than the stable one."""
    refused = {
        "router": ("topk", "a linear top-k router (its weights start at zero)"),
        "ties": ("lower", "the stable tie order: with every score tied it picks experts 0..k-1, each slice k/g times"),
        "gate_noise": (0.0, "no noise on the logits (it breaks the ties at random)"),
        "second_expert": ("top", "every chosen expert kept"),
        "num_expert_groups": (None, "no group-limited routing"),
        "num_limited_groups": (None, "no group-limited routing"),
        "cross_node_share": (None, "no topology gate (it reroutes pairs)"),
        "score_at": ("combine", "the weights applied to the experts' outputs (a scaled input changes act(W1 x))"),
        "capacity": (None, "no explicit capacity: it cannot hold all T tokens of the k experts every token "
                           "picks at the start; use capacity_factor"),
    }
    for name, (needed, why) in refused.items():
        if name in options and options[name] != needed:
            raise ValueError(f"upcycle() needs {name}={needed!r} ({why}), got {options[name]!r}")
    factor = options.get("capacity_factor", 0.0)
    if factor != 0 and abs(factor) < num_experts / k:
        raise ValueError(f"capacity_factor={factor} would drop tokens at the start, where every token picks the same "
                         f"k experts: use 0 (dropless) or |capacity_factor| >= num_experts / k = {num_experts / k:g}")


def expert_scale(num_experts: int, k: int, granularity: int, *, normalize_weights: bool = True,
                 score_func: str = "softmax", route_scale: float = 1.0) -> float:
    """sigma = g / (k * c): the factor on each expert's output that makes k equally weighted experts (weight c
    each, every score tied) holding each slice k/g times sum to the dense MLP."""
    if normalize_weights and k > 1:
        weight = 1.0 / k
    elif score_func == "sigmoid":
        weight = 0.5  # sigmoid(0)
    else:
        weight = 1.0 / num_experts  # the softmax of E equal logits
    return granularity / (k * weight * route_scale)


def slice_experts(dense: dict[str, Tensor], num_experts: int, granularity: int, scale: float) -> dict[str, Tensor]:
    """The E experts of a dense MLP in flexmoe's layout: expert e is slice ``e mod g`` of the hidden units.

    dense: ``w1: [M, H]`` (and ``w3: [M, H]`` for a gated MLP), ``w2: [H, M]``, optionally ``b1: [H]`` (and
    ``b3``), ``b2: [M]``. Returns ``w1, w3: [E, M, H/g]``, ``w2: [E, H/g, M]``, ``b1, b3: [E, H/g]``,
    ``b2: [E, M]``; ``w2`` times ``scale``, ``b2`` times ``scale / g`` (a token sums g slices)."""
    slices: dict[str, list[Tensor]] = {}
    for name, tensor in dense.items():
        if name == "b2":
            slices[name] = [tensor * (scale / granularity)] * granularity
            continue
        along = 0 if name in ("w2", "b1", "b3") else 1  # the dimension of the hidden units
        parts = tensor.chunk(granularity, dim=along)
        slices[name] = [part * scale for part in parts] if name == "w2" else list(parts)
    return {name: torch.stack([parts[e % granularity] for e in range(num_experts)]) for name, parts in slices.items()}
