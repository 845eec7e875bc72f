"""A plain reference MoE layer, written for the tests, that shares no code with flexmoe.

Everything is float64 and written as Python loops over tokens and their choices, so that each step of the
routing contract (docs/architecture.md) can be read off directly:

1. softmax of the router logits, one token at a time;
2. top-k, ties broken towards the lower expert index;
3. slots handed out in priority order: every token's 1st choice before any 2nd choice; within one choice by
   token order, or by descending top-1 probability (token order among equals) when batch-prioritized;
4. the capacity C of the routing contract; a (token, choice) whose slot >= C is dropped;
5. combine: ``y[t] = sum over kept choices of w * expert(x[t])`` (``score_at="combine"``) or
   ``expert(w * x[t])`` (``score_at="dispatch"``); dropped weights are not renormalized away.

The reference is differentiable through torch autograd (on its own loops), so the tests compare gradients
as well as values. Later (distributed) tests can import it too: ``from reference import ...`` works because
pytest puts ``tests/`` on ``sys.path``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "RefResult",
    "ref_activation",
    "ref_linear_logits",
    "ref_cosine_logits",
    "ref_softmax",
    "ref_top_k",
    "ref_capacity",
    "ref_ffn_expert",
    "ref_balance_loss",
    "ref_z_loss",
    "reference_moe",
    "layer_params_f64",
    "reference_for_layer",
    "random_expert_params",
    "assert_expert_grads",
]

ExpertFn = Callable[[int, Tensor], Tensor]  # (expert e, one token x_t [M]) -> [M]


@dataclass
class RefResult:
    """What the reference computes for T tokens, E experts, k choices.

    y: ``[T, M]`` float64 output. probs: ``[T, E]`` softmax probabilities. logits: ``[T, E]``.
    expert_index, slot: ``T`` lists of ``k`` ints (slot ``-1`` where dropped). weight: ``[T, k]`` combine weights.
    load: pairs routed to each expert before drops; tokens_per_expert: kept pairs per expert (``E`` ints).
    capacity: C used; num_dropped: dropped (token, choice) pairs. aux_loss, z_loss: 0-dim tensors.
    """

    y: Tensor
    logits: Tensor
    probs: Tensor
    expert_index: list[list[int]]
    slot: list[list[int]]
    weight: Tensor
    load: list[int]
    tokens_per_expert: list[int]
    capacity: int
    num_dropped: int
    aux_loss: Tensor
    z_loss: Tensor


def ref_activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation functions written from their formulas (no torch.nn.functional)."""
    if name == "gelu":  # exact GELU
        return lambda h: 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if name == "relu":
        return lambda h: torch.where(h > 0, h, torch.zeros_like(h))
    if name == "silu":
        return lambda h: h / (1.0 + torch.exp(-h))
    raise ValueError(f"unknown activation {name!r}")


def ref_linear_logits(x: Tensor, weight: Tensor) -> Tensor:
    """logits[t, e] = <x[t], weight[e]>. x: ``[T, M]``, weight: ``[E, M]`` -> ``[T, E]``."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(torch.stack([torch.dot(x[t], weight[e]) for e in range(weight.shape[0])]))
    return torch.stack(rows) if rows else x.new_zeros(0, weight.shape[0])


def ref_cosine_logits(x: Tensor, weight: Tensor, log_temperature: Tensor, min_temperature: float) -> Tensor:
    """SwinV2-MoE: cos(x[t], weight[e]) / max(exp(log_temperature), min_temperature). -> ``[T, E]``."""
    tau = torch.clamp(torch.exp(log_temperature), min=min_temperature)
    rows = []
    for t in range(x.shape[0]):
        row = []
        for e in range(weight.shape[0]):
            norms = torch.sqrt(torch.dot(x[t], x[t])) * torch.sqrt(torch.dot(weight[e], weight[e]))
            cos = torch.dot(x[t], weight[e]) / norms
            row.append(cos / tau)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def ref_softmax(logits_row: Tensor) -> Tensor:
    """softmax of one token's logits ``[E]``, shifted by the max for stability."""
    z = torch.exp(logits_row - logits_row.max().detach())
    return z / z.sum()


def ref_top_k(probs_row: list[float], k: int) -> list[int]:
    """The k experts with the largest probability, largest first; equal values: lower index first."""
    order = sorted(range(len(probs_row)), key=lambda e: (-probs_row[e], e))
    return order[:k]


def ref_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, capacity: int | None,
                 load: list[int]) -> int:
    """The routing contract's capacity C: explicit C; cf > 0: ceil(k cf T / E); cf == 0: dropless;
    cf < 0: min(max load, ...)."""
    if capacity is not None:
        return capacity
    max_load = max(load) if load else 0
    if capacity_factor > 0:
        return math.ceil(k * capacity_factor * num_tokens / num_experts)
    if capacity_factor == 0:
        return max_load  # every pair fits
    return min(max_load, math.ceil(k * (-capacity_factor) * num_tokens / num_experts))


