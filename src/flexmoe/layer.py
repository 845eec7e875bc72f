"""MoELayer: router -> RoutingPlan -> dispatch -> experts -> combine (docs/architecture.md, "The data path").

The layer's options live in three frozen dataclasses, each validated once when it is made:
:class:`~flexmoe.routing.RoutingOptions`, :class:`~flexmoe.experts.ExpertOptions` and
:class:`~flexmoe.parallel.ParallelOptions`. The keyword constructor routes every keyword to the dataclass with
a field of that name, so a new option is one field (and its docstring line) in one of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from flexmoe.dispatch import SCATTER_MAX_ELEMENTS, combine, dispatch, sum_choices_by_token, sum_rows_by_token
from flexmoe.experts import ExpertOptions, ExpertsCall, FeedForwardExperts
from flexmoe.fused_experts import fused_experts, use_fused
from flexmoe.grouped_linear_op import grouped_experts_ffn, uses_device_offsets
from flexmoe.padded_ffn_op import layout_op_runs, padded_experts_forward, padded_op_available
from flexmoe.padded_fused_op import padded_fused_experts, use_padded_fused
from flexmoe.parallel.auto import MeasuringChooser
from flexmoe.parallel.expert_parallel import ExpertParallel, ParallelSetting
from flexmoe.parallel.groups import check_config_agreement, default_ranks_per_node, resolve_group
from flexmoe.parallel.layout import ExpertLayout
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.strategy import ExpertStrategy, LayerShape, build_strategy, check_parallel_options
from flexmoe.routing.bias_balance import bias_update
from flexmoe.routing.build import build_plan
from flexmoe.routing.capacity import HOST_ORDER_MAX_PAIRS, count_per_expert, order_pairs_on_host, sort_pairs_by_expert
from flexmoe.routing.families import num_sequences_of
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan, check_logits, resolve_capacity
from flexmoe.routing.routers import build_router, route
from flexmoe.routing.scores import check_group_options, routed_weights, router_scores, select_experts
from flexmoe.routing.topology import topology_gate
from flexmoe.shared import SharedExpertGate
from flexmoe.tuning.policies import resolve_shadow
from flexmoe.validation import FLOAT_DTYPES, check_int, describe_value

__all__ = ["MoELayer", "update_expert_biases"]

_OptionsClass = type[RoutingOptions] | type[ExpertOptions] | type[ParallelOptions]
_OPTION_CLASSES: dict[str, _OptionsClass] = {"routing_options": RoutingOptions, "expert_options": ExpertOptions,
                                             "parallel_options": ParallelOptions}
# What one forward call may override: the capacity (routing) and every parallel option but the chooser.
_CALL_ROUTING = ("capacity", "capacity_factor")
_CALL_PARALLEL = tuple(f.name for f in dataclasses.fields(ParallelOptions) if f.name != "chooser")


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer.

    ``y = moe(x)`` with ``x: [..., model_dim]`` returns ``[..., model_dim]`` in x's dtype. Each token goes to
    ``k`` of ``num_experts`` expert FFNs (``model_dim -> hidden_dim -> model_dim``), weighted by the router.

    Every option is a keyword, e.g. ``MoELayer(512, 8, 1024, k=2, capacity_factor=1.25, r=1)``, or comes in
    its dataclass: ``MoELayer(512, 8, 1024, routing_options=RoutingOptions(k=1), parallel_options=...)``
    (keywords given as well are applied on top with ``dataclasses.replace``). The dataclasses' docstrings
    list every option; the main ones:

    Routing (:class:`~flexmoe.routing.RoutingOptions`; docs/architecture.md, "The routing contract"):
        k, capacity_factor (> 0 fixed, 0 dropless, < 0 adaptive), capacity, router ("topk", "cosine",
        "expert_choice", "base" or a module), router_dtype, normalize_weights, batch_prioritized,
        score_at ("combine" / "dispatch"), jitter, gate_noise, router_input_dropout, second_expert
        ("random": GShard's, k=2), cross_node_share (FasterMoE's topology-aware gate, needs ranks_per_node).
        router="expert_choice": each expert takes its top-C tokens; router="base": BASE layers' balanced
        assignment in training, the k best experts (dropless unless ``capacity``) at evaluation.
        balance: "aux" (the balance loss in ``aux_loss``, for the training loop to add) or "bias"
            (DeepSeek-V3, top-k routers): the buffer ``expert_bias`` is added to the probabilities to *select*
            experts only (combine weights stay unbiased). Each training forward adds its load (pairs per
            expert before drops) to ``pending_load``; :meth:`update_expert_bias` (or
            :func:`flexmoe.update_expert_biases` for a whole model), called once per optimizer step, applies
            ``expert_bias[e] += bias_update_rate * sign(mean load - load[e])`` to the load summed since the last
            update and over the expert-parallel group. Keep the bias out of bf16/fp16 (use autocast rather
            than ``.to(torch.bfloat16)``): their spacing near 0.25 exceeds the default rate 1e-3.

    The open MoE families (:mod:`flexmoe.routing.families` maps each model to its options):
        score_func ("softmax" / "sigmoid"), num_expert_groups and num_limited_groups (DeepSeek-V3's
        group-limited routing), route_scale, router_bias, capacity_per ("call" / "sequence": x ``[B, S, M]``,
        a capacity per sequence), aux_loss_type ("switch", "all_choices", "sequence"); balance="bias" works with
        both score functions (``bias_update_rate=0`` keeps a loaded bias fixed).
        Ties: equal scores go to the lower expert index (and equally rated groups to the lower group), a stable
        sort; ``torch.topk`` makes no such promise, so code ported from it may route an exact tie differently.

    Experts (:class:`~flexmoe.experts.ExpertOptions`): activation ("gelu", "relu", "silu" or a callable),
        glu, bias, glu_limit (GPT-OSS's clamped gated unit), shared_experts (N dense experts every token passes
        through, replicated on every rank) with shared_hidden_dim and shared_gate (Qwen2-MoE's sigmoid gate,
        parameter ``shared_gate.weight`` ``[1, M]``);
        or ``experts=`` a module ``forward(x: [N, M], counts: list[int]) -> [N, M]`` used instead.
        An adapter may wrap the built-in experts (PEFT's LoRA ``target_parameters=["experts.w1", ...]``): every
        call then runs inside the wrapper, so each path computes with the adapted weights (:attr:`expert_adapter`;
        docs/architecture.md, "Adapters on the experts").

    Expert parallelism (:class:`~flexmoe.parallel.ParallelOptions`; docs/architecture.md, "Experts over
    ranks"):
        group: the ``torch.distributed`` process group the experts are spread over (default: the world when
            torch.distributed is initialized, else one process; "single": one process holding every expert).
            ``num_experts`` stays global; this rank keeps its experts per
            :class:`~flexmoe.parallel.ExpertLayout`. Each rank's output equals one process holding all experts
            running this rank's tokens as its own batch. The ranks check at construction that they agree on
            the options.
        r, overlap_degree, a2a ("flat" / "2dh"), ranks_per_node (default torchrun's LOCAL_WORLD_SIZE),
        parallel ("static" / "auto": time the candidates per capacity bucket, keep the fastest; ``last_choice``
        and ``auto_decisions`` say what ran), chooser (default :class:`~flexmoe.parallel.MeasuringChooser`;
        :class:`flexmoe.tuning.ModelGuidedChooser` lets the cost model shortlist).
        FasterMoE, changing speed, never results: shadow (False, True: the cost model's
        :class:`flexmoe.tuning.CostModelShadowPolicy`, or a :class:`~flexmoe.parallel.ShadowPolicy`;
        ``last_shadowed`` lists the shadowed experts), schedule ("a2a" / "pairwise").
        How the experts run is a strategy object from :mod:`flexmoe.parallel.strategy`, chosen here.

    ``torch.compile(moe, fullgraph=True)`` works, forward and backward, for top-k routing in one process in
    capacity mode (cf > 0 or ``capacity``: the compiled call pads every expert's rows to the capacity, so no shape
    depends on the routing) and in dropless mode with the built-in experts (every pair has a row, ``N = T * k``,
    and the per-expert counts stay on the device, read by the experts' custom ops); one graph serves every
    routing. Adaptive capacity, custom experts in dropless mode, expert choice, BASE and expert parallelism
    compile with graph breaks where their counts reach the host (docs/architecture.md, "Compiling the layer").

    ``forward`` takes ``capacity``, ``capacity_factor`` and every parallel option but ``chooser`` as keywords
    for that call only. After each forward: ``aux_loss`` (balance loss, differentiable), ``z_loss`` and
    ``last_plan`` (the :class:`~flexmoe.routing.RoutingPlan`: ``tokens_per_expert``, ``capacity``,
    ``dropped_fraction``, ...).
    """

    # Buffers (registered in __init__, None unless balance="bias"): declared for the type checker.
    expert_bias: Tensor | None
    pending_load: Tensor | None
    # The experts module the layer was built with (outside the module tree; see expert_adapter).
    _built_experts: nn.Module

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        hidden_dim: int,
        *,
        experts: nn.Module | None = None,
        group: object | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        routing_options: RoutingOptions | None = None,
        expert_options: ExpertOptions | None = None,
        parallel_options: ParallelOptions | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        given = {"routing_options": routing_options, "expert_options": expert_options,
                 "parallel_options": parallel_options}
        chosen = _options_from_keywords(given, options)  # every option validated here, once
        routing, expert, parallel = chosen["routing_options"], chosen["expert_options"], chosen["parallel_options"]
        self.model_dim = check_int("model_dim", model_dim, 1)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.hidden_dim = check_int("hidden_dim", hidden_dim, 1)
        if routing.k > num_experts:
            raise ValueError(f"k must be in [1, num_experts={num_experts}], got {routing.k}")
        check_group_options(num_experts, routing.k, routing.num_expert_groups, routing.num_limited_groups)
        if experts is not None and expert.glu_limit is not None:
            raise ValueError("glu_limit applies to the built-in experts; a custom experts module has its own unit")
        if experts is not None and not isinstance(experts, nn.Module):
            raise TypeError(f"experts must be an nn.Module, got {type(experts).__name__}")
        self.ep_group = resolve_group(group)
        parallel = dataclasses.replace(
            parallel,
            ranks_per_node=default_ranks_per_node() if parallel.ranks_per_node is None else parallel.ranks_per_node,
            shadow=resolve_shadow(parallel.shadow) or False,
            chooser=parallel.chooser if parallel.chooser is not None else MeasuringChooser(),
        )
        self.routing_options, self.expert_options, self.parallel_options = routing, expert, parallel
        # Before anything is built, so that ranks built with different options all fail here, naming them.
        check_config_agreement(self.ep_group, self._describe_options(experts, dtype))

        self.layout = ExpertLayout(num_experts, self.ep_group.world_size, hidden_dim)
        if experts is not None and self.layout.shards_per_expert > 1:
            raise ValueError(
                f"a custom experts module cannot be sharded: num_experts={num_experts} must be a multiple of "
                f"the expert-parallel world size {self.ep_group.world_size}"
            )
        self.router = build_router(routing.router, model_dim, num_experts, bias=routing.router_bias)
        if isinstance(routing.router, str):
            self.router.to(device=device, dtype=dtype)
        # Only this rank's experts (or its hidden shard of one); see flexmoe.parallel.layout.
        self.experts = experts if experts is not None else expert.build(
            self.layout.experts_per_rank, model_dim, self.layout.local_hidden_dim, device=device, dtype=dtype)
        # The module every path computes with (the strategies hold it too), kept outside the module tree: an
        # adapter may replace the attribute `experts` by a wrapper around it (see expert_adapter).
        self.__dict__["_built_experts"] = self.experts
        # Shared experts see all of this rank's tokens: replicated like any dense layer, never spread over ranks.
        shared_hidden_dim = hidden_dim if expert.shared_hidden_dim is None else expert.shared_hidden_dim
        self.shared = expert.build(expert.shared_experts, model_dim, shared_hidden_dim, device=device, dtype=dtype) \
            if expert.shared_experts else None
        self.shared_gate = SharedExpertGate(model_dim, device=device, dtype=dtype) if expert.shared_gate else None
        # Buffers, not parameters: moved with the layer, changed by the load rule, never by the optimizer.
        # expert_bias is saved with the model; pending_load (this step's load so far) is not.
        uses_bias = routing.balance == "bias"
        # With the router's own precision (router_dtype None) the bias stays float32, as DeepSeek-V3's in HF.
        bias_dtype = torch.float32 if routing.router_dtype is None else routing.router_dtype
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=bias_dtype, device=device)
                             if uses_bias else None)
        self.register_buffer("pending_load", torch.zeros(num_experts, dtype=torch.long, device=device)
                             if uses_bias else None, persistent=False)
        self.topology = None if routing.cross_node_share is None else topology_gate(
            self.layout.expert_holders(), self.ep_group.rank, self.ep_group.world_size, parallel.ranks_per_node,
            routing.k, routing.cross_node_share)

        self._ep = ExpertParallel(self.ep_group, self.layout, self._built_experts) if self.ep_group.distributed \
            else None
        check_parallel_options(parallel, self.layout, self._built_experts, self._ep)
        self._shape = LayerShape(model_dim, hidden_dim, num_experts, routing.k, expert.glu)
        self._strategies: dict[tuple[str, str], Any] = {}  # unwrapped strategies by (schedule, parallel)
        self.strategy: ExpertStrategy = self._strategy_for(parallel)
        self.last_choice: ParallelSetting | None = None
        self.last_shadowed: list[int] = []
        # The last call's plan; after a call served without one, the function that builds it when first read.
        self._last_plan: RoutingPlan | None = None
        self._deferred_plan: Callable[[], RoutingPlan] | None = None

    # ---- the data path ----------------------------------------------------------------------------------

    def forward(self, x: Tensor, **call_options: Any) -> Tensor:
        """x: ``[..., model_dim]`` -> ``[..., model_dim]``, same dtype.

        ``call_options`` override the layer's for this call only: ``capacity`` and ``capacity_factor``
        (``capacity=0`` drops every token, and ``last_plan`` says so), and ``r``, ``overlap_degree``, ``a2a``,
        ``ranks_per_node``, ``parallel`` (with ``parallel="auto"``, the ones given restrict the candidates),
        ``shadow`` and ``schedule``. None means "the layer's".
        """
        self._check_input(x)
        adapter = self.expert_adapter
        if adapter is not None:
            # The adapter's weights apply only while its forward runs: the whole call runs inside it.
            return adapter(x, ExpertsCall(partial(self._forward, x, call_options)))
        return self._forward(x, call_options)

    def _forward(self, x: Tensor, call_options: dict[str, Any]) -> Tensor:
        """:meth:`forward` on the experts as they read now (adapted, inside an adapter's call)."""
        routing, parallel, pinned = self._call_options(call_options)
        tokens = x.reshape(-1, self.model_dim)  # [T, M]
        num_sequences = num_sequences_of(x, self.model_dim, routing.capacity_per, routing.aux_loss_type)
        if self._serves_without_plan(routing, tokens):
            served = self._forward_without_plan(tokens, routing, parallel, pinned, num_sequences)
            if served is not None:
                return served.to(x.dtype).reshape(x.shape)

        logits = route(self.router, _router_input(tokens, num_sequences), dtype=routing.router_dtype,
                       training=self.training, jitter=routing.jitter, gate_noise=routing.gate_noise,
                       input_dropout=routing.router_input_dropout)  # [T, E]
        plan = build_plan(logits, routing, training=self.training, selection_bias=self.expert_bias,
                          topology=self.topology, num_sequences=num_sequences, padded=self._padded_layout(routing),
                          counts_on_device=self._counts_on_device(routing, tokens))
        if self._runs_fused(tokens, plan, routing):
            y = self._fused_experts(tokens, plan)  # [T, M]
        elif (sent := self._exchange_tokens(tokens, plan, routing, parallel, pinned)) is not None:
            y = sent  # [T, M]
        else:
            expert_input = dispatch(tokens, plan, scale=routing.score_at == "dispatch")  # [N, M] by expert
            # Counts left on the device (compiling, dropless) are read there by the experts' custom ops only.
            counts = [] if plan.host_counts is None else plan.counts
            expert_output = self._run_experts(expert_input, counts, parallel, pinned,
                                              plan if self._by_layout(plan, expert_input) else None)  # [N, M]
            y = combine(expert_output, plan, weighted=routing.score_at == "combine")  # [T, M]
        if self.shared is not None:
            y = y + self._shared_output(tokens).to(y.dtype)

        if self.pending_load is not None and self.training and not _in_backward():
            # Counted once per forward; a recomputation under activation checkpointing runs inside backward.
            self.pending_load += plan.load.detach()
        self._last_plan, self._deferred_plan = plan, None
        return y.to(x.dtype).reshape(x.shape)

    def _runs_fused(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions) -> bool:
        """Whether dispatch, the experts and combine run fused, expert by expert (:mod:`flexmoe.fused_experts`):
        the built-in experts, all in this process, weights applied at combine, and where
        :func:`~flexmoe.fused_experts.use_fused` says it is faster (training with many small experts); compiling,
        by the custom op of :mod:`flexmoe.padded_fused_op` (over a padded plan, or any other packed)."""
        experts = self._built_experts
        if not isinstance(experts, FeedForwardExperts) or self.ep_group.distributed or routing.score_at != "combine":
            return False
        if plan.padded or torch.compiler.is_compiling():
            return not self._grouped_on_device(plan, tokens) and use_padded_fused(tokens, plan, experts.weights())
        return use_fused(tokens, plan.counts, experts.weights())

    def _fused_experts(self, tokens: Tensor, plan: RoutingPlan) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, the weighted sum of each token's experts (:func:`fused_experts`)."""
        e = self._built_experts
        assert isinstance(e, FeedForwardExperts)  # checked by _runs_fused
        self.last_choice, self.last_shadowed = self.strategy.last_choice, []
        if plan.padded or torch.compiler.is_compiling():
            return padded_fused_experts(tokens, plan, e.weights())
        return fused_experts(tokens, plan.row_token, plan.row_weight.to(tokens.dtype), plan.counts, e.weights())

    def _exchange_tokens(self, tokens: Tensor, plan: RoutingPlan, routing: RoutingOptions,
                         parallel: ParallelOptions, pinned: frozenset[str]) -> Tensor | None:
        """tokens: ``[T, M]`` -> ``[T, M]`` when this call's strategy sends each token once per rank instead of
        one row per (token, expert) pair (:mod:`flexmoe.parallel.token_exchange`; expert parallelism at r = 1,
        d = 1, weights applied at combine); None: the call dispatches rows."""
        if self._ep is None or plan.padded or routing.score_at != "combine":
            return None
        strategy = self._strategy_of(parallel)

        def rows_path(tokens_in: Tensor, run_rows: Callable[[Tensor], Tensor]) -> Tensor:
            out = self._in_expert_dtype(run_rows, dispatch(tokens_in, plan))  # [N, M] by expert
            return combine(out, plan)

        y = strategy.run_tokens(tokens, plan.row_token, plan.row_weight, plan.counts, parallel, pinned, rows_path)
        if y is not None:
            self.last_choice, self.last_shadowed = strategy.last_choice, list(strategy.last_shadowed)
        return y

    def _strategy_of(self, options: ParallelOptions) -> ExpertStrategy:
        """The strategy of a call with ``options``: the layer's own unless the call changed them."""
        same = options is self.parallel_options or options == self.parallel_options
        return self.strategy if same else self._strategy_for(options)

    def _serves_without_plan(self, routing: RoutingOptions, tokens: Tensor) -> bool:
        """Whether this call may take :meth:`_forward_without_plan`: no autograd, evaluation mode, eager, one
        process, top-k routing in token order with one capacity over the call, and few enough pairs for combine's
        scatter-add (decoding and small evaluation batches)."""
        if torch.is_grad_enabled() or self.training or torch.compiler.is_compiling():
            return False
        if self.ep_group.distributed:
            # It falls back to the full path when one of this rank's experts overflows: a decision of this rank
            # alone, which under expert parallelism would run other exchanges than its peers'.
            return False
        if routing.selection != "topk" or self.topology is not None or routing.batch_prioritized:
            return False
        return routing.capacity_per == "call" and 0 < tokens.shape[0] * routing.k * self.model_dim <= \
            SCATTER_MAX_ELEMENTS

    def _forward_without_plan(self, tokens: Tensor, routing: RoutingOptions, parallel: ParallelOptions,
                              pinned: frozenset[str], num_sequences: int | None) -> Tensor | None:
        """tokens: ``[T, M]`` -> ``[T, M]`` (or None when an expert is over its capacity: the full path then drops
        the pairs), computing only what the output needs (docs/architecture.md, "Decoding").

        The same routing functions as :func:`~flexmoe.routing.plan.make_plan` pick the experts and weights, and
        the rows are in the plan's order (by expert, then slot), so the experts compute exactly the full path's
        rows. What only the plan holds (slots, losses) is left to :func:`build_plan`, run on this call's logits
        when ``last_plan``, ``aux_loss`` or ``z_loss`` is first read. Decoding's calls are a few tokens, where the
        number of small ops, not the FLOPs, is the cost outside the experts.
        """
        k = routing.k
        # [T, E]; evaluation: no exploration
        logits = route(self.router, _router_input(tokens, num_sequences), dtype=routing.router_dtype)
        num_tokens, num_experts = check_logits(logits, k)
        scores = router_scores(logits, routing.score_func)
        expert_index, _ = select_experts(scores, k, selection_bias=self.expert_bias,
                                         num_expert_groups=routing.num_expert_groups,
                                         num_limited_groups=routing.num_limited_groups, ties=routing.ties)  # [T, k]
        few_pairs = num_tokens * k <= HOST_ORDER_MAX_PAIRS
        if few_pairs:
            order = order_pairs_on_host(expert_index.tolist(), num_experts)
            counts = order.counts
        else:
            counts = count_per_expert(expert_index, num_experts).tolist()
        max_load = max(counts)
        if max_load > resolve_capacity(num_tokens, num_experts, k, routing.capacity_factor, routing.capacity,
                                       max_load):
            return None
        _, weight = routed_weights(scores, expert_index, normalize_weights=routing.normalize_weights,
                                   route_scale=routing.route_scale, dtype=logits.dtype)  # [T, k]
        weight = weight.to(tokens.dtype)
        scaled = routing.score_at == "dispatch"
        if few_pairs:
            row_token, pair_row, by_expert = order.index_tensors(tokens.device, with_row_pair=scaled)
        else:
            _, by_expert = sort_pairs_by_expert(expert_index)  # [T*k] choice-major pairs in row order
            row_token = by_expert % num_tokens
        rows = tokens.index_select(0, row_token)  # [N, M] sorted by expert
        if scaled:
            rows = rows * weight.t().reshape(-1).index_select(0, by_expert).unsqueeze(-1)
        out = self._run_experts(rows, counts, parallel, pinned)
        combine_weight = None if scaled else weight.to(out.dtype)
        if few_pairs:
            y = sum_choices_by_token(out, pair_row, combine_weight, num_tokens)
        else:
            row_weight = None if combine_weight is None else \
                combine_weight.t().reshape(-1).index_select(0, by_expert)
            y = sum_rows_by_token(out, row_token, row_weight, num_tokens)
        if self.shared is not None:
            y = y + self._shared_output(tokens).to(y.dtype)
        # The bias as it was for this call (a later update must not change what this call's plan says).
        bias = None if self.expert_bias is None else self.expert_bias.clone()
        self._last_plan = None
        self._deferred_plan = partial(build_plan, logits, routing, selection_bias=bias, num_sequences=num_sequences)
        return y

    @property
    def expert_adapter(self) -> nn.Module | None:
        """The module an adapter put in place of ``experts`` (PEFT's LoRA ``target_parameters``: a wrapper whose
        ``get_base_layer()`` is the built experts), or None while ``experts`` is the module the layer was built
        with (docs/architecture.md, "Adapters on the experts").

        Raises ``ValueError`` when ``experts`` was replaced by anything else (the layer computes with the module it
        was built with, so a replacement would be silently ignored), or when a custom experts module is wrapped
        (only the built-in experts run a layer call inside their wrapper)."""
        current, built = self.experts, self._built_experts
        if current is built:
            return None
        get_base_layer = getattr(current, "get_base_layer", None)
        if not callable(get_base_layer) or get_base_layer() is not built:
            raise ValueError(
                f"MoELayer.experts was replaced by a {type(current).__name__} after the layer was built; the layer "
                f"computes with the module it was built with ({type(built).__name__}). Build a new MoELayer with "
                f"experts=..., or adapt the experts with a wrapper whose get_base_layer() is that module (PEFT)")
        if not isinstance(built, FeedForwardExperts):
            raise ValueError(
                f"an adapter ({type(current).__name__}) wraps the custom experts module {type(built).__name__}: "
                f"only the built-in FeedForwardExperts run a layer call inside such a wrapper; adapt the custom "
                f"module's own submodules instead (e.g. LoRA target_modules on its nn.Linear layers)")
        return current

    @property
    def last_plan(self) -> RoutingPlan | None:
        """The :class:`~flexmoe.routing.RoutingPlan` of the last call (None before the first)."""
        if self._deferred_plan is not None:
            self._last_plan, self._deferred_plan = self._deferred_plan(), None
        return self._last_plan

    @property
    def aux_loss(self) -> Tensor | None:
        """The last call's balance loss (differentiable when the call recorded autograd), ``last_plan.aux_loss``."""
        plan = self.last_plan
        return None if plan is None else plan.aux_loss

    @property
    def z_loss(self) -> Tensor | None:
        """The last call's router z-loss, ``last_plan.z_loss``."""
        plan = self.last_plan
        return None if plan is None else plan.z_loss

    def _by_layout(self, plan: RoutingPlan, rows: Tensor) -> bool:
        """Whether the built-in experts compute ``rows`` (``[N, M]``, dispatched by ``plan``) by the custom op of
        :mod:`flexmoe.padded_ffn_op`, which reads the counts on the device: always for a padded plan, and while
        compiling for any other in one process (dropless, adaptive capacity, expert choice, BASE), whose counts
        then never reach the graph. Traced as Python ints instead, every count that is 0 or 1 is a value dynamo
        specializes on: with many experts nearly every call recompiled, until dynamo's limit sent the rest of
        the forward back to eager (docs/architecture.md, "Compiling the layer")."""
        if plan.padded or plan.host_counts is None:  # host_counts None: the counts are on the device only
            return True
        experts = self._built_experts
        return (torch.compiler.is_compiling() and isinstance(experts, FeedForwardExperts)
                and not self.ep_group.distributed and layout_op_runs(experts.weights(), rows))

    def _counts_on_device(self, routing: RoutingOptions, tokens: Tensor) -> bool:
        """Whether this call's plan keeps its counts on the device: under ``torch.compile``, dropless top-k routing
        in one process with every pair kept (no random 2nd expert in training) and one capacity over the call
        (``capacity_per="call"``: a per-sequence one is the largest count of a sequence), the built-in experts
        run by the custom op that reads the counts on the device (:meth:`_by_layout`; the matmuls alone,
        :mod:`flexmoe.grouped_linear_op`, for a callable activation or under autocast). Every shape is then known
        before routing (``N = T * k``) and no routed value reaches the host: the call compiles into one graph
        (docs/architecture.md, "Compiling the layer")."""
        return (torch.compiler.is_compiling() and routing.selection == "topk" and self.topology is None
                and not self.ep_group.distributed and routing.capacity is None
                and routing.static_capacity_factor == 0 and routing.capacity_per == "call"
                and not (routing.second_expert == "random" and self.training)
                and isinstance(self.experts, FeedForwardExperts) and padded_op_available())

    def _padded_layout(self, routing: RoutingOptions) -> bool:
        """Whether this call pads every expert's rows to the capacity: under ``torch.compile``, in capacity mode,
        for top-k routing in one process (docs/architecture.md, "Compiling the layer"). Every shape is then static
        and no routed value reaches the host, so the call compiles into one graph. Eager calls never pad: they
        compute only the rows that hold tokens."""
        return (torch.compiler.is_compiling() and routing.selection == "topk" and self.topology is None
                and not self.ep_group.distributed
                and (routing.capacity is not None or routing.capacity_factor > 0))

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x must be float64, float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"x must have shape [..., model_dim={self.model_dim}], got {tuple(x.shape)}")

    def _call_options(self, call_options: dict[str, Any]) -> tuple[RoutingOptions, ParallelOptions, frozenset[str]]:
        """This call's routing and parallel options: the layer's, with the call's non-None keywords replaced."""
        given = {name: value for name, value in call_options.items() if value is not None}
        unknown = sorted(set(given) - set(_CALL_ROUTING) - set(_CALL_PARALLEL))
        if unknown:
            raise TypeError(f"MoELayer.forward() got unexpected keyword argument(s) {unknown}; a call may override "
                            f"{list(_CALL_ROUTING) + list(_CALL_PARALLEL)}")
        routing, parallel = self.routing_options, self.parallel_options
        routing_given = {n: v for n, v in given.items() if n in _CALL_ROUTING}
        if routing_given:
            routing = dataclasses.replace(routing, **routing_given)
        parallel_given = {n: v for n, v in given.items() if n in _CALL_PARALLEL}
        if parallel_given:
            if "shadow" in parallel_given:
                parallel_given["shadow"] = resolve_shadow(parallel_given["shadow"]) or False
            parallel = dataclasses.replace(parallel, **parallel_given)
        return routing, parallel, frozenset(parallel_given)

    def _run_experts(self, rows: Tensor, counts: list[int], options: ParallelOptions,
                     pinned: frozenset[str], layout_plan: RoutingPlan | None = None) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert -> ``[N, M]`` in rows' dtype, by this call's strategy.

        layout_plan: the rows are this plan's, computed by the built-in experts' custom op
        (:func:`flexmoe.padded_ffn_op.padded_experts_forward`, :meth:`_by_layout`): only the real rows; a plan
        with its counts on the device whose unit the op cannot take, by the grouped matmuls of
        :func:`flexmoe.grouped_linear_op.grouped_experts_ffn`."""
        strategy = self._strategy_of(options)
        experts = self._built_experts

        def run(expert_rows: Tensor) -> Tensor:
            if layout_plan is not None and isinstance(experts, FeedForwardExperts):
                weights = experts.weights()
                if layout_plan.host_counts is None and (not layout_op_runs(weights, expert_rows)
                                                        or self._grouped_on_device(layout_plan, expert_rows)):
                    # Counts on the device, and a unit the op cannot take by name (a callable, autocast) or a
                    # device where torch's grouped GEMM reads them there (the op would read them on the host).
                    return grouped_experts_ffn(expert_rows, layout_plan.tokens_per_expert, weights)
                return padded_experts_forward(expert_rows, layout_plan, weights)
            return strategy.run(expert_rows, counts, options, pinned)

        out = self._in_expert_dtype(run, rows)
        self.last_choice, self.last_shadowed = strategy.last_choice, list(strategy.last_shadowed)
        return out

    def _grouped_on_device(self, plan: RoutingPlan, rows: Tensor) -> bool:
        """Whether a plan with its counts on the device runs the experts' matmuls by ``torch._grouped_mm`` with
        device offsets (:func:`flexmoe.grouped_linear_op.uses_device_offsets`: off the CPU, bf16), so that no count
        reaches the host: not by the custom ops, which read them there (docs/architecture.md, "Compiling the
        layer")."""
        experts = self._built_experts
        if plan.host_counts is not None or not isinstance(experts, FeedForwardExperts):
            return False
        device_type = rows.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else experts.w1.dtype
        return all(uses_device_offsets(device_type, dtype, w.shape) for w in (experts.w1, experts.w2))

    def _in_expert_dtype(self, run: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
        """``run(rows)`` in the experts' dtype, returned in rows' dtype: a float32 layer fed bf16 activations (or
        the reverse) computes in its parameters' dtype (under autocast, as autocast says)."""
        expert_dtype = _parameter_dtype(self._built_experts)
        if expert_dtype is None or torch.is_autocast_enabled(rows.device.type) or expert_dtype == rows.dtype:
            return run(rows)
        return run(rows.to(expert_dtype)).to(rows.dtype)

    def _shared_output(self, tokens: Tensor) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, the sum of the shared experts' outputs (every token through each)."""
        shared = self.shared
        assert shared is not None  # forward calls this only for a layer with shared experts
        n, num_tokens = self.expert_options.shared_experts, tokens.shape[0]
        rows = tokens.repeat(n, 1) if n > 1 else tokens  # [n*T, M]: all tokens for shared expert 0, then 1, ...
        dtype = _parameter_dtype(shared)
        if not torch.is_autocast_enabled(tokens.device.type) and dtype is not None and dtype != rows.dtype:
            rows = rows.to(dtype)  # as for the routed experts: compute in the parameters' dtype
        out = shared(rows, [num_tokens] * n).view(n, num_tokens, self.model_dim).sum(0)
        return out if self.shared_gate is None else self.shared_gate(tokens, out)

    # ---- once per optimizer step ------------------------------------------------------------------------

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """balance="bias": move ``expert_bias`` against the load of the training forwards since the last call
        (summed over micro-batches and over the expert-parallel group), then start counting afresh.

        Call it once per optimizer step on every rank (:func:`flexmoe.update_expert_biases` does it for every
        layer of a model); a no-op for other balance modes. Under expert parallelism it is one all-reduce.
        """
        if self.expert_bias is None:
            return
        assert self.pending_load is not None  # registered together with expert_bias (balance="bias")
        load = self.pending_load.clone()
        if self.ep_group.distributed:
            # Every rank applies the same update from the same global load, so the biases stay identical.
            self.ep_group.call("balance='bias' load all-reduce",
                               lambda: torch.distributed.all_reduce(load, group=self.ep_group.group))
        self.expert_bias.copy_(bias_update(self.expert_bias, load, self.routing_options.bias_update_rate))
        self.pending_load.zero_()

    # ---- construction helpers ---------------------------------------------------------------------------

    def _strategy_for(self, options: ParallelOptions) -> ExpertStrategy:
        return build_strategy(options, self._ep, self._built_experts, self._shape, options.chooser,
                              self._strategies)

    def _describe_options(self, experts: nn.Module | None, dtype: torch.dtype | None) -> dict[str, object]:
        """The options as comparable values for the cross-rank agreement, one entry per field."""
        described: dict[str, object] = {"model_dim": self.model_dim, "num_experts": self.num_experts,
                                        "hidden_dim": self.hidden_dim, "experts": describe_value(experts),
                                        "dtype": str(dtype)}
        for options in (self.routing_options, self.expert_options, self.parallel_options):
            described.update(options.describe())
        return described

    @property
    def auto_decisions(self) -> list:
        """What ``parallel="auto"`` chose per capacity bucket, with every candidate's measured time."""
        return list(getattr(self.parallel_options.chooser, "decisions", []))

    @property
    def num_shared_experts(self) -> int:
        return self.expert_options.shared_experts

    @property
    def selection(self) -> str:
        """"topk", "expert_choice" or "base": how experts are picked."""
        return self.routing_options.selection

    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"k={self.k}, capacity_factor={self.capacity_factor}, capacity={self.capacity}, "
            f"score_at={self.score_at!r}"
        )


def _expose_options(cls: type) -> None:
    """Every option readable as a layer attribute (``moe.k``, ``moe.r``, ...), read-only: the options are
    frozen. ``router`` and ``shared_gate`` are modules of the layer; their options are
    ``moe.routing_options.router`` and ``moe.expert_options.shared_gate``."""
    for holder, options_cls in _OPTION_CLASSES.items():
        for f in dataclasses.fields(options_cls):
            if f.name in ("router", "shared_gate") or hasattr(cls, f.name):
                continue
            setattr(cls, f.name, _option_property(holder, f.name))


def _option_property(holder: str, name: str) -> property:
    """A read-only attribute reading ``self.<holder>.<name>``."""
    def read(self: MoELayer) -> Any:
        return getattr(getattr(self, holder), name)

    return property(read, doc=f"The layer's ``{name}`` (``{holder}.{name}``).")


_expose_options(MoELayer)


def update_expert_biases(model: nn.Module) -> int:
    """Call :meth:`MoELayer.update_expert_bias` on every MoE layer of ``model`` (balance="bias"); returns how many
    layers use the bias. Once per optimizer step, on every rank, e.g. just before ``optimizer.step()`` or as
    ``optimizer.register_step_pre_hook(lambda *_: update_expert_biases(model))``."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.expert_bias is not None]
    for layer in layers:
        layer.update_expert_bias()
    return len(layers)


def _options_from_keywords(given: dict[str, Any], keywords: dict[str, Any]) -> dict[str, Any]:
    """The three options objects: the given ones (or the defaults) with each keyword replaced in the dataclass
    that has a field of its name."""
    by_class: dict[str, dict[str, Any]] = {holder: {} for holder in _OPTION_CLASSES}
    for name, value in keywords.items():
        holder = next((h for h, c in _OPTION_CLASSES.items() if name in _field_names(c)), None)
        if holder is None:
            raise TypeError(f"MoELayer() got an unexpected keyword argument {name!r}")
        by_class[holder][name] = value
    chosen = {}
    for holder, options_cls in _OPTION_CLASSES.items():
        base = given[holder]
        if base is not None and not isinstance(base, options_cls):
            raise TypeError(f"{holder} must be a {options_cls.__name__}, got {type(base).__name__}")
        chosen[holder] = options_cls(**by_class[holder]) if base is None else dataclasses.replace(
            base, **by_class[holder])
    return chosen


def _field_names(options_cls: _OptionsClass) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(options_cls))


def _router_input(tokens: Tensor, num_sequences: int | None) -> Tensor:
    """What the router sees: the tokens ``[T, M]``, or ``[B, S, M]`` when the routing is per sequence (a router
    module that reads the sequences, as Switch's in ``transformers``, gets them; the linear gate is the same)."""
    return tokens if num_sequences is None else tokens.view(num_sequences, -1, tokens.shape[-1])


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpointing recomputation).

    Never while compiling: a compiled graph's backward recomputes tensors, it does not re-run the forward's code.
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _parameter_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
