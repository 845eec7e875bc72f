"""Expert parallelism that sends each token once per rank (docs/architecture.md, "Each token once per rank").

The row exchange (:meth:`flexmoe.parallel.expert_parallel.ExpertParallel.run`) sends one row per (token, expert)
pair: a token routed to three experts of one rank crosses the network three times, and three output rows come
back. With E = 64 and k = 8 a token reaches 1.99 of 2 ranks and 3.66 of 4, so most of those rows are copies.
Here each rank sends:

* each of its tokens once to every rank holding one of its experts (``[u, M]`` rows);
* per pair its combine weight (differentiable), which of those rows it reads and which local expert computes
  it, together as one float64 ``[n, 3]`` (one exchange, not two: each is a wait for the slowest rank);

the receiving rank runs its experts fused with the weighted sum (:func:`flexmoe.experts.fused.fused_experts`,
or the plain experts then a weighted sum for any other expert path), and sends back one row per token it
received: the weighted sum of that token's experts on that rank. The source adds up the rows it gets back.

Same numbers as the row exchange up to the order of the float additions: a token's k weighted outputs are
summed per rank first, then over ranks. The backward is autograd's through the exchanges (each the same
exchange transposed), the fused experts and the gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flexmoe.dispatch import sum_rows_by_token
from flexmoe.experts import FeedForwardExperts, differentiated_weights, expert_ffn
from flexmoe.experts.chooser import choose_fused_route
from flexmoe.experts.fused import fused_experts, fused_supported
from flexmoe.experts.kernels import route_bucket
from flexmoe.parallel.alltoall import CommStats, Exchange, HostCopy, SplitMatrix, exchange, transpose
from flexmoe.parallel.groups import ExpertGroup

__all__ = ["LocalRoute", "TokenRoute", "local_route", "pairs_per_rank", "token_route", "route_from_counts",
           "exchange_tokens", "receiver_fuses"]


@dataclass
class LocalRoute:
    """What one rank sends in :func:`exchange_tokens`, before any exchange of counts; all on the rows' device.

    sent: ``[W, T]`` whether token t goes to rank w; pair_slot: ``[N]`` per local pair (the plan's row order, which
    is by destination), the index of its token among the tokens sent to its destination; pair_expert: ``[N]`` its
    expert's index on the destination; tokens_to: ``[W]`` how many tokens go to each rank (the pairs are
    :func:`pairs_per_rank` of the counts). Nothing here is read on the host: the tokens sent
    (:meth:`send_token`) are taken once their number is known from the count exchange."""

    sent: Tensor
    pair_slot: Tensor
    pair_expert: Tensor
    tokens_to: Tensor

    def send_token(self, sent_tokens: int) -> Tensor:
        """``[u]`` the local tokens sent, by destination rank then token, given their number ``u`` (the sum of
        ``tokens_to``, read on the host with the split sizes): a ``nonzero`` of known size reads nothing."""
        flat = torch.nonzero_static(self.sent.reshape(-1), size=sent_tokens).squeeze(1)  # [u] w * T + t
        return flat.remainder(self.sent.shape[1])


class TokenRoute:
    """Who sends what to whom in one call of :func:`exchange_tokens` (the split matrices are the same on every
    rank): this rank's :class:`LocalRoute` and every rank's per-expert pair counts and tokens per destination,
    ``[W][E + W]``, exchanged on the device. Their host copy is read at the first use of a split matrix
    (:class:`~flexmoe.parallel.alltoall.HostCopy`, the one read of the call); ``gathered`` may be that copy or
    counts a caller read already (``parallel="auto"``: :func:`route_from_counts`)."""

    def __init__(self, local: LocalRoute, gathered: HostCopy | list[list[int]], num_experts: int) -> None:
        self.local, self._gathered, self.num_experts = local, gathered, num_experts
        self._read: tuple[SplitMatrix, SplitMatrix, list[list[int]]] | None = None

    def _values(self) -> tuple[SplitMatrix, SplitMatrix, list[list[int]]]:
        if self._read is None:
            rows = self._gathered if isinstance(self._gathered, list) else self._gathered.tolist()
            all_counts = [row[:self.num_experts] for row in rows]
            world = len(rows)
            self._read = ([row[self.num_experts:] for row in rows], [pairs_per_rank(c, world) for c in all_counts],
                          all_counts)
        return self._read

    @property
    def token_splits(self) -> SplitMatrix:
        """``W x W``: the tokens rank a sends to rank b."""
        return self._values()[0]

    @property
    def pair_splits(self) -> SplitMatrix:
        """``W x W``: the (token, expert) pairs rank a sends to rank b."""
        return self._values()[1]

    def local_counts(self, rank: int) -> list[int]:
        """``[E / W]``: the pairs ``rank`` receives per local expert, over every source."""
        all_counts = self._values()[2]
        local_experts = self.num_experts // len(all_counts)
        first = rank * local_experts
        return [sum(row[first + j] for row in all_counts) for j in range(local_experts)]


def local_route(row_token: Tensor, counts: list[int] | Tensor, num_tokens: int, world: int) -> LocalRoute:
    """This rank's part of the route of a plan's rows (``row_token: [N]`` sorted by global expert, ``counts:
    [E]``, Python ints or a tensor on the rows' device: nothing here reads it) over ``world`` ranks holding
    ``E / W`` whole experts each (rank i the experts ``i*E/W ..``)."""
    num_experts = len(counts)
    local_experts = num_experts // world
    device = row_token.device
    row_expert = torch.repeat_interleave(torch.arange(num_experts, device=device),
                                         torch.as_tensor(counts, device=device),
                                         output_size=row_token.shape[0])  # [N]
    row_rank = row_expert.div(local_experts, rounding_mode="floor")
    sent = torch.zeros(world, num_tokens, dtype=torch.bool, device=device)
    sent[row_rank, row_token] = True  # [W, T]: token t goes to rank w
    position = sent.reshape(-1).cumsum(0).sub_(1).view(world, num_tokens)  # its row among all tokens sent
    tokens_to = sent.sum(1)  # [W]
    first = tokens_to.cumsum(0) - tokens_to  # [W] the first row sent to each rank
    return LocalRoute(sent=sent, pair_slot=position[row_rank, row_token] - first[row_rank],
                      pair_expert=row_expert - row_rank * local_experts, tokens_to=tokens_to)


def pairs_per_rank(counts: list[int], world: int) -> list[int]:
    """``[W]``: the pairs of ``counts`` (``[E]``) that go to each rank, ``E / W`` whole experts per rank."""
    local_experts = len(counts) // world
    return [sum(counts[w * local_experts:(w + 1) * local_experts]) for w in range(world)]


def token_route(row_token: Tensor, counts: list[int] | Tensor, num_tokens: int, eg: ExpertGroup) -> TokenRoute:
    """The route of a plan's rows over ``eg`` (:func:`local_route`; ``counts`` ``[E]`` as there): one all-gather
    on the device of each rank's ``[E + W]`` per-expert counts and tokens per destination, its host copy started
    here and read later."""
    local = local_route(row_token, counts, num_tokens, eg.world_size)
    mine = torch.cat([torch.as_tensor(counts, dtype=torch.long, device=row_token.device), local.tokens_to])  # [E+W]
    parts = [torch.empty_like(mine) for _ in range(eg.world_size)]
    eg.call("token-count exchange", lambda: dist.all_gather(parts, mine, group=eg.group))
    return TokenRoute(local, HostCopy(torch.stack(parts)), len(counts))


def route_from_counts(local: LocalRoute, tokens_to: SplitMatrix, all_counts: list[list[int]]) -> TokenRoute:
    """The route of :func:`token_route` from counts already exchanged and read: every rank's ``tokens_to`` and
    its per-expert counts ``[W][E]`` (whose sums per destination are the pairs), so that a caller that gathers
    the per-expert counts anyway (``parallel="auto"``) needs no second all-gather."""
    return TokenRoute(local, [c + t for c, t in zip(all_counts, tokens_to)], len(all_counts[0]))


def exchange_tokens(tokens: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int] | Tensor,
                    experts: FeedForwardExperts, eg: ExpertGroup, transport: Exchange,
                    stats: CommStats | None = None, route: TokenRoute | None = None) -> Tensor:
    """tokens: ``[T, M]``; row_token / row_weight: ``[N]`` a plan's rows (sorted by global expert, weights in
    tokens' dtype), counts: ``[E]`` (Python ints, or a tensor on the tokens' device that is never read: the
    split sizes are the one read); experts: this rank's ``E / W`` experts; route: the rows' route if the
    caller has it (None: :func:`token_route`) -> ``[T, M]``: each token's weighted sum over its experts (module
    docstring).

    The host reads the counts once (the split sizes of all three exchanges: the tokens, their pairs and, with
    the token splits transposed, the sums coming back), as late as it can: the pairs are built while the copy
    of the counts travels."""
    if route is None:
        route = token_route(row_token, counts, tokens.shape[0], eg)  # the count exchange; its copy starts
    local = route.local
    rank = eg.rank
    # Per pair its weight, its token among those sent to its destination and its local expert, in one exchange
    # (each exchange is a wait for the slowest rank): float64 holds the indices exactly (below 2^53).
    pairs = torch.stack([row_weight.to(torch.float64), local.pair_slot.to(torch.float64),
                         local.pair_expert.to(torch.float64)], dim=1)
    token_splits, pair_splits = route.token_splits, route.pair_splits  # the read: waits for the count copy
    send_token = local.send_token(sum(token_splits[rank]))
    received = exchange(tokens.index_select(0, send_token), transport, token_splits, stats)
    received_pairs = exchange(pairs, transport, pair_splits, stats)  # [n, 3]
    weight = received_pairs[:, 0].to(tokens.dtype)
    pair_slot, local_expert = received_pairs[:, 1].detach().long(), received_pairs[:, 2].detach().long()
    # Each source's tokens follow the previous sources' in `received`: its pairs' slots start after theirs.
    from_source = [row[rank] for row in token_splits]
    pairs_from = [row[rank] for row in pair_splits]
    token_offset = torch.repeat_interleave(
        torch.tensor([sum(from_source[:src]) for src in range(len(from_source))], device=tokens.device),
        torch.tensor(pairs_from, device=tokens.device), output_size=sum(pairs_from))
    order = torch.argsort(local_expert, stable=True)  # pairs by local expert, sources in order
    local_token = (pair_slot + token_offset).index_select(0, order)
    local_weight = weight.index_select(0, order)
    local_counts = route.local_counts(rank)  # [E / W] from the counts read above: no bincount
    partial = _weighted_experts(received, local_token, local_weight, local_counts, experts)  # [u', M]
    if torch.is_grad_enabled() and not partial.requires_grad:
        # No pairs here that need a gradient: still join the gradient exchange, which every rank must run.
        anchor = received if received.requires_grad else next(iter(differentiated_weights(experts)), None)
        if anchor is not None:
            partial = partial + anchor.reshape(-1)[:0].sum().to(partial.dtype)
    back = exchange(partial, transport, transpose(token_splits), stats)  # [u, M]
    return tokens.new_zeros(tokens.shape).index_add(0, send_token, back.to(tokens.dtype))


def receiver_fuses(received: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   experts: FeedForwardExperts) -> bool:
    """Whether the receiving rank runs its experts fused (:func:`~flexmoe.experts.fused.fused_experts`) on
    ``received`` ``[u, M]`` with ``counts[e]`` pairs per local expert: where fused runs (training), and the experts'
    kernel chooser holds it faster for this bucket (:func:`~flexmoe.experts.chooser.choose_fused_route`, forced by
    ``expert_route``:
    a table every rank took from rank 0, or ``flexmoe calibrate``; without an entry, the plain experts).

    Side by side at E=64 k=8 H=256 over 2 ranks, 512 tokens each (128 rows x 256 per local expert), the step took
    0.77 of the row exchange's time fused and 0.87 with the plain experts; over 4 ranks of 4096 tokens each, 1.19 x
    the floor fused against 1.52 plain."""
    weights = experts.weights()
    if not counts or not fused_supported(received, weights) or experts.kernels.route == "rows":
        return False
    bucket = "receiver/" + route_bucket(received, sum(counts), weights)
    token, weight = row_token, row_weight.detach()
    return choose_fused_route(experts.kernels, bucket, received, weights,
                              run_fused=lambda x: fused_experts(x, token, weight, counts, weights),
                              run_rows=lambda x: _plain_experts(x, token, weight, counts, experts),
                              kernel_rows=lambda: (received.index_select(0, token), counts))


def _weighted_experts(received: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                      experts: FeedForwardExperts) -> Tensor:
    """received: ``[u, M]``; row_token / row_weight: ``[n]`` the pairs sorted by local expert, ``counts[e]``
    each -> ``[u, M]``: each received token's weighted sum over its experts here, fused where
    :func:`receiver_fuses` (no ``[n, M]`` rows are written, and the weight gradients go straight into one
    buffer), else the plain experts and a scatter-add."""
    if receiver_fuses(received, row_token, row_weight, counts, experts):
        return fused_experts(received, row_token, row_weight, counts, experts.weights())
    return _plain_experts(received, row_token, row_weight, counts, experts)


def _plain_experts(received: Tensor, row_token: Tensor, row_weight: Tensor, counts: list[int],
                   experts: FeedForwardExperts) -> Tensor:
    """:func:`_weighted_experts` by the experts over gathered rows ``[n, M]`` and a scatter-add."""
    rows = expert_ffn(received.index_select(0, row_token), counts, experts.weights(), experts.kernels)
    return sum_rows_by_token(rows, row_token, row_weight.to(rows.dtype), received.shape[0])
