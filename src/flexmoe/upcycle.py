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

:func:`upcycle` handles the application models (:class:`flexmoe.apps.models.gpt.GPT`, the ViT: their
``DenseMLP`` blocks become :class:`~flexmoe.MoELayer`) and Hugging Face dense models
(:mod:`flexmoe.hf.upcycle`: Llama/Mistral MLPs into Mixtral's block, Qwen2/Qwen3 MLPs into Qwen3-MoE's, then
:func:`flexmoe.hf.convert`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from flexmoe.validation import check_int

if TYPE_CHECKING:
    from flexmoe.apps.models.moe_model import MoEModel

__all__ = ["upcycle", "check_upcycle_shape", "check_upcycle_routing", "expert_scale", "slice_experts"]


def upcycle(model: nn.Module, *, num_experts: int, k: int, granularity: int = 1, **options: Any) -> nn.Module:
    """Turn every dense MLP of ``model`` into an MoE layer whose initial output equals the MLP's; in place,
    returns ``model``.

    num_experts: E, a multiple of ``granularity``; k: experts per token, a multiple of ``granularity``;
    granularity: g, each expert is 1/g of the MLP's hidden units (Megatron's granular upcycling), E/g copies of
    each slice. The router's weights start at zero (the module docstring has the math).

    model: an application model (``flexmoe.apps.models``: the GPT or ViT, dense or with dense blocks): options are
        fields of its config (``capacity_factor`` default 0, ``aux_loss_coef``, ...), ``model.cfg`` describes
        the result (every block MoE, ``moe_every=1``); or a Hugging Face model with Llama/Mistral/Qwen2/Qwen3
        MLPs (:func:`flexmoe.hf.upcycle.upcycle_hf`): options are MoELayer keywords, ``group`` the
        expert-parallel group, as for :func:`flexmoe.hf.convert`.

    Raises ``ValueError`` for sizes or options under which the output cannot equal the dense model's, and for a
    model with no dense MLP this function knows.
    """
    num_experts = check_int("num_experts", num_experts, 1)
    k = check_int("k", k, 1)
    granularity = check_int("granularity", granularity, 1)
    transformers = sys.modules.get("transformers")  # an HF model exists only if transformers was imported
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        from flexmoe.hf.upcycle import upcycle_hf

        return upcycle_hf(model, num_experts=num_experts, k=k, granularity=granularity, **options)
    from flexmoe.apps.models.moe_model import MoEModel

    if isinstance(model, MoEModel):
        return _upcycle_app_model(model, num_experts, k, granularity, options)
    raise ValueError(f"upcycle() takes a flexmoe application model (GPT, ViT) or a Hugging Face model with "
                     f"Llama/Mistral/Qwen2/Qwen3 MLPs, got {type(model).__name__}")


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


# The app models' config fields upcycle sets itself; the others may be given as options.
_STRUCTURE = frozenset({"dense", "moe_every", "num_experts", "k", "expert_hidden", "n_embd", "n_head", "n_layer",
                        "group"})


def _upcycle_app_model(model: MoEModel, num_experts: int, k: int, granularity: int,
                       options: dict[str, Any]) -> nn.Module:
    """The GPT / ViT case: each ``DenseMLP`` (``fc``, GELU, ``proj``) becomes the MoELayer its config builds."""
    from flexmoe.apps.models.moe_model import DenseMLP, build_moe_mlp

    cfg: Any = model.cfg
    given = sorted(set(options) & _STRUCTURE)
    if given:
        raise ValueError(f"upcycle() sets {given} itself (num_experts, k and granularity decide the layers)")
    if cfg.group is not None:
        raise ValueError("upcycle() builds one process's model: upcycle it without a group, then load its state "
                         "dict into the expert-parallel model (as flexmoe train --upcycle-from does)")
    mlps: list[tuple[str, Any]] = [(name, m) for name, m in model.named_modules() if isinstance(m, DenseMLP)]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no dense MLP to upcycle")
    hidden = cfg.dense_hidden
    check_upcycle_shape(num_experts, k, granularity, hidden)
    routing = {"capacity_factor": 0.0, "router": "topk", **options}
    check_upcycle_routing(routing, num_experts, k)
    # from_dict refuses a name that is no field of the config (ValueError naming it).
    new_cfg = type(cfg).from_dict({**cfg.to_dict(), **routing, "dense": False, "moe_every": 1,
                                   "num_experts": num_experts, "k": k, "expert_hidden": hidden // granularity})
    scale = expert_scale(num_experts, k, granularity)  # the app models' layers normalise, softmax scores
    for name, mlp in mlps:
        layer = build_moe_mlp(new_cfg).to(device=mlp.fc.weight.device, dtype=mlp.fc.weight.dtype)
        dense = {"w1": mlp.fc.weight.T, "b1": mlp.fc.bias, "w2": mlp.proj.weight.T, "b2": mlp.proj.bias}
        with torch.no_grad():
            for part, value in slice_experts(dense, num_experts, granularity, scale).items():
                getattr(layer.experts, part).copy_(value)
            router: Any = layer.router  # the linear top-k router (check_upcycle_routing)
            router.weight.zero_()
        parent_name, _, child = name.rpartition(".")
        parent: Any = model.get_submodule(parent_name)
        setattr(parent, child, layer)
        if hasattr(parent, "is_moe"):
            parent.is_moe = True
    model.cfg = new_cfg
    return model
