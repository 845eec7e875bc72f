"""Experts: batched feed-forward networks, and the protocol a custom expert follows.

An expert module takes the dispatched rows ``x: [N, M]`` (sorted by local expert) and the per-expert row
counts ``counts: list[int]`` (``sum(counts) == N``) and returns ``[N, M]``. Any module with that forward can be
passed to ``MoELayer(experts=...)``.

Under ``torch.compile`` in capacity mode the layer pads every expert to the same number of rows
(docs/architecture.md, "Compiling the layer"): the built-in experts then compute only the real rows through a
custom op (:mod:`flexmoe.padded_ffn_op`), or where it cannot run :func:`padded_expert_ffn` on the
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

from flexmoe.expert_weights import ExpertWeights, gated_unit, hidden_unit, needs_grad
from flexmoe.segment_ffn import addmm_into, segment_expert_ffn
from flexmoe.validation import check_int, describe_value

__all__ = ["ExpertOptions", "FeedForwardExperts", "ExpertsCall", "differentiated_weights", "expert_ffn",
           "padded_expert_ffn", "grouped_expert_ffn", "looped_expert_ffn", "segmented_expert_ffn", "use_segmented",
           "use_grouped_mm", "grouped_mm_supported", "gated_unit", "hidden_unit", "check_glu_limit",
           "resolve_activation", "activation_name", "activation_derivative", "activation_into", "all_like",
           "needs_grad", "joined_outputs", "joined_unit_ffn", "active_experts_ffn", "JOINED_UNIT_MAX_ELEMENTS",
           "embedding_bag_ffn", "use_embedding_bag", "EMBEDDING_BAG_MAX_ROWS_PER_EXPERT", "ExpertWeights",
           "embedding_bag_supported", "check_counts"]

_WEIGHT_NAMES = ("w1", "b1", "w2", "b2", "w3", "b3")

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
    """

    activation: str | Callable[[Tensor], Tensor] = "gelu"
    glu: bool = False
    bias: bool = True
    shared_experts: int = 0
    shared_hidden_dim: int | None = None
    shared_gate: bool = False
    glu_limit: float | None = None

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

    def describe(self) -> dict[str, Any]:
        """Every field as a value that compares equal across processes (callables by name)."""
        return {f.name: describe_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def build(self, num_experts: int, model_dim: int, hidden_dim: int, *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> FeedForwardExperts:
        """``num_experts`` experts of these options (the layer's local experts, or its shared experts)."""
        return FeedForwardExperts(num_experts, model_dim, hidden_dim, activation=self.activation, glu=self.glu,
                                  bias=self.bias, glu_limit=self.glu_limit, device=device, dtype=dtype)


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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.model_dim = model_dim
        self.hidden_dim = hidden_dim
        self.glu = glu
        self.activation = resolve_activation(activation)
        self.glu_limit = check_glu_limit(glu_limit, glu)
        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

        self.w1 = param(num_experts, model_dim, hidden_dim)
        self.w2 = param(num_experts, hidden_dim, model_dim)
        self.w3 = param(num_experts, model_dim, hidden_dim) if glu else None
        self.b1: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        self.b3: nn.Parameter | None = None
        if bias:
            self.b1 = param(num_experts, hidden_dim)
            self.b2 = param(num_experts, model_dim)
            self.b3 = param(num_experts, hidden_dim) if glu else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        for w, fan_in in ((self.w1, self.model_dim), (self.w3, self.model_dim), (self.w2, self.hidden_dim)):
            if w is not None:
                nn.init.uniform_(w, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        for b, fan_in in ((self.b1, self.model_dim), (self.b3, self.model_dim), (self.b2, self.hidden_dim)):
            if b is not None:
                nn.init.uniform_(b, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: Tensor, counts: list[int] | ExpertsCall) -> Tensor:
        """x: ``[N, M]`` rows sorted by expert, counts: ``[E]`` rows per expert -> ``[N, M]``.

        Given an :class:`ExpertsCall` instead of counts (x is then the layer's input, for the wrappers' sake),
        runs that call and returns its output."""
        if isinstance(counts, ExpertsCall):
            return counts.run()
        if len(counts) != self.num_experts:
            raise ValueError(f"counts must have {self.num_experts} entries (one per expert), got {len(counts)}")
        return expert_ffn(x, counts, self.weights())

    def weights(self) -> ExpertWeights:
        """The experts' weights and unit as they read now (inside an adapter's call: the adapted ones)."""
        return ExpertWeights(self.w1, self.b1, self.w2, self.b2, self.w3, self.b3, self.activation, self.glu_limit)

    def forward_padded(self, x: Tensor) -> Tensor:
        """x: ``[E, R, M]``, R rows per expert (some of them padding) -> ``[E, R, M]``: :func:`padded_expert_ffn`."""
        return padded_expert_ffn(x, self.weights())

    def ffn_with(self, x: Tensor, counts: list[int], weights: Mapping[str, Tensor | None]) -> Tensor:
        """These experts' activation and gated unit on other weights (gathered, broadcast or a hidden shard):
        ``weights`` maps ``w1, b1, w2, b2, w3, b3`` to ``[E', ...]`` tensors or None; x: ``[N, M]`` sorted by
        expert, counts: ``[E']`` -> ``[N, M]``."""
        if weights.get("w1") is None or weights.get("w2") is None:
            raise ValueError("weights must hold w1 and w2 (b1, b2, w3, b3 may be None)")
        return expert_ffn(x, counts, self.weights().with_tensors(**{n: weights.get(n) for n in _WEIGHT_NAMES}))

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, model_dim={self.model_dim}, hidden_dim={self.hidden_dim}, "
            f"glu={self.glu}, bias={self.b1 is not None}"
            + (f", glu_limit={self.glu_limit}" if self.glu_limit is not None else "")
        )


def expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """The experts' FFN on explicit weights: each expert's rows through its own two (or, GLU, three) matmuls.

    rows: ``[N, M]`` sorted by expert, counts: ``[E]`` (``sum(counts) == N``), weights: ``[E, ...]``
    (:class:`~flexmoe.expert_weights.ExpertWeights`) -> ``[N, M]``.

    Four ways compute the same numbers (up to float rounding): weighted sums of weight rows
    (:func:`embedding_bag_ffn`) where :func:`use_embedding_bag` says so (decoding), one grouped GEMM per
    matrix over all experts (:func:`grouped_expert_ffn`) where :func:`use_grouped_mm` says it is faster, the
    per-expert loop with a hand-written backward (:func:`segmented_expert_ffn`) where :func:`use_segmented`
    says so, else one ``addmm`` pair per expert through autograd (:func:`looped_expert_ffn`).
    """
    if use_embedding_bag(rows, counts, weights):
        return embedding_bag_ffn(rows, counts, weights)
    if use_grouped_mm(rows, counts, weights):
        return grouped_expert_ffn(rows, counts, weights)
    if use_segmented(rows, counts, weights):
        return segmented_expert_ffn(rows, counts, weights)
    return looped_expert_ffn(rows, counts, weights)


# Training, forward + backward, T=4096 M=512 k=8 fp32 on a 2-core AVX2 CPU, side by side (docs/architecture.md,
# "Expert compute"): the hand-written backward beat the autograd loop only where each expert has little work,
# rows per expert times hidden size at most this (E=128 H=128: 256 rows x 128, segmented/loop 0.90-0.95; E=256
# H=64: 0.84-0.89); above it the loop was as fast or faster (E=64 H=256, 512 rows x 256: 1.02-1.06; E=8 H=1024,
# k=2: 1.05-1.10).
_SEGMENTED_MAX_WORK_PER_EXPERT = 256 * 128
_SEGMENTED_DTYPES = (torch.float32,)


def use_segmented(rows: Tensor, counts: list[int], weights: ExpertWeights) -> bool:
    """Whether :func:`expert_ffn` runs :func:`segmented_expert_ffn` (the measured rule above): autograd records
    (training), float32 on the CPU (the only case measured), not traced by ``torch.compile`` (traced code keeps
    the loop), no autocast, and at most ``_SEGMENTED_MAX_WORK_PER_EXPERT`` rows x hidden per expert on
    average."""
    if not counts or rows.dtype not in _SEGMENTED_DTYPES or rows.device.type != "cpu":
        return False
    if not weights.needs_grad(rows) or torch.compiler.is_compiling():
        return False
    if torch.is_autocast_enabled(rows.device.type):
        return False
    if not weights.all_like(rows):
        return False
    return rows.shape[0] * weights.hidden <= _SEGMENTED_MAX_WORK_PER_EXPERT * len(counts)


# Where torch's grouped GEMM beats the per-expert loop, measured side by side on a quiet 2-core AVX2 CPU with
# torch 2.13 (docs/architecture.md, "Expert compute"): inference only (see use_grouped_mm), float32 only (it has
# no float64 kernel; bf16 / fp16 and GPUs are not measured, so they keep the loop), and at most this many rows
# per expert on average (the largest measured).
_GROUPED_MM_DTYPES = (torch.float32,)
_GROUPED_MM_MAX_ROWS_PER_EXPERT = 512
# At H=64 (E=256) the grouped GEMM measured no faster than the loop (0.97-1.03x, and worse in one loaded run):
# the loop is kept below this hidden size.
_GROUPED_MM_MIN_HIDDEN = 128
# Without autograd the loop runs only the experts that have rows: at E=64, k=8 it beat the grouped GEMM with
# 8 active experts (one token per call, 0.7x its time) and lost with ~48 (8 tokens): the loop is kept while at
# most 1/4 of the experts have rows.
_DECODE_LOOP_MAX_ACTIVE_SHARE = 4


def use_grouped_mm(rows: Tensor, counts: list[int], weights: ExpertWeights) -> bool:
    """Whether :func:`expert_ffn` runs :func:`grouped_expert_ffn` for these rows and weights (the measured rule
    above): :func:`grouped_mm_supported`, float32, not traced by ``torch.compile``, a hidden size of at least
    ``_GROUPED_MM_MIN_HIDDEN``, no autograd (inference), more than a quarter of the experts have rows and they
    average at most ``_GROUPED_MM_MAX_ROWS_PER_EXPERT`` rows."""
    if not counts or rows.dtype not in _GROUPED_MM_DTYPES or rows.device.type != "cpu":
        return False
    if not grouped_mm_supported(rows, weights):
        return False
    if torch.compiler.is_compiling():
        # torch 2.13's compiler (its meta kernel) takes _grouped_mm in bf16 only: traced code keeps the loop.
        return False
    if weights.hidden < _GROUPED_MM_MIN_HIDDEN:
        return False
    if needs_grad(rows, weights.w1, weights.w2, weights.w3):
        # Forward + backward on a quiet machine, the loop won at every shape measured (grouped/loop 1.14 at
        # E=8 H=1024, 1.23 at E=64 H=256, 1.17 at E=128 H=128, 1.05 at E=256 H=64; T=4096 M=512 fp32):
        # the grouped kernel's backward is the slow half on this CPU. Training keeps the loop.
        return False
    # Inference: the grouped kernel still visits every empty group, the loop only the experts with rows.
    active = sum(1 for n in counts if n)
    if active * _DECODE_LOOP_MAX_ACTIVE_SHARE <= len(counts):
        return False
    return rows.shape[0] <= _GROUPED_MM_MAX_ROWS_PER_EXPERT * len(counts)


def grouped_mm_supported(rows: Tensor, weights: ExpertWeights) -> bool:
    """Whether :func:`grouped_expert_ffn` can run on these tensors: torch has ``_grouped_mm``, a dtype its kernel
    takes on this device (the CPU: float32, bf16, fp16; other devices: bf16), and strides in multiples of 16
    bytes, also those of the hidden activations it makes itself (``[N, H]``, contiguous)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if rows.device.type == "cpu" else (torch.bfloat16,)
    if rows.dtype not in dtypes or not weights.all_like(rows):
        return False
    matrices = [w for w in (weights.w1, weights.w2, weights.w3) if w is not None]
    return all(_strides_aligned(t) for t in (rows, *matrices)) and (weights.hidden * rows.element_size()) % 16 == 0


def all_like(rows: Tensor, *tensors: Tensor | None) -> bool:
    """Every tensor given (None: absent) has the rows' dtype and device."""
    return all(t.dtype == rows.dtype and t.device == rows.device for t in tensors if t is not None)


def _strides_aligned(t: Tensor) -> bool:
    """Every stride of a dimension longer than 1, other than a unit stride, is a multiple of 16 bytes."""
    return all(stride == 1 or (stride * t.element_size()) % 16 == 0
               for size, stride in zip(t.shape, t.stride()) if size > 1)


# Without autograd, on the CPU, float32 calls averaging at most this many rows per expert that has rows run
# embedding_bag_ffn. Side by side (torch 2.13, M=512, benchmarks/decode_experts.py), of the better loop's time:
# on a 2-core AVX2 EPYC 0.36-0.84x from 1 to 4.3 rows per expert at E=64 H=256 k=8 (gelu and GLU), 0.46-0.73x
# from 1.3 to 4 rows at E=8 H=1024 k=2; at 8 rows 0.63-0.67x (E=64) and 0.97x (E=8), at 16 rows 1.32x. On a
# 2-core AVX-512 EPYC at 8 rows 0.38-0.63x (E=64) and 0.77x (E=8), at 12 rows 0.50-0.58x and 0.82x, at 16 rows
# 0.58-0.78x and 0.99-1.02x. It reads an expert's weights once per row instead of once per expert
# (docs/architecture.md, "Decoding"). GPUs and other dtypes are not measured and keep the matmuls.
EMBEDDING_BAG_MAX_ROWS_PER_EXPERT = 8
# With fewer rows than this there are too few bags to spread over the threads: at E=8 k=2, one token (2 rows)
# the bags took 1.12-1.17x the loop's time (benchmarks/decode_experts.py), at 4 rows 0.70-0.73x.
_EMBEDDING_BAG_MIN_ROWS = 4
# The index tensors hold rows x max(M, H) entries: above this many the matmuls run instead (memory, not time).
_EMBEDDING_BAG_MAX_INDICES = 1 << 22


def use_embedding_bag(rows: Tensor, counts: list[int], weights: ExpertWeights) -> bool:
    """Whether :func:`expert_ffn` runs :func:`embedding_bag_ffn` (the measured rule above): no autograd, not
    traced by ``torch.compile``, float32 on the CPU for rows and every weight, contiguous weight matrices, at
    least ``_EMBEDDING_BAG_MIN_ROWS`` rows, and at most ``EMBEDDING_BAG_MAX_ROWS_PER_EXPERT`` rows per expert
    that has rows on average."""
    if rows.shape[0] < _EMBEDDING_BAG_MIN_ROWS or rows.dtype != torch.float32 or rows.device.type != "cpu":
        return False
    if weights.needs_grad(rows) or torch.compiler.is_compiling():
        return False
    if not embedding_bag_supported(rows, weights):
        return False
    active = sum(1 for n in counts if n)
    return rows.shape[0] <= EMBEDDING_BAG_MAX_ROWS_PER_EXPERT * active


def embedding_bag_supported(rows: Tensor, weights: ExpertWeights) -> bool:
    """Whether :func:`embedding_bag_ffn` can run on these tensors: one dtype and device, contiguous weight
    matrices, and index tensors of at most ``_EMBEDDING_BAG_MAX_INDICES`` entries."""
    if not weights.all_like(rows):
        return False
    if not all(w.is_contiguous() for w in (weights.w1, weights.w2, weights.w3) if w is not None):
        return False
    return rows.shape[0] * max(weights.model_dim, weights.hidden) <= _EMBEDDING_BAG_MAX_INDICES


def embedding_bag_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` (shapes as there) with every row's products taken as weighted sums of its expert's
    weight rows, no matmul: ``x @ w[e] = sum_i x[i] * w[e][i, :]`` is ``F.embedding_bag`` over ``w`` viewed
    as ``[E * in, out]``, one bag per row (indices ``e * in + i``, ``per_sample_weights`` the row). One call per
    weight matrix covers all rows of all experts. No autograd; needs contiguous ``w1``, ``w2``, ``w3``.

    Decoding routes a row or a few to each expert: per expert the matmuls then cost far more than the bytes
    they read (measured, see ``EMBEDDING_BAG_MAX_ROWS_PER_EXPERT``), where the bags stream each row's weights
    once, spread over the threads."""
    num_experts = len(counts)
    check_counts(rows, counts)
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=rows.device),
                                         torch.tensor(counts, device=rows.device), output_size=rows.shape[0])
    # embedding_bag takes int32 indices: half the memory, while the flattened weight has fewer than 2^31 rows.
    index_dtype = torch.int32 if num_experts * max(weights.model_dim, weights.hidden) < 2**31 else torch.int64
    bags: dict[int, Tensor] = {}

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        fan_in, fan_out = w.shape[1], w.shape[2]
        if fan_in not in bags:  # [N, in]: row r's bag is its expert's in rows of the flattened weight
            bags[fan_in] = ((row_expert * fan_in).unsqueeze(1)
                            + torch.arange(fan_in, device=rows.device)).to(index_dtype)
        out = F.embedding_bag(bags[fan_in], w.view(num_experts * fan_in, fan_out), per_sample_weights=x,
                              mode="sum")
        return out if b is None else out.add_(b.index_select(0, row_expert))

    return _ffn(rows, linear, weights)


def grouped_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` as one ``torch._grouped_mm`` per weight matrix over all experts at once (shapes as
    there). Each expert's rows are one group (``offs``: where each group ends); the biases are gathered per
    row. Needs a dtype the device's grouped GEMM supports (:func:`grouped_mm_supported`)."""
    num_rows = rows.shape[0]
    check_counts(rows, counts)
    if num_rows == 0:
        return rows.new_zeros(0, weights.model_dim)
    sizes = torch.tensor(counts, device=rows.device)
    ends = sizes.cumsum(0).to(torch.int32)
    has_bias = any(b is not None for b in (weights.b1, weights.b2, weights.b3))
    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), sizes,
                                         output_size=num_rows) if has_bias else None

    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        out = torch._grouped_mm(x, w, offs=ends)
        if b is None:
            return out
        assert row_expert is not None  # made above whenever the experts have biases
        return out + b.index_select(0, row_expert)

    return _ffn(rows, linear, weights)