def ref_ffn_expert(params: dict[str, Tensor], activation: str = "gelu", glu: bool = False) -> ExpertFn:
    """Expert e on one token: act(x w1[e] + b1[e]) [* (x w3[e] + b3[e])] w2[e] + b2[e]. params hold float64."""
    act = ref_activation(activation)

    def expert(e: int, x_t: Tensor) -> Tensor:
        h = x_t @ params["w1"][e]
        if params.get("b1") is not None:
            h = h + params["b1"][e]
        h = act(h)
        if glu:
            g = x_t @ params["w3"][e]
            if params.get("b3") is not None:
                g = g + params["b3"][e]
            h = h * g
        out = h @ params["w2"][e]
        if params.get("b2") is not None:
            out = out + params["b2"][e]
        return out

    return expert


def ref_balance_loss(probs: Tensor, first_choice: list[int]) -> Tensor:
    """E * sum_e f_e * P_e; f_e: share of tokens whose 1st choice is e; P_e: mean probability of e."""
    num_tokens, num_experts = probs.shape
    total = probs.new_zeros(())
    for e in range(num_experts):
        f_e = sum(1 for t in range(num_tokens) if first_choice[t] == e) / num_tokens
        p_e = sum(probs[t, e] for t in range(num_tokens)) / num_tokens
        total = total + f_e * p_e
    return num_experts * total


def ref_z_loss(logits: Tensor) -> Tensor:
    """mean over tokens of logsumexp(logits[t])^2."""
    num_tokens = logits.shape[0]
    total = logits.new_zeros(())
    for t in range(num_tokens):
        m = logits[t].max().detach()
        lse = m + torch.log(torch.exp(logits[t] - m).sum())
        total = total + lse * lse
    return total / num_tokens


def reference_moe(
    x: Tensor,
    logits: Tensor,
    expert: ExpertFn,
    *,
    k: int,
    capacity_factor: float = 1.25,
    capacity: int | None = None,
    normalize_weights: bool = True,
    batch_prioritized: bool = False,
    score_at: str = "combine",
) -> RefResult:
    """The MoE layer on tokens ``x: [T, M]`` given router logits ``[T, E]`` and an expert function."""
    num_tokens, num_experts = logits.shape
    probs = torch.stack([ref_softmax(logits[t]) for t in range(num_tokens)]) if num_tokens else logits.clone()

    # 2. top-k, chosen on the values (selection is not differentiable), weights keep the graph.
    expert_index: list[list[int]] = []
    weights: list[list[Tensor]] = []
    for t in range(num_tokens):
        chosen = ref_top_k([float(v) for v in probs[t].detach()], k)
        expert_index.append(chosen)
        w = [probs[t, e] for e in chosen]
        if normalize_weights and k > 1:
            s = sum(w)
            w = [wi / s for wi in w]
        weights.append(w)

    # 3. priority order and slots.
    if batch_prioritized:
        top1 = [float(probs[t, expert_index[t][0]].detach()) for t in range(num_tokens)]
        token_order = sorted(range(num_tokens), key=lambda t: (-top1[t], t))
    else:
        token_order = list(range(num_tokens))
    next_slot = [0] * num_experts
    slot = [[-1] * k for _ in range(num_tokens)]
    for c in range(k):
        for t in token_order:
            e = expert_index[t][c]
            slot[t][c] = next_slot[e]
            next_slot[e] += 1
    load = list(next_slot)

    # 4. capacity and drops.
    cap = ref_capacity(num_tokens, num_experts, k, capacity_factor, capacity, load)
    tokens_per_expert = [0] * num_experts
    num_dropped = 0
    for t in range(num_tokens):
        for c in range(k):
            if slot[t][c] >= cap:
                slot[t][c] = -1
                num_dropped += 1
            else:
                tokens_per_expert[expert_index[t][c]] += 1

    # 5. combine.
    out_rows = []
    for t in range(num_tokens):
        y_t = x.new_zeros(x.shape[1])
        for c in range(k):
            if slot[t][c] < 0:
                continue
            e, w = expert_index[t][c], weights[t][c]
            if score_at == "combine":
                y_t = y_t + w * expert(e, x[t])
            else:
                y_t = y_t + expert(e, w * x[t])
        out_rows.append(y_t)
    y = torch.stack(out_rows) if out_rows else x.new_zeros(0, x.shape[1])

    weight_tensor = (torch.stack([torch.stack(w) for w in weights]) if num_tokens
                     else logits.new_zeros(0, k))
    return RefResult(
        y=y,
        logits=logits,
        probs=probs,
        expert_index=expert_index,
        slot=slot,
        weight=weight_tensor,
        load=load,
        tokens_per_expert=tokens_per_expert,
        capacity=cap,
        num_dropped=num_dropped,
        aux_loss=ref_balance_loss(probs, [row[0] for row in expert_index]) if num_tokens else probs.sum() * 0,
        z_loss=ref_z_loss(logits) if num_tokens else logits.sum() * 0,
    )


def layer_params_f64(module: torch.nn.Module) -> dict[str, Tensor]:
    """Float64 CPU leaf copies (requires_grad) of a module's parameters, keyed by their dotted names: the reference
    runs on the CPU whatever device the module is on."""
    return {name: p.detach().to("cpu", torch.float64).clone().requires_grad_(True)
            for name, p in module.named_parameters()}


