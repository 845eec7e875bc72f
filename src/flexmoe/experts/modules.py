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
from flexmoe.experts.side_by_side import side_by_side, side_by_side_halves, sit_side_by_side
from flexmoe.experts.weights import WEIGHT_NAMES, ExpertWeights
from flexmoe.validation import check_float_dtype, check_int, describe_value

__all__ = ["ExpertOptions", "FeedForwardExperts", "ExpertsCall", "differentiated_weights", "expert_ffn",
           "check_glu_limit", "resolve_activation", "activation_name", "activation_derivative", "activation_into"]

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
    joined_gate_up: gated experts keep ``w1`` and ``w3`` (``b1`` and ``b3``) as the two halves of one
        ``[E, M, 2H]`` storage, the layout of HF's ``gate_up_proj`` (:mod:`flexmoe.experts.side_by_side`): the
        ``grouped_mm`` kernel then reads both as one weight without copying ``2 * E * M * H`` values per call
        (large experts, and every call without autograd: :meth:`ExpertWeights.laid_out_gate_up`; small ones
        are copied in training). The parameters, their names and values are the same; they are not contiguous,
        which FSDP2's ``fully_shard`` refuses: :func:`flexmoe.sharding.parallelize` lays them apart
        (:meth:`FeedForwardExperts.lay_gated_pairs_apart`); pass False to shard by hand. False by default,
        True in :func:`flexmoe.hf.convert` (HF's layout).
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
    adapter), for any other module its parameters; only those that require a gradient.

    An expert-parallel path that differentiates the experts by hand, or ties a rank without rows into the
    backward exchange, takes these: the parameters alone would miss an adapter's (frozen base, trainable LoRA)."""
    if isinstance(experts, FeedForwardExperts):
        return [t for t in experts.weights().present() if t.requires_grad]
    return [p for p in experts.parameters() if p.requires_grad]


