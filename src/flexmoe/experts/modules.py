"""Experts: batched feed-forward networks, and the protocol a custom expert follows.

An expert module takes the dispatched rows ``x: [N, M]`` (sorted by local expert) and the per-expert row
counts ``counts: list[int]`` (``sum(counts) == N``) and returns ``[N, M]``. Any module with that forward can be
passed to ``MoELayer(experts=...)``.

Under ``torch.compile`` in capacity mode the layer pads every expert to the same number of rows
(docs/architecture.md, "Compiling the layer"): the built-in experts then compute only the real rows through a
custom op (:mod:`flexmoe.experts.padded_op`), or where it cannot run
:func:`~flexmoe.experts.row_kernels.padded_expert_ffn` on the
``[E, R, M]`` view (batched matmuls); a custom expert module gets its usual call with ``counts = [R] * E``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.experts.chooser import KernelChooser
from flexmoe.experts.kernels import KERNELS, RULE_KERNEL
from flexmoe.experts.row_kernels import one_expert_ffn
from flexmoe.experts.weights import WEIGHT_NAMES, ExpertWeights
from flexmoe.validation import check_float_dtype, check_int, describe_value

__all__ = ["ExpertOptions", "FeedForwardExperts", "JOINED_HALVES", "JOINED_PAIRS", "side_by_side_halves",
           "parameter_of", "joined_parameter_halves", "ExpertsCall", "differentiated_weights", "expert_ffn",
           "check_glu_limit", "resolve_activation", "activation_name", "activation_derivative", "activation_into"]

# Each joined parameter and the names of its halves (w1 | w3 as HF's gate_up_proj lays them out).
JOINED_PAIRS: tuple[tuple[str, tuple[str, str]], ...] = (("gate_up", ("w1", "w3")), ("gate_up_bias", ("b1", "b3")))
# Joined experts' views by name: the joined parameter each is a half of, and which half.
JOINED_HALVES: dict[str, tuple[str, int]] = {half: (joined, i) for joined, pair in JOINED_PAIRS
                                             for i, half in enumerate(pair)}
# The order plain experts register their parameters in, and every experts' state dict keys.
_REGISTRATION_ORDER: tuple[str, ...] = ("w1", "w2", "w3", "b1", "b2", "b3")


def side_by_side_halves(joined: Tensor) -> tuple[Tensor, Tensor]:
    """joined: ``[..., 2H]`` -> its two halves ``[..., H]`` (views: writing them writes ``joined``)."""
    half = joined.shape[-1] // 2
    return joined[..., :half], joined[..., half:]


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def resolve_activation(activation: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``"gelu"`` (exact), ``"relu"``, ``"silu"`` or any callable applied elementwise."""
    if callable(activation):
        return activation
    if activation in _ACTIVATIONS:
        return _ACTIVATIONS[activation]
    raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)} or a callable, got {activation!r}")


def activation_name(activation: Callable[[Tensor], Tensor]) -> str | None:
    """The name :func:`resolve_activation` knows ``activation`` by, or None for any other callable."""
    return next((name for name, fn in _ACTIVATIONS.items() if fn is activation), None)


# The derivative eager autograd runs for each named activation (GeluBackward0, ReluBackward0, SiluBackward0):
# derivative(grad, pre, out) writes d loss / d pre into out (which may be grad itself) and returns it.
_ACTIVATION_DERIVATIVES: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "gelu": lambda grad, pre, out: torch.ops.aten.gelu_backward.grad_input(grad, pre, grad_input=out),
    "relu": lambda grad, pre, out: torch.ops.aten.threshold_backward.grad_input(grad, pre, 0, grad_input=out),
    "silu": lambda grad, pre, out: torch.ops.aten.silu_backward.grad_input(grad, pre, grad_input=out),
}


def activation_derivative(activation: Callable[[Tensor], Tensor]) -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    """``derivative(grad, pre, out)`` for a named activation (the kernel eager autograd runs, writing
    ``activation'(pre) * grad`` into ``out``), or None for any other callable."""
    name = activation_name(activation)
    return None if name is None else _ACTIVATION_DERIVATIVES.get(name)


