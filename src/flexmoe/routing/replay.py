"""Routing replay's values: the record of the experts MoE layers chose, and the taps a layer consults to record
its choices or to take recorded ones instead of its router's (``flexmoe.record_routing`` / ``flexmoe.replay_routing``
in :mod:`flexmoe.model_routing` put them on a model's layers).

Reinforcement learning needs it: the trainer must backpropagate through the experts the rollout engine chose,
not through the ones its own router (in another precision, with other weights, with exploration noise) would
choose. docs/architecture.md, "Routing replay", states the contract; in short:

* ``with record_routing(model) as record:`` collects, per MoE layer (keyed by its qualified name in
  ``model.named_modules()``), the chosen experts ``[T, k]`` of every forward call, in call order (a
  ``generate()`` loop's prefill and each decode step are calls of their own).
* ``with replay_routing(model, record):`` makes each layer's n-th call take the record's n-th choices for that
  layer. Only the choice is replayed: the combine weights are the layer's own scores at the given experts (its
  family's normalisation, route scale), so gradients reach the router; the capacity drops pairs as usual; the
  balance and z losses come from the layer's own logits.
* :meth:`RoutingRecord.joined` turns a decode record (a prefill of ``[B, P]`` tokens, then calls of ``[B, 1]``)
  into one call over the whole sequences ``[B, P + n]``, for one training forward over what was generated.
* :meth:`RoutingRecord.from_routed_experts` makes that one call per layer from an inference engine's choices
  ``[B, S, L, k]`` (vLLM's and SGLang's ``routed_experts``; :mod:`flexmoe.routing.engine_routing` reads them).

The taps sit on the layers only inside the ``with`` block (attribute ``MoELayer.routing_tap``, None outside).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from flexmoe.routing.engine_routing import routed_calls
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import check_choices

__all__ = ["RoutingRecord", "RoutingTap", "TappedLayer", "RecordingTap", "ReplayingTap"]


@dataclass
class RoutingRecord:
    """The experts MoE layers chose, per layer and call: a plain value that ``torch.save`` writes and
    ``torch.load(..., weights_only=True)`` reads back.

    calls: layer name -> the chosen experts of each call in order, ``[T, k]`` long (on the layer's device).
    sequences: layer name -> B of each call: the call's T tokens were B sequences of T / B tokens (its input was
        ``[B, S, M]``; 1 for a flat ``[T, M]`` input). :meth:`joined` needs it to put each sequence's tokens
        together.
    """

    calls: dict[str, list[Tensor]] = field(default_factory=dict)
    sequences: dict[str, list[int]] = field(default_factory=dict)

    def joined(self) -> RoutingRecord:
        """The record with each layer's calls made one: for every sequence, its tokens of every call in call order.

        A decode record (prefill ``[B, P]``, then ``n`` calls of ``[B, 1]``) becomes one call over ``[B, P + n]``,
        ordered as a forward over those whole sequences flattens its tokens (sequence by sequence). This is for
        decoding with a KV cache (HF ``generate()``), whose calls see only new tokens; a loop that re-runs the
        whole context at every step (the apps' ``GPT.generate``) has the whole sequence in its last call already.
        Raises ``ValueError`` when a layer's calls do not all have the same B.
        """
        calls: dict[str, list[Tensor]] = {}
        sequences: dict[str, list[int]] = {}
        for name, layer_calls in self.calls.items():
            batch = set(self.sequences[name])
            if len(batch) != 1:
                raise ValueError(f"layer {name!r}: its calls have different numbers of sequences {sorted(batch)}; "
                                 "joined() puts each sequence's tokens together and needs one B")
            b = batch.pop()
            per_sequence = [c.reshape(b, -1, c.shape[-1]) for c in layer_calls]  # [B, S_i, k]
            calls[name] = [torch.cat(per_sequence, dim=1).reshape(-1, layer_calls[0].shape[-1])]
            sequences[name] = [b]
        return RoutingRecord(calls, sequences)

    @classmethod
    def from_routed_experts(cls, routed: Any, model: nn.Module, attention_mask: Any = None) -> RoutingRecord:
        """The record of an inference engine's rollout: one call per MoE layer of ``model`` over the whole sequences,
        for one training forward ``model(input_ids, attention_mask=attention_mask)`` under
        :func:`~flexmoe.replay_routing`.

        routed: ``[B, S, L, k]`` integer expert ids, a numpy array or a tensor (vLLM's ``routed_experts``, SGLang's
            ``routed_experts``, padded into the batch as the token ids are): ``routed[b, s, l]`` the experts token
            ``input_ids[b, s]`` took in the model's ``l``-th MoE layer, in :func:`~flexmoe.model_routing.
            named_moe_layers` order (its MoE layers in ``named_modules()`` order).
        attention_mask: ``[B, S]`` of 0 and 1 (None: all 1): 0 where ``routed`` holds no choices (padding on either
            side, a sequence's last token when the engine's routing stops one short); those positions are not read
            and take placeholder experts (:mod:`flexmoe.routing.engine_routing`).

        Under expert parallelism each rank passes its own rows of the batch (the sequences it trains on). Raises
        ``TypeError`` / ``ValueError`` naming what does not fit: a value that is not an integer array, not 4 dims,
        another number of MoE layers or another top-k than the model's, an expert outside a layer's ``[0, E)``
        where the mask is 1, a mask of another ``[B, S]`` or with values other than 0 and 1.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a nn.Module, got {type(model).__name__}")
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, TappedLayer)]
        if not layers:
            raise ValueError(f"the model ({type(model).__name__}) has no flexmoe MoE layer to replay routing into")
        facts = [(name, layer.num_experts, layer.routing_options.k, _device_of(layer)) for name, layer in layers]
        calls, batch = routed_calls(routed, attention_mask, facts)
        return cls({name: [choices] for name, choices in calls.items()}, {name: [batch] for name in calls})

    def num_calls(self, name: str) -> int:
        """How many calls of layer ``name`` the record holds."""
        return len(self.calls.get(name, []))


# A record is plain tensors, lists, dicts and ints: safe to read back with weights_only=True once its class is known.
torch.serialization.add_safe_globals([RoutingRecord])


class RoutingTap:
    """What a layer asks while recording or replaying (:attr:`MoELayer.routing_tap <flexmoe.MoELayer>`).

    ``replayed(x, num_experts, k, in_backward)``: the choices ``[T, k]`` this call must take, or None for the router's;
    ``chosen(x, expert_index)``: the call's choices ``[T, k]``, once made. x is the layer's input ``[..., M]``.
    """

    def replayed(self, x: Tensor, num_experts: int, k: int, in_backward: bool) -> Tensor | None:
        return None

    def chosen(self, x: Tensor, expert_index: Tensor, in_backward: bool) -> None:
        return None


@runtime_checkable
class TappedLayer(Protocol):
    """A layer that takes a routing tap: what :meth:`RoutingRecord.from_routed_experts` reads of a model's
    :class:`~flexmoe.MoELayer` modules. The routing package does not import the layer (docs/architecture.md), so
    it knows them by these attributes; ``replay_routing`` then checks the record's layers against the model's
    ``MoELayer`` modules by name."""

    num_experts: int
    routing_options: RoutingOptions
    routing_tap: RoutingTap | None

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def _device_of(layer: TappedLayer) -> torch.device:
    """Where a layer's recorded choices go: its parameters' device (the CPU for a layer on the meta device, whose
    parameters are not materialised yet)."""
    param = next(layer.parameters(), None)
    return torch.device("cpu") if param is None or param.is_meta else param.device


def _num_sequences(x: Tensor) -> int:
    """B of a layer input ``[B, S, M]``; 1 for ``[T, M]``."""
    return int(x.shape[0]) if x.dim() == 3 else 1


class RecordingTap(RoutingTap):
    """Appends each call's choices to ``record`` under the layer's ``name``. A recomputation inside backward
    (activation checkpointing) repeats a call already recorded and is left out."""

    def __init__(self, record: RoutingRecord, name: str) -> None:
        self.record, self.name = record, name
        record.calls.setdefault(name, [])
        record.sequences.setdefault(name, [])

    def chosen(self, x: Tensor, expert_index: Tensor, in_backward: bool) -> None:
        if in_backward:
            return
        self.record.calls[self.name].append(expert_index.detach().clone())
        self.record.sequences[self.name].append(_num_sequences(x))


class ReplayingTap(RoutingTap):
    """Gives the layer ``name`` the recorded choices of ``calls``, one call after the other, after checking that
    they fit the call (T, k, the expert range); ``ValueError`` naming the layer and the call when not, or when the
    layer makes more calls than recorded."""

    def __init__(self, calls: list[Tensor], name: str) -> None:
        self.calls, self.name = calls, name
        self.next_call = 0

    def replayed(self, x: Tensor, num_experts: int, k: int, in_backward: bool) -> Tensor | None:
        if in_backward:
            # A recomputation (activation checkpointing) would take the next call's choices, not its own.
            raise ValueError(f"layer {self.name!r}: routing replay under activation checkpointing is not supported "
                             "(the recomputation inside backward would replay another call)")
        n = self.next_call
        if n >= len(self.calls):
            raise ValueError(f"layer {self.name!r} made more calls than the record holds ({len(self.calls)}); "
                             "for one forward over a decode record's whole sequences replay record.joined()")
        expert_index = self.calls[n]
        check_choices(expert_index, num_experts, num_tokens=x.numel() // x.shape[-1], k=k,
                      name=f"the record's call {n} of layer {self.name!r}")
        self.next_call += 1
        return expert_index.to(x.device)
