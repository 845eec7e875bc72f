"""The multi-rank scenarios of the tests, run in every rank by the one entry point ``multiproc.rank_main``.

A scenario is ``scenario_NAME(rank, world, out)``: it runs inside a gloo group of ``world`` ranks and puts its
findings in ``out`` (``out["failures"]``: lines describing what differs; other keys: numbers the test checks
across ranks). The named pytest cases are in tests/test_expert_parallel.py. Many checks run inside one group,
because starting processes (importing torch) costs seconds.

The reference, shared by every scenario: one process holding all experts with the same global weights
(:func:`make_pair`), running each rank's tokens (:func:`inputs`) as its own batch (:func:`reference`).
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from flexmoe import MoELayer
from flexmoe.parallel import (
    CollectiveError,
    ConfigMismatchError,
    ExpertLayout,
    ShadowExperts,
    ShadowTopExperts,
    rows_per_rank,
    shard_expert_state,
    unshard_expert_states,
)
from flexmoe.sharding import wrap_ddp

M, H = 8, 8  # tiny: model dim, expert hidden (global)
EP_TOKENS, FASTERMOE_TOKENS = 12, 16  # tokens per rank of the expert-parallel and the FasterMoE scenarios
TIMEOUT_S = 6.0  # the collective timeout of the dead/stalled rank scenarios (see multiproc.rank_main)
HOT = (0, 1)  # with skewed routing these two experts get about half of the (token, choice) pairs


# --- the reference: one process holding all experts ----------------------------------------------------------

def make_pair(E: int, k: int, cf: float | None, world: int, rank: int, skewed: bool = False,
              both: dict | None = None, dtype: torch.dtype = torch.float64, **kw):
    """A single-process reference holding all experts and the distributed layer with the same weights.

    cf: the capacity factor (None: the layer's default). both: options of the two layers (router kind, shared
    experts); kw: options of the distributed one. skewed: the router reads feature 0 (shifted by +1 in
    :func:`inputs`) into the two HOT experts. dtype: the distributed layer's (the reference is float64)."""
    both = {**(both or {}), **({} if cf is None else {"capacity_factor": cf})}
    torch.manual_seed(1234)
    ref = MoELayer(M, E, H, k=k, group="single", dtype=torch.float64, **both)
    if skewed:
        with torch.no_grad():
            ref.router.weight[:, 0] = 0.0
            ref.router.weight[list(HOT), 0] = 0.5
    ep = MoELayer(M, E, H, k=k, dtype=dtype, **both, **kw)
    ep.router.load_state_dict(ref.router.state_dict())
    if ref.shared is not None:
        ep.shared.load_state_dict(ref.shared.state_dict())
    layout = ExpertLayout(E, world, H)
    local = shard_expert_state(dict(ref.experts.state_dict()), layout, rank)  # w1, w3 by name even if joined
    ep.experts.load_state_dict({n: t.to(dtype) for n, t in local.items()})
    return ref, ep, layout


def inputs(world: int, tokens: int, skewed: bool = False, cold: bool = False):
    """Each rank's tokens and output weights. skewed: feature 0 shifted by +1; cold: feature 0 >= 1."""
    xs, ws = [], []
    for j in range(world):
        g = torch.Generator().manual_seed(100 + j)
        x = torch.randn(tokens, M, generator=g, dtype=torch.float64)
        if skewed:
            x[:, 0] += 1.0
        if cold:
            x[:, 0] = x[:, 0].abs() + 1.0
        xs.append(x)
        ws.append(torch.randn(tokens, M, generator=g, dtype=torch.float64))
    return xs, ws


def grads_by_state_names(experts) -> dict[str, torch.Tensor]:
    """The experts' gradients by their state-dict names: a joined gate_up's (gate_up_bias's) as its halves'."""
    grads = {n: p.grad for n, p in experts.named_parameters()}
    joined_pairs = experts.joined_pairs() if hasattr(experts, "joined_pairs") else {}
    for joined, (first, second) in joined_pairs.items():
        g = grads.pop(joined)
        grads[first], grads[second] = (None, None) if g is None else g.chunk(2, dim=-1)
    return grads


def reference(ref: MoELayer, xs, ws, rank: int):
    """Each rank's tokens as their own batch: this rank's output, input and router grads; expert grads
    summed over every rank's batch (what the distributed experts receive through the all-to-all); the routed
    rows per expert of every rank."""
    total: dict[str, torch.Tensor] = {}
    mine = {}
    counts = []
    for j, (x, w) in enumerate(zip(xs, ws)):
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        y = ref(x)
        (y * w).sum().backward()
        counts.append(list(ref.last_plan.counts))
        for n, g in grads_by_state_names(ref.experts).items():
            total[n] = total.get(n, 0) + g
        if j == rank:
            mine = {"y": y.detach(), "x.grad": x.grad, "router": [p.grad.clone() for p in ref.router.parameters()]}
    return mine, total, counts


def compare(tag: str, got: torch.Tensor | None, want: torch.Tensor, failures: list[str], tol: float = 1e-9) -> None:
    # float64 experts; the routing math runs in float32 (router_dtype), whose gradients sum in another order.
    if got is None:
        failures.append(f"{tag}: no gradient")
        return
    got = got.to(want.device)  # the reference runs on the CPU, the layer on any device
    if got.shape != want.shape or not torch.allclose(got.to(want.dtype), want, rtol=tol, atol=tol / 10):
        err = (got.to(want.dtype) - want).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{tag}: mismatch (max err {err}, shapes {tuple(got.shape)} vs {tuple(want.shape)})")


