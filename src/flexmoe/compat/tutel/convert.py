"""Tutel checkpoints to and from :class:`flexmoe.MoELayer` state dicts.

A Tutel MoE layer at prefix ``p`` (found by its ``p + "experts.batched_fc1_w"``) holds, per rank::

    p_num_global_experts    E
    pexperts.batched_fc1_w  [E_local, H_local, M]     pexperts.batched_fc1_bias  [E_local, H_local]
    pexperts.batched_fc2_w  [E_local, H_local, M]     pexperts.batched_fc2_bias  [E_local, ceil(M / s)]
    pgates.0.wg.weight      [E, M]  (top gate; the cosine_top gate: temperature, sim_matrix, cosine_projector.*)

where rank r holds experts ``r * E_local ...`` (E >= world) or, with s = world / E ranks per expert, the
hidden slice ``r % s`` of expert ``r // s`` and slice ``r % s`` of its fc2 bias (the slices concatenated and
cut to M give the whole bias). The same layer as one global ``MoELayer`` (built-in experts, ``router="topk"``;
the cosine gate as ``router=flexmoe.compat.tutel.gates.CosineTopKGate(M, E, proj_dim=...)``)::

    prouter.weight  [E, M]   pexperts.w1 [E, M, H]   pexperts.b1 [E, H]   pexperts.w2 [E, H, M]   pexperts.b2 [E, M]

Every other key (the rest of the model) is copied from rank 0. For a flexmoe expert-parallel run, cut the
global experts per rank with :func:`flexmoe.parallel.shard_expert_state`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from flexmoe.compat.tutel.system import apply_rank_size_from_pattern

__all__ = ["tutel_to_flexmoe", "flexmoe_to_tutel", "load_tutel_files", "save_tutel_files"]

_TUTEL_EXPERT_KEYS = ("batched_fc1_w", "batched_fc1_bias", "batched_fc2_w", "batched_fc2_bias")
_COSINE_KEYS = ("temperature", "sim_matrix", "cosine_projector.weight", "cosine_projector.bias")


def _prefixes(state: Mapping[str, Tensor], marker: str) -> list[str]:
    return [key[: -len(marker)] for key in state if key.endswith(marker)]


def _as_list(states: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]]) -> list[Mapping[str, Tensor]]:
    if isinstance(states, Mapping):
        return [states]
    states = list(states)
    if not states or not all(isinstance(s, Mapping) for s in states):
        raise TypeError("states must be a state dict or a non-empty list of per-rank state dicts (rank order)")
    return states


def tutel_to_flexmoe(states: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
                     gate_index: int = 0) -> dict[str, Tensor]:
    """One global flexmoe state dict from a Tutel checkpoint: one state dict, or one per rank in rank order.

    Each Tutel MoE layer becomes a global ``MoELayer``'s keys (its gate ``gate_index`` as the router); the
    other keys come from rank 0.
    """
    states = _as_list(states)
    world = len(states)
    prefixes = _prefixes(states[0], "experts.batched_fc1_w")
    owned = {p + name for p in prefixes for name in ("_num_global_experts",)} | {
        key for p in prefixes for key in states[0] if key.startswith(p + "experts.") or key.startswith(p + "gates.")}
    out = {key: value for key, value in states[0].items() if key not in owned}
    for p in prefixes:
        for r, s in enumerate(states):
            if p + "experts.batched_fc1_w" not in s:
                raise ValueError(f"rank {r}'s state dict has no {p}experts.batched_fc1_w (rank 0's has)")
        out.update(_layer_to_flexmoe([s for s in states], p, world, gate_index))
    return out


def _layer_to_flexmoe(states: list[Mapping[str, Tensor]], p: str, world: int, gate_index: int) -> dict[str, Tensor]:
    local = states[0][p + "experts.batched_fc1_w"].shape[0]
    num_experts = int(states[0].get(p + "_num_global_experts", torch.tensor(local * world)))
    model_dim = states[0][p + "experts.batched_fc1_w"].shape[-1]

    def gathered(name: str) -> Tensor | None:
        key = p + "experts." + name
        if key not in states[0]:
            return None
        pieces = [s[key] for s in states]
        if num_experts >= world:
            if local * world != num_experts:
                raise ValueError(f"{p}: {world} rank files of {local} experts each, but {num_experts} experts")
            return torch.cat(pieces, dim=0)
        shards = world // num_experts  # ranks per expert, each with one hidden slice
        per_expert = [torch.cat(pieces[e * shards:(e + 1) * shards], dim=1) for e in range(num_experts)]
        return torch.cat(per_expert, dim=0)

    fc1_w, fc2_w = gathered("batched_fc1_w"), gathered("batched_fc2_w")
    fc1_b, fc2_b = gathered("batched_fc1_bias"), gathered("batched_fc2_bias")
    if fc1_w is None or fc2_w is None:  # fc1_w is there: the layer was found by it
        raise ValueError(f"{p}: the Tutel layer has experts.batched_fc1_w but no experts.batched_fc2_w")
    out = {p + "experts.w1": fc1_w.transpose(1, 2).contiguous(), p + "experts.w2": fc2_w.contiguous()}
    if (fc1_b is None) != (fc2_b is None):
        raise ValueError(f"{p}: MoELayer's experts have both biases or neither; this Tutel layer has one")
    if fc1_b is not None and fc2_b is not None:
        out[p + "experts.b1"] = fc1_b.contiguous()
        out[p + "experts.b2"] = fc2_b[:, :model_dim].contiguous()

    gate = f"{p}gates.{gate_index}."
    if gate + "wg.weight" in states[0]:
        out[p + "router.weight"] = states[0][gate + "wg.weight"]
    elif gate + "sim_matrix" in states[0]:
        for name in _COSINE_KEYS:
            out[p + "router." + name] = states[0][gate + name]
    else:
        raise ValueError(f"{p}: no gate {gate_index} of type 'top' or 'cosine_top' (custom gates do not convert)")
    return out


def flexmoe_to_tutel(state: Mapping[str, Tensor], world_size: int = 1) -> list[dict[str, Tensor]]:
    """Per-rank Tutel state dicts (``world_size`` of them) from a global flexmoe state dict.

    Every ``MoELayer`` (found by ``experts.w1``) becomes a Tutel layer with one gate (``gates.0``); the experts
    are cut as Tutel lays them out over ``world_size`` ranks; other keys are copied to every rank.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    prefixes = _prefixes(state, "experts.w1")
    owned = {key for p in prefixes for key in state if key.startswith(p + "experts.") or key.startswith(p + "router.")}
    rest = {key: value for key, value in state.items() if key not in owned}
    ranks = [dict(rest) for _ in range(world_size)]
    for p in prefixes:
        for r, layer in enumerate(_layer_to_tutel(state, p, world_size)):
            ranks[r].update(layer)
    return ranks


