"""The expert stage of a :class:`~flexmoe.MoELayer` call: dispatch -> experts -> combine (docs/architecture.md,
"The data path", "Expert compute").

:class:`ExpertStage` is the one place that decides how a call's experts run, for eager, compiled, dropless,
padded, decoding and token-exchange calls alike:

* the plan's layout (:meth:`ExpertStage.plan_layout`): compiling, its counts kept on the device or its rows
  padded to the capacity, so that the call compiles into one graph;
* the route (:meth:`ExpertStage.run`), ````ExpertOptions.expert_route``:

  - fused: dispatch, the experts and combine expert by expert in one autograd node (:mod:`flexmoe.experts.fused`;
    compiling, the custom op of :mod:`flexmoe.experts.padded_fused_op`);
  - token exchange: expert parallelism sending each token once per rank (:mod:`flexmoe.parallel.token_exchange`,
    whose receiving rank chooses fused or rows by the same timing, :func:`~flexmoe.experts.chooser.
    choose_fused_route`);
  - rows: dispatch, the experts over rows sorted by expert, combine;
  - read-free (:meth:`ExpertStage.read_free`, the path a GPU takes: ``expert_kernel="grouped_mm"``, or "auto"
    off the CPU): the rows route without a single host read, on the plan of
    :mod:`flexmoe.routing.read_free` (dropless, ``torch._grouped_mm`` over device offsets) or the padded plan
    (capacity mode, batched matmuls);

* the kernel over rows, ``ExpertOptions.expert_kernel``: eager, the one the experts'
  :class:`~flexmoe.experts.chooser.KernelChooser` picks; compiling, the custom ops that read the counts on the
  device (:mod:`flexmoe.experts.padded_op`, :mod:`flexmoe.experts.grouped_op`), or a forced kernel where it runs
  a traced call (the counts then reach the host).

A forced kernel or route that cannot run a call is replaced by what can, with one warning naming it and why.
After each call the stage reports ``last_route``, ``last_kernel``, ``last_choice`` and ``last_shadowed``,
written in one place (:meth:`ExpertStage._report`). The stage holds the layer's modules but owns none of them:
the parameters stay where the layer's state_dict has them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.autograd_state import autocast_on
from flexmoe.dispatch import SCATTER_MAX_ELEMENTS, combine, dispatch
from flexmoe.experts.chooser import KernelChooser, choose_fused_route
from flexmoe.experts.fused import fused_experts, fused_supported
from flexmoe.experts.grouped_op import (
    experts_ffn_by_ends,
    experts_ffn_by_row_weights,
    gathers_row_weights,
    grouped_experts_ffn,
    grouped_mm_runs,
    uses_device_offsets,
)
from flexmoe.experts.kernels import KERNELS, KernelCase, route_bucket
from flexmoe.experts.modules import ExpertOptions, FeedForwardExperts
from flexmoe.experts.padded_fused_op import padded_fused_experts, use_padded_fused
from flexmoe.experts.padded_op import layout_op_runs, padded_experts_forward, padded_op_available
from flexmoe.experts.row_kernels import padded_expert_ffn
from flexmoe.experts.weights import ExpertWeights
from flexmoe.module_call import call_module
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.strategy import AllToAllExperts, ExpertStrategy
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan

__all__ = ["ExpertStage", "PlanLayout", "parameter_dtype"]

# What last_kernel says for the compiled paths that run no kernel of flexmoe.experts.kernels.
PADDED_OP = "padded_op"  # flexmoe::padded_experts over the real rows (flexmoe.experts.padded_op)
GROUPED_OP = "grouped_op"  # the matmuls by flexmoe::grouped_linear or torch._grouped_mm (flexmoe.experts.grouped_op)
PADDED_BMM = "padded_bmm"  # batched matmuls over every padded row (flexmoe.experts.row_kernels.padded_expert_ffn)
GATHERED_BMM = "gathered_bmm"  # each row times its expert's gathered weights (grouped_op.experts_ffn_by_row_weights)

# On the CPU, "auto" takes the read-free path for dropless float32 calls that record autograd and compute at most
# this many rows (T * k): there the call's time is host work, which the read-free path has least of. Measured on
# a 2-core AVX2 CPU (converted Qwen3-MoE and Mixtral blocks, forward + backward, against the host-count routes the
# chooser times): read-free 0.92 against 1.29 of HF's time at 512 rows, 0.88 against 0.93-0.95 at 2048, the
# chooser's route ahead from 4096 rows (0.85 against 0.93) (docs/performance.md, "The CPU proxy, fifth pass").
CPU_READ_FREE_MAX_ROWS = 2048
# Without autograd (evaluation, decoding) the plan-free decoding path is the other candidate: read-free takes the
# calls of no more rows than experts, and those of at most this many experts. Measured the same way, no-grad eval
# forwards (converted Mixtral, Qwen3-MoE, GPT-OSS blocks over HF's, k=4-8, M=64 H=32): at E=8 read-free 0.72-1.27x
# HF's time against 1.16-1.60x for the decoding path at T=16-64, 0.87-1.01 against 1.08-1.12 at T=256; at E=16
# T=64 1.00-1.32 against 1.13-1.34; at E=32-64 T=16-64 the decoding path's chosen kernels lead (0.50-1.09 against
# 1.01-1.26) (docs/performance.md, "The CPU proxy, sixth pass").
CPU_READ_FREE_MAX_EXPERTS = 16
# ... and of at most this many values of rows x M x H (the measured sizes, up to 1024 rows at M=64 H=32): above,
# the decoding path's kernels (embedding_bag's weighted sums) read less than the grouped GEMMs.
CPU_READ_FREE_MAX_NO_GRAD_VALUES = 1 << 21
# ... or, among more experts, where the grouped GEMMs read the weights in place (ungated experts, or w1 | w3 laid
# out side by side: joined_gate_up, a converted block's default), no fewer rows than experts and at most this many
# values. Measured on a 2-core AVX-512 Xeon, no-grad eval forwards: converted Qwen3-MoE blocks (M=64 H=32 k=8)
# read-free 0.93-0.96x HF's time against 1.16-1.26x for the decoding path at E=32-64 T=16-64 (up to 1M values);
# flexmoe layers at M = H = 128, E=64 k=2, the decoding path ahead at 18 rows (1.19x) and at 2M values (1.16x)
# (docs/performance.md, "The CPU proxy, eighth pass").
CPU_READ_FREE_IN_PLACE_MAX_VALUES = 1 << 20


@dataclass(frozen=True)
class PlanLayout:
    """How a call's plan lays out its rows: ``padded`` (every expert's rows padded to the capacity) and
    ``counts_on_device`` (the counts never reach the host); both False in an eager call."""

    padded: bool = False
    counts_on_device: bool = False


# The read-free path's two layouts (frozen: shared by every call rather than made per call).
_PADDED, _DROPLESS = PlanLayout(padded=True), PlanLayout()


class ExpertStage:
    """How one layer's experts run (module docstring).

    experts: the module the layer was built with (below any adapter); options: the layer's
    :class:`~flexmoe.experts.ExpertOptions`; distributed: the experts are spread over an expert-parallel group;
    topology_gated: the layer routes by FasterMoE's topology gate (no compiled layout); model_dim: M. The stage
    holds the experts module, it does not own it (it is no nn.Module): the layer's state_dict keeps its keys. The
    shared experts come with each call (:meth:`shared_output`): an adapter may wrap them after construction.
    """

    def __init__(self, experts: nn.Module, options: ExpertOptions, *, distributed: bool, topology_gated: bool,
                 model_dim: int) -> None:
        self.experts = experts
        # The built-in experts, or None for a custom experts module (a plain attribute: read several times a call).
        self.builtin: FeedForwardExperts | None = experts if isinstance(experts, FeedForwardExperts) else None
        self.options = options
        self.distributed = distributed
        self.topology_gated = topology_gated
        self.model_dim = model_dim
        # What the last call ran (None before the first).
        self.last_route: str | None = None
        self.last_kernel: str | None = None
        self.last_choice: ParallelSetting | None = None
        self.last_shadowed: list[int] = []
        self._warned: set[str] = set()
        # The last read-free decision: (the weights, what else it depends on, its answer), see read_free_weights.
        self._read_free_decision: tuple[ExpertWeights, tuple[object, ...], bool] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The kept decision holds the experts' weights (joined experts': views, which copy.deepcopy refuses to
        # copy); a copy decides afresh for its own.
        return {**self.__dict__, "_read_free_decision": None}

    # ---- the plan's layout ----------------------------------------------------------------------------------

    def plan_layout(self, routing: RoutingOptions, tokens: Tensor, training: bool, adapted: bool = False,
                    ) -> PlanLayout:
        """tokens: ``[T, M]``. How this call's plan lays out its rows (:class:`PlanLayout`); ``adapted``: an
        adapter wraps the experts (the custom ops read the weights themselves: no device counts).

        Compiling, top-k routing in one process without the topology gate: in capacity mode (on the CPU only) the
        rows are padded to the capacity; dropless with every pair kept and one capacity over the call, the counts
        stay on the device and the built-in experts run by the custom ops that read them there. Every shape is
        then known before routing and no routed value reaches the host: the call compiles into one graph
        (docs/architecture.md, "Compiling the layer"). A forced kernel that runs a traced call takes the counts on
        the host instead (:meth:`_forced_compiled_kernel`).

        The padding is on the CPU only, for now: on CUDA (an H200, torch 2.11) the compiled padded call's backward
        gave zero gradients (tests/test_compile.py, under make test-gpu; docs/performance.md, "CUDA"), so there a
        compiled capacity-mode call takes the unpadded path, which breaks the graph where the counts reach the
        host."""
        if not torch.compiler.is_compiling() or routing.selection != "topk" or self.topology_gated \
                or self.distributed:
            return PlanLayout()
        if self._forced_compiled_kernel(tokens, training) is not None:
            return PlanLayout()
        capacity_mode = routing.capacity is not None or routing.capacity_factor > 0
        if capacity_mode:
            return PlanLayout(padded=tokens.device.type == "cpu")
        on_device = (routing.static_capacity_factor == 0 and routing.capacity_per == "call"
                     and not (routing.second_expert == "random" and training)
                     and self.builtin is not None and not adapted and padded_op_available())
        return PlanLayout(counts_on_device=on_device)

    @staticmethod
    def read_free_layout(routing: RoutingOptions) -> PlanLayout:
        """The plan's layout on the read-free path (:meth:`read_free`), eager or compiled: padded to the capacity
        in capacity mode (a capacity known before routing, so every shape is too), else dropless rows."""
        return _PADDED if routing.capacity is not None or routing.static_capacity_factor > 0 else _DROPLESS

    def _forced_compiled_kernel(self, tokens: Tensor, training: bool) -> str | None:
        """Under torch.compile, the forced ``expert_kernel`` that runs this call over rows with the counts on the
        host, or None (``"auto"``, custom experts, or a kernel that cannot run a traced call: warned once, the
        compiled custom ops run). ``grouped_mm`` where torch's grouped GEMM reads device offsets runs on the
        device counts instead (:meth:`_grouped_on_device`), so None for it there too."""
        experts = self.builtin
        if experts is None or experts.kernels.kernel == "auto":
            return None
        kernel = experts.kernels.kernel
        weights = experts.weights()
        rows = tokens if tokens.dtype == experts.w1.dtype else tokens.to(experts.w1.dtype)
        case = KernelCase.of(rows, [rows.shape[0]] + [0] * (weights.num_experts - 1), weights)
        if kernel == "grouped_mm" and self._device_offsets(rows):
            return None
        reason = KERNELS[kernel].supports(case)
        if reason is None:
            return kernel
        self._warn(f"compiled:{kernel}", f"expert_kernel={kernel!r} does not run this compiled call ({reason}); "
                   f"the compiled custom ops run such calls")
        return None

    def serves_without_plan(self, routing: RoutingOptions, tokens: Tensor, training: bool) -> bool:
        """Whether this call (tokens ``[T, M]``) may skip the plan (:func:`flexmoe.decoding.forward_without_plan`:
        its experts run over rows, :meth:`run_rows`): no autograd, evaluation mode, eager, one process, top-k
        routing in token order with one capacity over the call, and few enough pairs for combine's scatter-add
        (decoding and small evaluation batches)."""
        if torch.is_grad_enabled() or training or torch.compiler.is_compiling():
            return False
        if self.distributed:
            # It falls back to the full path when one of this rank's experts overflows: a decision of this rank
            # alone, which under expert parallelism would run other exchanges than its peers'.
            return False
        if routing.selection != "topk" or self.topology_gated or routing.batch_prioritized:
            return False
        return routing.capacity_per == "call" and 0 < tokens.shape[0] * routing.k * self.model_dim <= \
            SCATTER_MAX_ELEMENTS

    # ---- the read-free path ---------------------------------------------------------------------------------

    def read_free(self, routing: RoutingOptions, tokens: Tensor, training: bool, adapted: bool = False) -> bool:
        """Whether this call (tokens ``[T, M]``) takes the read-free path (:meth:`run_read_free`): no operation
        reads the device from the host, forward or backward (docs/architecture.md, "Expert compute").
        :meth:`read_free_weights` says the same and gives the weights the call runs on."""
        return self.read_free_weights(routing, tokens, training, adapted) is not None

    def read_free_weights(self, routing: RoutingOptions, tokens: Tensor, training: bool,
                          adapted: bool = False) -> ExpertWeights | None:
        """The experts' weights (:meth:`~flexmoe.experts.modules.FeedForwardExperts.weights`) where this call
        (tokens ``[T, M]``) takes the read-free path, for :meth:`run_read_free`; None where it does not. No
        operation on that path reads the device from the host, forward or backward.

        It is the path of ``expert_kernel="grouped_mm"`` (forced, any device: how the CPU tests count it), and of
        ``"auto"`` off the CPU: there the chooser's timing and the host counts would stall the stream at every
        call, so auto takes this path without timing anything (unless ``expert_route="fused"`` is forced). On the
        CPU auto takes it, untimed too, for small dropless float32 calls that record autograd
        (:data:`CPU_READ_FREE_MAX_ROWS`), whose time is host work; larger ones are timed as before. Eager
        or compiled (traced, dropless takes it in bf16 only: the grouped GEMM's meta function), one process, the
        built-in experts without an adapter, top-k routing with one capacity over the call, no batch priority,
        no random 2nd expert in training, no global balance loss, T >= 1. Capacity mode (a
        capacity known before routing) takes the padded layout, batched matmuls over every expert's
        ``capacity`` rows; dropless, ``torch._grouped_mm`` with the offsets on the device, where it takes the
        experts' dtype and shapes (:func:`~flexmoe.experts.grouped_op.grouped_mm_runs`: off the CPU bf16 only),
        else the call reads as before, with one warning when grouped_mm was forced. Adaptive capacity
        (``capacity_factor < 0``) depends on the loads: not read-free."""
        experts = self.builtin
        if experts is None or adapted or self.distributed or self.topology_gated:
            return None
        kernels, weights = experts.kernels, experts.weights()
        if torch.compiler.is_compiling():
            return self._decide_read_free(routing, tokens, training, kernels, weights)
        # The answer depends on these alone, and a loop asks again with the same at every step: it is kept, and the
        # checks run when one of them changes (weights: the same object while the parameters are, experts.weights).
        # (The weights' device is not among them: the checks read the tokens'.)
        w1, w2, device = weights.w1, weights.w2, tokens.device
        autocast = autocast_on(tokens)
        depends_on = (routing, training, torch.is_grad_enabled(), autocast, tokens.shape[0], tokens.dtype, device,
                      w1.dtype, w1.shape, w2.shape, kernels.kernel, kernels.route)
        kept = self._read_free_decision
        if kept is not None and kept[0] is weights and kept[1] == depends_on:
            return weights if kept[2] else None
        answer = self._decide_read_free(routing, tokens, training, kernels, weights)
        self._read_free_decision = (weights, depends_on, answer is not None)
        return answer

    def _decide_read_free(self, routing: RoutingOptions, tokens: Tensor, training: bool, kernels: KernelChooser,
                          weights: ExpertWeights) -> ExpertWeights | None:
        """:meth:`read_free_weights`' checks for the built-in experts, their weights ``weights`` (unadapted, one
        process, no topology gate)."""
        if kernels.route == "fused" or kernels.kernel not in ("auto", "grouped_mm"):
            return None
        forced = kernels.kernel == "grouped_mm"
        if not forced and tokens.device.type == "cpu":
            # A host-bound call is dropless float32 without autocast: the grouped GEMM takes it where aligned.
            if not _host_bound_on_cpu(routing, tokens, weights) or not _plain_topk(routing, training):
                return None
            aligned = grouped_mm_runs("cpu", torch.float32, weights.w1.shape) and \
                grouped_mm_runs("cpu", torch.float32, weights.w2.shape)
            return weights if aligned and tokens.shape[0] > 0 else None
        if not _plain_topk(routing, training) or tokens.shape[0] == 0:
            return None
        if routing.capacity is not None or routing.static_capacity_factor > 0:
            return weights
        if routing.static_capacity_factor < 0:
            return None
        compiling = torch.compiler.is_compiling()
        dtype = self._compute_dtype(tokens)
        # Traced, torch._grouped_mm's meta function is the judge, and it takes bf16 only, on every device; a
        # compiled float32 call keeps the compiled custom ops, which read the counts on the device.
        device_type = "meta" if compiling else tokens.device.type
        if grouped_mm_runs(device_type, dtype, weights.w1.shape) and grouped_mm_runs(device_type, dtype,
                                                                                    weights.w2.shape):
            return weights
        if forced and not compiling:
            self._warn("read_free", f"expert_kernel='grouped_mm' cannot run this call without host reads: "
                       f"torch._grouped_mm takes float32, bfloat16 or float16 matmuls on the CPU (bfloat16 "
                       f"elsewhere) whose sizes are 16 bytes apart, the experts compute in {dtype} on "
                       f"{tokens.device.type} with w1 {tuple(weights.w1.shape)}; such calls count their rows on "
                       f"the host")
        return None

    def exchange_read_free(self, routing: RoutingOptions, tokens: Tensor, training: bool, adapted: bool,
                           strategy: ExpertStrategy) -> bool:
        """Whether this call (tokens ``[T, M]``) under expert parallelism builds its plan without a host read
        (:func:`~flexmoe.routing.read_free.read_free_plan`, its counts left on the device), so that the call's
        one read is the split sizes of its exchanges (:meth:`~flexmoe.parallel.strategy.AllToAllExperts.
        run_device_counts`): the static all-to-all strategy (not shadowing, the pairwise schedule, replicas or
        ``parallel="auto"``, which read the counts on the host as before), top-k routing with one capacity over
        the call, no batch priority, no random 2nd expert in training, no global balance loss, no topology gate or
        adapter; dropless with T >= 1, or a capacity given as a number (``capacity``): the plan is then padded, every
        rank sending each expert exactly that many rows, and the call reads nothing (:meth:`~flexmoe.parallel.
        strategy.AllToAllExperts.run_padded`). A capacity factor makes each rank's capacity depend on its number
        of tokens, which its peers would have to read: such calls read as before (docs/architecture.md,
        "Experts over ranks")."""
        # A rank without tokens joins the padded exchange too (its peers' splits count on its C rows per expert);
        # dropless, it counts on the host, and the exchanges it runs are the same.
        dropless = routing.capacity is None and routing.static_capacity_factor == 0 and tokens.shape[0] > 0
        return (self.distributed and isinstance(strategy, AllToAllExperts) and not adapted
                and not self.topology_gated and _plain_topk(routing, training)
                and (dropless or routing.capacity is not None))

    def run_read_free(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                      weights: ExpertWeights) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]`` by the read-free path (:meth:`read_free`): dispatch by one gather, the
        experts by grouped matmuls over ``plan.expert_ends`` (dropless) or batched ones over the padded rows
        ``[E, C, M]`` (capacity mode), combine by one scatter-add (dropless) or a masked gather per pair (padded:
        dropped pairs read a zero row); few dropless rows on the CPU by :meth:`_run_on_gathered_weights`.
        plan: :func:`~flexmoe.routing.read_free.read_free_plan`'s, or the padded plan of ``make_plan(...,
        padded=True, read_free=True)``. weights: :meth:`read_free_weights`' answer."""
        scaled = routing.score_at == "dispatch"
        if not plan.padded and gathers_row_weights(tokens, plan.expert_index.numel(), weights):
            return self._run_on_gathered_weights(tokens, plan, weights, scaled)
        rows = tokens.index_select(0, plan.row_token)  # [N, M] by expert
        if scaled:
            rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
        if plan.padded:
            num_experts, capacity = weights.num_experts, plan.capacity  # a padded plan's capacity is static

            def ffn(r: Tensor) -> Tensor:
                return padded_expert_ffn(r.view(num_experts, capacity, r.shape[-1]), weights).flatten(0, 1)

            out = self.in_expert_dtype(ffn, rows)
            self._report("rows", PADDED_BMM, None, [])
            return _combine_padded(out, plan, weighted=not scaled)
        ends = plan.expert_ends
        assert ends is not None  # read_free_plan sets it
        out = self.in_expert_dtype(experts_ffn_by_ends, rows, ends, plan.row_expert, weights,
                                   expert_dtype=weights.w1.dtype)
        self._report("rows", "grouped_mm", None, [])  # torch._grouped_mm, its offsets on the device
        if not scaled:
            row_weight = plan.row_weight
            out = out * (row_weight if row_weight.dtype == out.dtype else row_weight.to(out.dtype)).unsqueeze(-1)
        return out.new_zeros(tokens.shape[0], out.shape[-1]).index_add(0, plan.row_token, out)

    def _run_on_gathered_weights(self, tokens: Tensor, plan: RoutingPlan, weights: ExpertWeights,
                                 scaled: bool) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]`` for few rows (:func:`~flexmoe.experts.grouped_op.gathers_row_weights`):
        the pairs in token order (row ``t * k + j`` is token t's j-th choice), each on its own expert's gathered
        weights, so that no row needs sorting by expert; combined by a weighted sum over each token's k rows."""
        num_tokens, k = plan.expert_index.shape
        rows = tokens.unsqueeze(1).expand(num_tokens, k, tokens.shape[1]).reshape(num_tokens * k, -1)  # [N, M]
        weight = plan.weight.reshape(-1, 1)  # [N, 1]
        if scaled:
            rows = rows * weight.to(rows.dtype)
        row_expert = plan.expert_index.reshape(-1)
        out = self.in_expert_dtype(experts_ffn_by_row_weights, rows, row_expert, weights,
                                   expert_dtype=weights.w1.dtype)
        self._report("rows", GATHERED_BMM, None, [])
        if not scaled:
            out = out * (weight if weight.dtype == out.dtype else weight.to(out.dtype))
        return out.view(num_tokens, k, -1).sum(1)

    def _compute_dtype(self, tokens: Tensor) -> torch.dtype:
        """The dtype the experts' matmuls run in: autocast's where it is on for them, else the parameters'."""
        experts = self.builtin
        assert experts is not None
        if autocast_on(tokens) and self.options.experts_autocast:
            return torch.get_autocast_dtype(tokens.device.type)
        return experts.w1.dtype

    # ---- a call's route -------------------------------------------------------------------------------------

    def run(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions, parallel: ParallelOptions,
            pinned: frozenset[str], strategy: ExpertStrategy) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, each token's weighted sum over its experts (or, ``score_at="dispatch"``,
        the plain sum of its experts' outputs on weighted rows), by the route this call takes (module docstring).
        strategy: the call's expert strategy (:mod:`flexmoe.parallel.strategy`)."""

        if self.distributed and (plan.padded or plan.host_counts is None) and isinstance(strategy, AllToAllExperts):
            return self._exchange_device_counts(tokens, plan, routing, parallel, strategy)

        def rows_route(t: Tensor) -> Tensor:
            return self._rows_route(t, plan, routing, parallel, pinned, strategy)

        if self._runs_fused(tokens, plan, routing, rows_route):
            return self._run_fused(tokens, plan, strategy)
        sent = self._exchange_tokens(tokens, plan, routing, parallel, pinned, strategy)
        if sent is not None:
            return sent
        return rows_route(tokens)

    def _rows_route(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions, parallel: ParallelOptions,
                    pinned: frozenset[str], strategy: ExpertStrategy) -> Tensor:
        """The three stages one after another: dispatch ``[N, M]``, the experts, combine -> ``[T, M]``."""
        expert_input = dispatch(tokens, plan, scale=routing.score_at == "dispatch")  # [N, M] by expert
        # Counts left on the device (compiling, dropless) are read there by the experts' custom ops only.
        counts = [] if plan.host_counts is None else plan.counts
        layout_plan = plan if self._by_layout(plan, expert_input) else None
        expert_output = self.run_rows(expert_input, counts, parallel, pinned, strategy, layout_plan)  # [N, M]
        return combine(expert_output, plan, weighted=routing.score_at == "combine")

    def _runs_fused(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                    rows_route: Callable[[Tensor], Tensor]) -> bool:
        """Whether dispatch, the experts and combine run fused, expert by expert (:mod:`flexmoe.experts.fused`):
        the built-in experts, all in this process, weights applied at combine, and where fused runs (eager:
        :func:`~flexmoe.experts.fused.fused_supported`, training; compiling: the custom op of
        :mod:`flexmoe.experts.padded_fused_op`). Then ``expert_route``: "fused" takes it, "rows" never; "auto"
        takes it where measured faster than the three stages for this call's bucket
        (:func:`~flexmoe.experts.chooser.choose_fused_route`; compiling, by the op's size rule), unless a row
        kernel is forced (it runs inside the rows route)."""
        experts = self.builtin
        if experts is None or self.distributed or routing.score_at != "combine" or experts.kernels.route == "rows":
            return False
        forced, kernel_forced = experts.kernels.route == "fused", experts.kernels.kernel != "auto"
        weights = experts.weights()
        if plan.padded or torch.compiler.is_compiling():
            if self._grouped_on_device(plan, tokens):
                return False
            if kernel_forced and not forced:
                return False
            runs = use_padded_fused(tokens, plan, weights, size_rule=not forced)
            if forced and not runs:
                self._warn("route:compiled", "expert_route='fused' does not run this compiled call (the fused op "
                           "needs autograd, a named activation with a closed-form derivative, no clamp, no "
                           "autocast, float32/float64 on the CPU); the rows route runs such calls")
            return runs
        if not any(plan.counts):  # no rows: nothing to fuse, nothing to time
            return False
        if not fused_supported(tokens, weights):
            if forced:
                self._warn("route:eager", "expert_route='fused' does not run this call (the fused experts need "
                           "autograd, no autocast, the tokens and weights in one dtype and device); the rows "
                           "route runs such calls")
            return False
        if forced or kernel_forced:  # a forced row kernel runs inside the rows route
            return forced
        bucket = route_bucket(tokens, plan.row_token.shape[0], weights)
        return choose_fused_route(experts.kernels, bucket, tokens, weights,
                                  run_fused=lambda t: self._fused(t, plan, experts),
                                  run_rows=rows_route,
                                  kernel_rows=lambda: (dispatch(tokens, plan), plan.counts))

    def _run_fused(self, tokens: Tensor, plan: RoutingPlan, strategy: ExpertStrategy) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, the weighted sum of each token's experts (:func:`fused_experts`)."""
        experts = self.builtin
        assert experts is not None  # checked by _runs_fused
        if self._autocast_off(tokens):
            with torch.autocast(tokens.device.type, enabled=False):
                out = self._fused(tokens.to(experts.w1.dtype), plan, experts).to(tokens.dtype)
        else:
            out = self._fused(tokens, plan, experts)
        compiled = plan.padded or torch.compiler.is_compiling()
        self._report("fused", "padded_fused_op" if compiled else "fused", strategy.last_choice, [])
        return out

    @staticmethod
    def _fused(x: Tensor, plan: RoutingPlan, experts: FeedForwardExperts) -> Tensor:
        if plan.padded or torch.compiler.is_compiling():
            return padded_fused_experts(x, plan, experts.weights())
        return fused_experts(x, plan.row_token, plan.row_weight.to(x.dtype), plan.counts, experts.weights())

    def _exchange_tokens(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                         parallel: ParallelOptions, pinned: frozenset[str], strategy: ExpertStrategy,
                         ) -> Tensor | None:
        """tokens: ``[T, M]`` -> ``[T, M]`` when this call's strategy sends each token once per rank instead of
        one row per (token, expert) pair (:mod:`flexmoe.parallel.token_exchange`; expert parallelism at r = 1,
        d = 1, weights applied at combine); None: the call dispatches rows."""
        if not self.distributed or plan.padded or routing.score_at != "combine":
            return None

        def rows_path(tokens_in: Tensor, run_rows: Callable[[Tensor], Tensor]) -> Tensor:
            out = self.in_expert_dtype(run_rows, dispatch(tokens_in, plan))  # [N, M] by expert
            return combine(out, plan)

        chooser = self._chooser()
        if chooser is not None:
            chooser.last_kernel = None
        y = strategy.run_tokens(tokens, plan.row_token, plan.row_weight, plan.counts, parallel, pinned, rows_path)
        if y is not None:
            self._report("tokens", None if chooser is None else chooser.last_kernel, strategy.last_choice,
                         strategy.last_shadowed)
        return y

    def _exchange_device_counts(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                                parallel: ParallelOptions, strategy: AllToAllExperts) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]`` under expert parallelism, on a plan whose counts are on the device
        (:meth:`exchange_read_free`): tokens or rows through the exchange, whose split sizes are the one host
        read of the call (:meth:`~flexmoe.parallel.strategy.AllToAllExperts.run_device_counts`); a padded plan's
        rows by the exchange of fixed splits, which reads nothing (:meth:`~flexmoe.parallel.strategy.
        AllToAllExperts.run_padded`)."""
        scaled = routing.score_at == "dispatch"
        chooser = self._chooser()
        if chooser is not None:
            chooser.last_kernel = None  # the kernel this call's experts run, reported below
        if plan.padded:
            # [E * C, M] by expert, the empty rows included. A rank without tokens sends only empty rows, gathered
            # from a zero row after its tokens so that its backward joins the gradient exchange as its peers do.
            source = tokens if tokens.shape[0] else torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
            rows = source.index_select(0, plan.row_token)
            if scaled:
                rows = rows * plan.row_weight.to(rows.dtype).unsqueeze(-1)
            capacity = plan.capacity  # a padded plan's is static
            out = self.in_expert_dtype(lambda r: strategy.run_padded(r, capacity, parallel), rows)
            self._report("rows", None if chooser is None else chooser.last_kernel, strategy.last_choice, [])
            return _combine_padded(out, plan, weighted=not scaled)

        def rows_path(tokens_in: Tensor, run_rows: Callable[[Tensor], Tensor]) -> Tensor:
            out = self.in_expert_dtype(run_rows, dispatch(tokens_in, plan, scale=scaled))  # [N, M] by expert
            return combine(out, plan, weighted=not scaled)

        y, sent_tokens = strategy.run_device_counts(tokens, plan.row_token, plan.row_weight, plan.tokens_per_expert,
                                                    parallel, rows_path, send_tokens=not scaled)
        self._report("tokens" if sent_tokens else "rows", None if chooser is None else chooser.last_kernel,
                     strategy.last_choice, strategy.last_shadowed)
        return y

    # ---- the experts over rows ------------------------------------------------------------------------------

    def run_rows(self, rows: Tensor, counts: list[int], parallel: ParallelOptions, pinned: frozenset[str],
                 strategy: ExpertStrategy, layout_plan: RoutingPlan | None = None) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert -> ``[N, M]`` in rows' dtype, by ``strategy`` (eager: the
        kernel the experts' chooser picks).

        layout_plan: the rows are this plan's, computed by the built-in experts' custom op
        (:func:`flexmoe.experts.padded_op.padded_experts_forward`, :meth:`_by_layout`): only the real rows; a
        plan with its counts on the device whose unit the op cannot take, or where torch's grouped GEMM reads
        them there, by the grouped matmuls of :func:`flexmoe.experts.grouped_op.grouped_experts_ffn`."""
        experts, chooser = self.builtin, self._chooser()
        kernel: list[str | None] = [None]

        def run(expert_rows: Tensor) -> Tensor:
            if layout_plan is not None and experts is not None:
                weights = experts.weights()
                if layout_plan.host_counts is None and (not layout_op_runs(weights, expert_rows)
                                                        or self._grouped_on_device(layout_plan, expert_rows)):
                    kernel[0] = GROUPED_OP
                    return grouped_experts_ffn(expert_rows, layout_plan.tokens_per_expert, weights)
                kernel[0] = PADDED_OP if layout_op_runs(weights, expert_rows) else PADDED_BMM
                return padded_experts_forward(expert_rows, layout_plan, weights)
            if chooser is not None:
                chooser.last_kernel = None
            out = strategy.run(expert_rows, counts, parallel, pinned)
            kernel[0] = None if chooser is None else chooser.last_kernel
            return out

        out = self.in_expert_dtype(run, rows)
        self._report("rows", kernel[0], strategy.last_choice, strategy.last_shadowed)
        return out

    def _by_layout(self, plan: RoutingPlan, rows: Tensor) -> bool:
        """Whether the built-in experts compute ``rows`` (``[N, M]``, dispatched by ``plan``) by the custom op of
        :mod:`flexmoe.experts.padded_op`, which reads the counts on the device: always for a padded plan, and
        while compiling for any other in one process (dropless, adaptive capacity, expert choice, BASE), whose
        counts then never reach the graph, unless a forced kernel runs the call. Traced as Python ints instead,
        every count that is 0 or 1 is a value dynamo specializes on: with many experts nearly every call
        recompiled, until dynamo's limit sent the rest of the forward back to eager (docs/architecture.md,
        "Compiling the layer")."""
        if plan.padded or plan.host_counts is None:  # host_counts None: the counts are on the device only
            return True
        experts = self.builtin
        return (torch.compiler.is_compiling() and experts is not None and not self.distributed
                and layout_op_runs(experts.weights(), rows)
                and self._forced_compiled_kernel(rows, torch.is_grad_enabled()) is None)

    def _grouped_on_device(self, plan: RoutingPlan, rows: Tensor) -> bool:
        """Whether a plan with its counts on the device runs the experts' matmuls by ``torch._grouped_mm`` with
        device offsets (:func:`flexmoe.experts.grouped_op.uses_device_offsets`: off the CPU, bf16), so that no
        count reaches the host: not by the custom ops, which read them there (docs/architecture.md, "Compiling
        the layer")."""
        return plan.host_counts is None and self._device_offsets(rows)

    def _device_offsets(self, rows: Tensor) -> bool:
        experts = self.builtin
        if experts is None:
            return False
        device_type = rows.device.type
        autocast = autocast_on(rows) and self.options.experts_autocast
        dtype = torch.get_autocast_dtype(device_type) if autocast else experts.w1.dtype
        return all(uses_device_offsets(device_type, dtype, w.shape) for w in (experts.w1, experts.w2))

    def in_expert_dtype(self, run: Callable[..., Tensor], rows: Tensor, *args: Any,
                        expert_dtype: torch.dtype | None = None) -> Tensor:
        """``run(rows, *args)`` in the experts' dtype, returned in rows' dtype: a float32 layer fed bf16 activations
        (or the reverse) computes in its parameters' dtype (under autocast, as autocast says, unless
        ``experts_autocast`` is False: autocast is then off around the experts, which compute in their
        parameters' dtype as without it). ``expert_dtype``: that dtype where the caller holds the weights (None:
        read from the experts)."""
        if expert_dtype is None:
            builtin = self.builtin
            expert_dtype = builtin.w1.dtype if builtin is not None else parameter_dtype(self.experts)
        if expert_dtype == rows.dtype and not autocast_on(rows):
            return run(rows, *args)  # the common call: nothing to cast, no autocast to switch off
        if expert_dtype is not None and self._autocast_off(rows):
            with torch.autocast(rows.device.type, enabled=False):
                return run(rows.to(expert_dtype), *args).to(rows.dtype)
        if expert_dtype is None or autocast_on(rows) or expert_dtype == rows.dtype:
            return run(rows, *args)
        return run(rows.to(expert_dtype), *args).to(rows.dtype)

    def _autocast_off(self, rows: Tensor) -> bool:
        """Whether autocast is on for ``rows``' device and ``experts_autocast`` turns it off around the routed
        experts (ExpertOptions)."""
        return autocast_on(rows) and not self.options.experts_autocast

    # ---- the shared experts ---------------------------------------------------------------------------------

    def shared_output(self, tokens: Tensor, shared: nn.Module, shared_gate: nn.Module | None) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, the sum of the shared experts' outputs (every token through each),
        scaled by ``shared_gate`` (None: ungated). The layer's modules as they are now (an adapter may wrap them)."""
        n, num_tokens = self.options.shared_experts, tokens.shape[0]
        rows = tokens.repeat(n, 1) if n > 1 else tokens  # [n*T, M]: all tokens for shared expert 0, then 1, ...
        dtype = parameter_dtype(shared)
        if not autocast_on(tokens) and dtype is not None and dtype != rows.dtype:
            rows = rows.to(dtype)  # as for the routed experts: compute in the parameters' dtype
        out = call_module(shared, rows, [num_tokens] * n)  # [n*T, M]
        if n > 1:  # one shared expert's rows are already the sum
            out = out.view(n, num_tokens, self.model_dim).sum(0)
        return out if shared_gate is None else call_module(shared_gate, tokens, out)

    # ---- reports ----------------------------------------------------------------------------------------------

    def _report(self, route: str, kernel: str | None, choice: ParallelSetting | None, shadowed: list[int]) -> None:
        """What the last call ran: the one place that writes the stage's reports."""
        self.last_route, self.last_kernel = route, kernel
        self.last_choice, self.last_shadowed = choice, list(shadowed)

    def _chooser(self) -> KernelChooser | None:
        experts = self.builtin
        return None if experts is None else experts.kernels

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


