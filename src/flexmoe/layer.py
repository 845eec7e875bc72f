"""MoELayer: validates its configuration and composes router -> plan -> dispatch -> experts -> combine."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexmoe.dispatch import combine, dispatch
from flexmoe.experts import FeedForwardExperts
from flexmoe.parallel.auto import AutoContext, Chooser, MeasuringChooser, StageTimer, candidates, capacity_bucket
from flexmoe.parallel.expert_parallel import ExpertParallel, ParallelSetting
from flexmoe.parallel.groups import check_config_agreement, default_ranks_per_node, resolve_group
from flexmoe.parallel.layout import ExpertLayout
from flexmoe.parallel.pairwise import check_pairwise, check_schedule, run_pairwise
from flexmoe.parallel.shadow import (
    ShadowContext,
    ShadowPolicy,
    check_shadow_supported,
    choose_experts,
    describe_shadow,
    resolve_shadow,
    run_shadowed,
)
from flexmoe.routing.bias_balance import bias_update
from flexmoe.routing.build import build_plan, check_routing_options, selection_kind
from flexmoe.routing.plan import RoutingPlan
from flexmoe.routing.families import check_family_options, num_sequences_of
from flexmoe.shared import SharedExpertGate
from flexmoe.routing.topology import TopologyGate, expert_nodes
from flexmoe.routing.routers import build_router, route

__all__ = ["MoELayer"]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _check_capacity(capacity: object) -> int | None:
    if capacity is None:
        return None
    return _check_int("capacity", capacity, 0)


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer.

    ``y = moe(x)`` with ``x: [..., model_dim]`` returns ``[..., model_dim]`` in x's dtype. Each token goes to
    ``k`` of ``num_experts`` expert FFNs (``model_dim -> hidden_dim -> model_dim``), weighted by the router.

    Routing (DESIGN.md section 3):
        k: choices per token, 1 <= k <= num_experts.
        capacity_factor: > 0 fixed capacity ``ceil(k * cf * T / E)``; 0 dropless; < 0 adaptive, at most
            ``ceil(k * |cf| * T / E)`` and never more than the largest load.
        capacity: an explicit per-expert capacity (int >= 0) that overrides ``capacity_factor``.
        router: "topk" (linear, no bias), "cosine" (SwinV2-MoE), or a module ``[T, M] -> [T, E]``.
        router_dtype: dtype of the routing math (default float32, whatever the model's dtype).
        normalize_weights: divide the k weights of a token by their sum (k > 1).
        batch_prioritized: hand out slots by descending top-1 probability instead of token order.
        score_at: "combine" weights expert outputs when combining; "dispatch" scales expert inputs.
        jitter, gate_noise, router_input_dropout: exploration, active only in training.

    Routers beyond top-k and balancing (:mod:`flexmoe.routing.build`):
        router="expert_choice": each expert takes its top-C tokens (C from ``capacity``, else
            ``ceil(k * cf * T / E)`` with cf > 0); every expert's load is exactly ``min(C, T)``, a token gets
            0..E experts, weighted by its unrenormalized probability. router="base": BASE layers; in training
            every expert gets exactly ``T*k/E`` tokens (``T*k mod E`` of them one more), the assignment with the
            largest total router logit, solved by an auction; at evaluation each token goes to its k best
            experts, dropless unless ``capacity`` is given. Both use the linear gate; ``aux_loss`` is 0.
        balance: "aux" (default: the balance loss in ``aux_loss``, for the training loop to add) or "bias"
            (DeepSeek-V3, top-k routers): a per-expert bias, the buffer ``expert_bias``, is added to the
            probabilities to *select* experts only (combine weights stay unbiased); after every training
            forward ``expert_bias[e] += bias_update_rate * sign(mean load - load[e])``, the loads (pairs per
            expert before drops) summed over the expert-parallel group.
        bias_update_rate: the step of that update (default 1e-3). The bias has ``router_dtype``; keep it out of
            bf16/fp16 (use autocast rather than ``.to(torch.bfloat16)``), whose spacing near 0.25 exceeds 1e-3.
        second_expert: "top" (default) or "random" (GShard, k=2 only): in training a token's 2nd choice is
            dispatched with probability ``min(1, 2 * p2 / (p1 + p2))`` (torch's generator), skipped pairs are
            counted in ``last_plan.num_skipped``; at evaluation every choice is dispatched.
        shared_experts: N >= 0 dense FFN experts (module ``shared``; same hidden_dim, activation, glu and bias
            as the built-in experts) that every token passes through, their outputs added to the routed
            output (DeepSeek-MoE). Replicated on every rank (data-parallel), never spread over ranks.
        cross_node_share: FasterMoE's topology-aware gate (top-k routers; None: off): this rank sends at most
            ``floor(share * T * k)`` pairs to experts on other nodes, the rest go to the best expert of its own
            node not chosen yet. Nodes are ``ranks_per_node`` consecutive ranks; an expert sits on the node of
            the rank(s) holding it per the expert layout.

    The open MoE families (:mod:`flexmoe.routing.families` says which options reproduce which family):
        score_func: "softmax" (default) or "sigmoid" router scores (DeepSeek-V3). The combine weights are the
            chosen experts' scores, divided by their sum with ``normalize_weights`` (k > 1), times ``route_scale``.
        num_expert_groups, num_limited_groups: group-limited routing (None: off). The experts form G groups of
            E/G consecutive experts; a group is rated by the sum of its two best selection scores (score + the
            ``balance="bias"`` bias); only each token's best ``num_limited_groups`` groups are eligible for its
            top-k. Needs ``k <= num_limited_groups * E / G``.
        route_scale: a float > 0 multiplying the routed weights (default 1.0).
        router_bias: the linear router gets a bias ``router.bias: [E]`` (default False).
        ``balance="bias"`` works with both score functions; ``bias_update_rate=0`` keeps a loaded bias fixed.
        shared_hidden_dim: hidden size of each shared expert (default ``hidden_dim``); shared_gate: True scales
            the shared experts' summed output by ``sigmoid(x @ shared_gate.weight.T)``, ``shared_gate.weight``
            ``[1, M]`` (Qwen2-MoE).
        glu_limit: GPT-OSS's gated unit for ``glu=True`` experts (and shared experts),
            ``activation(min(gate, L)) * (clamp(up, -L, L) + 1)`` with ``L = glu_limit`` (None: off).
        capacity_per: "call" (default: capacity over all tokens of the call) or "sequence" (x ``[B, S, M]``:
            each sequence has its own per-expert capacity, computed from S; :mod:`flexmoe.routing.capacity`).
        aux_loss_type: "switch" (default: ``E * sum_e f_e P_e`` over the 1st choices), "all_choices" (the same
            over all k choices, Hugging Face's Mixtral-family loss) or "sequence" (DeepSeek-V3's sequence-wise
            loss, averaged over the B sequences of x ``[B, S, M]``). Sigmoid scores enter the losses divided
            by their sum per token.

    Ties: whenever scores are equal the lower expert index wins (and, between equally rated groups, the lower
    group index): the selection is a stable descending sort. ``torch.topk`` makes no such promise (on CPU and
    CUDA it may return either of two equal values, and may differ between devices or with ``sorted=False``),
    so a model ported from code using ``torch.topk`` (e.g. Hugging Face's) can route a tied token differently;
    exact ties are rare outside constant or quantized router weights.

    Experts:
        activation ("gelu", "relu", "silu" or a callable), glu (gated expert with ``w3``), bias; or
        ``experts=`` a module ``forward(x: [N, M], counts: list[int]) -> [N, M]`` used instead.

    Expert parallelism (DESIGN.md section 4; :mod:`flexmoe.parallel`):
        group: the ``torch.distributed`` process group the experts are spread over (default: the world when
            torch.distributed is initialized, else one process). ``num_experts`` stays global; this rank keeps
            its experts per :class:`~flexmoe.parallel.ExpertLayout` (``E % W == 0``: E/W whole experts;
            ``W % E == 0``: a hidden-dim shard of one expert). Each rank's output equals one process holding
            all experts running this rank's tokens as its own batch. The ranks check at construction that
            they agree on the configuration.
        r: adaptive parallelism (0: gather all experts everywhere, no all-to-all; 1..s, dividing the s
            shards per expert: how many ranks share one expert's work; 1 with whole experts).
        overlap_degree: d chunks whose all-to-all overlaps the previous chunk's expert compute.
        a2a: "flat" or "2dh" (2-D hierarchical over nodes of ``ranks_per_node`` ranks; defaults to
            torchrun's LOCAL_WORLD_SIZE, read once here).
        parallel: "static" (use r, overlap_degree, a2a) or "auto" (time the candidate settings for the
            first steps of each capacity bucket, keep the fastest; ``last_choice`` says which ran,
            ``auto_decisions`` lists the decisions).
        chooser: what ``parallel="auto"`` decides with (default :class:`~flexmoe.parallel.MeasuringChooser`,
            timing every candidate); ``ModelGuidedChooser("local")`` lets the cost model shortlist them.
        Each of these five is also a keyword of ``forward`` that applies to that call only.

    FasterMoE's dynamic techniques (DESIGN.md section 4), off by default; they change speed, never results:
        shadow: False, True (:class:`~flexmoe.parallel.CostModelShadowPolicy`: shadow the hot experts when
            the cost model says the straggler time saved beats the weight broadcast + gradient reduce) or any
            :class:`~flexmoe.parallel.ShadowPolicy`. Each step the chosen experts' weights are broadcast, every
            rank computes its own rows of them, and their gradients are reduced back to the owners;
            ``last_shadowed`` lists them. Built-in experts, whole (E % W == 0) only.
        schedule: "a2a" (default) or "pairwise": the exchange as W-1 pairwise steps, each arrived piece
            computed at once while the next travels (:mod:`flexmoe.parallel.pairwise`). Needs whole experts,
            r=1, overlap_degree=1, a2a="flat" and parallel="static".
        Both are also keywords of ``forward`` for that call only.

    After each forward: ``aux_loss`` (balance loss, differentiable), ``z_loss`` and ``last_plan`` (the
    :class:`~flexmoe.routing.RoutingPlan`: ``tokens_per_expert``, ``capacity``, ``dropped_fraction``, ...).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        hidden_dim: int,
        *,
        k: int = 2,
        capacity_factor: float = 1.25,
        capacity: int | None = None,
        router: str | nn.Module = "topk",
        router_dtype: torch.dtype = torch.float32,
        normalize_weights: bool = True,
        batch_prioritized: bool = False,
        score_at: str = "combine",
        jitter: float = 0.0,
        gate_noise: float = 0.0,
        router_input_dropout: float = 0.0,
        balance: str = "aux",
        bias_update_rate: float = 1e-3,
        second_expert: str = "top",
        shared_experts: int = 0,
        cross_node_share: float | None = None,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        glu: bool = False,
        bias: bool = True,
        experts: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        group: object | None = None,
        r: int = 1,
        overlap_degree: int = 1,
        a2a: str = "flat",
        ranks_per_node: int | None = None,
        parallel: str = "static",
        shadow: bool | ShadowPolicy = False,
        schedule: str = "a2a",
        chooser: Chooser | None = None,
        # The open MoE families (issue 12; flexmoe.routing.families):
        score_func: str = "softmax",
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        route_scale: float = 1.0,
        router_bias: bool = False,
        capacity_per: str = "call",
        aux_loss_type: str = "switch",
        shared_hidden_dim: int | None = None,
        shared_gate: bool = False,
        glu_limit: float | None = None,
    ) -> None:
        super().__init__()
        shadow_policy = resolve_shadow(shadow)  # its description (e.g. the cost profile) is checked below
        # First of all, so that ranks built with different configurations all fail here, naming the difference.
        self.ep_group = resolve_group(group)
        check_config_agreement(self.ep_group, {
            "model_dim": model_dim, "num_experts": num_experts, "hidden_dim": hidden_dim, "k": k,
            "capacity_factor": capacity_factor, "capacity": capacity, "router": _describe(router),
            "router_dtype": str(router_dtype), "normalize_weights": normalize_weights,
            "batch_prioritized": batch_prioritized, "score_at": score_at, "activation": _describe(activation),
            "balance": balance, "bias_update_rate": bias_update_rate, "second_expert": second_expert,
            "shared_experts": shared_experts, "cross_node_share": cross_node_share,
            "glu": glu, "bias": bias, "experts": _describe(experts), "dtype": str(dtype), "r": r,
            "overlap_degree": overlap_degree, "a2a": a2a, "ranks_per_node": ranks_per_node, "parallel": parallel,
            "shadow": describe_shadow(shadow_policy), "schedule": schedule,
            "chooser": _describe(chooser),
            "score_func": score_func, "num_expert_groups": num_expert_groups,
            "num_limited_groups": num_limited_groups, "route_scale": route_scale, "router_bias": router_bias,
            "capacity_per": capacity_per, "aux_loss_type": aux_loss_type, "shared_hidden_dim": shared_hidden_dim,
            "shared_gate": shared_gate, "glu_limit": glu_limit,
        })
        self.model_dim = _check_int("model_dim", model_dim, 1)
        self.num_experts = _check_int("num_experts", num_experts, 1)
        self.hidden_dim = _check_int("hidden_dim", hidden_dim, 1)
        self.k = _check_int("k", k, 1)
        if k > num_experts:
            raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
        self.capacity_factor = _check_float("capacity_factor", capacity_factor)
        self.capacity = _check_capacity(capacity)
        if router_dtype not in _FLOAT_DTYPES:
            raise TypeError(f"router_dtype must be a floating dtype, got {router_dtype}")
        self.router_dtype = router_dtype
        self.normalize_weights = bool(normalize_weights)
        self.batch_prioritized = bool(batch_prioritized)
        if score_at not in ("combine", "dispatch"):
            raise ValueError(f"score_at must be 'combine' or 'dispatch', got {score_at!r}")
        self.score_at = score_at
        self.jitter = _check_float("jitter", jitter, 0.0, 1.0)
        self.gate_noise = _check_float("gate_noise", gate_noise, 0.0)
        self.router_input_dropout = _check_float("router_input_dropout", router_input_dropout, 0.0, 1.0)
        check_routing_options(
            router=router, k=k, capacity_factor=self.capacity_factor, capacity=self.capacity, balance=balance,
            bias_update_rate=bias_update_rate, second_expert=second_expert, cross_node_share=cross_node_share,
        )
        self.selection = selection_kind(router)  # "topk", "expert_choice" or "base": how experts are picked
        self.balance = balance
        self.bias_update_rate = float(bias_update_rate)
        self.second_expert = second_expert
        self.num_shared_experts = _check_int("shared_experts", shared_experts, 0)
        self.cross_node_share = None if cross_node_share is None else float(cross_node_share)
        # The open MoE families (issue 12):
        check_family_options(
            router=router, num_experts=num_experts, k=k, score_func=score_func, num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups, route_scale=route_scale, router_bias=router_bias,
            capacity_per=capacity_per, aux_loss_type=aux_loss_type, cross_node_share=cross_node_share,
        )
        self.score_func, self.route_scale = score_func, float(route_scale)
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups
        self.capacity_per, self.aux_loss_type = capacity_per, aux_loss_type
        self.shared_hidden_dim = hidden_dim if shared_hidden_dim is None else _check_int(
            "shared_hidden_dim", shared_hidden_dim, 1)
        if glu_limit is not None and experts is not None:
            raise ValueError("glu_limit applies to the built-in experts; a custom experts module has its own unit")

        self.layout = ExpertLayout(num_experts, self.ep_group.world_size, hidden_dim)
        if experts is not None and self.layout.shards_per_expert > 1:
            raise ValueError(
                f"a custom experts module cannot be sharded: num_experts={num_experts} must be a multiple of "
                f"the expert-parallel world size {self.ep_group.world_size}"
            )

        self.router = build_router(router, model_dim, num_experts, bias=router_bias)
        if isinstance(router, str):
            self.router.to(device=device, dtype=dtype)
        if experts is not None:
            if not isinstance(experts, nn.Module):
                raise TypeError(f"experts must be an nn.Module, got {type(experts).__name__}")
            self.experts = experts
        else:
            # Only this rank's experts (or its hidden shard of one); see flexmoe.parallel.layout.
            self.experts = FeedForwardExperts(
                self.layout.experts_per_rank, model_dim, self.layout.local_hidden_dim, activation=activation,
                glu=glu, bias=bias, glu_limit=glu_limit, device=device, dtype=dtype,
            )
        # Shared experts see all of this rank's tokens: replicated like any dense layer, never spread over ranks.
        self.shared = FeedForwardExperts(
            self.num_shared_experts, model_dim, self.shared_hidden_dim, activation=activation, glu=glu, bias=bias,
            glu_limit=glu_limit, device=device, dtype=dtype,
        ) if self.num_shared_experts else None
        if shared_gate and not self.num_shared_experts:
            raise ValueError("shared_gate gates the shared experts' output: it needs shared_experts >= 1")
        self.shared_gate = SharedExpertGate(model_dim, device=device, dtype=dtype) if shared_gate else None
        # A buffer, not a parameter: saved and moved with the layer, changed only by the load rule, never by
        # the optimizer.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=router_dtype, device=device)
                             if balance == "bias" else None)
        self._ep = ExpertParallel(self.ep_group, self.layout, self.experts) if self.ep_group.distributed else None
        self.r = r
        self.overlap_degree = overlap_degree
        self.a2a = a2a
        self.ranks_per_node = default_ranks_per_node() if ranks_per_node is None else ranks_per_node
        self.parallel = _check_parallel(parallel)
        self.schedule = check_schedule(schedule)
        if self.schedule == "pairwise":
            check_pairwise(self.layout, r, overlap_degree, a2a, self.parallel)
        if shadow_policy is not None:
            check_shadow_supported(self.layout, self.experts)
        self.shadow: ShadowPolicy | None = shadow_policy
        self.last_shadowed: list[int] = []
        if self._ep is not None:
            self._ep.check(self._setting(None, None, None, None))
        self.chooser: Chooser = chooser if chooser is not None else MeasuringChooser()
        self.last_choice: ParallelSetting | None = None
        self._pending_timer: StageTimer | None = None

        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.last_plan: RoutingPlan | None = None
        self._topology = None if self.cross_node_share is None else _topology_gate(
            self.layout, self.ep_group.rank, self.ranks_per_node, self.k, self.cross_node_share)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"x must be float64, float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.model_dim:
            raise ValueError(f"x must have shape [..., model_dim={self.model_dim}], got {tuple(x.shape)}")

    def forward(
        self,
        x: Tensor,
        *,
        capacity: int | None = None,
        capacity_factor: float | None = None,
        r: int | None = None,
        overlap_degree: int | None = None,
        a2a: str | None = None,
        ranks_per_node: int | None = None,
        parallel: str | None = None,
        shadow: bool | ShadowPolicy | None = None,
        schedule: str | None = None,
    ) -> Tensor:
        """x: ``[..., model_dim]`` -> ``[..., model_dim]``, same dtype.

        ``capacity`` and ``capacity_factor`` override the layer's for this call only (``capacity=0`` drops
        every token, and ``last_plan`` says so). So do ``r``, ``overlap_degree``, ``a2a``, ``ranks_per_node``
        and ``parallel`` (with ``parallel="auto"``, the ones given restrict the candidates), ``shadow`` and
        ``schedule``.
        """
        self._check_input(x)
        capacity = self.capacity if capacity is None else _check_capacity(capacity)
        if capacity_factor is None:
            capacity_factor = self.capacity_factor
        else:
            capacity_factor = _check_float("capacity_factor", capacity_factor)

        tokens = x.reshape(-1, self.model_dim)
        logits = route(
            self.router,
            tokens,
            dtype=self.router_dtype,
            training=self.training,
            jitter=self.jitter,
            gate_noise=self.gate_noise,
            input_dropout=self.router_input_dropout,
        )
        plan = build_plan(
            logits,
            kind=self.selection,
            k=self.k,
            capacity_factor=capacity_factor,
            capacity=capacity,
            normalize_weights=self.normalize_weights,
            batch_prioritized=self.batch_prioritized,
            training=self.training,
            selection_bias=self.expert_bias,
            second_expert=self.second_expert,
            topology=self._topology,
            score_func=self.score_func,
            num_expert_groups=self.num_expert_groups,
            num_limited_groups=self.num_limited_groups,
            route_scale=self.route_scale,
            capacity_per=self.capacity_per,
            aux_loss_type=self.aux_loss_type,
            num_sequences=num_sequences_of(x, self.model_dim, self.capacity_per, self.aux_loss_type),
        )
        expert_input = dispatch(tokens, plan, scale=self.score_at == "dispatch")
        expert_output = self._run_experts(
            expert_input, plan.counts, r=r, overlap_degree=overlap_degree, a2a=a2a,
            ranks_per_node=ranks_per_node, parallel=parallel, shadow=shadow, schedule=schedule,
        )
        y = combine(expert_output, plan, weighted=self.score_at == "combine")
        if self.shared is not None:
            y = y + self._shared_output(tokens).to(y.dtype)
        if self.expert_bias is not None and self.training:
            self._update_expert_bias(plan.load)

        self.aux_loss = plan.aux_loss
        self.z_loss = plan.z_loss
        self.last_plan = plan
        return y.to(x.dtype).reshape(x.shape)

    def _shared_output(self, tokens: Tensor) -> Tensor:
        """tokens: ``[T, M]`` -> ``[T, M]``, the sum of the shared experts' outputs (every token through each)."""
        n, num_tokens = self.num_shared_experts, tokens.shape[0]
        rows = tokens.repeat(n, 1) if n > 1 else tokens  # [n*T, M]: all tokens for shared expert 0, then 1, ...
        dtype = _parameter_dtype(self.shared)
        if not torch.is_autocast_enabled(tokens.device.type) and dtype is not None and dtype != rows.dtype:
            rows = rows.to(dtype)  # as for the routed experts: compute in the parameters' dtype
        out = self.shared(rows, [num_tokens] * n).view(n, num_tokens, self.model_dim).sum(0)
        return out if self.shared_gate is None else self.shared_gate(tokens, out)

    @torch.no_grad()
    def _update_expert_bias(self, load: Tensor) -> None:
        """balance="bias": move ``expert_bias`` against the observed load ``[E]`` (global under EP)."""
        load = load.detach().clone()
        if self.ep_group.distributed:
            # Every rank applies the same update from the same global load, so the biases stay identical.
            self.ep_group.call("balance='bias' load all-reduce",
                               lambda: dist.all_reduce(load, group=self.ep_group.group))
        self.expert_bias.copy_(bias_update(self.expert_bias, load, self.bias_update_rate))

    def _run_experts(self, rows: Tensor, counts: list[int], **parallel_overrides) -> Tensor:
        """rows: ``[N, M]`` sorted by global expert -> ``[N, M]`` in rows' dtype."""
        expert_dtype = _parameter_dtype(self.experts)
        autocast_on = torch.is_autocast_enabled(rows.device.type)
        if expert_dtype is None or autocast_on or expert_dtype == rows.dtype:
            return self._expert_stage(rows, counts, **parallel_overrides)
        # A float32 layer fed bf16 activations (or the reverse) computes in its parameters' dtype.
        return self._expert_stage(rows.to(expert_dtype), counts, **parallel_overrides).to(rows.dtype)

    def _expert_stage(self, rows: Tensor, counts: list[int], *, r: int | None, overlap_degree: int | None,
                      a2a: str | None, ranks_per_node: int | None, parallel: str | None,
                      shadow: bool | ShadowPolicy | None = None, schedule: str | None = None,
                      all_counts: list[list[int]] | None = None) -> Tensor:
        """The experts, here or spread over the expert-parallel group (transport + compute)."""
        if self._ep is None:
            return self.experts(rows, counts)
        if all_counts is None:  # the outer call (shadowing calls back with the remaining rows and counts)
            all_counts = self._ep.gather_counts(counts)
            self.last_shadowed = self._shadowed(all_counts, shadow, r, overlap_degree, a2a, ranks_per_node)
            if self.last_shadowed:
                return run_shadowed(
                    self.experts, self.ep_group, self.layout, rows, counts, all_counts, self.last_shadowed,
                    lambda rest, rest_counts, rest_all: self._expert_stage(
                        rest, rest_counts, r=r, overlap_degree=overlap_degree, a2a=a2a,
                        ranks_per_node=ranks_per_node, parallel=parallel, schedule=schedule,
                        all_counts=rest_all))
        mode = self.parallel if parallel is None else _check_parallel(parallel)
        if (self.schedule if schedule is None else check_schedule(schedule)) == "pairwise":
            setting = self._setting(r, overlap_degree, a2a, ranks_per_node)
            check_pairwise(self.layout, setting.r, setting.overlap_degree, setting.a2a, mode)
            self.last_choice = setting
            return run_pairwise(self.ep_group, self.layout, self.experts, rows, all_counts)
        if mode == "static":
            setting = self._setting(r, overlap_degree, a2a, ranks_per_node)
            self._ep.check(setting)
            self.last_choice = setting
            return self._ep.run(rows, counts, all_counts, setting)
        # auto: the per-call knobs that were given narrow the candidates.
        if self._pending_timer is not None:
            self._pending_timer.flush()
        g = self.ranks_per_node if ranks_per_node is None else ranks_per_node
        options = [s for s in candidates(self._ep.valid_r(), self.ep_group.world_size, g)
                   if (r is None or s.r == r) and (overlap_degree is None or s.overlap_degree == overlap_degree)
                   and (a2a is None or s.a2a == a2a)]
        if not options:
            raise ValueError(f"parallel='auto' has no candidate with r={r}, overlap_degree={overlap_degree}, "
                             f"a2a={a2a!r}; valid r: {self._ep.valid_r()}")
        bucket = (capacity_bucket(all_counts), torch.is_grad_enabled(), r, overlap_degree, a2a, g)
        context = AutoContext(self.ep_group, all_counts, self.model_dim, self.hidden_dim, self.num_experts, self.k,
                              rows.dtype, bool(getattr(self.experts, "glu", False)))
        setting = self.chooser.choose(bucket, options, context)
        self.last_choice = setting
        timer = StageTimer(lambda seconds: self.chooser.record(bucket, setting, seconds))
        self._pending_timer = timer
        return timer.leave(self._ep.run(timer.enter(rows), counts, all_counts, setting))

    def _shadowed(self, all_counts: list[list[int]], shadow: bool | ShadowPolicy | None, r: int | None,
                  overlap_degree: int | None, a2a: str | None, ranks_per_node: int | None) -> list[int]:
        """The experts to shadow in this call (:mod:`flexmoe.parallel.shadow`); [] when off."""
        policy = self.shadow if shadow is None else resolve_shadow(shadow)
        if policy is None:
            return []
        check_shadow_supported(self.layout, self.experts)
        setting = self._setting(r, overlap_degree, a2a, ranks_per_node)
        if setting.r == 0:
            return []  # r=0 already gives every rank every expert
        context = ShadowContext(
            self.layout, self.model_dim, self.hidden_dim, self.k, _parameter_dtype(self.experts) or torch.float32,
            glu=bool(getattr(self.experts, "glu", False)), a2a=setting.a2a, ranks_per_node=setting.ranks_per_node,
            overlap_degree=setting.overlap_degree,
        )
        return choose_experts(policy, all_counts, context)

    def _setting(self, r: int | None, overlap_degree: int | None, a2a: str | None,
                 ranks_per_node: int | None) -> ParallelSetting:
        """The static setting of one call: the call's values where given, else the layer's."""
        return ParallelSetting(
            r=self.r if r is None else r,
            overlap_degree=self.overlap_degree if overlap_degree is None else overlap_degree,
            a2a=self.a2a if a2a is None else a2a,
            ranks_per_node=self.ranks_per_node if ranks_per_node is None else ranks_per_node,
        )

    @property
    def auto_decisions(self) -> list:
        """What ``parallel="auto"`` chose per capacity bucket, with every candidate's measured time."""
        return list(getattr(self.chooser, "decisions", []))

    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"k={self.k}, capacity_factor={self.capacity_factor}, capacity={self.capacity}, "
            f"score_at={self.score_at!r}"
        )