def reference_for_layer(
    moe: torch.nn.Module,
    x: Tensor,
    *,
    activation: str = "gelu",
    glu: bool = False,
    router: str = "topk",
    expert: Callable[[dict[str, Tensor]], ExpertFn] | None = None,
    **routing: Any,
) -> tuple[RefResult, Tensor, dict[str, Tensor]]:
    """Run the reference with float64 copies of a flexmoe layer's weights (read, never its computation).

    x: ``[..., M]`` of any dtype, on any device (the reference runs on the CPU). Returns ``(result, x64 [T, M]
    leaf, params)`` where params are the float64 CPU leaves keyed as in ``moe.named_parameters()`` (e.g.
    ``"router.weight"``, ``"experts.w1"``), so a test can backpropagate through ``result.y`` and compare each
    ``.grad``. The router and expert settings are the test's own (passed in), not read from the layer.
    ``expert`` builds a custom expert function from params; ``routing``: the keyword options of
    :func:`reference_moe` (``k`` and the routing contract's settings).
    """
    params = layer_params_f64(moe)
    x64 = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float64).clone().requires_grad_(True)
    if router == "topk":
        logits = ref_linear_logits(x64, params["router.weight"])
    elif router == "cosine":
        logits = ref_cosine_logits(x64, params["router.weight"], params["router.log_temperature"],
                                   moe.router.min_temperature)
    else:
        raise ValueError(f"unknown router {router!r}")
    if expert is None:
        expert_params = {n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("experts.")}
        for joined, (first, second) in (("gate_up", ("w1", "w3")), ("gate_up_bias", ("b1", "b3"))):
            if joined in expert_params:  # joined experts hold the gated pair as one parameter: w1 | w3
                expert_params[first], expert_params[second] = expert_params.pop(joined).chunk(2, dim=-1)
        expert_fn = ref_ffn_expert(expert_params, activation, glu)
    else:
        expert_fn = expert(params)
    result = reference_moe(x64, logits, expert_fn, **routing)
    return result, x64, params


def randn64(generator: torch.Generator, *shape: int, scale: float = 0.7) -> Tensor:
    """``[*shape]`` float64 normal values times ``scale``, drawn from ``generator``."""
    return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale


def random_expert_params(generator: torch.Generator, num_experts: int, model_dim: int, hidden: int, *,
                         glu: bool, bias: bool, scale: float = 0.7) -> dict[str, Tensor | None]:
    """Random float64 expert weights ``w1, w3 [E, M, H]``, ``w2 [E, H, M]`` and biases (None where absent)."""
    def r(*shape: int) -> Tensor:
        return randn64(generator, *shape, scale=scale)

    return {"w1": r(num_experts, model_dim, hidden), "b1": r(num_experts, hidden) if bias else None,
            "w2": r(num_experts, hidden, model_dim), "b2": r(num_experts, model_dim) if bias else None,
            "w3": r(num_experts, model_dim, hidden) if glu else None,
            "b3": r(num_experts, hidden) if glu and bias else None}


def assert_expert_grads(got: dict[str, Tensor | None], ref: dict[str, Tensor | None], *, idle_expert: int,
                        **tol: float) -> None:
    """Every expert weight's gradient in ``got`` (any float dtype) equals the float64 reference's in ``ref`` (the
    same weights present), and expert ``idle_expert``, which had no rows, has exact zeros."""
    for name, ref_t in ref.items():
        got_t = got[name]
        if ref_t is None or got_t is None:
            assert ref_t is None and got_t is None, name
            continue
        assert got_t.grad is not None and ref_t.grad is not None, name
        assert torch.equal(got_t.grad[idle_expert], torch.zeros_like(got_t.grad[idle_expert])), name
        torch.testing.assert_close(got_t.grad.to("cpu", torch.float64), ref_t.grad, **tol, msg=name)


def ref_layout_rows(unit_rows: list[int], capacity: int, num_experts: int) -> tuple[int, dict[int, int]]:
    """The rows of a custom op's layout, written out: ``(N, {real row: its expert})``. Units ``u = e * B + b``; a
    padded layout gives each unit ``capacity`` rows, its real ones first; capacity 0 (packed) puts them back to
    back with no padding."""
    units_per_expert = len(unit_rows) // num_experts
    real: dict[int, int] = {}
    start = 0
    for u, n in enumerate(unit_rows):
        for i in range(n):
            real[start + i] = u // units_per_expert
        start += capacity if capacity else n
    return start, real


def ref_layout_split(unit_rows: list[int], capacity: int, num_experts: int,
                     ) -> tuple[int, dict[int, int], list[int], list[int]]:
    """:func:`ref_layout_rows` with its rows split: ``(N, {real row: its expert}, real rows, padding rows)``,
    both lists ascending."""
    num_rows, expert_of = ref_layout_rows(unit_rows, capacity, num_experts)
    real = sorted(expert_of)
    return num_rows, expert_of, real, sorted(set(range(num_rows)) - set(real))