class FeedForwardExperts(nn.Module):
    """``num_experts`` two-layer FFNs stored batched.

    Parameters: ``w1: [E, M, H]``, ``b1: [E, H]``, ``w2: [E, H, M]``, ``b2: [E, M]`` and, with ``glu``,
    ``w3: [E, M, H]``, ``b3: [E, H]``. Expert e computes ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``, or with
    ``glu`` ``(act(x @ w1[e] + b1[e]) * (x @ w3[e] + b3[e])) @ w2[e] + b2[e]`` (with ``glu_limit`` the gated unit
    is GPT-OSS's clamped one, :func:`gated_unit`).
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

        # With joined_gate_up: the [E, M, 2H] tensor whose halves w1 and w3 are, and the [E, 2H] one of b1 and b3
        # (None: not laid out so). Not parameters or buffers: their halves are; a kernel reads one only after
        # still_halves_of confirms it (weights()).
        self.gate_up: Tensor | None = None
        self.gate_up_bias: Tensor | None = None

        def gated_pair(*shape: int) -> tuple[nn.Parameter, nn.Parameter]:
            if not self.joined_gate_up:
                return param(*shape), param(*shape)
            # w1 and w3 (b1 and b3) as the halves of one [..., 2H] storage: the gated GEMM reads both without a
            # copy (flexmoe.experts.side_by_side).
            first, second = side_by_side_halves(torch.empty(*shape[:-1], 2 * shape[-1], device=device, dtype=dtype))
            return nn.Parameter(first), nn.Parameter(second)

        # Registered in the order w1, w2, w3, b1, b2, b3 (the state dict's, the optimizer's).
        if glu:
            w1, w3 = gated_pair(num_experts, model_dim, hidden_dim)
        else:
            w1, w3 = param(num_experts, model_dim, hidden_dim), None
        self.w1 = w1  # [E, M, H]
        self.w2 = param(num_experts, hidden_dim, model_dim)
        self.w3 = w3
        self.b1: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        self.b3: nn.Parameter | None = None
        if bias:
            b1, b3 = gated_pair(num_experts, hidden_dim) if glu else (param(num_experts, hidden_dim), None)
            self.b1 = b1
            self.b2 = param(num_experts, model_dim)
            self.b3 = b3
        self._record_joined()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for w, fan_in in ((self.w1, self.model_dim), (self.w3, self.model_dim), (self.w2, self.hidden_dim)):
            if w is not None:
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        for b, fan_in in ((self.b1, self.model_dim), (self.b3, self.model_dim), (self.b2, self.hidden_dim)):
            if b is not None:
                nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> FeedForwardExperts:
        # module.to / .float / .cuda give each parameter its own storage: lay the gated pairs side by side again.
        super()._apply(fn, recurse)
        self.lay_gated_pairs_side_by_side()
        return self

    def __getstate__(self) -> dict[str, Any]:
        # The joined tensors are views of the parameters' storage: copied, they would be copies of their own (twice
        # the memory until __setstate__ lays the pairs out again and records new ones).
        return {**self.__dict__, "gate_up": None, "gate_up_bias": None, "_weights": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.deepcopy and unpickling: Parameter's deepcopy clones each parameter into its own storage.
        super().__setstate__(state)
        self.lay_gated_pairs_side_by_side()

    def lay_gated_pairs_side_by_side(self) -> None:
        """Puts ``w1`` and ``w3`` (``b1`` and ``b3``) back into one ``[..., 2H]`` storage where something gave them
        their own (the parameters stay the same objects, their values unchanged); a no-op without
        ``joined_gate_up``, where they already share one, or where they are not plain tensors (sharded)."""
        if not getattr(self, "joined_gate_up", False):
            return
        for first_name, second_name in (("w1", "w3"), ("b1", "b3")):
            first, second = getattr(self, first_name), getattr(self, second_name)
            if not isinstance(first, nn.Parameter) or not isinstance(second, nn.Parameter):
                continue
            if type(first.data) is not Tensor or type(second.data) is not Tensor or first.shape != second.shape:
                continue
            if first.dtype != second.dtype or first.device != second.device or sit_side_by_side(first, second):
                continue
            with torch.no_grad():
                joined = torch.cat([first.data, second.data], dim=-1)
            first.data, second.data = side_by_side_halves(joined)
        self._record_joined()

    def lay_gated_pairs_apart(self) -> None:
        """Gives ``w1`` and ``w3`` (``b1`` and ``b3``) each its own contiguous storage and turns ``joined_gate_up``
        off (the parameters stay the same objects, their values unchanged): what FSDP2's ``fully_shard``, which
        refuses non-contiguous parameters, needs (:func:`flexmoe.sharding.parallelize` calls it)."""
        for name in ("w1", "w3", "b1", "b3"):
            p = getattr(self, name)
            if isinstance(p, nn.Parameter) and type(p.data) is Tensor and not p.is_contiguous():
                p.data = p.data.contiguous()
        self.joined_gate_up = False
        self.gate_up = self.gate_up_bias = None

    def _record_joined(self) -> None:
        """Keep the ``[..., 2H]`` tensors the gated pairs are the halves of (``gate_up``, ``gate_up_bias``), so
        that a kernel reads them without working the layout out at every call; None where they are not."""
        def joined_of(first: Tensor | None, second: Tensor | None) -> Tensor | None:
            if first is None or second is None:
                return None
            with torch.no_grad():  # the plain view of their storage, no autograd function
                return side_by_side(first, second)

        joined = getattr(self, "joined_gate_up", False)
        self.gate_up = joined_of(self.w1, self.w3) if joined else None
        self.gate_up_bias = joined_of(self.b1, self.b3) if joined else None

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
        # What the weights depend on, by identity (one tuple of ids, compared at C speed): the parameters as
        # _parameters holds them now, the unit and the laid-out tensors. The kept weights hold every one of these
        # objects, so no other object can have one of their ids while they are kept.
        params = self._parameters
        key = (*map(id, params.values()), id(self.activation), self.glu_limit, id(self.gate_up),
               id(self.gate_up_bias))
        kept = self.__dict__.get("_weights")
        if kept is not None and kept[0] == key:
            return kept[1]
        weights = ExpertWeights(self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.activation,
                                self.glu_limit, self.gate_up, self.gate_up_bias)
        registered = all(t is None or params.get(name) is t for name, t in zip(WEIGHT_NAMES, weights.tensors()))
        self.__dict__["_weights"] = (key, weights) if registered else None
        return weights

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
