"""MoELayer: router -> RoutingPlan -> dispatch -> experts -> combine (docs/architecture.md, "The data path").

The layer's options live in three frozen dataclasses (:mod:`flexmoe.layer_options`); how its experts run (route,
kernel, the compiled layout) is decided by its :class:`~flexmoe.experts.stage.ExpertStage`, decoding without a
plan is :mod:`flexmoe.decoding`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from flexmoe.autograd_state import in_backward
from flexmoe.decoding import DecodingLayer, forward_without_plan, router_input
from flexmoe.experts import ExpertOptions, ExpertsCall, FeedForwardExperts
from flexmoe.experts.shared_gate import SharedExpertGate
from flexmoe.experts.stage import ExpertStage
from flexmoe.layer_options import call_options, describe_layer, expose_options, options_from_keywords
from flexmoe.parallel.auto import MeasuringChooser
from flexmoe.parallel.expert_parallel import ExpertParallel, ParallelSetting
from flexmoe.parallel.groups import check_config_agreement, default_ranks_per_node, resolve_group
from flexmoe.parallel.layout import ExpertLayout
from flexmoe.parallel.options import ParallelOptions
from flexmoe.parallel.strategy import ExpertStrategy, LayerShape, build_strategy, check_parallel_options
from flexmoe.routing.bias_balance import bias_update
from flexmoe.routing.build import build_plan
from flexmoe.routing.families import num_sequences_of
from flexmoe.routing.global_balance import GlobalBalance
from flexmoe.routing.options import RoutingOptions
from flexmoe.routing.plan import RoutingPlan
from flexmoe.routing.routers import build_router, route
from flexmoe.routing.scores import check_group_options
from flexmoe.routing.topology import topology_gate
from flexmoe.tuning.policies import resolve_shadow
from flexmoe.validation import FLOAT_DTYPES, check_float_dtype, check_int, describe_value

if TYPE_CHECKING:
    from flexmoe.routing.replay import RoutingTap

__all__ = ["MoELayer", "update_expert_biases"]


def _warn_unadapted_gate_up(wrapper: nn.Module, built: FeedForwardExperts) -> None:
    """One warning where adapters wrap joined experts and none adapts ``gate_up``: ``target_parameters`` naming
    ``experts.w1`` / ``experts.w3`` (the plain experts' names) match nothing there, and PEFT says nothing of a
    target that matches nothing while another matches."""
    adapted: set[object] = set()
    module: nn.Module | None = wrapper
    while module is not None and module is not built:
        adapted.add(getattr(module, "parameter_name", None))
        module = getattr(module, "base_layer", None)
    if "gate_up" not in adapted:
        warnings.warn("an adapter wraps experts that hold w1 | w3 as one parameter, gate_up (joined_gate_up, "
                      "flexmoe.hf.convert's default), without adapting it: target_parameters 'experts.w1' and "
                      "'experts.w3' match nothing there; target 'experts.gate_up'", UserWarning, stacklevel=4)


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
        An adapter may wrap the built-in experts (PEFT's LoRA ``target_parameters=["experts.w1", ...]``;
        ``"experts.gate_up"`` with ``joined_gate_up``): every
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
    # How each call's experts run (outside the module tree: it holds modules the layer owns).
    expert_stage: ExpertStage

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
        constructor_options = {"routing_options": routing_options, "expert_options": expert_options,
                 "parallel_options": parallel_options}
        chosen = options_from_keywords(constructor_options, options)  # every option validated here, once
        routing, expert, parallel = chosen["routing_options"], chosen["expert_options"], chosen["parallel_options"]
        self.model_dim = check_int("model_dim", model_dim, 1)
        self.num_experts = check_int("num_experts", num_experts, 1)
        self.hidden_dim = check_int("hidden_dim", hidden_dim, 1)
        dtype = check_float_dtype("dtype", dtype)
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
        check_config_agreement(self.ep_group, describe_layer(
            model_dim, num_experts, hidden_dim, describe_value(experts), dtype, (routing, expert, parallel)))

        self.layout = ExpertLayout(num_experts, self.ep_group.world_size, hidden_dim)
        if experts is not None and self.layout.shards_per_expert > 1:
            raise ValueError(f"a custom experts module cannot be sharded: num_experts={num_experts} must be a "
                             f"multiple of the expert-parallel world size {self.ep_group.world_size}")
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
        # Their gated pair apart, whatever joined_gate_up says: HF holds a shared expert's as two Linears.
        plain = dataclasses.replace(expert, joined_gate_up=False)
        self.shared = plain.build(expert.shared_experts, model_dim, shared_hidden_dim, device=device, dtype=dtype) \
            if expert.shared_experts else None
        self.shared_gate = SharedExpertGate(model_dim, device=device, dtype=dtype) if expert.shared_gate else None
        if self.ep_group.distributed:  # every rank runs the kernels rank 0 measured (flexmoe.experts.chooser)
            for built in (self._built_experts, self.shared):
                if isinstance(built, FeedForwardExperts):
                    self.ep_group.call("expert kernel table broadcast",
                                       partial(built.kernels.share, self.ep_group.group))
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
        self.global_balance = GlobalBalance(num_experts) if routing.aux_loss_type == "global" else None
        self._ep = ExpertParallel(self.ep_group, self.layout, self._built_experts) if self.ep_group.distributed \
            else None
        check_parallel_options(parallel, self.layout, self._built_experts, self._ep)
        self._shape = LayerShape(model_dim, hidden_dim, num_experts, routing.k, expert.glu)
        self._strategies: dict[tuple[str, str], Any] = {}  # unwrapped strategies by (schedule, parallel)
        self.strategy: ExpertStrategy = self._strategy_for(parallel)
        # The replica placement and load window (redundant_experts > 0) are buffers: checkpoints carry them.
        self.replicas = getattr(self.strategy, "state", None)
        # How each call's experts run (route, kernel, the compiled layout): one object, outside the module tree (it
        # holds the layer's modules; their parameters stay where the state_dict has them).
        self.__dict__["expert_stage"] = ExpertStage(
            self._built_experts, expert, distributed=self.ep_group.distributed,
            topology_gated=self.topology is not None, model_dim=model_dim)
        # The last call's plan; after a call served without one, the function that builds it when first read.
        self._last_plan: RoutingPlan | None = None
        self._deferred_plan: Callable[[], RoutingPlan] | None = None
        self._last_weight: Tensor | None = None
        # Routing replay's recorder or replayer while flexmoe.record_routing / replay_routing runs, else None.
        self.routing_tap: RoutingTap | None = None

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
            return adapter(x, ExpertsCall(partial(self._forward, x, call_options, True)))
        return self._forward(x, call_options, False)

    def _forward(self, x: Tensor, keywords: dict[str, Any], adapted: bool) -> Tensor:
        """:meth:`forward` on the experts as they read now (adapted, inside an adapter's call); keywords: the
        call's options; adapted: whether an adapter wraps the experts (:attr:`expert_adapter`)."""
        routing, parallel, pinned = call_options(self.routing_options, self.parallel_options, keywords)
        tokens = x.reshape(-1, self.model_dim)  # [T, M]
        num_sequences = num_sequences_of(x, self.model_dim, routing.capacity_per, routing.aux_loss_type)
        tap = self.routing_tap
        # Only a tap and a training call's counts ask (the question costs an evaluation call host time).
        backward_now = (tap is not None or self.training) and in_backward()
        replayed = None if tap is None else tap.replayed(x, self.num_experts, routing.k, backward_now)  # [T, k]
        stage, strategy = self.expert_stage, self.strategy_of(parallel)
        # The path a GPU takes: no host read in the whole call (docs/architecture.md, "Expert compute").
        read_free_weights = None if replayed is not None else \
            stage.read_free_weights(routing, tokens, self.training, adapted)
        read_free = read_free_weights is not None
        # Under expert parallelism the plan reads nothing either where the exchange takes its counts on the device:
        # the split sizes are then the call's one read (docs/architecture.md, "Experts over ranks").
        plan_read_free = read_free or (replayed is None and stage.exchange_read_free(routing, tokens, self.training,
                                                                                     adapted, strategy))
        if not read_free and stage.serves_without_plan(routing, tokens, self.training):  # decoding: no plan
            served = forward_without_plan(
                DecodingLayer(self.router, self.expert_bias, self.num_experts, stage, strategy, self.shared,
                              self.shared_gate), tokens, routing,
                parallel, pinned, num_sequences, replayed)
            if served is not None:
                y, deferred, chosen, weight = served
                self._keep_plan(None, deferred, weight)
                if tap is not None:
                    tap.chosen(x, chosen, backward_now)
                return y.to(x.dtype).reshape(x.shape)

        # 1. the router's logits, 2. the plan, 3.-5. dispatch, the experts and combine (the expert stage).
        logits = route(self.router, router_input(tokens, num_sequences), dtype=routing.router_dtype,
                       training=self.training, jitter=routing.jitter, gate_noise=routing.gate_noise,
                       input_dropout=routing.router_input_dropout, num_experts=self.num_experts)  # [T, E]
        layout = stage.read_free_layout(routing) if plan_read_free else \
            stage.plan_layout(routing, tokens, self.training, adapted=adapted)
        plan = build_plan(logits, routing, training=self.training, selection_bias=self.expert_bias,
                          topology=self.topology, num_sequences=num_sequences, padded=layout.padded,
                          counts_on_device=layout.counts_on_device, expert_index=replayed, read_free=plan_read_free)
        if tap is not None:
            tap.chosen(x, plan.expert_index, backward_now)
        if self.global_balance is not None and self.training and torch.is_grad_enabled():
            plan.aux_loss = self.global_balance.loss(logits, plan.expert_index, routing.score_func,
                                                     accumulate=not backward_now)
        if read_free_weights is not None:  # read_free
            y = stage.run_read_free(tokens, plan, routing, read_free_weights)  # [T, M]
        else:
            y = stage.run(tokens, plan, routing, parallel, pinned, strategy)  # [T, M]
        shared = self.shared
        if shared is not None:
            shared_y = stage.shared_output(tokens, shared, self.shared_gate)
            y = y + (shared_y if shared_y.dtype == y.dtype else shared_y.to(y.dtype))

        if self.pending_load is not None and self.training and not backward_now:
            # Counted once per forward; a recomputation under activation checkpointing runs inside backward.
            plan.add_load_to(self.pending_load)
        self._keep_plan(plan, None, plan.weight)
        return (y if y.dtype == x.dtype else y.to(x.dtype)).reshape(x.shape)

    def __getstate__(self) -> dict[str, Any]:
        # The last call's plan and weights record that call (tensors of its autograd graph, which deepcopy refuses
        # to copy): a copy or a pickle starts without them, as a new layer does, and the original keeps its own.
        return {**self.__dict__, "_last_plan": None, "_deferred_plan": None, "_last_weight": None}

    def _keep_plan(self, plan: RoutingPlan | None, deferred: Callable[[], RoutingPlan] | None,
                   weight: Tensor) -> None:
        """Keep the call's plan (or the function that builds it when first read) for :attr:`last_plan`, and its
        ``[T, k]`` weights for :attr:`last_weight`. Plain attributes, written past ``nn.Module.__setattr__``, whose
        checks for parameters, buffers and modules cost a measurable share of a small call's host time."""
        self.__dict__["_last_plan"], self.__dict__["_deferred_plan"] = plan, deferred
        self.__dict__["_last_weight"] = weight

    def strategy_of(self, options: ParallelOptions) -> ExpertStrategy:
        """The strategy of a call with ``options``: the layer's own unless the call changed them."""
        same = options is self.parallel_options or options == self.parallel_options
        return self.strategy if same else self._strategy_for(options)

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
        if built.joined_gate_up and not self.__dict__.get("_adapter_checked"):
            self.__dict__["_adapter_checked"] = True
            _warn_unadapted_gate_up(current, built)
        return current

    @property
    def last_choice(self) -> ParallelSetting | None:
        """The expert-parallel setting the last call ran (None before the first, or in one process)."""
        return self.expert_stage.last_choice

    @property
    def last_shadowed(self) -> list[int]:
        """The experts the last call shadowed (FasterMoE's shadowing; empty without)."""
        return self.expert_stage.last_shadowed

    @property
    def last_plan(self) -> RoutingPlan | None:
        """The :class:`~flexmoe.routing.RoutingPlan` of the last call (None before the first)."""
        if self._deferred_plan is not None:
            self._last_plan, self._deferred_plan = self._deferred_plan(), None
        return self._last_plan

    @property
    def last_weight(self) -> Tensor | None:
        """``[T, k]``: the last call's routing weight of each token's choices, ``last_plan.weight``, without
        building the plan a no-grad evaluation call leaves for later (what GPT-OSS's converted block returns beside
        its output at every decoding step). None before the first call."""
        return self._last_weight

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

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x must be float64, float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"x must have shape [..., model_dim={self.model_dim}], got {tuple(x.shape)}")

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


expose_options(MoELayer)


def update_expert_biases(model: nn.Module) -> int:
    """Call :meth:`MoELayer.update_expert_bias` on every MoE layer of ``model`` (balance="bias"); returns how many
    layers use the bias. Once per optimizer step, on every rank, e.g. just before ``optimizer.step()`` or as
    ``optimizer.register_step_pre_hook(lambda *_: update_expert_biases(model))``."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.expert_bias is not None]
    for layer in layers:
        layer.update_expert_bias()
    return len(layers)



