"""The routing options of a layer: how tokens pick experts and how many each expert takes.

One frozen dataclass, validated once when it is made. A new routing option is one field here plus its line in
the docstring; :meth:`RoutingOptions.describe` (the cross-rank agreement) and the layer's keyword constructor
pick it up from the field list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flexmoe.routing.families import check_family_options
from flexmoe.routing.scores import TIES, check_select_by
from flexmoe.validation import (
    check_choice,
    check_float,
    check_float_dtype,
    check_int,
    check_optional_int,
    constant_float,
    describe_value,
)

__all__ = ["RoutingOptions", "ROUTER_NAMES", "selection_kind"]

ROUTER_NAMES = ("topk", "cosine", "expert_choice", "base")


def selection_kind(router: object) -> str:
    """How experts are picked for a ``router=`` value: "expert_choice", "base", or "topk" (anything else)."""
    return router if router in ("expert_choice", "base") else "topk"


@dataclass(frozen=True)
class RoutingOptions:
    """How a layer routes (see docs/architecture.md, "The routing contract").

    k: choices per token, >= 1 (and <= num_experts, checked by the layer).
    capacity_factor: > 0 fixed capacity ``ceil(k * cf * T / E)``; 0 dropless; < 0 adaptive, at most
        ``ceil(k * |cf| * T / E)`` and never more than the largest load.
    capacity: an explicit per-expert capacity (int >= 0) that overrides ``capacity_factor``.
    router: "topk" (linear, no bias), "cosine" (SwinV2-MoE), "expert_choice", "base", or a module ``[T, M] -> [T, E]``
        (``[B, S, M] -> [B, S, E]`` when the routing is per sequence: ``capacity_per`` or ``aux_loss_type``
        "sequence").
    router_dtype: dtype of the routing math (default float32, whatever the model's dtype: autocast is off around
        the router). None: the router's own precision: it runs under the caller's autocast like any module and
        the routing math runs in its logits' dtype, the softmax in float32 at least (a converted Hugging Face
        model's default, routing as HF does).
    normalize_weights: divide the k weights of a token by their sum (k > 1).
    batch_prioritized: hand out slots by descending top-1 probability instead of token order.
    score_at: "combine" weights expert outputs when combining; "dispatch" scales expert inputs.
    jitter: multiplicative input noise in [0, 1], training only.
    gate_noise: std of the noise added to the logits, >= 0, training only.
    router_input_dropout: dropout on the router's input in [0, 1], training only.
    balance: "aux" (balance loss in ``aux_loss``) or "bias" (a selection bias per expert, top-k routers only).
    bias_update_rate: the step of the ``balance="bias"`` update, finite and >= 0.
    second_expert: "top" or "random" (GShard's random 2nd expert in training, k=2 top-k routers only).
    cross_node_share: FasterMoE's topology-aware gate: the share of pairs that may cross nodes, in [0, 1]
        (None: off; top-k routers only).

    The open MoE families (:mod:`flexmoe.routing.families` says which options reproduce which model):
    score_func: "softmax" (default) or "sigmoid" (DeepSeek-V3) router scores; the combine weights are the chosen
        experts' scores (normalised over the k with ``normalize_weights``) times ``route_scale``.
    num_expert_groups, num_limited_groups: group-limited routing (None: off): E experts in G groups of E/G
        consecutive experts, a group rated by the sum of its two best selection scores (score + bias), only a
        token's best ``num_limited_groups`` groups eligible for its top-k.
    route_scale: a float > 0 multiplying the routed weights (DeepSeek-V3's ``routed_scaling_factor``).
    router_bias: the linear router has a bias ``router.bias: [E]`` (GPT-OSS, Switch).
    capacity_per: "call" (capacity over all tokens of the call) or "sequence" (x ``[B, S, M]``: each sequence
        has its own per-expert capacity, computed from S; Switch Transformer).
    aux_loss_type: "switch" (``E * sum_e f_e P_e`` over the 1st choices), "all_choices" (over all k choices,
        Hugging Face's Mixtral-family loss), "sequence" (DeepSeek-V3's sequence-wise loss, x ``[B, S, M]``) or
        "global" (``E * sum_e f_e P_e`` with f_e the share of all k choices over the whole data-parallel batch and
        the step's micro-batches so far, :mod:`flexmoe.routing.global_balance`; the training loop calls
        :func:`flexmoe.reset_global_balance` once per optimizer step).
    ties: how a top-k router breaks equal scores: "lower" (the lower expert index, the same on every device) or
        "topk" (as ``torch.topk``, which Hugging Face's routers call: a converted model's default, since bf16
        logits under autocast tie often).
    select_by: what a top-k router ranks to pick a token's k experts: "scores" (default; plus the selection bias,
        within the group limit) or "logits" (GPT-OSS's router: the top-k of the logits; without ``balance="bias"``
        or groups). The same experts, save where distinct logits give equal scores (a softmax underflowing to 0,
        a sigmoid rounding to 1), which "logits" still orders. A softmax router's renormalised weights then need
        no softmax over all E experts.
    """

    k: int = 2
    capacity_factor: float = 1.25
    capacity: int | None = None
    router: str | nn.Module = "topk"
    router_dtype: torch.dtype | None = torch.float32
    normalize_weights: bool = True
    batch_prioritized: bool = False
    score_at: str = "combine"
    jitter: float = 0.0
    gate_noise: float = 0.0
    router_input_dropout: float = 0.0
    balance: str = "aux"
    bias_update_rate: float = 1e-3
    second_expert: str = "top"
    cross_node_share: float | None = None
    score_func: str = "softmax"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    route_scale: float = 1.0
    router_bias: bool = False
    capacity_per: str = "call"
    aux_loss_type: str = "switch"
    ties: str = "lower"
    select_by: str = "scores"
    # Set per instance by __post_init__ (see static_capacity_factor); ClassVar keeps them out of the fields.
    _capacity_factor_ratio: ClassVar[tuple[int, int]]
    # "topk", "expert_choice" or "base": how experts are picked (selection_kind of router). Stored rather than a
    # property: every call asks, and a property costs a small call host time.
    selection: ClassVar[str]

    def __post_init__(self) -> None:
        check_int("k", self.k, 1)
        self._set("capacity_factor", check_float("capacity_factor", self.capacity_factor))
        self._set("_capacity_factor_ratio", self.capacity_factor.as_integer_ratio())
        check_optional_int("capacity", self.capacity, 0)
        check_float_dtype("router_dtype", self.router_dtype)
        self._set("normalize_weights", bool(self.normalize_weights))
        self._set("batch_prioritized", bool(self.batch_prioritized))
        check_choice("score_at", self.score_at, ("combine", "dispatch"))
        self._set("jitter", check_float("jitter", self.jitter, 0.0, 1.0))
        self._set("gate_noise", check_float("gate_noise", self.gate_noise, 0.0))
        self._set("router_input_dropout", check_float("router_input_dropout", self.router_input_dropout, 0.0, 1.0))
        self._set("selection", selection_kind(self.router))
        self._check_selection()

    def _check_selection(self) -> None:
        """The options that depend on how experts are selected (which router, which balancing)."""
        router = self.router
        if isinstance(router, str):
            if router not in ROUTER_NAMES:
                raise ValueError(f"router must be one of {list(ROUTER_NAMES)} or an nn.Module, got {router!r}")
        elif not isinstance(router, nn.Module):
            raise TypeError(f"router must be a name or an nn.Module, got {type(router).__name__}")
        check_choice("balance", self.balance, ("aux", "bias"))
        rate = self.bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"bias_update_rate must be a number, got {type(rate).__name__}")
        rate = constant_float(rate)
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"bias_update_rate must be finite and >= 0, got {rate}")
        self._set("bias_update_rate", rate)
        check_choice("second_expert", self.second_expert, ("top", "random"))
        check_choice("ties", self.ties, TIES)
        share = self.cross_node_share
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)):
                raise TypeError(f"cross_node_share must be a number or None, got {type(share).__name__}")
            share = constant_float(share)
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"cross_node_share must be in [0, 1], got {share}")
            self._set("cross_node_share", share)

        kind = self.selection
        if kind == "expert_choice" and self.capacity is None and not self.capacity_factor > 0:
            raise ValueError(
                f"router='expert_choice' needs capacity_factor > 0 (each expert takes C = ceil(k * cf * T / E) "
                f"tokens) or an explicit capacity, got capacity_factor={self.capacity_factor}"
            )
        if kind != "topk":
            # These act on the k choices of each token, which expert choice and BASE do not make.
            if self.balance == "bias":
                raise ValueError(f"balance='bias' needs a top-k router; router={router!r} is balanced by construction")
            if self.second_expert == "random":
                raise ValueError(f"second_expert='random' needs a top-k router, got router={router!r}")
            if self.cross_node_share is not None:
                raise ValueError(f"cross_node_share needs a top-k router, got router={router!r}")
            if self.select_by != "scores":
                raise ValueError(f"select_by={self.select_by!r} needs a top-k router, got router={router!r}")
        if self.second_expert == "random" and self.k != 2:
            raise ValueError(f"second_expert='random' is GShard's rule for k=2 (a token's two choices), got k={self.k}")
        check_family_options(
            router=router, k=self.k, score_func=self.score_func, num_expert_groups=self.num_expert_groups,
            num_limited_groups=self.num_limited_groups, route_scale=self.route_scale, router_bias=self.router_bias,
            capacity_per=self.capacity_per, aux_loss_type=self.aux_loss_type, cross_node_share=share,
        )
        self._set("route_scale", float(self.route_scale))
        check_select_by(self.select_by, self.balance == "bias", self.num_expert_groups)

    @property
    def needs_sequences(self) -> bool:
        """Whether routing needs the input's sequences (x ``[B, S, M]``)."""
        return self.capacity_per == "sequence" or self.aux_loss_type == "sequence"

    def describe(self) -> dict[str, Any]:
        """Every field as a value that compares equal across processes (modules by class name)."""
        return {f.name: describe_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @property
    def static_capacity_factor(self) -> float:
        """``capacity_factor``, the same float, as a constant to a ``torch.compile`` trace: under
        ``dynamic=True`` dynamo turns the layer's float options into symbolic floats, and a capacity computed
        from one cannot be passed on to the dispatch's autograd function ("Source of ... is None"). The two
        ints of the float's exact ratio, stored when the options were made, are constants, and their quotient
        is exactly the float again."""
        numerator, denominator = self._capacity_factor_ratio
        return numerator / denominator

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # normalizing a field of the frozen instance during validation
