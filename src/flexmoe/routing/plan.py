"""The routing plan: which expert and which slot every (token, choice) pair gets.

Everything after the router reads a :class:`RoutingPlan`. It is built by pure functions from the router's
logits, following the routing contract (docs/architecture.md, "The routing contract"):

* top-k picks the k largest probabilities of a token (ties: the lower expert index first);
* slots are handed out in priority order: every token's 1st choice before any token's 2nd choice, and within
  one choice by token order (or by descending top-1 probability with batch-prioritized routing);
* a (token, choice) pair whose slot is >= the capacity is dropped: it contributes nothing, and the plan
  counts it.

The plan also lays the kept pairs out as *rows*: sorted by expert, then by slot. Row ``n`` carries token
``row_token[n]`` to expert ``row_expert[n]`` and is weighted by ``row_weight[n]`` when combined. Experts see only
rows that hold tokens, never empty padding slots.

The one exception is the *padded* plan (``padded=True``, for ``torch.compile`` in capacity mode;
docs/architecture.md, "Compiling the layer"): every expert gets exactly ``capacity`` rows (per sequence with
``capacity_per="sequence"``), so that every shape is known before routing and nothing reaches the host.
Empty rows carry token 0 with weight 0 and are never combined. A dropless plan needs no padding to be static
(every pair has a row, ``N = T * k``): with ``counts_on_device=True`` (``torch.compile``, dropless) its counts
stay in ``tokens_per_expert`` and reach the host only when ``counts`` or ``capacity`` is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flexmoe.routing.capacity import assign_sequence_slots, assign_slots, kept_counts
from flexmoe.routing.losses import balance_loss, router_z_loss
from flexmoe.routing.random_routing import sample_second_expert
from flexmoe.routing.scores import check_select_by, normalize_topk, routed_weights, router_scores, select_experts, top_k
from flexmoe.routing.topology import TopologyGate

__all__ = ["RoutingPlan", "resolve_capacity", "top_k", "normalize_topk", "assign_slots", "all_finite", "check_logits",
           "check_choices", "plan_from_pairs", "plan_from_choices", "make_plan"]


@dataclass
class RoutingPlan:
    """The routing of one batch of T tokens over E experts with k choices each.

    Per (token, choice) pair, shape ``[T, k]``:
        expert_index: chosen expert (long).
        slot: position inside that expert's buffer, ``-1`` where the pair was dropped (long).
        weight: combine weight (router dtype, differentiable); kept as routed even where the pair was dropped,
            because dropped weights are not renormalized away (the model's residual path carries the token).
        probs_topk: the router probability of each chosen expert (before normalization).

    Per row (the kept pairs, sorted by expert then slot), shape ``[N]`` with ``N = sum(tokens_per_expert)``:
        row_token: the token each row carries.
        row_choice: which of the token's k choices the row is.
        row_weight: the combine weight of the row (differentiable).

    Per expert, shape ``[E]``:
        tokens_per_expert: rows each expert computes (after drops), long, on the logits' device.
        load: pairs routed to each expert before drops.

    Padded plans (``padded=True``) differ in what depends on the routed values: every expert has
    ``counts[e] = B * capacity`` rows (B sequences, 1 unless ``capacity_per="sequence"``), the empty ones with
    ``row_token = row_choice = 0`` and ``row_weight = 0``; ``num_dropped`` and ``dropped_fraction`` are 0-dim
    tensors (``int()`` / ``float()`` read either kind).

    Scalars:
        counts: the rows each expert computes, a Python list (what the experts split their rows by):
            ``tokens_per_expert`` as a list, or ``B * capacity`` each in a padded plan.
        capacity: the per-expert capacity used (the largest load in dropless mode).
        Both are properties over ``host_counts`` / ``host_capacity``, which a dropless plan made with
        ``counts_on_device`` leaves None: its counts are then read from ``tokens_per_expert`` when first asked
        for (one host sync; inside a compiled region a graph break, so the compiled layer never asks).
        num_dropped: dropped (token, choice) pairs; dropped_fraction: the same over ``T * k``.
        aux_loss: the load-balancing loss (differentiable); z_loss: the router z-loss (differentiable).
        num_skipped: (token, choice) pairs the router chose not to dispatch, counted apart from capacity drops
            (GShard's random routing of the 2nd expert; see :mod:`flexmoe.routing.random_routing`). Skipped
            pairs claim no slot (``slot == -1``) and are not in ``num_dropped`` or ``load``.
        kind: the builder that made the plan: "topk" (this module, also the random 2nd expert), "base"
            (:mod:`flexmoe.routing.balanced`) or "expert_choice" (:mod:`flexmoe.routing.expert_choice`, whose
            per-pair fields are ``[T, E]``, one column per expert). Readers of the row fields need not care.
        scores: ``[T, E]`` the router's scores (softmax or sigmoid of the logits, detached) where the builder
            kept them (top-k plans; None otherwise), read by :mod:`flexmoe.routing.balance_metrics`.
    """

    expert_index: Tensor
    slot: Tensor
    weight: Tensor
    probs_topk: Tensor
    row_token: Tensor
    row_choice: Tensor
    row_weight: Tensor
    tokens_per_expert: Tensor
    load: Tensor
    host_counts: list[int] | None
    host_capacity: int | None
    num_dropped: int | Tensor
    dropped_fraction: float | Tensor
    aux_loss: Tensor
    z_loss: Tensor
    num_skipped: int | Tensor = 0
    kind: str = "topk"
    padded: bool = False
    pair_row: Tensor | None = None  # [T, k] the row of each pair (N where none); a padded plan sets it
    scores: Tensor | None = None  # [T, E] the router's scores (detached; top-k plans), for the balance metrics
    # [E] int32, the row after each expert's last, on the device: set by the read-free plan
    # (flexmoe.routing.read_free), whose grouped matmuls take it as their offsets; None otherwise.
    expert_ends: Tensor | None = None

    def add_load_to(self, total: Tensor) -> None:
        """``total += load``: this plan's pairs per expert added to a running count ``[E]`` (balance="bias")."""
        total += self.load.detach()

    @property
    def counts(self) -> list[int]:
        """``[E]`` the rows each expert computes, as Python ints (read from the device once if not yet there)."""
        if self.host_counts is None:
            self.host_counts = self.tokens_per_expert.tolist()
        return self.host_counts

    @property
    def capacity(self) -> int:
        """The per-expert capacity used (dropless: the largest load, read from the device once if not yet there)."""
        if self.host_capacity is None:
            self.host_capacity = max(self.counts, default=0)
        return self.host_capacity

    @property
    def num_tokens(self) -> int:
        return self.expert_index.shape[0]

    @property
    def k(self) -> int:
        return self.expert_index.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert.shape[0]

    @property
    def every_pair_has_row(self) -> bool:
        """True when every (token, choice) pair has a row: nothing dropped or skipped (a dropless top-k plan).
        Combine and dispatch's backward then need no mask for missing pairs. Never for a padded plan, whose
        counts stay on the device, nor for expert choice, whose pair grid ``[T, E]`` is mostly empty."""
        if self.padded or self.kind == "expert_choice":
            return False
        return isinstance(self.num_dropped, int) and isinstance(self.num_skipped, int) \
            and self.num_dropped == 0 and self.num_skipped == 0

    @property
    def row_expert(self) -> Tensor:
        """``[N]`` the expert of each row."""
        device = self.tokens_per_expert.device
        counts = torch.tensor(self.counts, dtype=torch.long, device=device)
        return torch.repeat_interleave(torch.arange(len(self.counts), device=device), counts)


def resolve_capacity(
    num_tokens: int,
    num_experts: int,
    k: int,
    capacity_factor: float,
    capacity: int | None,
    max_load: int | None = None,
) -> int:
    """The per-expert capacity C (docs/architecture.md, "The routing contract").

    ``capacity`` (an int) overrides everything. Otherwise ``capacity_factor > 0`` gives
    ``ceil(k * cf * T / E)``; ``== 0`` is dropless (C = the largest load); ``< 0`` gives
    ``min(max_load, ceil(k * |cf| * T / E))``. ``max_load`` is needed for the last two.
    """
    if capacity is not None:
        return int(capacity)
    if capacity_factor > 0:
        return math.ceil(k * capacity_factor * num_tokens / num_experts)
    if max_load is None:
        raise ValueError("max_load is needed for dropless (capacity_factor == 0) or adaptive (< 0) capacity")
    if capacity_factor == 0:
        return int(max_load)
    return min(int(max_load), math.ceil(k * -capacity_factor * num_tokens / num_experts))


def _priority_order(probs_topk: Tensor, batch_prioritized: bool) -> Tensor | None:
    """``[T]`` the order in which tokens claim slots within one choice; None for token order."""
    if not batch_prioritized:
        return None
    # Descending top-1 probability; the stable sort keeps token order among equals.
    return torch.sort(probs_topk[:, 0], descending=True, stable=True).indices


def all_finite(t: Tensor) -> bool:
    """Whether every element of the float tensor ``t`` is finite, by one product, one sum and one host read:
    ``0 * x`` is 0 for a finite x and NaN for an infinity or a NaN, and a sum of zeros is never NaN (no
    overflow, unlike a plain sum). Two small ops where ``isfinite(t).all()`` takes five (a decoding call's
    cost is its number of ops)."""
    total = float((t.detach() * 0).sum())
    return total == total


# The bound of check_logits' device-side comparison: a 0-d CPU tensor, which every device's comparison takes as a
# scalar (never written).
_INFINITY = torch.tensor(math.inf)


def check_logits(logits: Tensor, k: int, *, name: str = "logits",
                 nonfinite_message: str = "router logits contain NaN or infinity; check the layer input and the "
                                          "router weights", read_free: bool = False) -> tuple[int, int]:
    """Every plan builder's input check: logits ``[T, E]``, finite, and 1 <= k <= E. Returns ``(T, E)``.

    ``name`` and ``nonfinite_message`` word the errors for callers whose input is not router logits.
    ``read_free`` (the read-free path, :mod:`flexmoe.routing.read_free`) or compiling: the finiteness is asserted
    on the device (``torch._assert_async``), without a host read: on the CPU a ``RuntimeError`` with the message
    at once, on a GPU a device-side assert that surfaces at the next synchronization (asynchronous).
    """
    if logits.dim() != 2:
        raise ValueError(f"{name} must be [tokens, experts], got shape {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
    if read_free or torch.compiler.is_compiling():
        # A traced `if` on a value would end the graph, and reading it stalls the stream; the check runs on the
        # device (a RuntimeError when it fails).
        # max |x| < inf is False for an infinity and a NaN (the inf-norm propagates it): two operations before
        # the assert, where isfinite then all take five; max |x| as one reduction (vector_norm), not abs then max,
        # and the comparison against a 0-d tensor (a Python float is wrapped into one at every call). Each
        # operation costs a small call 1-2% of its time (docs/performance.md, "tenth pass").
        # Detached only where autograd would record the check (a decoding call skips the operation).
        # No tokens, no logits to check (the inf-norm has no value over nothing).
        if num_tokens > 0:
            recorded = logits.requires_grad and torch.is_grad_enabled()
            largest = torch.linalg.vector_norm(logits.detach() if recorded else logits, math.inf)
            torch._assert_async(largest.lt(_INFINITY), nonfinite_message)
    elif not all_finite(logits):
        raise ValueError(nonfinite_message)
    return num_tokens, num_experts


def check_choices(expert_index: Tensor, num_experts: int, *, num_tokens: int | None = None, k: int | None = None,
                  active: Tensor | None = None, name: str = "expert_index") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``expert_index`` is ``[num_tokens, k]`` integer choices in
    ``[0, num_experts)`` (where ``active``, ``[T, k]`` bool, says the pair is dispatched; default all). None for
    ``num_tokens`` / ``k``: any. One host read (the range); under ``torch.compile`` none: the range is asserted on
    the device instead (a ``RuntimeError`` when it fails), since a traced host read would end the graph."""
    if expert_index.dim() != 2:
        raise ValueError(f"{name} must be [tokens, k], got shape {tuple(expert_index.shape)}")
    if expert_index.dtype.is_floating_point or expert_index.dtype.is_complex or expert_index.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer expert indices, got dtype {expert_index.dtype}")
    if num_tokens is not None and expert_index.shape[0] != num_tokens:
        raise ValueError(f"{name} has {expert_index.shape[0]} tokens, the call has T={num_tokens}")
    if k is not None and expert_index.shape[1] != k:
        raise ValueError(f"{name} has k={expert_index.shape[1]} choices per token, the layer routes k={k}")
    if torch.compiler.is_compiling():
        # expert_index[active] would have a data-dependent shape: inactive pairs are read as 0 instead.
        check = expert_index if active is None else expert_index.masked_fill(~active, 0)
        torch._assert_async(((check >= 0) & (check < num_experts)).all(),
                            f"{name} must lie in [0, num_experts={num_experts})")
        return
    check = expert_index if active is None else expert_index[active]
    if check.numel():
        low, high = (int(v) for v in torch.aminmax(check))
        if low < 0 or high >= num_experts:
            raise ValueError(f"{name} must lie in [0, num_experts={num_experts}), got values in [{low}, {high}]")


def make_plan(
    logits: Tensor,
    k: int,
    *,
    capacity_factor: float = 1.25,
    capacity: int | None = None,
    normalize_weights: bool = True,
    batch_prioritized: bool = False,
    selection_bias: Tensor | None = None,
    topology: TopologyGate | None = None,
    random_second: bool = False,
    generator: torch.Generator | None = None,
    score_func: str = "softmax",
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    route_scale: float = 1.0,
    aux_loss_type: str = "switch",
    capacity_per: str = "call",
    num_sequences: int | None = None,
    padded: bool = False,
    counts_on_device: bool = False,
    ties: str = "lower",
    select_by: str = "scores",
    expert_index: Tensor | None = None,
    read_free: bool = False,
) -> RoutingPlan:
    """Build the top-k :class:`RoutingPlan` for router logits.

    logits: ``[T, E]`` in the routing dtype (float32 by default). ``k`` choices per token, 1 <= k <= E.
    The scores are ``score_func`` of the logits ("softmax" or "sigmoid"); ``selection_bias`` (``[E]``,
    optional) is added to them only to *select* experts (load balancing without an auxiliary loss), and
    ``num_expert_groups`` / ``num_limited_groups`` restrict each token to its best groups
    (:mod:`flexmoe.routing.scores`). The combine weights are the chosen unbiased scores, normalised over the k
    when ``normalize_weights``, times ``route_scale``.
    ``topology`` re-routes the pairs past a cross-node budget (:mod:`flexmoe.routing.topology`);
    ``random_second`` dispatches each 2nd choice at random (GShard, k=2; :mod:`flexmoe.routing.random_routing`,
    samples from ``generator``, default torch's global one).
    ``num_sequences``: the T tokens are B sequences of T / B tokens (for ``capacity_per="sequence"``, each
    sequence routed with its own capacity, :mod:`flexmoe.routing.capacity`, and for ``aux_loss_type``
    "sequence"); ``aux_loss_type`` picks the balance loss (:func:`flexmoe.routing.losses.balance_loss`).
    ``padded``: the padded layout (every expert ``capacity`` rows, no host sync; see :func:`plan_from_pairs`).
    ``counts_on_device``: dropless without a host sync, the counts left on the device (:func:`plan_from_pairs`).
    ``ties``: how equal scores are broken, "lower" (the lower expert index) or "topk" (as ``torch.topk``).
    ``select_by``: "scores", or "logits": the k best logits are picked (GPT-OSS's router; not with a selection bias
    or groups, :func:`~flexmoe.routing.scores.check_select_by`).
    ``expert_index``: ``[T, k]`` replayed choices, taken instead of the router's (routing replay,
    :mod:`flexmoe.routing.replay`): the selection bias, the group limit and the topology gate, which only pick,
    are skipped; the weights, the losses and the capacity come from these logits as usual. Not with
    ``random_second`` (its keep decisions would be drawn anew).
    ``read_free``: no host read in checking and picking (with ``padded``, none at all; :mod:`flexmoe.routing.
    read_free`).

    Raises ``ValueError`` for non-finite logits, a k out of range, a negative capacity or bad replayed choices.
    """
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    num_experts = check_logits(logits, k, read_free=read_free)[1]

    scores = router_scores(logits, score_func)
    if expert_index is None:
        check_select_by(select_by, selection_bias is not None, num_expert_groups)
        ranked = logits if select_by == "logits" else scores
        expert_index, choice_scores = select_experts(ranked, k, selection_bias=selection_bias,
                                                     num_expert_groups=num_expert_groups,
                                                     num_limited_groups=num_limited_groups, ties=ties,
                                                     read_free=read_free)
        if topology is not None:
            expert_index = topology.apply(choice_scores, expert_index)
    else:
        if random_second:
            raise ValueError("replayed choices (routing replay) cannot be combined with second_expert='random' in "
                             "training: which 2nd choices run would be drawn anew")
        check_choices(expert_index, num_experts, num_tokens=logits.shape[0], k=k)
        expert_index = expert_index.to(device=logits.device, dtype=torch.long)
    probs_topk, weight = routed_weights(scores, expert_index, normalize_weights=normalize_weights,
                                        route_scale=route_scale, dtype=logits.dtype,
                                        softmax_of=logits if score_func == "softmax" else None)
    return plan_from_pairs(
        logits, expert_index, probs_topk, weight,
        active=sample_second_expert(probs_topk, generator) if random_second else None,
        capacity_factor=capacity_factor,
        capacity=capacity,
        priority=_priority_order(probs_topk.detach(), batch_prioritized),
        aux_loss=balance_loss(aux_loss_type, scores, expert_index, score_func=score_func,
                              num_sequences=num_sequences),
        num_sequences=num_sequences if capacity_per == "sequence" else None,
        padded=padded,
        counts_on_device=counts_on_device,
        z_loss=router_z_loss(logits, scores if score_func == "softmax" else None),
        scores=scores.detach(),
    )


def plan_from_pairs(
    logits: Tensor,
    expert_index: Tensor,
    probs_topk: Tensor,
    weight: Tensor,
    *,
    active: Tensor | None = None,
    capacity_factor: float = 0.0,
    capacity: int | None = None,
    priority: Tensor | None = None,
    aux_loss: Tensor,
    kind: str = "topk",
    num_sequences: int | None = None,
    padded: bool = False,
    counts_on_device: bool = False,
    z_loss: Tensor | None = None,
    scores: Tensor | None = None,
) -> RoutingPlan:
    """The plan for chosen pairs: the one place that assigns slots, applies the capacity and lays out rows.

    logits: ``[T, E]`` (for the z-loss); expert_index, probs_topk, weight: ``[T, k]`` as in
    :class:`RoutingPlan`; active: ``[T, k]`` bool, the pairs to dispatch (default all). Inactive pairs are
    *skipped*: they claim no slot, get ``slot == -1``, are left out of ``load`` and counted in ``num_skipped``,
    not in ``num_dropped``. Capacity as in :func:`resolve_capacity` over the active pairs' loads.
    priority: ``[T]`` the token order within one choice (None: token order). num_sequences: B when each of the B
    sequences (``T / B`` tokens each) has its own capacity (``capacity_per="sequence"``): slots then count within
    (expert, sequence) and ``capacity`` is per sequence. None: one capacity over the call.
    padded: lay the rows out padded, ``capacity`` rows per (expert, sequence) unit (:func:`_padded_plan`); the
    capacity must then be known before routing (``capacity_factor > 0`` or ``capacity``), else ``ValueError``.
    counts_on_device: nothing reaches the host, for ``torch.compile`` in dropless mode: every pair has a row, so
    ``N = T * k`` is known before routing, and the counts stay in ``tokens_per_expert`` (``host_counts`` and
    ``host_capacity`` None until read); dropless plans only (:func:`_check_counts_on_device`).
    z_loss: the plan's z-loss (None: the router z-loss of ``logits``); scores: the plan's ``scores`` (``[T, E]``).
    """
    num_tokens, num_experts = logits.shape
    k = expert_index.shape[1]
    num_units = 1 if num_sequences is None else num_sequences
    _check_counts_on_device(counts_on_device, capacity_factor, capacity, active, padded, num_sequences)
    num_active: int | Tensor  # a tensor only in a padded plan, which never brings it to the host
    if active is None:
        masked_index, num_slots_experts, num_active = expert_index, num_experts, num_tokens * k
    else:
        # Skipped pairs go to a virtual expert E that sorts after every real one, so that the slots are handed
        # out in priority order among the active pairs only; the virtual expert is then cut off.
        masked_index = torch.where(active, expert_index, torch.full_like(expert_index, num_experts))
        num_slots_experts, num_active = num_experts + 1, active.sum() if padded else int(active.sum())
    if num_units == 1:  # counted on the device when padded (no host read: compiling, or the read-free path)
        slot, load_all, order = assign_slots(masked_index, num_slots_experts, priority, on_device=padded)
        unit_load = load_all[:num_experts].unsqueeze(1)  # [E, 1]
    else:
        slot, unit_load, order = assign_sequence_slots(masked_index, num_slots_experts, priority, num_units, padded)
        unit_load = unit_load[:num_experts]  # [E, B]
    if padded:
        cap = _static_capacity(num_tokens // num_units, num_experts, k, capacity_factor, capacity)
        return _padded_plan(logits, expert_index, probs_topk, weight, masked_index, slot, unit_load, cap,
                            num_active, aux_loss, kind, z_loss, scores)
    assert isinstance(num_active, int)  # only a padded plan keeps it on the device
    order = order[:num_active]
    load = unit_load.sum(dim=1) if num_units > 1 else unit_load.view(-1)
    pairs = _Pairs(logits, expert_index, probs_topk, weight, slot, active, num_active, aux_loss,
                   router_z_loss(logits) if z_loss is None else z_loss, kind, scores)
    if counts_on_device:  # dropless: every pair keeps its row, and the counts stay in ``load``
        return _unpadded_plan(pairs, slot, order, load, load, counts=None, capacity_used=None)
    # The one host sync: the row counts size every later tensor. Under torch.compile the rest of the plan runs
    # eagerly: traced, dynamo guards on each count read back (torch 2.15 traces it; 2.13 gave up on the frame
    # and ran it eagerly anyway), so a graph was added for every new pattern of counts until the recompile limit.
    # (Wrapped here, not decorated: the decorator would import torch._dynamo with flexmoe.)
    finish = torch.compiler.disable(_plan_with_host_counts) if torch.compiler.is_compiling() else _plan_with_host_counts
    return finish(pairs, order, unit_load, load, capacity_factor, capacity)


@dataclass
class _Pairs:
    """What :func:`plan_from_pairs` hands on to lay out the rows: the plan's per-pair tensors (``[T, k]``; ``slot``
    before the capacity, ``active`` None when every pair is), the number of active pairs, the losses, the kind and
    the scores."""

    logits: Tensor
    expert_index: Tensor
    probs_topk: Tensor
    weight: Tensor
    slot: Tensor
    active: Tensor | None
    num_active: int
    aux_loss: Tensor
    z_loss: Tensor
    kind: str
    scores: Tensor | None


def _plan_with_host_counts(pairs: _Pairs, order: Tensor, unit_load: Tensor, load: Tensor, capacity_factor: float,
                           capacity: int | None) -> RoutingPlan:
    """The unpadded plan once the loads are on the host: resolve the capacity, drop the pairs over it.

    order: ``[num_active]`` the active pairs sorted by (expert, [seq,] slot); unit_load: ``[E, units]`` the active
    pairs per (expert, unit), the units being the call or its sequences; load: ``[E]``.
    """
    num_tokens, num_experts = pairs.logits.shape
    k = pairs.expert_index.shape[1]
    unit_list = unit_load.tolist()
    max_load = max((n for row in unit_list for n in row), default=0)
    host_cap = resolve_capacity(num_tokens // unit_load.shape[1], num_experts, k, capacity_factor, capacity, max_load)
    counts = kept_counts(unit_list, host_cap)
    # Every pair keeps its row when no unit is over capacity (always so in dropless mode): no masking then.
    drops = max_load > host_cap
    rows, slot = order, pairs.slot
    if drops:
        rows = order[slot.view(-1).index_select(0, order) < host_cap]
    if drops or pairs.active is not None:
        kept = slot < host_cap if pairs.active is None else pairs.active & (slot < host_cap)
        slot = torch.where(kept, slot, torch.full_like(slot, -1))
    tokens_per_expert = torch.tensor(counts, dtype=torch.long, device=load.device) if drops else load
    return _unpadded_plan(pairs, slot, rows, load, tokens_per_expert, counts=counts, capacity_used=host_cap)


def _unpadded_plan(pairs: _Pairs, slot: Tensor, rows: Tensor, load: Tensor, tokens_per_expert: Tensor, *,
                   counts: list[int] | None, capacity_used: int | None) -> RoutingPlan:
    """The plan whose pairs have ``slot`` (``[T, k]``, -1: no row) and whose rows are ``rows`` (``[N]`` pair
    indices ``t * k + j``, by expert); counts None: on the device only (``counts_on_device``)."""
    num_tokens = pairs.logits.shape[0]
    k = pairs.expert_index.shape[1]
    num_dropped = 0 if counts is None else pairs.num_active - sum(counts)
    row_token = torch.div(rows, k, rounding_mode="floor")
    return RoutingPlan(
        expert_index=pairs.expert_index,
        slot=slot,
        weight=pairs.weight,
        probs_topk=pairs.probs_topk,
        row_token=row_token,
        row_choice=rows - row_token * k,
        row_weight=pairs.weight.reshape(-1).index_select(0, rows),
        tokens_per_expert=tokens_per_expert,
        load=load,
        host_counts=counts,
        host_capacity=capacity_used,
        num_dropped=num_dropped,
        dropped_fraction=num_dropped / max(num_tokens * k, 1),
        aux_loss=pairs.aux_loss,
        z_loss=pairs.z_loss,
        num_skipped=num_tokens * k - pairs.num_active,
        kind=pairs.kind,
        scores=pairs.scores,
    )


def _check_counts_on_device(counts_on_device: bool, capacity_factor: float, capacity: int | None,
                            active: Tensor | None, padded: bool, num_sequences: int | None) -> None:
    """``counts_on_device`` needs a dropless plan with every pair active and one capacity over the call
    (:func:`plan_from_pairs`); ValueError naming what was given otherwise."""
    num_units = 1 if num_sequences is None else num_sequences
    if counts_on_device and (capacity is not None or capacity_factor != 0 or active is not None or padded
                             or num_units > 1):
        raise ValueError("counts_on_device needs a dropless plan with every pair active and one capacity over the "
                         f"call (capacity_factor=0, no capacity, no active mask, not padded, no num_sequences), got "
                         f"capacity_factor={capacity_factor}, capacity={capacity}, active mask: {active is not None}, "
                         f"padded={padded}, num_sequences={num_sequences}")


def plan_from_choices(expert_index: Tensor, weight: Tensor, num_experts: int, *,
                      active: Tensor | None = None) -> RoutingPlan:
    """The dropless plan for choices made elsewhere (e.g. by a Hugging Face router).

    expert_index: ``[T, k]`` long, each in ``[0, num_experts)`` where ``active``; weight: ``[T, k]`` the combine
    weights (differentiable; gradients reach whoever made them); active: ``[T, k]`` bool, the pairs to compute
    (default all; inactive pairs are skipped, their expert index is not read). Every active pair gets a row
    (capacity = the largest load). There are no logits, so ``probs_topk`` is ``weight`` and both router losses are
    zero: the caller owns its routing and its losses.

    Under ``torch.compile`` with every pair active, nothing reaches the host: the choices are checked on the device
    (:func:`check_choices`) and the counts stay in ``tokens_per_expert`` (``host_counts`` None, as
    :func:`plan_from_pairs`' ``counts_on_device``), so a compiled caller must read them there (e.g.
    :func:`flexmoe.experts.grouped_op.grouped_experts_ffn`), not through ``counts``. With an ``active`` mask the
    plan still counts on the host (its row count depends on the mask).
    """
    if expert_index.dim() != 2 or weight.shape != expert_index.shape:
        raise ValueError(f"expert_index and weight must both be [tokens, k], got {tuple(expert_index.shape)} and "
                         f"{tuple(weight.shape)}")
    check_choices(expert_index, num_experts, active=active)
    num_tokens = expert_index.shape[0]
    # Zero logits only give plan_from_pairs the expert count; no routing reads them, and their z-loss
    # ((log E)^2) would be a made-up number: both losses are zero.
    logits = weight.new_zeros(num_tokens, num_experts)
    zero = weight.new_zeros(())
    return plan_from_pairs(logits, expert_index, weight.detach(), weight, active=active, capacity_factor=0.0,
                           aux_loss=zero, z_loss=zero,
                           counts_on_device=active is None and torch.compiler.is_compiling())


def _static_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, capacity: int | None) -> int:
    """The capacity of a padded plan, which must not depend on the routing: ``capacity`` or ``cf > 0``."""
    if capacity is None and capacity_factor <= 0:
        raise ValueError("a padded plan needs a capacity known before routing: capacity_factor > 0 or an explicit "
                         f"capacity, got capacity_factor={capacity_factor} (dropless or adaptive)")
    return resolve_capacity(num_tokens, num_experts, k, capacity_factor, capacity)


def _padded_plan(
    logits: Tensor,
    expert_index: Tensor,
    probs_topk: Tensor,
    weight: Tensor,
    masked_index: Tensor,
    slot: Tensor,
    unit_load: Tensor,
    cap: int,
    num_active: int | Tensor,
    aux_loss: Tensor,
    kind: str,
    z_loss: Tensor | None = None,
    scores: Tensor | None = None,
) -> RoutingPlan:
    """The plan with every (expert, sequence) unit padded to ``cap`` rows: ``N = E * B * cap`` rows.

    masked_index: ``[T, k]`` the expert of each pair, ``E`` for a skipped one; slot: ``[T, k]`` its slot within
    its unit; unit_load: ``[E, B]``. A kept pair's row is ``(e * B + b) * cap + slot``, the same order
    (expert, sequence, slot) as the unpadded plan's rows, with gaps. Every shape follows from T, E, k, B and
    ``cap``: nothing here reads a routed value on the host, so ``torch.compile`` traces it in one graph.
    """
    num_tokens, num_experts = logits.shape
    k = expert_index.shape[1]
    num_units = unit_load.shape[1]
    device = logits.device
    num_pairs, num_rows = num_tokens * k, num_experts * num_units * cap
    unit = masked_index
    if num_units > 1:
        sequence = torch.arange(num_tokens, device=device).div(num_tokens // num_units, rounding_mode="floor")
        unit = masked_index * num_units + sequence.unsqueeze(1)
    kept = (slot < cap) & (masked_index < num_experts)  # skipped pairs sit on the virtual expert E
    pair_row = torch.where(kept, unit * cap + slot, torch.full_like(slot, num_rows))  # [T, k]
    # The inverse map, the pair of each row; every pair without a row writes the one spare entry past the end.
    row_pair = torch.full((num_rows + 1,), num_pairs, dtype=torch.long, device=device)
    row_pair[pair_row.reshape(-1)] = torch.arange(num_pairs, device=device)
    row_pair = row_pair[:num_rows]
    empty = row_pair == num_pairs
    row_pair = row_pair.masked_fill(empty, 0)
    tokens_per_expert = unit_load.clamp(max=cap).sum(dim=1)
    num_dropped = num_active - tokens_per_expert.sum()
    # No pairs (a rank without tokens joining a padded exchange): every row is empty, and there is no weight to
    # gather from.
    row_weight = weight.new_zeros(num_rows) if num_pairs == 0 else weight.reshape(-1)[row_pair].masked_fill(empty, 0)

    return RoutingPlan(
        expert_index=expert_index,
        slot=torch.where(kept, slot, torch.full_like(slot, -1)),
        weight=weight,
        probs_topk=probs_topk,
        row_token=torch.div(row_pair, k, rounding_mode="floor"),
        row_choice=row_pair % k,
        row_weight=row_weight,
        tokens_per_expert=tokens_per_expert,
        load=unit_load.sum(dim=1),
        host_counts=[num_units * cap] * num_experts,
        host_capacity=cap,
        num_dropped=num_dropped,
        dropped_fraction=num_dropped / max(num_pairs, 1),
        aux_loss=aux_loss,
        z_loss=router_z_loss(logits) if z_loss is None else z_loss,
        num_skipped=num_pairs - num_active,
        kind=kind,
        padded=True,
        pair_row=pair_row,
        scores=scores,
    )