def segmented_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` as the per-expert loop with a hand-written backward, one autograd node for all experts
    (:func:`flexmoe.segment_ffn.segment_expert_ffn`; shapes as there). The same matmuls as
    :func:`looped_expert_ffn`, written into full-size buffers; the elementwise unit runs once over all rows."""
    return segment_expert_ffn(rows, counts, weights)


def looped_expert_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` as one ``addmm`` pair per expert over ``w.unbind(0)`` (shapes as there); any dtype and
    device. Indexing ``w[e]`` in the loop instead would write each slice's gradient into a full-size zero
    tensor; without autograd it costs nothing, so then only the experts that have rows are visited (decoding
    touches a few of many)."""
    if not weights.needs_grad(rows):
        return _no_grad_experts_ffn(rows, counts, weights)
    check_counts(rows, counts)
    outputs = [_ffn(x, _linear, expert) for x, expert in zip(rows.split(counts), weights.per_expert())
               if x.shape[0]]
    return joined_outputs(outputs, rows, weights.model_dim)


def _no_grad_experts_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`looped_expert_ffn` without autograd: the experts that have rows only. Few rows (decoding: a row or
    two per expert, at least ``_JOINED_UNIT_MIN_ROWS`` in all) take :func:`joined_unit_ffn`, the unit once over
    every row; more, or fewer, take :func:`active_experts_ffn`, each expert's unit on its own rows."""
    check_counts(rows, counts)
    if rows.shape[0] >= _JOINED_UNIT_MIN_ROWS and rows.shape[0] * weights.hidden <= JOINED_UNIT_MAX_ELEMENTS:
        return joined_unit_ffn(rows, counts, weights)
    return active_experts_ffn(rows, counts, weights)


