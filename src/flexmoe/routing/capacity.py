"""Capacity counted per sequence (Switch Transformer / T5 style, ``capacity_per="sequence"``), pure functions.

With ``capacity_per="call"`` (the default) an expert's capacity C is shared by all T tokens of the call. With
``"sequence"`` the input is B sequences of S tokens and each sequence is routed with its own capacity
``C = resolve_capacity(S, ...)`` per expert, as if it were a call of its own: a pair's slot is its rank among
the pairs of the same expert *and* sequence (in the usual priority order), and it is dropped when that slot is
>= C. An expert then computes up to ``B * C`` rows, laid out by sequence, then slot.

The trick: an (expert, sequence) unit is a virtual expert ``e * B + b``, so :func:`assign_slots` hands out the
slots unchanged and its order already sorts the pairs by (expert, sequence, slot).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["CAPACITY_PER", "HOST_ORDER_MAX_PAIRS", "count_per_expert", "sort_pairs_by_expert", "order_pairs_on_host",
           "HostPairOrder", "assign_slots", "assign_sequence_slots", "kept_counts"]

CAPACITY_PER = ("call", "sequence")

# Up to this many (token, choice) pairs a call orders its rows on the host (order_pairs_on_host): decoding's
# T=1 and T=8 at k=8. Larger calls keep the tensor sort (the Python loop grows with the pairs).
HOST_ORDER_MAX_PAIRS = 64


def count_per_expert(expert_index: Tensor, num_experts: int, *, on_device: bool = False) -> Tensor:
    """``[E]`` long: how many entries of ``expert_index`` (any shape, values in ``[0, E)``) name each expert.

    Eager: ``torch.bincount``, one op. Traced by ``torch.compile``, or ``on_device`` (the read-free path): a
    scatter-add into ``[E]``, whose shape is known before the values are, so the host never waits for the device
    (``bincount`` sizes its output by the largest value: a host read) and a traced graph does not break
    (docs/architecture.md, "Compiling the layer").
    """
    flat = expert_index.reshape(-1)
    if not torch.compiler.is_compiling() and not on_device:
        return torch.bincount(flat, minlength=num_experts)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_pairs_by_expert(expert_index: Tensor) -> tuple[Tensor, Tensor]:
    """The (token, choice) pairs of ``expert_index`` ``[T, k]`` in slot order: by expert, and within an expert
    every token's 1st choice before any token's 2nd choice, tokens in order.

    Returns ``(sorted_expert [k*T], by_expert [k*T])``: ``by_expert`` lists choice-major pair indices
    ``p = choice * T + token`` (the rows of the dropless plan), ``sorted_expert`` their experts.
    """
    return torch.sort(expert_index.t().reshape(-1), stable=True)


class HostPairOrder(NamedTuple):
    """The dropless rows of a few (token, choice) pairs, as Python lists (see :func:`order_pairs_on_host`).

    counts: ``[E]`` rows per expert; row_token: ``[N]`` each row's token; row_pair: ``[N]`` each row's choice-major
    pair ``choice * T + token`` (:func:`sort_pairs_by_expert`'s ``by_expert``); pair_row: ``[T * k]`` the row of
    each token-major pair ``token * k + choice``.
    """

    counts: list[int]
    row_token: list[int]
    row_pair: list[int]
    pair_row: list[int]

    def index_tensors(self, device: torch.device, *, with_row_pair: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(row_token [N], pair_row [T * k], row_pair)`` as long tensors on ``device`` (``row_pair`` ``[N]`` with
        ``with_row_pair``, else empty), made by one ``torch.tensor`` call (on a decoding call each costs as much
        as a kernel)."""
        n, end = len(self.row_token), len(self.row_token) + len(self.pair_row)
        index = torch.tensor(self.row_token + self.pair_row + (self.row_pair if with_row_pair else []),
                             device=device)
        return index[:n], index[n:end], index[end:]


def order_pairs_on_host(choices: list[list[int]], num_experts: int) -> HostPairOrder:
    """:func:`sort_pairs_by_expert` and :func:`count_per_expert` for ``choices = expert_index.tolist()``
    (``[T][k]``, values in ``[0, E)``), by a counting sort in Python.

    The rows come in the same order (by expert, then choice, then token). For a call of a few pairs (decoding)
    one host read of the choices and this loop cost less than the sort, bincount, division and their reads
    (docs/architecture.md, "Decoding").
    """
    num_tokens = len(choices)
    k = len(choices[0]) if choices else 0
    counts = [0] * num_experts
    for token_choices in choices:
        for e in token_choices:
            if not 0 <= e < num_experts:
                raise ValueError(f"expert_index must lie in [0, num_experts={num_experts}), got {e}")
            counts[e] += 1
    next_row, start = [], 0
    for n in counts:
        next_row.append(start)
        start += n
    num_pairs = num_tokens * k
    row_token, row_pair, pair_row = [0] * num_pairs, [0] * num_pairs, [0] * num_pairs
    for c in range(k):  # choice-major, token by token: the stable sort's order within an expert
        for t in range(num_tokens):
            e = choices[t][c]
            r = next_row[e]
            next_row[e] = r + 1
            row_token[r], row_pair[r], pair_row[t * k + c] = t, c * num_tokens + t, r
    return HostPairOrder(counts, row_token, row_pair, pair_row)


def assign_slots(
    expert_index: Tensor,
    num_experts: int,
    priority: Tensor | None = None,
    *,
    on_device: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Slots in priority order, before any capacity is applied.

    expert_index: ``[T, k]``; priority: ``[T]`` the token order within one choice (None: token order);
    on_device: count without a host read (:func:`count_per_expert`).
    Returns ``(slot [T, k], load [E], order [T*k])`` where ``order`` lists the flat pair indices
    ``token * k + choice`` sorted by (expert, slot): a pair's slot is its rank among the pairs of its expert.
    """
    num_tokens, k = expert_index.shape
    device = expert_index.device
    ranked = expert_index if priority is None else expert_index.index_select(0, priority)
    sorted_expert, by_expert = sort_pairs_by_expert(ranked)
    load = count_per_expert(ranked, num_experts, on_device=on_device)
    starts = torch.cumsum(load, 0) - load
    slot_sorted = torch.arange(num_tokens * k, device=device) - starts.index_select(0, sorted_expert)
    choice = torch.div(by_expert, num_tokens, rounding_mode="floor")
    token = by_expert - choice * num_tokens
    if priority is not None:
        token = priority.index_select(0, token)
    flat_pair = token * k + choice
    slot = torch.empty(num_tokens * k, dtype=torch.long, device=device).index_copy_(0, flat_pair, slot_sorted)
    return slot.view(num_tokens, k), load, flat_pair


def assign_sequence_slots(expert_index: Tensor, num_experts: int, priority: Tensor | None, num_sequences: int,
                          on_device: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Slots counted per (expert, sequence).

    expert_index: ``[T, k]`` with ``T = B * S`` tokens sequence-major (token t is in sequence ``t // S``);
    priority: ``[T]`` the token order within one choice (None: token order). Returns ``(slot [T, k], unit_load [E, B],
    order [T*k])``: ``unit_load[e, b]`` pairs of sequence b chose e, ``order`` the flat pairs sorted by
    (expert, sequence, slot). With ``num_sequences == 1`` this is :func:`assign_slots`.
    """
    num_tokens, k = expert_index.shape
    if num_sequences < 1 or num_tokens % num_sequences != 0:
        raise ValueError(f"num_sequences must divide the {num_tokens} tokens, got {num_sequences}")
    seq_len = num_tokens // num_sequences
    sequence = torch.arange(num_tokens, device=expert_index.device).div(seq_len, rounding_mode="floor")
    unit = expert_index * num_sequences + sequence.unsqueeze(1)
    slot, load, order = assign_slots(unit, num_experts * num_sequences, priority, on_device=on_device)
    return slot, load.view(num_experts, num_sequences), order


def kept_counts(unit_load: list[list[int]], capacity: int) -> list[int]:
    """Rows per expert once every (expert, sequence) unit keeps at most ``capacity`` pairs. unit_load: ``[E][B]``."""
    return [sum(min(n, capacity) for n in row) for row in unit_load]