def gathered_grads(ep: MoELayer, layout: ExpertLayout, world: int) -> dict[str, torch.Tensor]:
    """Every rank's expert gradients, put back into global ``[E, ...]`` form."""
    # A rank whose experts got no rows may have no gradient at all (None): that is zero.
    mine = {n: (g.detach().clone() if g is not None else torch.zeros_like(getattr(ep.experts, n).detach()))
            for n, g in grads_by_state_names(ep.experts).items()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return unshard_expert_states(every, layout)


def check_case(tag, ref, ep, layout, rank, world, failures, tokens=EP_TOKENS, skewed=False, cold=False,
               x_grad=True, global_grads=False, tol=1e-9, counter=None, **call) -> dict:
    """This rank's output, input grad (if ``x_grad``) and router grads against the reference; expert grads as
    this rank's shard of the reference's, or (``global_grads``, which also checks the no-grad output) gathered
    into global form. Returns the reference's routed rows per rank and expert and the shadowed experts.
    counter: an :class:`~flexmoe.apps.bench.host_reads.OpCounter` around the layer's forward and backward only;
    the number of its reads in the forward is returned as ``"forward_reads"``."""
    from contextlib import nullcontext

    xs, ws = inputs(world, tokens, skewed, cold)
    want, total, counts = reference(ref, xs, ws, rank)
    ep.zero_grad(set_to_none=True)
    dtype, device = ep.experts.w1.dtype, ep.experts.w1.device
    x = xs[rank].to(device, dtype, copy=True).requires_grad_(x_grad)
    w = ws[rank].to(device, dtype)
    with counter if counter is not None else nullcontext():
        y = ep(x, **call)
        forward_reads = len(counter.host_reads) if counter is not None else 0
        (y * w).sum().backward()
    compare(f"{tag} output", y.detach(), want["y"], failures, tol)
    if x_grad:
        compare(f"{tag} x.grad", x.grad, want["x.grad"], failures, tol)
    for got, w in zip(ep.router.parameters(), want["router"]):
        compare(f"{tag} router.grad", got.grad, w, failures, tol)
    if global_grads:
        for n, g in gathered_grads(ep, layout, world).items():
            compare(f"{tag} experts.{n}.grad (global)", g, total[n], failures, tol)
        with torch.no_grad():  # the inference path (no autograd Functions) gives the same output
            compare(f"{tag} no_grad output", ep(xs[rank].to(device, dtype), **call), want["y"], failures, tol)
    else:
        local = shard_expert_state(total, layout, rank)
        for n, g in grads_by_state_names(ep.experts).items():
            compare(f"{tag} experts.{n}.grad", g, local[n], failures, tol)
    return {"counts": counts, "shadowed": list(ep.last_shadowed), "forward_reads": forward_reads}


# --- expert parallelism ----------------------------------------------------------------------------------------

def scenario_ep_equivalence(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    if world == 2:
        experts = [4, 2, 1]
        a2as = [("flat", None), ("2dh", 1), ("2dh", 2)]
    else:
        experts = [8, 2, 1]
        a2as = [("flat", None), ("2dh", 2)]
    for E in experts:
        for k in (1, 2):
            if k > E:
                continue
            for cf in (1.0, 0.0):
                ref, ep, layout = make_pair(E, k, cf, world, rank)
                valid_r = ep._ep.valid_r()
                for r in valid_r:
                    for d in ((1,) if r == 0 else (1, 2, 4)):
                        for a2a, g in (a2as[:1] if r == 0 else a2as):
                            tag = f"[W={world} E={E} k={k} cf={cf} r={r} d={d} a2a={a2a}/{g}]"
                            try:
                                check_case(tag, ref, ep, layout, rank, world, failures,
                                           r=r, overlap_degree=d, a2a=a2a, ranks_per_node=g)
                            except Exception:
                                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                            cases += 1
    # Constructor-level settings (not per call), and an invalid r with a clear error.
    ref, ep, layout = make_pair(world // 2, 1, 0.0, world, rank, r=2, overlap_degree=2, a2a="2dh",
                                ranks_per_node=2)  # experts sharded in 2
    check_case("[constructor r=2 d=2 2dh]", ref, ep, layout, rank, world, failures)
    cases += 1
    try:
        ep(torch.randn(EP_TOKENS, M, dtype=torch.float64), r=3)
        failures.append("r=3 did not raise")
    except ValueError as e:
        if "valid r" not in str(e):
            failures.append(f"r=3 error unclear: {e}")
    out["failures"], out["cases"] = failures, cases


def scenario_ep_on_device(rank: int, world: int, out: dict) -> None:
    """Expert parallelism with the layer on the scenario's device (its report's ``device_type``: rank r on GPU r
    modulo the GPUs, over NCCL or gloo, else the CPU): capacity and dropless, k=1 and 2, sharded experts (E < W)
    and whole ones, sending rows and tokens."""
    device = torch.device("cuda", torch.cuda.current_device()) if out.get("device_type") == "cuda" else \
        torch.device("cpu")
    failures: list[str] = []
    cases = 0
    for E, k, cf in ((2 * world, 2, 1.0), (2 * world, 1, 0.0), (world // 2 or 1, 1, 0.0)):
        ref, ep, layout = make_pair(E, k, cf, world, rank)
        ep = ep.to(device)
        # One rank: the group's layer runs every expert itself (no exchange), the call takes no r.
        for r in ep._ep.valid_r() if ep._ep is not None else [None]:
            tag = f"[{device.type} W={world} E={E} k={k} cf={cf} r={r}]"
            try:
                check_case(tag, ref, ep, layout, rank, world, failures, **({} if r is None else {"r": r}))
            except Exception:
                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            cases += 1
    out["failures"], out["cases"], out["device"] = failures, cases, str(device)


def _rows_each_way(plan, rank: int, world: int) -> tuple[int, int]:
    """The rows this rank puts into one forward's exchanges, counted from its plan and its peers' by dense loops:
    (sending tokens: each token once per rank it has experts on, one [3] row per pair, and the sums of the tokens
    received back; sending rows: each pair, and the results of the pairs received back)."""
    per_rank = len(plan.counts) // world
    row_rank = [e // per_rank for e, n in enumerate(plan.counts) for _ in range(n)]
    tokens = plan.row_token.tolist()
    tokens_to = [len({t for t, d in zip(tokens, row_rank) if d == dest}) for dest in range(world)]
    pairs_to = [row_rank.count(dest) for dest in range(world)]
    every: list = [None] * world
    dist.all_gather_object(every, (tokens_to, pairs_to))
    tokens_in = sum(peer[0][rank] for peer in every)
    pairs_in = sum(peer[1][rank] for peer in every)
    return sum(tokens_to) + sum(pairs_to) + tokens_in, sum(pairs_to) + pairs_in


def scenario_token_exchange(rank: int, world: int, out: dict) -> None:
    """r=1 d=1 sends tokens (each once per rank with one of its experts), fused experts in float32 and the plain
    experts in float64; token_exchange=False and d=4 send rows. Which one ran is told by the rows this rank put
    into the forward's exchanges (CommStats.rows), against :func:`_rows_each_way`."""
    failures: list[str] = []
    cases = 0
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        for E, k, cf, skewed in ((2 * world, 3, 0.0, False), (2 * world, 2, 1.0, False),
                                 (2 * world, 2 * world, 0.0, False), (2 * world, 2, 0.0, True)):
            ref, ep, layout = make_pair(E, k, cf, world, rank, skewed=skewed, dtype=dtype)
            for call, sends_tokens in ((dict(overlap_degree=1), True), (dict(overlap_degree=4), False),
                                       (dict(overlap_degree=1, token_exchange=False), False)):
                tag = f"[{dtype} E={E} k={k} cf={cf} skewed={skewed} {call}]"
                try:
                    stats = ep._ep.stats
                    stats.reset()
                    with torch.no_grad():
                        ep(inputs(world, EP_TOKENS, skewed, skewed)[0][rank].to(dtype), **call)
                    with_tokens, with_rows = _rows_each_way(ep.last_plan, rank, world)
                    expected = with_tokens if sends_tokens else with_rows
                    if stats.rows != expected:
                        failures.append(f"{tag}: {stats.rows} rows into the exchanges, expected {expected} "
                                        f"(tokens {with_tokens}, rows {with_rows})")
                    check_case(tag, ref, ep, layout, rank, world, failures, skewed=skewed, cold=skewed,
                               global_grads=True, tol=tol, **call)
                except Exception:
                    failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                cases += 1
    out["failures"], out["cases"] = failures, cases


def scenario_host_reads(rank: int, world: int, out: dict) -> None:
    """The host reads of one expert-parallel layer call, forward and backward (dropless and capacity, sending
    tokens and rows, flat, 2dh and d=2 chunks), counted per flexmoe module by the operation counter: the
    expert-parallel code (``flexmoe.parallel``) reads the host once per call, the split sizes of the count
    exchange, and its exchanges all take their sizes from that read (the dispatch exchange; the combine
    exchange, the same splits transposed; the token exchange's pairs); the backward reads nothing. Dropless,
    that is the forward's only read: the plan leaves its counts on the device. With a capacity given as a number
    the padded exchange (every rank sends each expert exactly C rows) reads nothing at all. Outputs and gradients
    equal one process."""
    from flexmoe.apps.bench.host_reads import OpCounter

    failures: list[str] = []
    reads: dict[str, dict[str, list[str]]] = {}
    # A capacity given as a number is every rank's: the padded exchange (C rows per expert from each rank).
    for mode, cf, both in (("cf=0.0", 0.0, None), ("cf=1.0", 1.0, None), ("capacity=5", None, {"capacity": 5})):
        ref, ep, layout = make_pair(2 * world, 2, cf, world, rank, both=both)
        padded = cf is None
        for name, call in (("tokens", {}), ("rows", dict(token_exchange=False)),
                           ("rows 2dh", dict(token_exchange=False, a2a="2dh", ranks_per_node=1)),
                           ("rows d=2", dict(overlap_degree=2)), ("r=0", dict(r=0)))[:2 if cf == 1.0 else 4 + padded]:
            tag = f"[{mode} {name}]"
            counter = OpCounter()
            try:
                case = check_case(tag, ref, ep, layout, rank, world, failures, global_grads=False, counter=counter,
                                  **call)
            except Exception:
                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                continue
            forward = case["forward_reads"]
            sites = [f"{r}@{m}" for r, m in zip(counter.host_reads, counter.read_sites)]
            reads[tag] = {"forward": sites[:forward], "backward": sites[forward:]}
            if padded:  # fixed splits: nothing to read, forward or backward; and the capacity did drop pairs
                if sites:
                    failures.append(f"{tag}: the padded exchange read the host: {sites}")
                if ep.expert_stage.last_route != "rows":
                    failures.append(f"{tag}: the call ran the {ep.expert_stage.last_route} route, not rows")
                if all(sum(c) == 2 * EP_TOKENS for c in case["counts"]):
                    failures.append(f"{tag}: no rank dropped a pair at capacity 5: {case['counts']}")
                continue
            route = "tokens" if name == "tokens" else "rows"
            if ep.expert_stage.last_route != route:
                failures.append(f"{tag}: the call ran the {ep.expert_stage.last_route} route, not {route}")
            exchange_reads = [s for s in sites[:forward] if "@flexmoe.parallel." in s]
            if exchange_reads != ["tolist@flexmoe.parallel.alltoall"]:
                failures.append(f"{tag}: the expert-parallel code read the host {len(exchange_reads)} times in the "
                                f"forward, want once (the count exchange's split sizes): {exchange_reads}")
            # In capacity mode the rows route's dispatch and combine (flexmoe.dispatch, the same code as in one
            # process) select the kept pairs by a boolean mask, forward and backward: not an exchange's read.
            backward = [s for s in sites[forward:] if cf == 0.0 or "@flexmoe.dispatch" not in s]
            if backward:
                failures.append(f"{tag}: the backward read the host: {backward}")
            # Dropless, the plan reads nothing (its counts stay on the device): the split sizes are the one read.
            if cf == 0.0 and sites[:forward] != ["tolist@flexmoe.parallel.alltoall"]:
                failures.append(f"{tag}: the forward read the host {forward} times, want once (the split sizes): "
                                f"{sites[:forward]}")
    # Weights applied at dispatch (rows scaled before the experts): rows only, the same reads.
    for mode, cf, both, want in (("cf=0.0", 0.0, {"score_at": "dispatch"}, ["tolist@flexmoe.parallel.alltoall"]),
                                 ("capacity=5", None, {"score_at": "dispatch", "capacity": 5}, [])):
        tag = f"[{mode} score_at=dispatch]"
        counter = OpCounter()
        try:
            ref, ep, layout = make_pair(2 * world, 2, cf, world, rank, both=both)
            forward = check_case(tag, ref, ep, layout, rank, world, failures, counter=counter)["forward_reads"]
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            continue
        sites = [f"{r}@{m}" for r, m in zip(counter.host_reads, counter.read_sites)]
        reads[tag] = {"forward": sites[:forward], "backward": sites[forward:]}
        if sites != want or ep.expert_stage.last_route != "rows":
            failures.append(f"{tag}: reads {sites} (want {want}), route {ep.expert_stage.last_route} (want rows)")
    # The last rank without tokens: it counts on the host (dropless) or joins the padded exchange with C empty rows
    # per expert, and runs the same exchanges as its peers; outputs and global expert gradients equal one process.
    for mode, cf, both in (("cf=0.0", 0.0, None), ("capacity=5", None, {"capacity": 5})):
        for name, call in (("tokens", {}), ("rows", dict(token_exchange=False))):
            tag = f"[{mode} {name}, rank {world - 1} without tokens]"
            try:
                ref, ep, layout = make_pair(2 * world, 2, cf, world, rank, both=both)
                xs, ws = inputs(world, EP_TOKENS)
                xs[-1], ws[-1] = xs[-1][:0], ws[-1][:0]
                want, total, _ = reference(ref, xs, ws, rank)
                x = xs[rank].clone().requires_grad_(True)
                y = ep(x, **call)
                (y * ws[rank]).sum().backward()
                compare(f"{tag} output", y.detach(), want["y"], failures)
                compare(f"{tag} x.grad", x.grad, want["x.grad"], failures)
                for n, g in gathered_grads(ep, layout, world).items():
                    compare(f"{tag} experts.{n}.grad (global)", g, total[n], failures)
            except Exception:
                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            reads[tag] = {}
    # Padded, experts sharded over the ranks (E < W), at every valid r: nothing read either.
    try:
        ref, ep, layout = make_pair(world // 2, 1, None, world, rank, both={"capacity": 8})
    except Exception:
        failures.append(f"[capacity=8 E={world // 2}] raised:\n{traceback.format_exc()}")
        out["failures"], out["cases"], out["reads"] = failures, len(reads), reads
        return
    for r in ep._ep.valid_r():
        tag = f"[capacity=8 E={world // 2} r={r}]"
        counter = OpCounter()
        try:
            check_case(tag, ref, ep, layout, rank, world, failures, counter=counter, r=r)
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            continue
        reads[tag] = {"forward": list(counter.host_reads), "backward": []}
        if counter.host_reads:
            failures.append(f"{tag}: the padded exchange read the host: {counter.host_reads}")
    out["failures"], out["cases"], out["reads"] = failures, len(reads), reads


class _SendTokens:
    """A ``parallel="auto"`` chooser that always picks r=1 d=1 sending tokens."""

    def choose(self, bucket, options, context):
        return next(s for s in options if s.r == 1 and s.overlap_degree == 1 and s.token_exchange)

    def record(self, bucket, setting, seconds) -> None:
        pass


def scenario_evaluation(rank: int, world: int, out: dict) -> None:
    """Evaluation (eval mode, no autograd) where rank 0's tokens overflow an expert's capacity and the other
    ranks' do not. One process serves such calls without a plan unless an expert overflows; a rank deciding that
    alone ran other exchanges than its peers (gloo: "Received data size doesn't match expected size"), so every
    expert-parallel call takes the full path. Each rank's output must equal one process on its own tokens."""
    failures: list[str] = []
    cases = 0
    capacity = 10
    xs, _ = inputs(world, EP_TOKENS)
    xs[0][:, 0] += 4.0  # with the skewed router, rank 0's tokens all choose the two HOT experts: 12 > capacity
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        ref, ep, _ = make_pair(2 * world, 2, 1.0, world, rank, skewed=True, dtype=dtype)
        ref.eval()
        ep.eval()
        with torch.no_grad():
            loads = [int(ref(x, capacity=capacity) is not None and ref.last_plan.load.max()) for x in xs]
        if not (loads[0] > capacity >= max(loads[1:])):
            failures.append(f"the scenario must overflow rank 0 only: max load per rank {loads}, capacity {capacity}")
        for call in (dict(), dict(token_exchange=False), dict(overlap_degree=2)):
            for tokens in (EP_TOKENS, 1):
                tag = f"[{dtype} {call} T={tokens}]"
                x = xs[rank][:tokens]
                try:
                    with torch.no_grad():
                        got = ep(x.to(dtype), capacity=capacity, **call)
                        want = ref(x, capacity=capacity)
                    compare(f"{tag} y", got, want, failures, tol)
                except Exception:
                    failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                cases += 1
    out["failures"], out["cases"] = failures, cases


def scenario_auto(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    ref, ep, layout = make_pair(2 * world, 2, 0.0, world, rank, parallel="auto")
    for step in range(12):
        try:
            check_case(f"[auto step {step}]", ref, ep, layout, rank, world, failures)
        except Exception:
            failures.append(f"auto step {step} raised:\n{traceback.format_exc()}")
    if not ep.auto_decisions:
        failures.append("auto made no decision in 12 steps")
    out["choice"] = str(ep.last_choice)
    out["decisions"] = [d.describe() for d in ep.auto_decisions]
    out["tried"] = sorted({str(s) for d in ep.auto_decisions for s in d.seconds})
    # A chooser that always sends tokens: its forward must exchange the counts once, the chooser's per-expert
    # counts and the tokens sent to each rank in one all-gather, and stay exact.
    ref, ep, layout = make_pair(2 * world, 2, 0.0, world, rank, parallel="auto", chooser=_SendTokens())
    check_case("[auto sending tokens]", ref, ep, layout, rank, world, failures)
    real_all_gather, calls = dist.all_gather, []

    def counted_all_gather(*args, **kwargs):
        calls.append(1)
        return real_all_gather(*args, **kwargs)

    dist.all_gather = counted_all_gather
    try:
        x = torch.randn(EP_TOKENS, M, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        ep(x).sum().backward()
    finally:
        dist.all_gather = real_all_gather
    out["all_gathers_sending_tokens"] = len(calls)
    if str(ep.last_choice) != "r=1 d=1 a2a=flat":
        failures.append(f"the token-sending chooser ran {ep.last_choice}")
    out["failures"] = failures


def scenario_ddp(rank: int, world: int, out: dict) -> None:
    """A 2-rank DDP step equals the single-process step on the same global batch (dropless routing)."""
    failures: list[str] = []

    def build(group):
        torch.manual_seed(7)
        return torch.nn.Sequential(
            torch.nn.Linear(M, M, dtype=torch.float64),
            MoELayer(M, 4, H, k=2, capacity_factor=0.0, group=group, dtype=torch.float64),
            torch.nn.Linear(M, 1, dtype=torch.float64),
        )

    ref = build("single")
    model = build(None)
    layout = ExpertLayout(4, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref[1].experts.named_parameters()}, layout, rank)
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            p.copy_(local[n.rsplit(".", 1)[1]] if ".experts." in n else ref_params[n])
    ddp = wrap_ddp(model)
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(world * EP_TOKENS, M, generator=g, dtype=torch.float64)
    ts = torch.randn(world * EP_TOKENS, 1, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        mine = slice(rank * EP_TOKENS, (rank + 1) * EP_TOKENS)
        loss = torch.nn.functional.mse_loss(ddp(xs[mine]), ts[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_loss = torch.nn.functional.mse_loss(ref(xs), ts)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    want = shard_expert_state({n: p.detach() for n, p in ref[1].experts.named_parameters()}, layout, rank)
    for n, p in model[1].experts.named_parameters():
        compare(f"ddp experts.{n}", p.detach(), want[n], failures, tol=1e-7)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if ".experts." not in n:
            compare(f"ddp {n}", p.detach(), q.detach(), failures, tol=1e-7)
    out["failures"] = failures


def scenario_mismatch(rank: int, world: int, out: dict) -> None:
    t0 = time.perf_counter()
    try:
        MoELayer(M, 2 * world, H + 8 * rank, k=2)
        out["failures"] = ["mismatched hidden_dim did not raise"]
    except ConfigMismatchError as e:
        msg = str(e)
        out["failures"] = [] if "hidden_dim" in msg and "rank 1" in msg else [f"unclear message: {msg}"]
    out["seconds"] = time.perf_counter() - t0


def scenario_dead_rank(rank: int, world: int, out: dict) -> None:
    moe = MoELayer(M, 2 * world, H, k=2)
    if rank == world - 1:
        os._exit(0)  # exits early, without a word
    t0 = time.perf_counter()
    try:
        moe(torch.randn(EP_TOKENS, M)).sum().backward()
        out["failures"] = ["forward with a dead rank did not raise"]
    except CollectiveError as e:
        out["failures"] = [] if "timeout" in str(e) else [f"unclear message: {e}"]
        out["message"] = str(e)[:300]
    out["seconds"] = time.perf_counter() - t0


def scenario_stalled_rank(rank: int, world: int, out: dict) -> None:
    moe = MoELayer(M, 2 * world, H, k=2)
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 1)  # alive but never joins the collective
        out["failures"] = []
        return
    t0 = time.perf_counter()
    try:
        moe(torch.randn(EP_TOKENS, M))
        out["failures"] = ["forward with a stalled rank did not raise"]
    except CollectiveError as e:
        out["failures"] = []
        out["message"] = str(e)[:300]
    out["seconds"] = time.perf_counter() - t0


def scenario_no_leak(rank: int, world: int, out: dict) -> None:
    """After forward+backward steps nothing of an exchange stays alive (an exchange that referenced its own
    autograd node's output formed a cycle through C++ that no collector frees: ~20 MB per step leaked)."""
    import gc

    from flexmoe.parallel.alltoall import PendingExchange

    failures: list[str] = []
    moe = MoELayer(M, 2 * world, H, k=2, dtype=torch.float64)
    x = torch.randn(EP_TOKENS, M, dtype=torch.float64, requires_grad=True)
    for d, a2a, g in ((1, "flat", None), (2, "flat", None), (2, "2dh", 2 if world == 4 else 1)):
        for _ in range(3):
            moe(x, overlap_degree=d, a2a=a2a, ranks_per_node=g).sum().backward()
        gc.collect()
        alive = sum(isinstance(o, PendingExchange) for o in gc.get_objects())
        if alive:
            failures.append(f"d={d} a2a={a2a}: {alive} exchanges still alive after the steps")
    out["failures"] = failures



# --- FasterMoE: shadowing and the pairwise schedule -------------------------------------------------------------

def scenario_fastermoe_equivalence(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    shares = {}
    for E in (8, world):  # 8: the benchmark shape; world: one expert per rank
        modes = {
            "shadow hot": dict(shadow=ShadowExperts(HOT)),
            "shadow top3": dict(shadow=ShadowTopExperts(3)),
            "shadow last": dict(shadow=ShadowExperts([E - 1])),
            "shadow all": dict(shadow=ShadowTopExperts(E)),
            "shadow default": dict(shadow=True),
            "pairwise": dict(schedule="pairwise"),
            "pairwise+shadow": dict(schedule="pairwise", shadow=ShadowExperts(HOT)),
        }
        if world == 4:
            modes["shadow d=2 2dh"] = dict(shadow=ShadowExperts(HOT), overlap_degree=2, a2a="2dh",
                                           ranks_per_node=2)
        for k, cf in ((2, 0.0), (2, 1.0), (1, 0.0)):
            for skewed in (True, False):
                ref, ep, layout = make_pair(E, k, cf, world, rank, skewed)
                for name, call in modes.items():
                    tag = f"[W={world} E={E} k={k} cf={cf} {'skewed' if skewed else 'uniform'} {name}]"
                    try:
                        a2a_before = ep._ep.stats.exchanges
                        info = check_case(tag, ref, ep, layout, rank, world, failures, FASTERMOE_TOKENS, skewed,
                                          global_grads=True, **call)
                        if call.get("schedule") == "pairwise" and ep._ep.stats.exchanges != a2a_before:
                            failures.append(f"{tag}: the all-to-all ran under schedule='pairwise'")
                        forced = call.get("shadow")
                        if isinstance(forced, ShadowExperts) and ep.last_shadowed != sorted(forced.experts):
                            failures.append(f"{tag} last_shadowed={ep.last_shadowed}")
                        if skewed and k == 2 and cf == 0.0 and E == 8:
                            g = [sum(c) for c in zip(*info["counts"])]
                            shares[f"E={E}"] = sum(g[e] for e in HOT) / sum(g)
                            if name == "shadow hot":
                                out.setdefault("load", {})[f"E={E}"] = {
                                    "before": rows_per_rank(info["counts"], layout),
                                    "after": rows_per_rank(info["counts"], layout, info["shadowed"])}
                    except Exception:
                        failures.append(f"{tag} raised:\n{traceback.format_exc()}")
                    cases += 1
    # The last rank's experts get no rows and the input needs no gradient: that rank's backward reaches the
    # exchanges only through the other ranks' expert weights, and must still join them.
    ref, ep, layout = make_pair(8, 2, 0.0, world, rank, True)
    with torch.no_grad():
        for model in (ref, ep):
            model.router.weight[list(layout.experts_of_rank(world - 1)), 0] = -50.0
    for name, call in (("plain", {}), ("shadow hot", dict(shadow=ShadowExperts(HOT))),
                       ("shadow all of rank 0", dict(shadow=ShadowExperts(layout.experts_of_rank(0)))),
                       ("pairwise", dict(schedule="pairwise"))):
        tag = f"[W={world} cold last rank, x without grad, {name}]"
        try:
            info = check_case(tag, ref, ep, layout, rank, world, failures, FASTERMOE_TOKENS, True, cold=True,
                              x_grad=False, global_grads=True, **call)
            if any(c[e] for c in info["counts"] for e in layout.experts_of_rank(world - 1)):
                failures.append(f"{tag}: the last rank's experts got rows")
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
        cases += 1
    # Constructor-level options (not per call).
    ref, ep, layout = make_pair(2 * world, 2, 0.0, world, rank, True, shadow=ShadowExperts([0]),
                                schedule="pairwise")
    check_case("[constructor shadow+pairwise]", ref, ep, layout, rank, world, failures, FASTERMOE_TOKENS, True,
               global_grads=True)
    if ep.last_shadowed != [0]:
        failures.append(f"constructor shadow: last_shadowed={ep.last_shadowed}")
    cases += 1
    out["failures"], out["cases"], out["hot_share"] = failures, cases, shares


def expect_error(tag: str, failures: list[str], fn, words: tuple[str, ...]) -> None:
    try:
        fn()
        failures.append(f"{tag}: did not raise")
    except ValueError as e:
        if not all(w in str(e) for w in words):
            failures.append(f"{tag}: unclear message: {e}")


class Custom(nn.Module):
    """A custom expert module (one linear per local expert)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(M, M, dtype=torch.float64) for _ in range(n))

    def forward(self, x, counts):
        return torch.cat([lin(p) for lin, p in zip(self.lin, x.split(counts))])


def scenario_fastermoe_errors(rank: int, world: int, out: dict) -> None:
    """Unsupported combinations fail at construction (on every rank) or at the call, with clear messages."""
    failures: list[str] = []
    E = 2 * world
    expect_error("sharded + shadow", failures, lambda: MoELayer(M, world // 2, H, k=1, shadow=True),
                 ("shadow", "whole experts"))
    expect_error("custom + shadow", failures, lambda: MoELayer(M, E, H, experts=Custom(2), shadow=True),
                 ("shadow", "FeedForwardExperts"))
    expect_error("sharded + pairwise", failures, lambda: MoELayer(M, world // 2, H, k=1, schedule="pairwise"),
                 ("pairwise", "whole experts"))
    expect_error("d=2 + pairwise", failures, lambda: MoELayer(M, E, H, overlap_degree=2, schedule="pairwise"),
                 ("pairwise", "overlap_degree"))
    expect_error("bad schedule", failures, lambda: MoELayer(M, E, H, schedule="ring"), ("schedule",))
    moe = MoELayer(M, E, H, k=2)
    x = torch.randn(FASTERMOE_TOKENS, M)
    expect_error("auto + pairwise", failures, lambda: moe(x, parallel="auto", schedule="pairwise"),
                 ("pairwise", "parallel='static'"))
    # A custom expert module works with the pairwise schedule (it only needs the expert protocol).
    moe = MoELayer(M, E, H, k=2, experts=Custom(2), dtype=torch.float64, schedule="pairwise")
    moe(torch.randn(FASTERMOE_TOKENS, M, dtype=torch.float64)).sum().backward()
    if any(p.grad is None for p in moe.experts.parameters()):
        failures.append("custom experts + pairwise: a parameter got no gradient")
    out["failures"] = failures



# --- routing options across ranks ---------------------------------------------------------------------------

def scenario_topology(rank: int, world: int, out: dict) -> None:
    """4 ranks as 2 nodes x 2, 8 experts (experts 0-3 on node 0, 4-7 on node 1), k=2: the cross-node bound."""
    from flexmoe.routing.plan import top_k
    from test_topology_gate import reference_limit

    failures: list[str] = []
    num_tokens, k, num_experts, node = 40, 2, 8, rank // 2
    expert_node = torch.tensor([e // 4 for e in range(num_experts)])
    for share in (0.0, 0.25, 0.6):  # binding, binding, loose (about half the pairs want the other node)
        torch.manual_seed(0)  # the same router on every rank, as in data-parallel training
        moe = MoELayer(M, num_experts, H, k=k, capacity_factor=0.0, cross_node_share=share, ranks_per_node=2,
                       dtype=torch.float64, router_dtype=torch.float64)
        g = torch.Generator().manual_seed(10 + rank)
        x = torch.randn(num_tokens, M, generator=g, dtype=torch.float64, requires_grad=True)
        y = moe(x)
        y.square().sum().backward()
        plan = moe.last_plan
        budget = int(share * num_tokens * k)
        remote = int((expert_node[plan.expert_index] != node).sum())
        # What plain top-k would have sent across, and the gate's choice by the plain loop of the gate test.
        probs = torch.softmax(x.detach() @ moe.router.weight.detach().t(), dim=-1)
        wanted = top_k(probs, k)[1]
        wanted_remote = int((expert_node[wanted] != node).sum())
        want = reference_limit(probs, wanted, expert_node, node, budget)
        tag = f"[share={share}]"
        if remote > budget:
            failures.append(f"{tag} {remote} pairs cross nodes, budget {budget}")
        if remote != min(budget, wanted_remote):
            failures.append(f"{tag} {remote} remote pairs, expected min(budget {budget}, wanted {wanted_remote})")
        if share < 0.5 and wanted_remote <= budget:
            failures.append(f"{tag} the input does not exceed the budget ({wanted_remote} <= {budget}): no test")
        if wanted_remote <= budget and not torch.equal(plan.expert_index, wanted):
            failures.append(f"{tag} within the budget the gate changed the top-k choice")
        if not torch.equal(plan.expert_index, want):
            failures.append(f"{tag} expert choices differ from the plain loop")
        if not (torch.isfinite(x.grad).all() and moe.router.weight.grad is not None):
            failures.append(f"{tag} gradients missing or not finite")
        out.setdefault("remote", {})[str(share)] = [remote, budget, wanted_remote]
    out["failures"] = failures


def scenario_routing_ep(rank: int, world: int, out: dict) -> None:
    """balance="bias" uses the global load; expert choice, BASE and shared experts equal one process per batch."""
    failures: list[str] = []
    num_tokens, num_experts = 12, 4

    # Bias: every rank ends with the same bias, the update of the summed load.
    torch.manual_seed(3)
    moe = MoELayer(M, num_experts, H, k=2, capacity_factor=0.0, balance="bias", bias_update_rate=0.01).train()
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(num_tokens, M, generator=g)
    x[:, 0] += 3.0 * rank  # the ranks see differently skewed tokens
    moe(x)
    moe.update_expert_bias()  # once per optimizer step; the all-reduce of the load happens here
    loads = [torch.zeros(num_experts, dtype=torch.long) for _ in range(world)]
    dist.all_gather(loads, moe.last_plan.load.clone())
    total = torch.stack(loads).sum(0).double()
    want = 0.01 * torch.sign(total.mean() - total)
    if not torch.allclose(moe.expert_bias.double(), want, atol=1e-7):
        failures.append(f"bias {moe.expert_bias.tolist()} != update of the global load {want.tolist()}")
    biases = [torch.zeros(num_experts) for _ in range(world)]
    dist.all_gather(biases, moe.expert_bias.float())
    if any(not torch.equal(b, biases[0]) for b in biases):
        failures.append("ranks hold different biases")
    local_only = 0.01 * torch.sign(moe.last_plan.load.double().mean() - moe.last_plan.load.double())
    out["bias_differs_from_local_rule"] = not torch.allclose(want, local_only)

    # Each rank's output and gradients equal one process holding every expert running this rank's tokens.
    for cf, kw in ((1.0, {"router": "expert_choice"}), (None, {"router": "base"}), (0.5, {"shared_experts": 2})):
        tag = str({**kw, **({} if cf is None else {"capacity_factor": cf})})
        try:
            ref, ep, _ = make_pair(num_experts, 2, cf, world, rank, both=kw)
            x = torch.randn(num_tokens, M, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)
            xr, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            yr, ye = ref(xr), ep(xe)
            yr.square().sum().backward()
            ye.square().sum().backward()
            pairs = [("output", ye, yr), ("x.grad", xe.grad, xr.grad),
                     ("router.grad", ep.router.weight.grad, ref.router.weight.grad)]
            if ref.shared is not None:
                # Shared experts are replicated: each rank's gradient is that of its own tokens (DDP averages).
                pairs += [(f"shared.{n}.grad", p.grad, q.grad)
                          for (n, p), q in zip(ep.shared.named_parameters(), ref.shared.parameters())]
            for what, got, want_t in pairs:
                if not torch.allclose(got, want_t, rtol=1e-9, atol=1e-10):
                    failures.append(f"{tag} {what} differs by {(got - want_t).abs().max().item():.3g}")
        except Exception:
            failures.append(f"{tag} raised:\n{traceback.format_exc()}")
    out["failures"] = failures


# --- the open MoE families' routing options (issue 12) -------------------------------------------------------

FAMILY_B, FAMILY_S = 2, 6  # sequences and tokens per sequence on each rank (input [B, S, M])
FAMILY_TOL = 1e-9

FAMILY_CASES = {
    "sigmoid": dict(E="many", k=2, score_func="sigmoid"),
    "sigmoid groups + bias balance + scale": dict(E="many", k=3, score_func="sigmoid", num_expert_groups=4,
                                                  num_limited_groups=2, route_scale=2.5, balance="bias",
                                                  bias_update_rate=0.01, shared_experts=1, shared_hidden_dim=6),
    "softmax bias balance": dict(E="many", k=2, balance="bias", bias_update_rate=0.02),
    "shared gate + hidden": dict(E="many", k=2, shared_experts=2, shared_hidden_dim=5, shared_gate=True, glu=True),
    "per-sequence capacity": dict(E="many", k=2, capacity_factor=0.75, capacity_per="sequence",
                                  aux_loss_type="sequence", router_bias=True),
    "glu_limit, sharded experts": dict(E="few", k=1, glu=True, glu_limit=0.4, score_func="sigmoid",
                                       capacity_factor=0.0),
}


def _family_build(world: int, opts: dict) -> tuple[MoELayer, MoELayer, ExpertLayout]:
    opts = dict(opts)
    E = 8 if opts.pop("E") == "many" else max(world // 2, 1)  # "few": E < W, hidden-dim shards
    opts.setdefault("capacity_factor", 0.0)
    torch.manual_seed(1234)
    ref = MoELayer(M, E, H, group="single", dtype=torch.float64, router_dtype=torch.float64,
                   **{**opts, "bias_update_rate": 0.0})
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.7)
        if ref.expert_bias is not None:
            ref.expert_bias.copy_(torch.linspace(-0.1, 0.1, E, dtype=torch.float64))
    ep = MoELayer(M, E, H, dtype=torch.float64, router_dtype=torch.float64, **opts)
    layout = ExpertLayout(E, world, H)
    local = shard_expert_state({n: p.detach() for n, p in ref.experts.named_parameters()}, layout,
                               dist.get_rank())
    ref_state = ref.state_dict()
    with torch.no_grad():
        for n, p in ep.named_parameters():
            p.copy_(local[n.split(".", 1)[1]] if n.startswith("experts.") else ref_state[n])
        if ep.expert_bias is not None:
            ep.expert_bias.copy_(ref.expert_bias)
    return ref, ep, layout


def _family_inputs(world: int, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    xs, ws = [], []
    for j in range(world):
        g = torch.Generator().manual_seed(100 * step + j)
        xs.append(torch.randn(FAMILY_B, FAMILY_S, M, generator=g, dtype=torch.float64))
        ws.append(torch.randn(FAMILY_B, FAMILY_S, M, generator=g, dtype=torch.float64))
    return xs, ws


def _family_compare(tag: str, got: torch.Tensor | None, want: torch.Tensor | None, failures: list[str]) -> None:
    if want is None:  # a parameter without gradient in the reference must have none here either
        if got is not None:
            failures.append(f"{tag}: a gradient where the reference has none")
        return
    compare(tag, got, want, failures, FAMILY_TOL)


def _family_step(tag: str, ref: MoELayer, ep: MoELayer, layout: ExpertLayout, rank: int, world: int, step: int,
                failures: list[str]) -> None:
    xs, ws = _family_inputs(world, step)
    total: dict[str, torch.Tensor] = {}
    total_load = torch.zeros(ref.num_experts, dtype=torch.float64)
    mine: dict = {}
    for j in range(world):  # one process, each rank's tokens as their own batch
        ref.zero_grad(set_to_none=True)
        x = xs[j].clone().requires_grad_(True)
        y = ref(x)
        ((y * ws[j]).sum() + 0.3 * ref.aux_loss).backward()
        total_load += ref.last_plan.load.double()
        for n, g in grads_by_state_names(ref.experts).items():
            total[n] = total.get(n, 0) + g
        if j == rank:
            mine = {"y": y.detach(), "x": x.grad, "aux": ref.aux_loss.detach(),
                    "grads": {n: p.grad.clone() for n, p in ref.named_parameters() if not n.startswith("experts.")}}
    bias_before = None if ep.expert_bias is None else ep.expert_bias.clone()
    ep.zero_grad(set_to_none=True)
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x)
    ((y * ws[rank]).sum() + 0.3 * ep.aux_loss).backward()
    ep.update_expert_bias()  # once per optimizer step: the load of this step, summed over the ranks
    _family_compare(f"{tag} output", y.detach(), mine["y"], failures)
    _family_compare(f"{tag} aux_loss", ep.aux_loss.detach(), mine["aux"], failures)
    _family_compare(f"{tag} x.grad", x.grad, mine["x"], failures)
    for n, p in ep.named_parameters():
        if not n.startswith("experts."):
            _family_compare(f"{tag} {n}.grad", p.grad, mine["grads"][n], failures)
    local = shard_expert_state(total, layout, rank)
    for n, p in ep.experts.named_parameters():
        _family_compare(f"{tag} experts.{n}.grad", p.grad, local[n], failures)
    if bias_before is not None:
        # The rule written out: b += rate * sign(mean load - load), the load summed over every rank's batch.
        want = bias_before + ep.bias_update_rate * torch.sign(total_load.mean() - total_load)
        if not torch.equal(ep.expert_bias, want):
            failures.append(f"{tag} expert_bias: {ep.expert_bias.tolist()} != {want.tolist()}")
        if torch.equal(want, bias_before):
            failures.append(f"{tag} expert_bias did not move: the case does not test the update")
        with torch.no_grad():
            ref.expert_bias.copy_(want)  # the next step's reference starts from the updated bias


def scenario_families(rank: int, world: int, out: dict) -> None:
    failures: list[str] = []
    cases = 0
    for name, opts in FAMILY_CASES.items():
        try:
            ref, ep, layout = _family_build(world, opts)
            for step in range(2):
                _family_step(f"[W={world} {name} step {step}]", ref, ep, layout, rank, world, step, failures)
                cases += 1
        except Exception:
            failures.append(f"[{name}] raised:\n{traceback.format_exc()}")
    out["failures"], out["cases"] = failures, cases


def scenario_joined_gate_up(rank: int, world: int, out: dict) -> None:
    """Gated experts with ``joined_gate_up`` (one gate_up parameter) over expert parallelism, float32, forced
    onto the grouped_mm kernel: every rank's experts hold their gate_up, take the reference's shard (by the state
    dict's halves), and outputs, input, router and global expert gradients (gate_up's by its halves) equal one
    process, dropless and with a capacity, sending tokens and rows, shadowing an expert and on the pairwise
    schedule."""
    failures: list[str] = []
    cases = 0
    glu = {"glu": True, "activation": "silu"}
    # The last case has fewer experts than ranks: each rank holds a hidden shard of gate_up's halves.
    for E, k, cf in ((2 * world, 2, 0.0), (2 * world, 2, 1.0), (world, 1, 0.0), (1, 1, 0.0)):
        ref, ep, layout = make_pair(E, k, cf, world, rank, both={**glu, "joined_gate_up": True}, dtype=torch.float32,
                                    expert_kernel="grouped_mm")
        experts = ep.experts
        if not ref.experts.joined_gate_up or "gate_up" not in dict(ref.experts.named_parameters()):
            failures.append(f"[E={E}] the one-process reference does not hold gate_up")
        if [n for n, _ in experts.named_parameters()] != ["gate_up", "w2", "gate_up_bias", "b2"]:
            failures.append(f"[E={E}] the local experts do not hold gate_up")
        calls: list[dict] = [dict(), dict(token_exchange=False)]
        if layout.shards_per_expert == 1:  # FasterMoE's shadowing (broadcast halves) and the pairwise schedule
            calls += [dict(shadow=ShadowExperts([0])), dict(schedule="pairwise")]
        for call in calls:
            tag = f"[E={E} k={k} cf={cf} {call}]"
            try:
                check_case(tag, ref, ep, layout, rank, world, failures, global_grads=True, tol=2e-4, **call)
            except Exception:
                failures.append(f"{tag} raised:\n{traceback.format_exc()}")
            cases += 1
    out["failures"], out["cases"] = failures, cases


SCENARIOS = {
    "ep_equivalence": scenario_ep_equivalence,
    "ep_on_device": scenario_ep_on_device,
    "token_exchange": scenario_token_exchange,
    "host_reads": scenario_host_reads,
    "evaluation": scenario_evaluation,
    "auto": scenario_auto,
    "ddp": scenario_ddp,
    "mismatch": scenario_mismatch,
    "dead_rank": scenario_dead_rank,
    "stalled_rank": scenario_stalled_rank,
    "no_leak": scenario_no_leak,
    "fastermoe_equivalence": scenario_fastermoe_equivalence,
    "fastermoe_errors": scenario_fastermoe_errors,
    "topology": scenario_topology,
    "routing_ep": scenario_routing_ep,
    "families": scenario_families,
    "joined_gate_up": scenario_joined_gate_up,
}

# The scenarios of parallelize (FSDP2 with expert parallelism) live in their own file; one registry serves both.
from fsdp_worker import SCENARIOS as _FSDP_SCENARIOS  # noqa: E402

SCENARIOS.update(_FSDP_SCENARIOS)
