"""Reading an inference engine's routing: the experts each token took in a rollout, as vLLM and SGLang return them,
checked and laid out as routing replay's calls (:meth:`flexmoe.RoutingRecord.from_routed_experts` builds the
record from them; docs/architecture.md, "Routing replay", states the convention).

What the engines return, per request (vLLM ``CompletionOutput.routed_experts`` with
``enable_return_routed_experts=True``; SGLang ``meta_info["routed_experts"]`` with ``--enable-return-routed-experts``
and ``return_routed_experts=True``, base64 int32 to decode): an integer array ``[tokens, layers, top_k]`` over the
prompt and the generated tokens but the last (the last token was sampled, never run through the model), unpadded.
An RL framework pads them into a batch as it pads the token ids; what is read here is that batch:

* ``routed [B, S, L, k]``: ``routed[b, s, l]`` the experts that token ``s`` of sequence ``b`` (the training
  forward's ``input_ids[b, s]``) took in the model's ``l``-th MoE layer;
* ``attention_mask [B, S]``: 1 where ``routed`` holds the token's choices, 0 where it does not (padding on the left,
  the right or between, and a sequence's last token where the engine's routing stops one short). Positions at 0 are
  not read: they get placeholder choices (below).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import Tensor

__all__ = ["LayerFacts", "routed_calls"]

# What the record needs of each MoE layer: (qualified name, number of experts, k, device of its choices).
LayerFacts = tuple[str, int, int, torch.device]


def routed_calls(routed: Any, attention_mask: Any, layers: list[LayerFacts]) -> tuple[dict[str, Tensor], int]:
    """``routed [B, S, L, k]`` (and ``attention_mask [B, S]``, None: every position holds a choice) -> (layer name ->
    its choices ``[B * S, k]`` long, sequence by sequence as a forward over ``[B, S]`` flattens its tokens; B).

    The layer axis is ``layers``' order. Masked positions get placeholder choices, spread over the experts in turn
    (position ``t`` of the ``B * S``, choice ``j``: expert ``(t * k + j) mod E``) so that they load none of them more
    than another: their outputs are not trained on, and in a dropless layer they change no other token's output.

    Raises ``TypeError`` for a value that is not a numpy array or a tensor, or holds no integers (the mask: no 0/1
    integers or booleans), ``ValueError`` naming what differs for a shape that does not fit (not 4 dims, another
    number of layers, another top-k than a layer routes, a mask of other ``[B, S]`` or values other than 0 and 1) and
    for a choice outside ``[0, E)`` where the mask is 1.
    """
    choices = _as_tensor(routed, "routed")
    if not _is_integer(choices):
        raise TypeError(f"routed must hold integer expert ids, got dtype {choices.dtype}")
    if choices.dim() != 4:
        raise ValueError(f"routed must be [batch, seq, layers, top_k] (4 dims), got shape {tuple(choices.shape)}")
    batch, seq, num_layers, k = choices.shape
    if batch * seq * k == 0:
        raise ValueError(f"routed holds no choices: shape {tuple(choices.shape)}")
    if num_layers != len(layers):
        raise ValueError(f"routed has {num_layers} layers (its axis 2), the model has {len(layers)} MoE layers "
                         f"{[name for name, *_ in layers]}; an engine that returns every decoder layer needs its "
                         "MoE layers' entries selected, in the model's order")
    padding = (~_mask(attention_mask, batch, seq).reshape(-1)).nonzero().squeeze(1)  # [P] token positions
    # Each layer's [B*S, k] contiguous and long (the record's dtype; engines give int32), in one copy of our own.
    per_layer = torch.empty(num_layers, batch * seq, k, dtype=torch.int64)
    per_layer.view(num_layers, batch, seq, k).copy_(choices.permute(2, 0, 1, 3))
    calls: dict[str, Tensor] = {}
    for axis, (name, num_experts, layer_k, device) in enumerate(layers):
        if k != layer_k:
            raise ValueError(f"routed has top_k={k} (its axis 3), MoE layer {name!r} routes k={layer_k}")
        filled = per_layer[axis]
        # Placeholders on the padding: token t's choice j is expert (t*k + j) mod E, distinct per token as k <= E.
        filled[padding] = (padding.unsqueeze(1) * k + torch.arange(k)) % num_experts
        low, high = (int(v) for v in torch.aminmax(filled))  # the placeholders are in range: only real ids can fail
        if low < 0 or high >= num_experts:
            _range_error(filled.reshape(batch, seq, k), num_experts, axis, name)
        calls[name] = filled.to(device)
    return calls, batch


def _as_tensor(value: Any, name: str) -> Tensor:
    """``value`` (a tensor or a numpy array) as a CPU tensor; ``TypeError`` naming ``name`` for anything else."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        try:
            return torch.tensor(value)  # a copy: engines' arrays are often read-only views of a decoded buffer
        except TypeError:
            raise TypeError(f"{name} must hold integers, got a numpy array of dtype {value.dtype}") from None
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")


def _is_integer(tensor: Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def _mask(attention_mask: Any, batch: int, seq: int) -> Tensor:
    """The positions that hold choices, ``[B, S]`` bool; ``TypeError`` / ``ValueError`` when ``attention_mask`` is
    not ``[B, S]`` of 0 and 1 (integers or booleans)."""
    if attention_mask is None:
        return torch.ones(batch, seq, dtype=torch.bool)
    mask = _as_tensor(attention_mask, "attention_mask")
    if mask.dtype != torch.bool and not _is_integer(mask):
        raise TypeError(f"attention_mask must hold 0 and 1 as integers or booleans, got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, seq):
        raise ValueError(f"attention_mask is {list(mask.shape)}, routed's tokens are [{batch}, {seq}] (its first two "
                         "dims): the mask must be the batch's, one entry per token")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"attention_mask must hold 0 and 1, got values {sorted(set(mask.unique().tolist()))}")
        mask = mask == 1
    return mask


def _range_error(layer_choices: Tensor, num_experts: int, axis: int, name: str) -> NoReturn:
    """``ValueError`` naming the first position where ``layer_choices [B, S, k]`` (the mask's 0s filled in range)
    is outside ``[0, num_experts)``; a negative id there is read as a token the engine gave no routing."""
    bad = (layer_choices < 0) | (layer_choices >= num_experts)
    b, s, j = (int(i) for i in bad.nonzero()[0])
    value = int(layer_choices[b, s, j])
    where = f"routed[{b}, {s}, {axis}] (MoE layer {name!r})"
    if value < 0:
        raise ValueError(f"{where} holds expert {value} where attention_mask is 1: the engine gave this token no "
                         "routing (padding, or a sequence's last token, which the engine never ran through the "
                         "model); set attention_mask to 0 there, or check that routed is aligned with the tokens")
    raise ValueError(f"{where} holds expert {value}, outside [0, {num_experts}) of the layer's experts")