def _describe(value: object) -> object:
    """A comparable stand-in for a config value (modules and callables by type / name)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, nn.Module):
        return type(value).__name__
    return getattr(value, "__name__", type(value).__name__)


def _topology_gate(layout: ExpertLayout, rank: int, ranks_per_node: int | None, k: int,
                   share: float) -> TopologyGate:
    """The topology-aware gate of ``rank``: nodes of ``ranks_per_node`` consecutive ranks, experts on the node
    of the rank(s) holding them."""
    world = layout.world_size
    if ranks_per_node is None:
        if world > 1:
            raise ValueError("cross_node_share needs ranks_per_node (the ranks of one node) under expert parallelism")
        ranks_per_node = 1
    if ranks_per_node < 1 or world % ranks_per_node != 0:
        raise ValueError(f"cross_node_share needs ranks_per_node dividing the world size {world}, got {ranks_per_node}")
    holders: list[list[int]] = [[] for _ in range(layout.num_experts)]
    for r in range(world):
        for e in layout.experts_of_rank(r):
            holders[e].append(r)
    nodes = expert_nodes(holders, ranks_per_node)
    for node in range(world // ranks_per_node):
        if nodes.count(node) < k:
            raise ValueError(f"cross_node_share: node {node} holds {nodes.count(node)} experts, fewer than k={k}; "
                             "overflow pairs could not stay on the node")
    return TopologyGate(tuple(nodes), rank // ranks_per_node, share)


def _check_parallel(parallel: object) -> str:
    if parallel not in ("static", "auto"):
        raise ValueError(f"parallel must be 'static' or 'auto', got {parallel!r}")
    return str(parallel)


def _parameter_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters():
        return p.dtype
    return None
