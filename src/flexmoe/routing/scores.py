"""Router scores and top-k selection of the open MoE families (pure functions).

The layer's top-k routing, step by step (docs/architecture.md, routing contract):

1. scores ``[T, E]`` from the logits: ``score_func="softmax"`` (Mixtral, Qwen, OLMoE, GPT-OSS, Switch) or
   ``"sigmoid"`` (DeepSeek-V3, GLM-4.5, Kimi-K2), :func:`router_scores`;
2. choice scores: the scores plus the selection bias (``balance="bias"``), detached: they only *pick* experts;
3. group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``): the E experts form G equal groups of
   consecutive experts, a group is rated by the sum of its two best choice scores, only the best
   ``num_limited_groups`` groups stay eligible, :func:`group_limited_mask` (a k larger than the eligible experts
   takes masked ones too, :func:`select_experts`);
4. the k best eligible choice scores, ties to the lower expert index (:func:`flexmoe.routing.plan.top_k`), or
   with ``select_by="logits"`` the k best logits (GPT-OSS: the same order, without a bias or groups);
5. weights from the unbiased scores of the chosen experts, renormalised over the k (k > 1) when asked, times
   ``route_scale``, :func:`routed_weights`. Renormalised softmax scores are the softmax over the chosen logits
   (every other expert's term cancels), which is how they are computed: one softmax over ``[T, k]`` in place of a
   sum and a divide, whose backward takes a third of the operations.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SCORE_FUNCS", "TIES", "SELECT_BY", "check_select_by", "top_k", "top_k_by_unique_keys", "normalize_topk",
           "topk_weights", "router_scores", "softmax_dtype", "group_limited_mask", "select_experts", "routed_weights",
           "softmax_of_chosen", "check_group_options"]

SCORE_FUNCS = ("softmax", "sigmoid")
# How equal scores are broken: "lower" (the lower expert index, a stable sort: the same on every device and
# compiled) or "topk" (as torch.topk breaks them, which Hugging Face's routers call: the same choices as theirs on
# the same device; torch.topk itself promises no order).
TIES = ("lower", "topk")
# What a top-k router ranks: the scores (with the selection bias and the group limit), or the logits (GPT-OSS).
SELECT_BY = ("scores", "logits")


def check_select_by(select_by: object, selection_bias: bool, num_expert_groups: object) -> None:
    """Raise ``ValueError`` unless ``select_by`` is one of :data:`SELECT_BY` and fits the other options: the
    scores and the logits rank alike (both score functions are increasing), but a selection bias is added to the
    scores and groups are rated by sums of scores, neither of which the logits' ranking knows."""
    if select_by not in SELECT_BY:
        raise ValueError(f"select_by must be 'scores' or 'logits', got {select_by!r}")
    if select_by == "logits":
        for name, unfit in (("balance='bias'", selection_bias), ("num_expert_groups", num_expert_groups is not None)):
            if unfit:
                raise ValueError(f"select_by='logits' cannot be combined with {name}: it adds to or sums the "
                                 f"scores, which the logits' ranking leaves out")


# From this many scores on, top_k first asks torch.topk (measured on a 2-core AVX2 CPU: [4096, 64] 2.2 ms against
# the stable sort's 5.3 ms, [4096, 256] 6.9 against 27.5 ms; at [8, 64] the sort is faster, 23 against 40 us).
_TOPK_MIN_SCORES = 1 << 15


def top_k(probs: Tensor, k: int, ties: str = "lower", *, read_free: bool = False) -> tuple[Tensor, Tensor]:
    """The k largest probabilities of each row, ties broken towards the lower expert index (``ties="topk"``: as
    ``torch.topk`` breaks them, :data:`TIES`).

    probs: ``[T, E]``. Returns ``(values [T, k], indices [T, k])``, largest first. ``read_free``: never read the
    device from the host (the read-free path, :mod:`flexmoe.routing.read_free`), as when compiling.
    """
    if ties == "topk":
        values, indices = torch.topk(probs, k, dim=-1)
        return values, indices
    if probs.numel() >= _TOPK_MIN_SCORES:
        if torch.compiler.is_compiling() or read_free:
            if probs.dtype in _KEYED_DTYPES:
                return top_k_by_unique_keys(probs, k)
        else:
            # torch.topk makes no promise on ties, but where each row's k + 1 best values are all distinct its
            # answer is the only one, the stable sort's; one host sync tells, and ties (rare in float scores) take
            # the sort.
            values, indices = torch.topk(probs, min(k + 1, probs.shape[-1]), dim=-1)
            if not bool((values[:, 1:] == values[:, :-1]).any()):
                return values[:, :k], indices[:, :k]
    # A stable descending sort keeps equal values in index order.
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


