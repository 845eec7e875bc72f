"""The routing tap: what an :class:`~flexmoe.MoELayer` asks, at each call, while its routing is recorded or replayed
(:attr:`MoELayer.routing_tap <flexmoe.MoELayer>`; the recording and replaying taps are in
:mod:`flexmoe.routing.replay`).

It lives apart from the taps so that the layer, which only consults it, does not import the record (the record
reads a model's layers: :meth:`flexmoe.RoutingRecord.from_routed_experts`).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["RoutingTap"]


class RoutingTap:
    """What a layer asks while recording or replaying (:attr:`MoELayer.routing_tap <flexmoe.MoELayer>`).

    ``replayed(x, num_experts, k, in_backward)``: the choices ``[T, k]`` this call must take, or None for the router's;
    ``chosen(x, expert_index)``: the call's choices ``[T, k]``, once made. x is the layer's input ``[..., M]``.
    """

    def replayed(self, x: Tensor, num_experts: int, k: int, in_backward: bool) -> Tensor | None:
        return None

    def chosen(self, x: Tensor, expert_index: Tensor, in_backward: bool) -> None:
        return None