def _layer_to_tutel(state: Mapping[str, Tensor], p: str, world: int) -> list[dict[str, Tensor]]:
    for extra in ("experts.w3", "shared.w1", "expert_bias"):
        if p + extra in state:
            raise ValueError(f"{p}{extra}: Tutel's layer has no equivalent (GLU experts, shared experts or the "
                             "bias balance); only plain FFN experts convert")
    w1 = state[p + "experts.w1"]
    num_experts, model_dim, hidden = w1.shape
    fc1_w, fc2_w = w1.transpose(1, 2), state[p + "experts.w2"]
    fc1_b, fc2_b = state.get(p + "experts.b1"), state.get(p + "experts.b2")
    if (fc1_b is None) != (fc2_b is None):
        raise ValueError(f"{p}: Tutel's experts have both biases or neither; this layer has only one of "
                         "experts.b1 and experts.b2")

    if p + "router.weight" in state and p + "router.log_temperature" not in state:
        gate = {"gates.0.wg.weight": state[p + "router.weight"]}
    elif all(p + "router." + name in state for name in _COSINE_KEYS):
        gate = {"gates.0." + name: state[p + "router." + name] for name in _COSINE_KEYS}
    else:
        raise ValueError(f"{p}router: only the linear top-k router and flexmoe.compat.tutel.gates.CosineTopKGate "
                         "convert (flexmoe's CosineRouter has no projector, unlike Tutel's cosine gate)")

    out = []
    for r in range(world):
        if num_experts >= world:
            if num_experts % world:
                raise ValueError(f"{p}: {num_experts} experts do not divide over {world} ranks")
            local = num_experts // world
            pick = slice(r * local, (r + 1) * local)
            layer = {"experts.batched_fc1_w": fc1_w[pick], "experts.batched_fc2_w": fc2_w[pick]}
            if fc1_b is not None and fc2_b is not None:
                layer["experts.batched_fc1_bias"] = fc1_b[pick]
                layer["experts.batched_fc2_bias"] = fc2_b[pick]
        else:
            if world % num_experts or hidden % (world // num_experts):
                raise ValueError(f"{p}: {num_experts} experts of hidden size {hidden} do not shard over {world} ranks")
            shards = world // num_experts
            e, j = divmod(r, shards)
            h = hidden // shards
            layer = {"experts.batched_fc1_w": fc1_w[e:e + 1, j * h:(j + 1) * h],
                     "experts.batched_fc2_w": fc2_w[e:e + 1, j * h:(j + 1) * h]}
            if fc1_b is not None and fc2_b is not None:
                piece = -(-model_dim // shards)
                padded = fc2_b.new_zeros(num_experts, piece * shards)
                padded[:, :model_dim] = fc2_b
                layer["experts.batched_fc1_bias"] = fc1_b[e:e + 1, j * h:(j + 1) * h]
                layer["experts.batched_fc2_bias"] = padded[e:e + 1, j * piece:(j + 1) * piece]
        layer = {key: value.contiguous() for key, value in layer.items()}
        layer.update(gate)
        layer["_num_global_experts"] = torch.tensor(num_experts)
        out.append({p + key: value for key, value in layer.items()})
    return out


def load_tutel_files(pattern: str, size: int) -> list[dict[str, Tensor]]:
    """The per-rank state dicts ``pattern`` names (Tutel's ``{rank}``/``{size}`` pattern), rank order."""
    states = []
    for rank in range(size):
        path = apply_rank_size_from_pattern(pattern, rank=rank, size=size, create_dir=False)
        if not os.path.exists(path):
            raise FileNotFoundError(f"rank {rank} of {size}: no checkpoint file {path}")
        states.append(torch.load(path, map_location="cpu", weights_only=True))
    return states


def save_tutel_files(states: Sequence[Mapping[str, Tensor]], pattern: str) -> list[str]:
    """Write per-rank state dicts under ``pattern`` (``{rank}``, ``{size}``); the paths written."""
    paths = []
    for rank, state in enumerate(states):
        path = apply_rank_size_from_pattern(pattern, rank=rank, size=len(states))
        torch.save(dict(state), path)
        paths.append(path)
    return paths
