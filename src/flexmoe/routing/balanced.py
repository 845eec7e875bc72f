"""BASE layers (Lewis et al., 2021): a balanced assignment of tokens to experts, solved by an auction.

The problem. T tokens, E experts, k choices, scores ``a[t, e]`` (the router logits, as in BASE: the affinity
``h_t . w_e``). Choose ``x[t, e]`` in {0, 1} maximizing ``sum a[t, e] x[t, e]`` subject to every token taking
exactly k distinct experts and every expert getting exactly ``T * k / E`` tokens. When ``E`` does not divide
``T * k`` (remainder r), r experts get ``ceil(T * k / E)`` tokens and the others ``floor(T * k / E)``; *which*
experts get the extra token is part of the optimization (a dummy token with equal scores for every expert takes
the ``E - r`` spare slots, so it never changes the objective).

The algorithm: Bertsekas' auction, in its Jacobi (all bidders at once) form with epsilon-scaling, on an
equivalent assignment problem in which every bidder has only two options. Each (token, expert) pair is a
bidder; the objects are ``C`` slots of every expert (value ``a[t, e]`` to the bidder (t, e)) and ``E - k``
"not chosen" slots of every token (value 0). A bidder that ends in expert e's slots means ``x[t, e] = 1``; the
token's ``E - k`` "not chosen" slots force exactly k experts per token. Slots of one object share one price
(the lowest standing bid once the object is full). Every round each unassigned bidder bids for the better of
its two options, raising it by the difference plus epsilon; each object keeps its best bids up to its slot
count, and outbid holders become unassigned. At the end of a phase every bidder is assigned and
epsilon-complementary slackness holds, so the total score is within ``T * E * eps`` of the optimum; the last
phase uses ``eps = 1e-9 * (score range) / (T * E)``, optimal for all practical purposes (the tests compare with
exhaustive search).

Cost: every round is a few ``[T, E]`` tensor operations (a top-C per expert, a top-(E-k) per token); a solve
takes hundreds to a thousand rounds, which on a 2-core CPU is about 0.2 s for T=512, E=8 and about 6 s for
T=4096, E=8, k=2 (long chains of displaced bidders dominate). That is slow next to the expert math; a faster
solver (e.g. an expert-side auction with a round limit as in fairseq, which gives up exact optimality) is
future work.

At inference BASE routes every token to its best expert, without balancing (the paper's test-time rule): the
layer then builds the ordinary top-k plan, dropless unless an explicit capacity is given.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flexmoe.routing.plan import RoutingPlan, check_logits, normalize_topk, plan_from_pairs, top_k

__all__ = ["balanced_loads", "balanced_assignment", "make_base_plan"]

_NEG_INF = float("-inf")


def balanced_loads(num_tokens: int, num_experts: int, k: int) -> tuple[int, int]:
    """``(floor(T*k/E), r)``: every expert gets the floor, ``r = T*k mod E`` of them one token more."""
    return divmod(num_tokens * k, num_experts)


def _auction_phase(
    a: Tensor, price_e: Tensor, price_t: Tensor, expert_slots: int, token_slots: Tensor, eps: float,
    max_rounds: int,
) -> Tensor:
    """One epsilon phase from empty holdings; prices are updated in place. Returns ``hold_e [T, E]`` bool.

    a: ``[T, E]`` float64 scores; price_e: ``[E]``; price_t: ``[T]``; token_slots: ``[T]`` long.
    """
    num_tokens, num_experts = a.shape
    device = a.device
    hold_e = torch.zeros_like(a, dtype=torch.bool)  # bidder (t, e) holds a slot of expert e
    hold_t = torch.zeros_like(a, dtype=torch.bool)  # bidder (t, e) holds a "not chosen" slot of token t
    paid = torch.zeros_like(a)  # the bid with which a holder won its slot
    max_token_slots = int(token_slots.max())
    slot_ok = torch.arange(max_token_slots, device=device) < token_slots.unsqueeze(1)  # [T, S]
    for _ in range(max_rounds):
        free = ~(hold_e | hold_t)
        if not bool(free.any()):
            return hold_e
        value_e = a - price_e  # [T, E]
        value_t = -price_t.unsqueeze(1)  # [T, 1]
        to_expert = value_e >= value_t
        raise_by = (value_e - value_t).abs() + eps  # best minus second best (the only other option), plus eps
        bid_e = torch.where(free & to_expert, price_e + raise_by, _NEG_INF)
        bid_t = torch.where(free & ~to_expert, price_t.unsqueeze(1) + raise_by, _NEG_INF)

        # Experts: standing holders (at what they paid) and new bidders compete for the C slots.
        cand_e = torch.where(hold_e, paid, bid_e)
        best_e, who_e = cand_e.topk(expert_slots, dim=0)  # [C, E], sorted descending
        won_e = best_e > _NEG_INF
        new_hold_e = torch.zeros_like(hold_e).scatter_(0, who_e, won_e)
        full_e = won_e.all(dim=0)
        # A full expert's price is its lowest standing bid; prices never fall.
        price_e.copy_(torch.where(full_e, torch.maximum(price_e, best_e[-1]), price_e))

        # Tokens: the same for their "not chosen" slots, E - k of them (r for the dummy token).
        cand_t = torch.where(hold_t, paid, bid_t)
        best_t, who_t = cand_t.topk(max_token_slots, dim=1)  # [T, S]
        won_t = (best_t > _NEG_INF) & slot_ok
        new_hold_t = torch.zeros_like(hold_t).scatter_(1, who_t, won_t)
        full_t = (won_t | ~slot_ok).all(dim=1)
        lowest_t = best_t.gather(1, (token_slots - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        price_t.copy_(torch.where(full_t, torch.maximum(price_t, lowest_t), price_t))

        paid = torch.where(new_hold_e, cand_e, torch.where(new_hold_t, cand_t, 0.0))
        hold_e, hold_t = new_hold_e, new_hold_t
    raise RuntimeError(f"balanced_assignment: the auction did not finish in {max_rounds} rounds (eps={eps:g})")


def balanced_assignment(scores: Tensor, k: int = 1, *, final_eps: float | None = None,
                        max_rounds: int = 100_000) -> Tensor:
    """The optimal balanced assignment of tokens to experts (see the module docstring).

    scores: ``[T, E]``; k: experts per token, ``1 <= k <= E``. Returns ``x: [T, E]`` bool with exactly k
    ``True`` per row and ``floor(T*k/E)`` or ``ceil(T*k/E)`` per column (``T*k mod E`` columns get the ceil),
    maximizing ``scores[x].sum()`` up to ``T * E * final_eps`` (default ``1e-9 * range / (T * E)``).
    No gradient flows through it.
    """
    num_tokens, num_experts = check_logits(scores, k, name="scores", nonfinite_message="scores contain NaN or infinity")
    device = scores.device
    if num_tokens == 0 or k == num_experts:
        return torch.ones(num_tokens, num_experts, dtype=torch.bool, device=device)

    # float64 so that tiny eps steps stay exact; subtracting a token's max changes no assignment's ranking
    # (every token takes exactly k experts) and keeps the two options of a bidder on one scale.
    a = scores.detach().to(torch.float64)
    a = a - a.max(dim=1, keepdim=True).values
    floor_load, remainder = balanced_loads(num_tokens, num_experts, k)
    expert_slots = floor_load + (1 if remainder else 0)
    token_slots = torch.full((num_tokens,), num_experts - k, dtype=torch.long, device=device)
    if remainder:
        # The dummy token fills the E - r spare slots; equal scores make it neutral in the objective.
        a = torch.cat([a, a.new_zeros(1, num_experts)])
        token_slots = torch.cat([token_slots, token_slots.new_tensor([remainder])])
    persons = a.numel()

    spread = float(a.max() - a.min())
    spread = spread if spread > 0 else 1.0
    if final_eps is None:
        final_eps = 1e-9 * spread / persons
    price_e = a.new_zeros(num_experts)
    price_t = a.new_zeros(a.shape[0])
    # Start fine: a coarse first phase inflates prices that later phases then climb out of in tiny steps (with
    # spread / 4 some inputs took 10x more rounds than with spread / 512 in our measurements).
    eps = spread / 512
    while True:
        eps = max(eps, final_eps)
        hold_e = _auction_phase(a, price_e, price_t, expert_slots, token_slots, eps, max_rounds)
        if eps <= final_eps:
            break
        eps /= 8  # epsilon-scaling: the prices of a coarse phase are a good start for the next one
    return hold_e[:num_tokens]


def make_base_plan(logits: Tensor, k: int = 1, *, normalize_weights: bool = True) -> RoutingPlan:
    """The BASE training plan for router logits ``[T, E]``: the balanced assignment of the logits.

    Per pair ``[T, k]``: a token's k assigned experts in descending probability (ties: lower index first), the
    combine weight is the softmax probability ``p[t, e]`` of the assigned expert (divided by the sum of the
    token's k assigned probabilities with ``normalize_weights`` and k > 1), as for top-k. Nothing is dropped:
    ``capacity`` is ``ceil(T*k/E)`` and ``load == tokens_per_expert`` is exactly balanced. ``aux_loss`` is a
    differentiable zero (the assignment is balanced by construction); ``z_loss`` as usual.
    """
    num_tokens, num_experts = check_logits(logits, k)
    # Never traced: every round of the auction starts with a host read (``free.any()``), so dynamo broke the
    # graph there and compiled the rest of the loop again for each round (its guard: the loop counter), until its
    # limit: 15 s of compiling for one BASE layer at E=6, T=10. Under torch.compile it runs eagerly, one graph
    # break. (Wrapped here, not decorated: the decorator would import torch._dynamo with flexmoe.)
    solve = torch.compiler.disable(balanced_assignment) if torch.compiler.is_compiling() else balanced_assignment
    assigned = solve(logits, k)
    probs = torch.softmax(logits, dim=-1)
    _, expert_index = top_k(probs.detach().masked_fill(~assigned, -1.0), k)
    probs_topk = probs.gather(1, expert_index)
    floor_load, remainder = balanced_loads(num_tokens, num_experts, k)
    return plan_from_pairs(
        logits, expert_index, probs_topk, normalize_topk(probs_topk, normalize_weights),
        capacity=floor_load + (1 if remainder else 0),
        aux_loss=probs.sum() * 0.0,
        kind="base",
    )