# Each named activation written into a given buffer (its aten out= variant): activation(pre, out) -> out.
_ACTIVATIONS_INTO: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gelu": lambda pre, out: torch.ops.aten.gelu.out(pre, out=out),
    "relu": lambda pre, out: torch.ops.aten.relu.out(pre, out=out),
    "silu": lambda pre, out: torch.ops.aten.silu.out(pre, out=out),
}


def activation_into(activation: Callable[[Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``into(pre, out)`` writing a named activation of ``pre`` into ``out``, or None for any other callable."""
    name = activation_name(activation)
    return None if name is None else _ACTIVATIONS_INTO.get(name)


@dataclass(frozen=True)
class ExpertOptions:
    """The built-in experts of a layer (model_dim, num_experts and hidden_dim are the layer's arguments).

    activation: "gelu" (exact), "relu", "silu" or a callable applied elementwise.
    glu: gated experts (a third matrix ``w3``, SwiGLU-style with activation="silu").
    bias: the experts' linear layers have biases.
    shared_experts: N >= 0 dense experts every token passes through (DeepSeek-MoE), replicated on every rank.
    shared_hidden_dim: hidden size of each shared expert (None: the layer's ``hidden_dim``; Qwen2-MoE and
        DeepSeek-V3 use their own).
    shared_gate: scale the shared experts' summed output by ``sigmoid(x @ shared_gate.weight.T)``, a learned
        ``[1, M]`` gate (Qwen2-MoE); needs ``shared_experts >= 1``.
    glu_limit: GPT-OSS's gated unit for ``glu=True`` experts (routed and shared),
        ``activation(min(gate, L)) * (clamp(up, -L, L) + 1)`` with ``L = glu_limit`` (None: ``activation(gate) * up``).
    expert_kernel: how the experts compute their rows: "auto" (timed per case on this machine, cached:
        :class:`~flexmoe.experts.chooser.KernelChooser`) or a kernel of :data:`flexmoe.experts.kernels.KERNELS`
        ("loop", "segmented", "grouped_mm", "embedding_bag", "joined_unit"), which runs wherever it can, compiled
        calls included (elsewhere a warning names it and why, once: :class:`~flexmoe.experts.stage.ExpertStage`).
    expert_route: how the expert stage runs: "auto" (the fused route where measured faster, per case, as the
        kernels; the rows route under a forced kernel), "fused" (dispatch, experts and combine fused expert by
        expert, :mod:`flexmoe.experts.fused`, wherever it runs) or "rows" (dispatch, the experts' kernel, combine).
    kernel_cache: the directory of the measured choices' file, ``kernels-<machine>.json`` (None:
        ``~/.cache/flexmoe``).
    experts_autocast: whether the routed experts' matmuls follow the caller's ``torch.autocast`` (True: in its
        dtype) or compute in the experts' parameters' dtype with autocast off around them (False: as HF's
        ``grouped_mm`` experts implementation does, ``torch._grouped_mm`` being no autocast op; ``flexmoe.hf.convert``
        sets it from the HF model's ``experts_implementation``). Every kernel then computes alike.
    joined_gate_up: gated experts hold ``w1`` and ``w3`` as one parameter ``gate_up: [E, M, 2H]`` (``b1`` and
        ``b3`` as ``gate_up_bias: [E, 2H]``), the layout of HF's ``gate_up_proj``: the kernels read the pair as one
        weight without a copy per call, and autograd hands its gradient to one parameter. ``w1``, ``w3``, ``b1``,
        ``b3`` still read as the halves (views); the state dict keeps their names, so checkpoints load into either
        layout. Freeze, optimize or adapt ``gate_up`` (PEFT: ``target_parameters=["experts.gate_up", ...]``).
        Expert parallelism cuts gate_up by its halves (the layout's); FSDP2 shards plain experts:
        :func:`flexmoe.sharding.parallelize` lays the pair apart (:meth:`FeedForwardExperts.lay_gated_pairs_apart`).
        Shared experts hold theirs apart (HF's are two Linears). False by default, True in
        :func:`flexmoe.hf.convert` (HF's layout).
    """

    activation: str | Callable[[Tensor], Tensor] = "gelu"
    glu: bool = False
    bias: bool = True
    shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_gate: bool = False
    glu_limit: float | None = None
    expert_kernel: str = "auto"
    expert_route: str = "auto"
    kernel_cache: str | None = None
    experts_autocast: bool = True
    joined_gate_up: bool = False

    def __post_init__(self) -> None:
        resolve_activation(self.activation)
        object.__setattr__(self, "glu", bool(self.glu))
        object.__setattr__(self, "bias", bool(self.bias))
        check_int("shared_experts", self.shared_experts, 0)
        if self.shared_hidden_dim is not None:
            check_int("shared_hidden_dim", self.shared_hidden_dim, 1)
        if not isinstance(self.shared_gate, bool):
            raise TypeError(f"shared_gate must be a bool, got {type(self.shared_gate).__name__}")
        if self.shared_gate and not self.shared_experts:
            raise ValueError("shared_gate gates the shared experts' output: it needs shared_experts >= 1")
        object.__setattr__(self, "glu_limit", check_glu_limit(self.glu_limit, self.glu))
        # The expert_kernel's and expert_route's TypeError / ValueError.
        KernelChooser(self.expert_kernel, route=self.expert_route, timer=None)
        if self.kernel_cache is not None and not isinstance(self.kernel_cache, str):
            raise TypeError(f"kernel_cache must be a directory (str) or None, got {type(self.kernel_cache).__name__}")
        if not isinstance(self.experts_autocast, bool):
            raise TypeError(f"experts_autocast must be a bool, got {type(self.experts_autocast).__name__}")
        if not isinstance(self.joined_gate_up, bool):
            raise TypeError(f"joined_gate_up must be a bool, got {type(self.joined_gate_up).__name__}")

    def describe(self) -> dict[str, Any]:
        """Every field as a value that compares equal across processes (callables by name)."""
        return {f.name: describe_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def build(self, num_experts: int, model_dim: int, hidden_dim: int, *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> FeedForwardExperts:
        """``num_experts`` experts of these options (the layer's local experts, or its shared experts)."""
        return FeedForwardExperts(num_experts, model_dim, hidden_dim, activation=self.activation, glu=self.glu,
                                  bias=self.bias, glu_limit=self.glu_limit, joined_gate_up=self.joined_gate_up,
                                  device=device, dtype=dtype,
                                  kernels=KernelChooser.for_options(self.expert_kernel, self.kernel_cache,
                                                                    self.expert_route))


class ExpertsCall:
    """A whole layer call made through its experts module: ``experts(x, ExpertsCall(run))`` returns ``run()``.

    An adapter that wraps the experts and changes their weights only while its own forward runs (PEFT's LoRA
    ``target_parameters`` registers a parametrization there) would be bypassed by every path of
    :class:`~flexmoe.MoELayer` that reads the weights itself (fused experts, custom ops, expert parallelism). The
    layer therefore runs such a call inside the wrapper: the wrapper calls its base module, the built-in experts,
    whose forward runs ``run`` while their weights read as adapted (docs/architecture.md, "Adapters on the
    experts").
    """

    def __init__(self, run: Callable[[], Tensor]) -> None:
        self.run = run


def differentiated_weights(experts: nn.Module) -> list[Tensor]:
    """The tensors whose gradients a call of ``experts`` produces: for the built-in experts their weights as they
    read now (inside an adapter's call the adapted ones, ``w + delta``, through which the gradient reaches the
    adapter; joined experts' ``gate_up``, not its halves), for any other module its parameters; only those that
    require a gradient.

    An expert-parallel path that differentiates the experts by hand, or ties a rank without rows into the
    backward exchange, takes these: the parameters alone would miss an adapter's (frozen base, trainable LoRA)."""
    if isinstance(experts, FeedForwardExperts):
        weights = experts.weights()
        # Joined experts: gate_up (gate_up_bias), not its halves, which a kernel reading gate_up never touches.
        tensors = (weights.gate_up, weights.w2, weights.gate_up_bias, weights.b2) if experts.joined_gate_up else \
            weights.tensors()
        return [t for t in tensors if t is not None and t.requires_grad]
    return [p for p in experts.parameters() if p.requires_grad]


class FeedForwardExperts(nn.Module):
    """``num_experts`` two-layer FFNs stored batched.

    Parameters: ``w1: [E, M, H]``, ``b1: [E, H]``, ``w2: [E, H, M]``, ``b2: [E, M]`` and, with ``glu``,
    ``w3: [E, M, H]``, ``b3: [E, H]``. Expert e computes ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``, or with
    ``glu`` ``(act(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]`` (with ``glu_limit`` the gated unit
    is GPT-OSS's clamped one, :func:`gated_unit`).

    With ``joined_gate_up`` the gated pair is one parameter, ``gate_up: [E, M, 2H]`` (``gate_up_bias: [E, 2H]``),
    and ``w1``, ``w3``, ``b1``, ``b3`` read as its halves (views, :data:`JOINED_HALVES`); the state dict names
    the halves (:class:`ExpertOptions`).
    """

    def __init__(
        self,
        num_experts: int,
        model_dim: int,
        hidden_dim: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        glu: bool = False,
        bias: bool = True,
        glu_limit: float | None = None,
        joined_gate_up: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kernels: KernelChooser | None = None,
    ) -> None:
        super().__init__()
        dtype = check_float_dtype("dtype", dtype)
        # Which kernel computes each call (measured per case on this machine); see flexmoe.experts.chooser.
        self.kernels = kernels if kernels is not None else KernelChooser.for_options("auto", None)
        self.num_experts = num_experts
        self.model_dim = model_dim
        self.hidden_dim = hidden_dim
        self.glu = glu
        self.activation = resolve_activation(activation)
        self.glu_limit = check_glu_limit(glu_limit, glu)
        if not isinstance(joined_gate_up, bool):
            raise TypeError(f"joined_gate_up must be a bool, got {type(joined_gate_up).__name__}")
        self.joined_gate_up = joined_gate_up and glu

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        # Registered in the order w1, w2, w3, b1, b2, b3 (the state dict's, the optimizer's); joined experts
        # register gate_up in place of w1 and w3, gate_up_bias in place of b1 and b3 (their halves, JOINED_HALVES).
        if self.joined_gate_up:
            self.gate_up = param(num_experts, model_dim, 2 * hidden_dim)  # [E, M, 2H]: w1 | w3
            self.w2 = param(num_experts, hidden_dim, model_dim)
            self.gate_up_bias: nn.Parameter | None = param(num_experts, 2 * hidden_dim) if bias else None
            self.b2: nn.Parameter | None = param(num_experts, model_dim) if bias else None
        else:
            self.w1 = param(num_experts, model_dim, hidden_dim)  # [E, M, H]
            self.w2 = param(num_experts, hidden_dim, model_dim)
            self.w3 = param(num_experts, model_dim, hidden_dim) if glu else None
            self.b1 = param(num_experts, hidden_dim) if bias else None
            self.b2 = param(num_experts, model_dim) if bias else None
            self.b3 = param(num_experts, hidden_dim) if bias and glu else None
        self.reset_parameters()

    def __getattr__(self, name: str) -> Any:
        # Joined experts' w1, w3, b1, b3 are views of the halves of gate_up and gate_up_bias (the weights' own,
        # made once while the parameters stay the same); other experts have no joined tensors.
        if name in JOINED_HALVES and self.__dict__.get("joined_gate_up"):
            return getattr(self.weights(), name)
        if name in ("gate_up", "gate_up_bias") and self.__dict__.get("joined_gate_up") is False:
            return None
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in JOINED_HALVES and self.__dict__.get("joined_gate_up"):
            raise AttributeError(f"{name} of joined experts is a half of {JOINED_HALVES[name][0]} (a view): assign "
                                 f"or change {JOINED_HALVES[name][0]}, or call lay_gated_pairs_apart() first")
        super().__setattr__(name, value)

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)); a joined pair half by half, as
        # two parameters of their own would be.
        for w, fan_in in ((self.w1, self.model_dim), (self.w3, self.model_dim), (self.w2, self.hidden_dim)):
            if w is not None:
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        for b, fan_in in ((self.b1, self.model_dim), (self.b3, self.model_dim), (self.b2, self.hidden_dim)):
            if b is not None:
                nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> FeedForwardExperts:
        # module.to / .float / .cuda may replace a parameter's .data: the halves kept by weights() would then be
        # views of the old storage.
        self.__dict__["_weights"] = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        # The kept weights hold views of the parameters; copied, they would be copies of their own.
        return {**self.__dict__, "_weights": None}

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # Joined experts save the halves under the names plain gated experts save (w1, w3, b1, b3), in the same
        # order: a checkpoint loads into either layout, and every tool keyed on the names reads it.
        if not self.joined_gate_up:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        saved: dict[str, Any] = {}
        super()._save_to_state_dict(saved, prefix, keep_vars)
        for joined_name, (first, second) in JOINED_PAIRS:
            joined = saved.pop(prefix + joined_name, None)
            if joined is not None:
                saved[prefix + first], saved[prefix + second] = side_by_side_halves(joined)
        for name in (*_REGISTRATION_ORDER, *(n[len(prefix):] for n in saved)):
            if prefix + name in saved:
                destination[prefix + name] = saved.pop(prefix + name)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        # Joined experts load the halves (w1 and w3, b1 and b3: what _save_to_state_dict writes, and what plain
        # gated experts save) into their joined parameter; a state dict naming gate_up itself loads as it is.
        partial: list[tuple[str, tuple[str, str]]] = []
        if self.joined_gate_up:
            for joined_name, pair in JOINED_PAIRS:
                if getattr(self, joined_name) is None or prefix + joined_name in state_dict:
                    continue
                first, second = (state_dict.get(prefix + half) for half in pair)
                if first is not None and second is not None:
                    state_dict[prefix + joined_name] = torch.cat([first, second], dim=-1)
                    for half in pair:
                        del state_dict[prefix + half]
                else:
                    partial.append((joined_name, pair))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for joined_name, pair in partial:  # one half or none: report the halves by name, load the one given
            missing = [prefix + half for half in pair if prefix + half not in state_dict]
            if prefix + joined_name in missing_keys:
                at = missing_keys.index(prefix + joined_name)
                missing_keys[at:at + 1] = missing
            for half in pair:
                key = prefix + half
                if key not in state_dict:
                    continue
                if key in unexpected_keys:
                    unexpected_keys.remove(key)
                value, target = state_dict[key], getattr(self, half)
                if not isinstance(value, Tensor) or value.shape != target.shape:
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                                      f"{getattr(value, 'shape', type(value).__name__)} from checkpoint, the shape "
                                      f"in current model is {target.shape}.")
                    continue
                with torch.no_grad():
                    target.copy_(value)

    def joined_pairs(self) -> dict[str, tuple[str, str]]:
        """Each joined parameter these experts register (``gate_up``, ``gate_up_bias``) -> the names of its
        halves (``w1``, ``w3``; ``b1``, ``b3``); empty for plain experts."""
        if not self.joined_gate_up:
            return {}
        return {joined: pair for joined, pair in JOINED_PAIRS if joined in self._parameters}

    def lay_gated_pairs_apart(self) -> None:
        """Turns joined experts into plain gated ones: ``w1`` and ``w3`` (``b1`` and ``b3``) become parameters of
        their own, contiguous copies of the halves of ``gate_up`` (``gate_up_bias``), with its ``requires_grad``,
        and ``joined_gate_up`` is off; a no-op for other experts. What FSDP2's ``fully_shard`` shards
        (:func:`flexmoe.sharding.parallelize` calls it). New parameter objects: call it before
        an optimizer is built on them. ``ValueError`` where an adapter parametrizes ``gate_up``."""
        if not self.joined_gate_up:
            return
        if any(name in getattr(self, "parametrizations", {}) for name, _ in JOINED_PAIRS):
            raise ValueError("lay_gated_pairs_apart: gate_up carries a parametrization (an adapter); merge or "
                             "remove it first")
        parts: dict[str, nn.Parameter | None] = {}
        for joined_name, pair in JOINED_PAIRS:
            joined = self._parameters.pop(joined_name, None)
            self.__dict__.pop(joined_name, None)
            for i, half in enumerate(pair):
                parts[half] = None if joined is None else nn.Parameter(
                    side_by_side_halves(joined.detach())[i].contiguous(), requires_grad=joined.requires_grad)
        parts.update(w2=self._parameters.pop("w2"), b2=self._parameters.pop("b2", None))
        self.__dict__["joined_gate_up"] = False
        self.__dict__["_weights"] = None
        for name in _REGISTRATION_ORDER:
            setattr(self, name, parts[name])

    def forward(self, x: Tensor, counts: list[int] | ExpertsCall) -> Tensor:
        """x: ``[N, M]`` rows sorted by expert, counts: ``[E]`` rows per expert -> ``[N, M]``.

        Given an :class:`ExpertsCall` instead of counts (x is then the layer's input, for the wrappers' sake),
        runs that call and returns its output."""
        if isinstance(counts, ExpertsCall):
            return counts.run()
        if len(counts) != self.num_experts:
            raise ValueError(f"counts must have {self.num_experts} entries (one per expert), got {len(counts)}")
        kernels = self.kernels
        if self.num_experts == 1 and kernels.kernel in ("auto", "grouped_mm") and x.shape[0] == counts[0] > 0:
            # One expert (a shared expert): one matmul per weight is what every kernel computes, and the floor;
            # choosing a kernel (its case, its checks, a first timing) would cost such a call more host time than
            # its matmuls on a small call. The grouped_mm kernel's own one-expert branch.
            kernels.last_kernel = "grouped_mm"
            return one_expert_ffn(x, self.weights())
        return expert_ffn(x, counts, self.weights(), kernels)

    def weights(self) -> ExpertWeights:
        """The experts' weights and unit as they read now (inside an adapter's call: the adapted ones). The same
        object call after call while the parameters are the same objects (a call's host time is spent on such
        reads): each is looked up in ``_parameters``, where ``torch.func.functional_call`` puts its tensors too;
        a parametrized (adapted) parameter is not there, so it is read afresh."""
        if self.joined_gate_up:
            return self._joined_weights()
        if torch.compiler.is_compiling():  # traced: nothing is kept (dynamo would guard on what is)
            return ExpertWeights(self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.activation,
                                 self.glu_limit)
        # What the weights depend on, by identity (one tuple of ids, compared at C speed): the parameters as
        # _parameters holds them now and the unit. The kept weights hold every one of these objects, so no other
        # object can have one of their ids while they are kept.
        params = self._parameters
        key = (*map(id, params.values()), id(self.activation), self.glu_limit)
        kept = self.__dict__.get("_weights")
        if kept is not None and kept[0] == key:
            return kept[1]
        weights = ExpertWeights(self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.activation,
                                self.glu_limit)
        registered = all(t is None or params.get(name) is t for name, t in zip(WEIGHT_NAMES, weights.tensors()))
        self.__dict__["_weights"] = (key, weights) if registered else None
        return weights

    def _joined_weights(self) -> ExpertWeights:
        """:meth:`weights` of joined experts: ``w1``, ``w3`` (``b1``, ``b3``) the halves of ``gate_up``
        (``gate_up_bias``), as views made once and kept while they stay right."""
        gate_up, gate_up_bias = self.gate_up, self.gate_up_bias  # through an adapter's parametrization, if any
        if torch.compiler.is_compiling():  # traced: the views are graph operations, nothing is kept
            return self._halves_of(gate_up, gate_up_bias)
        params = self._parameters
        # Besides the objects (as plain weights), what the views depend on and the parameter object does not show:
        # its .data replaced (the address), requires_grad_ (the views carry their own flag), and inference mode
        # (views made there record nothing: they are kept for that mode only). Not its version: an optimizer's
        # in-place step changes the values the views share, not what they are, and the weights stay the same
        # object from step to step (the decisions kept on them with it).
        key = (*map(id, params.values()), id(self.activation), self.glu_limit, gate_up.data_ptr(),
               gate_up.requires_grad, torch.is_inference_mode_enabled(),
               None if gate_up_bias is None else (gate_up_bias.data_ptr(), gate_up_bias.requires_grad))
        kept = self.__dict__.get("_weights")
        if kept is not None and kept[0] == key:
            return kept[1]
        weights = self._halves_of(gate_up, gate_up_bias)
        sources = (("gate_up", gate_up), ("gate_up_bias", gate_up_bias), ("w2", self.w2), ("b2", self.b2))
        registered = all(t is None or params.get(name) is t for name, t in sources)
        self.__dict__["_weights"] = (key, weights) if registered else None
        return weights

    def _halves_of(self, gate_up: Tensor, gate_up_bias: Tensor | None) -> ExpertWeights:
        with torch.enable_grad():  # views autograd records whatever the mode now: kept, they serve training too
            w1, w3 = side_by_side_halves(gate_up)
            b1, b3 = side_by_side_halves(gate_up_bias) if gate_up_bias is not None else (None, None)
        return ExpertWeights(w1, b1, self.w2, self.b2, w3, b3, self.activation, self.glu_limit, gate_up,
                             gate_up_bias)

    def ffn_with(self, x: Tensor, counts: list[int], weights: Mapping[str, Tensor | None]) -> Tensor:
        """These experts' activation and gated unit on other weights (gathered, broadcast or a hidden shard):
        ``weights`` maps ``w1, b1, w2, b2, w3, b3`` to ``[E', ...]`` tensors or None; x: ``[N, M]`` sorted by
        expert, counts: ``[E']`` -> ``[N, M]``."""
        if weights.get("w1") is None or weights.get("w2") is None:
            raise ValueError("weights must hold w1 and w2 (b1, b2, w3, b3 may be None)")
        return expert_ffn(x, counts, self.weights().with_tensors(**{n: weights.get(n) for n in WEIGHT_NAMES}),
                          self.kernels)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden_dim={self.hidden_dim}, "
            f"glu={self.glu}, bias={self.b1 is not None}"
            + (f", glu_limit={self.glu_limit}" if self.glu_limit is not None else "")
        )


def parameter_of(module: nn.Module, name: str) -> Tensor | None:
    """The tensor that holds ``module.<name>`` as a parameter: itself, or for a half of joined experts (``w1``,
    ``w3``, ``b1``, ``b3``) the joined one (``gate_up``, ``gate_up_bias``), whose ``requires_grad`` and flags
    both halves share."""
    if isinstance(module, FeedForwardExperts) and module.joined_gate_up and name in JOINED_HALVES:
        return getattr(module, JOINED_HALVES[name][0])
    return getattr(module, name)


def joined_parameter_halves(model: nn.Module) -> dict[str, tuple[str, str]]:
    """Full name of every joined experts' parameter (``...experts.gate_up``) -> the full names of its halves
    (``...experts.w1``, ``...experts.w3``). Checkpoints name the halves, as plain experts' parameters and the
    state dict do, so that one loads into either layout (FSDP2 lays the pairs apart)."""
    out: dict[str, tuple[str, str]] = {}
    for prefix, sub in model.named_modules():
        if isinstance(sub, FeedForwardExperts):
            dot = f"{prefix}." if prefix else ""
            for joined, (first, second) in sub.joined_pairs().items():
                out[dot + joined] = (dot + first, dot + second)
    return out


def check_glu_limit(glu_limit: object, glu: bool) -> float | None:
    """``glu_limit`` as a float > 0 (or None); only gated experts have a linear branch to clamp."""
    if glu_limit is None:
        return None
    if isinstance(glu_limit, bool) or not isinstance(glu_limit, (int, float)):
        raise TypeError(f"glu_limit must be a number or None, got {type(glu_limit).__name__}")
    if not (math.isfinite(glu_limit) and glu_limit > 0):
        raise ValueError(f"glu_limit must be finite and > 0, got {glu_limit}")
    if not glu:
        raise ValueError("glu_limit clamps the gated unit: it needs glu=True")
    return float(glu_limit)


def expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights, kernels: KernelChooser | None = None,
               ) -> Tensor:
    """The experts' FFN on explicit weights: rows ``[N, M]`` sorted by expert, ``counts[e]`` rows each
    (``sum(counts) == N``), weights ``[E, ...]`` -> ``[N, M]``; H may be a hidden shard (expert parallelism), the
    result then a partial sum. By the kernel ``kernels`` chooses for this call (None: the rule, the loop)."""
    if kernels is None:
        return KERNELS[RULE_KERNEL].run(rows, counts, weights)
    return kernels.run(rows, counts, weights)