_KEYED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def top_k_by_unique_keys(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """:func:`top_k` without a sort or a host sync (for compiled graphs): ``torch.topk`` of keys that are all
    distinct, so its answer is the only one. Each score's float32 bits, as an int32 ordered like the floats
    (negative floats have their magnitude bits flipped; -0.0 is made +0.0 first, as the floats compare equal),
    widened to int64, times E, plus ``E - 1 - index``: a larger score has a larger key, and of equal scores the
    lower index does. probs: ``[T, E]`` float32, bfloat16 or float16 (exact in float32)."""
    num_experts = probs.shape[-1]
    bits = (probs.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    tie_break = num_experts - 1 - torch.arange(num_experts, device=probs.device)
    _, indices = torch.topk(ordered * num_experts + tie_break, k, dim=-1)
    return probs.gather(-1, indices), indices


def normalize_topk(probs_topk: Tensor, normalize: bool, *, floor: bool = True) -> Tensor:
    """The combine weights ``[T, k]`` of the chosen scores ``[T, k]``: divided by their sum per token when
    ``normalize`` and k > 1, else the scores themselves. ``floor=False`` where the sum cannot be 0 (softmax
    scores: the best of a token's is at least 1 / E): the same numbers, one operation less each way."""
    if normalize and probs_topk.shape[1] > 1:
        total = probs_topk.sum(dim=-1, keepdim=True)
        # The floor only guards sigmoid scores that all underflowed to 0; it never changes a positive sum.
        return probs_topk / (total.clamp_min(torch.finfo(probs_topk.dtype).tiny) if floor else total)
    return probs_topk


def softmax_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """The dtype a softmax over logits of ``logits_dtype`` is taken in: float32 at least (:func:`router_scores`)."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def router_scores(logits: Tensor, score_func: str = "softmax") -> Tensor:
    """logits: ``[T, E]`` -> scores ``[T, E]``: ``softmax`` over the experts, in float32 at least (bf16 or fp16
    logits are upcast first, as Hugging Face's routers do: rounded probabilities would tie where the logits do
    not), or an elementwise ``sigmoid`` in the logits' dtype."""
    if score_func == "softmax":
        # float32 at least; chosen in Python (torch.promote_types would be one more dispatched operation).
        return torch.softmax(logits, dim=-1, dtype=softmax_dtype(logits.dtype))
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")


def check_group_options(num_experts: int | None, k: int, num_expert_groups: object, num_limited_groups: object) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the argument unless the group options fit E
    (``num_experts=None``: only what does not depend on E). Any k fits: a k larger than the eligible groups'
    experts takes masked ones too (:func:`select_experts`); ``k`` stays for the callers' signature."""
    if num_expert_groups is None and num_limited_groups is None:
        return
    if num_expert_groups is None or num_limited_groups is None:
        raise ValueError("num_expert_groups and num_limited_groups go together (both None: group routing off), "
                         f"got {num_expert_groups} and {num_limited_groups}")
    for name, value in (("num_expert_groups", num_expert_groups), ("num_limited_groups", num_limited_groups)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    assert isinstance(num_expert_groups, int) and isinstance(num_limited_groups, int)  # the loop checked both
    if num_limited_groups > num_expert_groups:
        raise ValueError(f"num_limited_groups must be <= num_expert_groups={num_expert_groups}, "
                         f"got {num_limited_groups}")
    if num_experts is None:
        return
    if num_experts % num_expert_groups != 0:
        raise ValueError(f"num_expert_groups must divide num_experts={num_experts}, got {num_expert_groups}")
    # k may exceed the experts of the eligible groups: select_experts then also picks masked ones (as HF's
    # DeepSeek-V3 router does), so no bound on k beyond k <= E, which the plan checks.


def group_limited_mask(choice_scores: Tensor, num_groups: int, num_limited_groups: int,
                       ties: str = "lower", *, read_free: bool = False) -> Tensor:
    """``[T, E]`` bool, True for the experts of each token's ``num_limited_groups`` best groups.

    choice_scores: ``[T, E]``; the experts form ``num_groups`` groups of ``E / num_groups`` consecutive
    experts. A group's rating is the sum of its two best choice scores (its one score for groups of one); ties
    between groups go to the lower group index (``ties="topk"``: as ``torch.topk`` breaks them).
    """
    num_tokens, num_experts = choice_scores.shape
    best_groups = _best_groups(choice_scores, num_groups, num_limited_groups, ties, read_free)
    keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=choice_scores.device)
    keep.scatter_(1, best_groups, True)
    return keep.repeat_interleave(num_experts // num_groups, dim=1)


def _best_groups(choice_scores: Tensor, num_groups: int, num_limited_groups: int, ties: str,
                 read_free: bool) -> Tensor:
    """choice_scores: ``[T, E]`` -> each token's ``num_limited_groups`` best groups ``[T, L]``
    (:func:`group_limited_mask`'s rating)."""
    num_tokens, num_experts = choice_scores.shape
    grouped = choice_scores.view(num_tokens, num_groups, num_experts // num_groups)
    # The two best values of each group: the same numbers however ties are broken, so torch.topk's (one operation,
    # and cheaper than a sort) serve every tie rule.
    best_two = torch.topk(grouped, min(2, grouped.shape[-1]), dim=-1).values
    return top_k(best_two.sum(dim=-1), num_limited_groups, ties, read_free=read_free)[1]


def select_experts(
    scores: Tensor,
    k: int,
    *,
    selection_bias: Tensor | None = None,
    num_expert_groups: int | None = None,
    num_limited_groups: int | None = None,
    ties: str = "lower",
    read_free: bool = False,
) -> tuple[Tensor, Tensor]:
    """Each token's k experts: ``(expert_index [T, k], choice_scores [T, E])``.

    scores: ``[T, E]``; selection_bias: ``[E]`` added to the scores to pick only (the sum in the wider dtype).
    With groups, experts outside a token's best groups get ``-inf`` choice scores before the top-k, as in HF's
    DeepSeek-V3 router: when k exceeds the eligible experts, every eligible one is picked and the rest of the k
    are masked ones (equal at ``-inf``, so by the tie rule), still weighted by their real scores
    (:func:`routed_weights`). Ties: the lower expert index, or as ``torch.topk`` breaks them with
    ``ties="topk"``. ``read_free``: without a host read (:func:`top_k`).
    """
    choice = scores.detach()
    if selection_bias is not None:
        # In the wider of the two dtypes, as HF's DeepSeek-V3 adds its float32 bias to bf16 scores under autocast.
        choice = choice + selection_bias
    if num_expert_groups is not None and num_limited_groups is not None:
        # group_limited_mask's choice, applied per group: the mask [T, G] broadcast over each group's experts,
        # not repeated into [T, E] and inverted (two operations fewer).
        num_tokens, num_experts = choice.shape
        best_groups = _best_groups(choice, num_expert_groups, num_limited_groups, ties, read_free)
        dropped = torch.ones(num_tokens, num_expert_groups, dtype=torch.bool, device=choice.device)
        dropped.scatter_(1, best_groups, False)
        choice = choice.view(num_tokens, num_expert_groups, -1).masked_fill(dropped.unsqueeze(-1), float("-inf"))
        choice = choice.view(num_tokens, num_experts)
    _, expert_index = top_k(choice, k, ties, read_free=read_free)
    return expert_index, choice


def routed_weights(
    scores: Tensor,
    expert_index: Tensor,
    *,
    normalize_weights: bool = True,
    route_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    floor: bool = True,
    softmax_of: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(probs_topk [T, k], weight [T, k])``: the chosen experts' unbiased scores, and the combine weights
    (divided by their sum when ``normalize_weights`` and k > 1, then times ``route_scale``), both in ``dtype``
    (the logits'; None: the scores'). ``floor``: :func:`normalize_topk`'s. ``softmax_of``: the logits ``[T, E]``
    where ``scores`` are their softmax: renormalised weights are then the softmax over the chosen logits
    (:func:`softmax_of_chosen`), the same numbers by fewer operations."""
    probs_topk = scores.gather(1, expert_index)
    if softmax_of is not None and normalize_weights and expert_index.shape[1] > 1:
        weight = softmax_of_chosen(softmax_of.gather(1, expert_index), scores.dtype, route_scale, dtype)
        return (probs_topk if dtype is None or dtype == probs_topk.dtype else probs_topk.to(dtype)), weight
    return topk_weights(probs_topk, normalize_weights=normalize_weights, route_scale=route_scale, dtype=dtype,
                        floor=floor)


def softmax_of_chosen(chosen_logits: Tensor, score_dtype: torch.dtype, route_scale: float = 1.0,
                      dtype: torch.dtype | None = None) -> Tensor:
    """The renormalised softmax weights ``[T, k]`` of each token's chosen logits ``chosen_logits`` ``[T, k]``:
    ``softmax(logits)[chosen] / softmax(logits)[chosen].sum()`` is ``softmax(logits[chosen])``. Computed in
    ``score_dtype`` (the scores', float32 at least), times ``route_scale``, in ``dtype`` (None: ``score_dtype``)."""
    weight = torch.softmax(chosen_logits, dim=-1, dtype=score_dtype)
    if route_scale != 1.0:
        weight = weight * route_scale
    return weight if dtype is None or dtype == weight.dtype else weight.to(dtype)


def topk_weights(probs_topk: Tensor, *, normalize_weights: bool = True, route_scale: float = 1.0,
                 dtype: torch.dtype | None = None, floor: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`routed_weights` from the chosen scores ``probs_topk`` ``[T, k]`` themselves (a top-k's values):
    ``(probs_topk, weight)``, both ``[T, k]`` in ``dtype``."""
    weight = normalize_topk(probs_topk, normalize_weights, floor=floor)
    if route_scale != 1.0:
        weight = weight * route_scale
    if dtype is not None and dtype != probs_topk.dtype:
        probs_topk, weight = probs_topk.to(dtype), weight.to(dtype)
    return probs_topk, weight
