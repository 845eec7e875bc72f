"""Which of a model's parameters Muon takes and which AdamW takes: :func:`muon_param_groups`, one function to read.

Muon is for the hidden layers' weight matrices: attention's and dense MLPs' ``[out, in]`` weights and the
experts' stacks ``[E, M, H]`` (each expert's matrix orthogonalised on its own). The rest is AdamW's, as in
Keller Jordan's, Moonlight's and torch's recipes: the embeddings and the output head (their rows are looked up
or read one token at a time, not one linear map), norms and biases (vectors), the experts' biases ``[E, H]``
(one vector per expert), and the router when the caller asks (``router_to_adamw``: Moonlight keeps it in Muon,
some recipes keep it apart; a router ``[E, M]`` is a small matrix either way).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flexmoe.checkpoint import expert_placement
from flexmoe.experts.modules import FeedForwardExperts
from flexmoe.model_routing import named_moe_layers
from flexmoe.sharding.model_experts import expert_parameters

__all__ = ["muon_param_groups"]

# The experts' vector parameters, one vector per expert: AdamW's.
_EXPERT_BIASES = ("b1", "b2", "b3", "gate_up_bias")


def muon_param_groups(model: nn.Module, *, router_to_adamw: bool = False,
                      head: nn.Module | None = None) -> list[dict[str, Any]]:
    """``model``'s parameters as :class:`~flexmoe.optim.MuonWithAdamW`'s param groups, each a dict with
    ``"params"`` and ``"use_muon"``; groups without parameters are left out, the rest in this order:

    1. Muon: every other matrix ``[out, in]`` and expert stack ``[E, M, H]``;
    2. Muon, ``"last_dim_parts": 2``: the joined gated pairs ``gate_up [E, M, 2H]``, each half orthogonalised on
       its own as the un-joined ``w1`` and ``w3`` would be (:mod:`flexmoe.optim.muon`);
    3. AdamW with the optimizer's weight decay: embeddings, ``head`` (the output projection; default: the
       ``get_output_embeddings()`` of the model or of its outermost submodule that has one, a Hugging Face model
       inside a wrapper), the router's weight with ``router_to_adamw``, and any other tensor of more than 3 dims
       (a convolution's);
    4. AdamW, ``"weight_decay": 0.0``: vectors (biases, norms) and the experts' biases ``[E, H]``.

    Raises ValueError for experts sharded inside each expert's matrix by expert parallelism (fewer experts than
    ranks: each rank a share of one expert's hidden units), where no rank holds a whole matrix to orthogonalise.
    """
    placement = expert_placement(model)
    if placement is not None and placement.layout.shards_per_expert > 1:
        raise ValueError(f"model: Muon orthogonalises each expert's whole matrix, but its experts are split into "
                         f"{placement.layout.shards_per_expert} hidden shards over the expert-parallel ranks "
                         f"({placement.layout.num_experts} experts, {placement.layout.world_size} ranks); use at "
                         f"most as many ranks as experts, or AdamW")
    if head is None:
        head = _output_embeddings(model)
    adamw_matrices = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    adamw_matrices |= {id(p) for p in head.parameters()} if head is not None else set()
    if router_to_adamw:
        adamw_matrices |= {id(p) for _, layer in named_moe_layers(model) for p in layer.router.parameters()}
    # Expert stacks: every MoE layer's routed experts, and any FeedForwardExperts (shared experts too).
    stacks = {id(p) for _, p, _ in expert_parameters(model)}
    stacks |= {id(p) for m in model.modules() if isinstance(m, FeedForwardExperts) for p in m.parameters()}
    gated_pairs = {id(m.gate_up) for m in model.modules() if isinstance(m, FeedForwardExperts)
                   and "gate_up" in m.joined_pairs()}

    muon: list[nn.Parameter] = []
    muon_pairs: list[nn.Parameter] = []
    adamw_decay: list[nn.Parameter] = []
    adamw_no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():  # each parameter once, however many modules share it
        if id(p) in gated_pairs:
            muon_pairs.append(p)
        elif (id(p) in stacks and name.rsplit(".", 1)[-1] in _EXPERT_BIASES) or p.dim() < 2:
            adamw_no_decay.append(p)
        elif id(p) in adamw_matrices or p.dim() > 3 or (p.dim() == 3 and id(p) not in stacks):
            adamw_decay.append(p)
        else:
            muon.append(p)
    groups = [{"params": muon, "use_muon": True}, {"params": muon_pairs, "use_muon": True, "last_dim_parts": 2},
              {"params": adamw_decay, "use_muon": False}, {"params": adamw_no_decay, "use_muon": False,
                                                          "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The output projection of the outermost module of ``model`` (itself first) that has Hugging Face's
    ``get_output_embeddings()``; None if none has."""
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if callable(getter):
            found = getter()
            if isinstance(found, nn.Module):
                return found
    return None