def _plain_topk(routing: RoutingOptions, training: bool) -> bool:
    """Whether the call's routing is the plain top-k that a plan without host reads serves: top-k selection, one
    capacity over the call, no batch priority, no global balance loss, no random 2nd expert in training."""
    return (routing.selection == "topk" and routing.capacity_per == "call" and not routing.batch_prioritized
            and routing.aux_loss_type != "global" and not (routing.second_expert == "random" and training))


def _host_bound_on_cpu(routing: RoutingOptions, tokens: Tensor, weights: ExpertWeights) -> bool:
    """Whether "auto" takes the read-free path for this CPU call (tokens ``[T, M]``): eager, dropless, float32
    tokens and experts, no autocast, at most :data:`CPU_READ_FREE_MAX_ROWS` rows, and, without autograd, either
    rows that run on their gathered weights (:func:`~flexmoe.experts.grouped_op.gathers_row_weights`: a decoding
    step of small experts), or at most :data:`CPU_READ_FREE_MAX_EXPERTS` experts and
    :data:`CPU_READ_FREE_MAX_NO_GRAD_VALUES` values of rows x M x H, or weights read in place (ungated, or w1 | w3
    side by side) with no fewer rows than experts and at most :data:`CPU_READ_FREE_IN_PLACE_MAX_VALUES` values.
    Such calls' time is host work, which the chooser's timed routes, reading the counts, add to; larger no-grad
    calls keep the decoding path's kernels."""
    num_tokens, model_dim = tokens.shape
    rows = num_tokens * routing.k
    if rows > CPU_READ_FREE_MAX_ROWS or torch.compiler.is_compiling() or tokens.dtype != torch.float32 \
            or weights.w1.dtype != torch.float32 or autocast_on(tokens) or routing.capacity is not None \
            or routing.static_capacity_factor != 0:
        return False
    if torch.is_grad_enabled():
        return True
    values, num_experts = rows * model_dim * weights.hidden, weights.num_experts
    if gathers_row_weights(tokens, rows, weights) or (
            num_experts <= CPU_READ_FREE_MAX_EXPERTS and values <= CPU_READ_FREE_MAX_NO_GRAD_VALUES):
        return True
    # Weights the grouped GEMMs read in place (ungated, or w1 | w3 laid out side by side: no copy per call).
    return rows >= num_experts and values <= CPU_READ_FREE_IN_PLACE_MAX_VALUES and (
        weights.w3 is None or weights.laid_out_gate_up() is not None)


def _combine_padded(out: Tensor, plan: RoutingPlan, weighted: bool) -> Tensor:
    """out: ``[N, M]`` the padded plan's rows -> ``[T, M]``, each token's (weighted) sum over its kept pairs, by one
    gather of ``[T, k]`` rows with a zero row appended for the pairs without one (dropped: ``pair_row == N``):
    every shape static, nothing read, and a NaN in an empty row never reaches a token."""
    pair_row = plan.pair_row
    assert pair_row is not None  # a padded plan sets it
    num_tokens, k = pair_row.shape
    with_zero = torch.cat([out, out.new_zeros(1, out.shape[-1])])  # [N + 1, M]
    per_pair = with_zero.index_select(0, pair_row.reshape(-1)).view(num_tokens, k, out.shape[-1])  # [T, k, M]
    if weighted:
        per_pair = per_pair * plan.weight.to(out.dtype).unsqueeze(-1)
    return per_pair.sum(1)


def parameter_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of ``module``'s first parameter (None without parameters): the built-in experts' ``w1``'s, read
    directly (walking the module tree costs a small call a dozen Python frames), else by that walk."""
    if isinstance(module, FeedForwardExperts):
        return module.w1.dtype
    for p in module.parameters():
        return p.dtype
    return None