def active_experts_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` (shapes as there) as the plain loop over the experts that have rows, each expert's
    matmuls and unit on its own rows (the bench's floor without autograd)."""
    check_counts(rows, counts)
    outputs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        outputs.append(_ffn(rows[start : start + n], _linear, weights.for_expert(e)))
        start += n
    return joined_outputs(outputs, rows, weights.model_dim)


# Without autograd, calls of at most this many rows x hidden elements run the unit once over all rows
# (:func:`joined_unit_ffn`): 512 rows of H=256 (decoding 64 tokens at k=8), a 512 KiB float32 buffer.
JOINED_UNIT_MAX_ELEMENTS = 1 << 17
# Below this many rows (one token at k <= 3) the plain loop measured faster, side by side: the loop over the
# joined loop 0.64 at 1 row, 0.80-0.94 at 2 (E=64 H=256 gelu / GLU, E=8 H=1024 gelu; benchmarks/decode_experts.py
# shows E=8 k=2 at T=1), 0.96-1.03 at 3.
_JOINED_UNIT_MIN_ROWS = 4


def joined_unit_ffn(rows: Tensor, counts: list[int], weights: ExpertWeights) -> Tensor:
    """:func:`expert_ffn` (shapes as there) with each expert's matmuls written into its rows of one buffer and
    the elementwise unit applied once over every row, between the two loops; no autograd (``out=``).

    Decoding routes a row or two to each of k experts: a unit call per expert then costs more than its matmuls
    (each elementwise call dispatches, and may wake the thread pool, for a few hundred elements)."""
    check_counts(rows, counts)
    w1, b1, w2, b2, w3, b3 = weights.tensors()
    assert w1 is not None and w2 is not None
    experts = [e for e, n in enumerate(counts) if n]
    sizes = [counts[e] for e in experts]
    # One split per buffer gives every expert's rows as views in a single call: slicing each buffer per expert
    # costs a dispatch per slice, and mm into a fresh slice measured ~3 us more than into a split view.
    xs = rows.split(sizes)
    pre1 = rows.new_empty(rows.shape[0], weights.hidden)
    pre3 = rows.new_empty(rows.shape[0], weights.hidden) if w3 is not None else None
    for e, x, p1 in zip(experts, xs, pre1.split(sizes)):
        addmm_into(p1, x, w1[e], _at(b1, e))
    if pre3 is not None and w3 is not None:
        for e, x, p3 in zip(experts, xs, pre3.split(sizes)):
            addmm_into(p3, x, w3[e], _at(b3, e))
    h = weights.unit(pre1, pre3)
    out = rows.new_empty(rows.shape[0], weights.model_dim)
    for e, hx, o in zip(experts, h.split(sizes), out.split(sizes)):
        addmm_into(o, hx, w2[e], _at(b2, e))
    return out


def _at(p: Tensor | None, e: int) -> Tensor | None:
    return p[e] if p is not None else None


def check_counts(rows: Tensor, counts: list[int]) -> None:
    """counts must cover the rows: ``sum(counts) == rows.shape[0]``."""
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"counts must sum to the number of rows {rows.shape[0]}, got {sum(counts)}")


def joined_outputs(outputs: list[Tensor], rows: Tensor, model_dim: int) -> Tensor:
    """The experts' outputs, in order, as ``[N, model_dim]`` (zeros when no expert had rows)."""
    if not outputs:
        return rows.new_zeros(rows.shape[0], model_dim)
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def padded_expert_ffn(rows: Tensor, weights: ExpertWeights) -> Tensor:
    """The experts' FFN when every expert has the same number of rows: batched matmuls, no loop over experts.

    rows: ``[E, R, M]`` (expert e's R rows, padding included); weights as in :func:`expert_ffn` -> ``[E, R, M]``.
    Row for row the same function as :func:`expert_ffn`; padding rows cost their FLOPs like any other row.
    """
    def linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # [E, R, in] @ [E, in, out] (+ [E, out])
        return torch.baddbmm(b.unsqueeze(1), x, w) if b is not None else torch.bmm(x, w)

    return _ffn(rows, linear, weights)


def _ffn(x: Tensor, linear: Callable[[Tensor, Tensor, Tensor | None], Tensor], weights: ExpertWeights) -> Tensor:
    """The expert FFN once, whatever ``linear(x, w, b)`` does (one expert's addmm, a grouped GEMM over all
    experts, a batched matmul over padded ones): ``linear(act(x w1 + b1), w2, b2)``, or with ``w3`` the gated
    unit (:func:`gated_unit`) of the ``w1`` and ``w3`` projections."""
    w3 = weights.w3
    pre3 = linear(x, w3, weights.b3) if w3 is not None else None
    return linear(weights.unit(linear(x, weights.w1, weights.b1), pre3), weights.w2, weights.b2)


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


def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x: ``[n, in]``, w: ``[in, out]``, b: ``[out]`` -> ``[n, out]``."""
    return torch.addmm(b, x, w) if b is not None else x @ w
