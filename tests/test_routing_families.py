"""The open MoE families' routing options (issue 12) against a float64 loop reference written here.

The reference below shares no code with flexmoe: Python loops over tokens, choices and experts, every formula
spelled out (sigmoid, group ratings, clamps, capacities per sequence, the three balance losses). It is
differentiable through autograd on its own loops, so the tests compare the output, the balance loss and every
gradient (input, router weight and bias, every expert and shared-expert parameter, the shared gate).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from flexmoe import MoELayer
from flexmoe.routing.scores import _TOPK_MIN_SCORES, top_k, top_k_by_unique_keys
from reference import ref_top_k

M, H = 6, 5


def _silu(h: Tensor) -> Tensor:
    return h / (1.0 + torch.exp(-h))


def _gpt_oss_act(h: Tensor) -> Tensor:
    return h / (1.0 + torch.exp(-1.702 * h))


def _sigmoid(v: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-v))


def _min(v: Tensor, hi: float) -> Tensor:
    return torch.where(v > hi, torch.full_like(v, hi), v)


def _max(v: Tensor, lo: float) -> Tensor:
    return torch.where(v < lo, torch.full_like(v, lo), v)


def ref_ffn(x: Tensor, p: dict, e: int, act, glu: bool, limit: float | None) -> Tensor:
    """One token ``[M]`` through expert e of parameters p (w1 [E,M,H], ...), as loops of dot products."""
    hidden = p["w1"].shape[2]
    h = []
    for j in range(hidden):
        g = sum(x[i] * p["w1"][e, i, j] for i in range(x.shape[0])) + (p["b1"][e, j] if "b1" in p else 0.0)
        if glu:
            u = sum(x[i] * p["w3"][e, i, j] for i in range(x.shape[0])) + (p["b3"][e, j] if "b3" in p else 0.0)
            if limit is None:
                h.append(act(g) * u)
            else:
                h.append(act(_min(g, limit)) * (_max(_min(u, limit), -limit) + 1.0))
        else:
            h.append(act(g))
    out = []
    for i in range(x.shape[0]):
        out.append(sum(h[j] * p["w2"][e, j, i] for j in range(hidden)) + (p["b2"][e, i] if "b2" in p else 0.0))
    return torch.stack(out)


def reference(x: Tensor, p: dict, opt: dict) -> tuple[Tensor, Tensor, list[list[int]], list[int]]:
    """x: ``[B, S, M]`` float64. Returns (y [B, S, M], aux_loss, expert choices per token, kept rows per expert)."""
    B, S, M = x.shape
    E = p["router_w"].shape[0]
    k = opt["k"]
    tokens = x.reshape(B * S, M)
    T = B * S
    scores, choices, weights = [], [], []
    for t in range(T):
        logits = [sum(tokens[t, i] * p["router_w"][e, i] for i in range(M))
                  + (p["router_b"][e] if "router_b" in p else 0.0) for e in range(E)]
        if opt["score_func"] == "sigmoid":
            s = [_sigmoid(v) for v in logits]
        else:
            top = max(float(v.detach()) for v in logits)  # a constant shift: softmax and its gradient ignore it
            z = [torch.exp(v - top) for v in logits]
            s = [v / sum(z) for v in z]
        # The choice only ranks experts (no gradient flows through it): plain floats.
        choice = [float(s[e].detach()) + (float(p["sel_bias"][e].detach()) if "sel_bias" in p else 0.0)
                  for e in range(E)]
        eligible = list(range(E))
        if opt.get("groups"):
            G, keep = opt["groups"]
            size = E // G
            rating = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(G)]
            best = sorted(range(G), key=lambda g: (-rating[g], g))[:keep]
            eligible = [e for e in range(E) if e // size in best]
        chosen = sorted(eligible, key=lambda e: (-choice[e], e))[:k]
        w = [s[e] for e in chosen]
        if opt["normalize"] and k > 1:
            total = sum(w)
            w = [v / total for v in w]
        w = [v * opt["route_scale"] for v in w]
        scores.append(torch.stack(s))
        choices.append(chosen)
        weights.append(w)

    # Slots: every token's 1st choice before any 2nd, token order within one choice; the counter of an expert
    # runs over the whole call, or over each sequence with capacity_per="sequence".
    per_seq = opt["capacity_per"] == "sequence"
    unit_tokens = S if per_seq else T
    filled: dict[tuple[int, int], int] = {}
    slot = [[0] * k for _ in range(T)]
    for j in range(k):
        for t in range(T):
            key = (choices[t][j], t // S if per_seq else 0)
            slot[t][j] = filled.get(key, 0)
            filled[key] = slot[t][j] + 1
    if opt.get("capacity") is not None:
        cap = opt["capacity"]
    elif opt["cf"] > 0:
        cap = math.ceil(k * opt["cf"] * unit_tokens / E)
    else:
        cap = max(filled.values())

    act = opt["act_ref"]
    y = []
    kept = [0] * E
    for t in range(T):
        out = torch.zeros(M, dtype=torch.float64)
        for j in range(k):
            if slot[t][j] < cap:
                e = choices[t][j]
                kept[e] += 1
                out = out + weights[t][j] * ref_ffn(tokens[t], p["experts"], e, act, opt["glu"], opt["limit"])
        if "shared" in p:
            shared = sum(ref_ffn(tokens[t], p["shared"], n, act, opt["glu"], opt["limit"])
                         for n in range(p["shared"]["w1"].shape[0]))
            if "shared_gate" in p:
                shared = shared * _sigmoid(sum(tokens[t, i] * p["shared_gate"][0, i] for i in range(M)))
            out = out + shared
        y.append(out)

    # Balance losses on probabilities: sigmoid scores divided by their sum per token.
    probs = [sc / sc.sum() if opt["score_func"] == "sigmoid" else sc for sc in scores]
    kind = opt["aux"]
    if kind == "sequence":
        losses = []
        for b in range(B):
            total = 0.0
            for e in range(E):
                f = E / (k * S) * sum(1 for t in range(b * S, (b + 1) * S) for c in choices[t] if c == e)
                P = sum(probs[t][e] for t in range(b * S, (b + 1) * S)) / S
                total = total + f * P
            losses.append(total)
        aux = sum(losses) / B
    else:
        aux = 0.0
        for e in range(E):
            if kind == "switch":
                f = sum(1 for t in range(T) if choices[t][0] == e) / T
            else:  # all_choices
                f = sum(1 for t in range(T) for c in choices[t] if c == e) / T
            aux = aux + f * sum(probs[t][e] for t in range(T)) / T
        aux = E * aux
    return torch.stack(y).view(B, S, M), aux, choices, kept


BASE = dict(k=2, score_func="softmax", groups=None, route_scale=1.0, normalize=True, capacity_per="call", cf=0.0,
            capacity=None, aux="switch", glu=False, limit=None, router_bias=False, shared=0, shared_hidden=None,
            shared_gate=False, selection_bias=False, activation="silu")

CASES = {
    "sigmoid": dict(score_func="sigmoid"),
    "sigmoid unnormalised k=3": dict(score_func="sigmoid", k=3, normalize=False),
    "sigmoid groups, bias, scale (DeepSeek-V3)": dict(score_func="sigmoid", k=3, groups=(4, 2), route_scale=2.5,
                                                       selection_bias=True, shared=1, shared_hidden=7, glu=True),
    "softmax groups": dict(groups=(4, 3), k=2),
    "route scale softmax": dict(route_scale=0.7),
    # 3/8 is exact in bf16 (0.3 is not); test_gpu_sync checks that no routed pre-activation lies within bf16
    # rounding of it (at 0.3, one did, and its gradient term came or went with torch's clamp at the bound).
    "router bias + glu_limit (GPT-OSS)": dict(router_bias=True, glu=True, limit=0.375, activation="gpt_oss"),
    "shared hidden + gate (Qwen2-MoE)": dict(shared=2, shared_hidden=3, shared_gate=True, glu=True,
                                             normalize=False),
    "capacity per sequence": dict(capacity_per="sequence", cf=0.75),
    "capacity per sequence, explicit, k=1 (Switch)": dict(capacity_per="sequence", capacity=2, k=1,
                                                           router_bias=True),
    "aux all_choices": dict(aux="all_choices", k=3),
    "aux sequence sigmoid": dict(aux="sequence", score_func="sigmoid", k=2),
    "aux sequence softmax + per-sequence capacity": dict(aux="sequence", capacity_per="sequence", cf=1.0),
    "aux switch sigmoid": dict(aux="switch", score_func="sigmoid"),
}


def _build(opt: dict, E: int = 8, model_dim: int = M, hidden: int = H, **options: object) -> MoELayer:
    """The layer of case ``opt`` in float64 (``options``: other MoELayer keywords, or these replaced)."""
    torch.manual_seed(3)
    activation = _gpt_oss_act if opt["activation"] == "gpt_oss" else opt["activation"]
    layer = MoELayer(
        model_dim, E, hidden, k=opt["k"], capacity_factor=opt["cf"], capacity=opt["capacity"],
        normalize_weights=opt["normalize"],
        score_func=opt["score_func"], num_expert_groups=opt["groups"][0] if opt["groups"] else None,
        num_limited_groups=opt["groups"][1] if opt["groups"] else None, route_scale=opt["route_scale"],
        router_bias=opt["router_bias"], capacity_per=opt["capacity_per"], aux_loss_type=opt["aux"],
        shared_experts=opt["shared"], shared_hidden_dim=opt["shared_hidden"], shared_gate=opt["shared_gate"],
        glu=opt["glu"], glu_limit=opt["limit"], activation=activation,
        balance="bias" if opt["selection_bias"] else "aux", bias_update_rate=0.0,
        **{"dtype": torch.float64, "router_dtype": torch.float64, "group": "single", **options},
    )
    with torch.no_grad():
        for prm in layer.parameters():  # larger than the default init, so that the clamps and groups matter
            prm.normal_(0.0, 0.8)
        if opt["selection_bias"]:
            layer.expert_bias.copy_(torch.randn(E, dtype=torch.float64) * 0.3)
    return layer


def _params(layer: MoELayer) -> dict:
    """The layer's parameters as leaf float64 CPU tensors of the reference (their gradients are compared)."""
    def leaf(t: Tensor) -> Tensor:
        return t.detach().to("cpu").clone().requires_grad_(True)

    p = {"router_w": leaf(layer.router.weight), "experts": {}}
    if layer.router.bias is not None:
        p["router_b"] = leaf(layer.router.bias)
    for n, prm in layer.experts.named_parameters():
        p["experts"][n] = leaf(prm)
    if layer.shared is not None:
        p["shared"] = {n: leaf(prm) for n, prm in layer.shared.named_parameters()}
    if layer.shared_gate is not None:
        p["shared_gate"] = leaf(layer.shared_gate.weight)
    if layer.expert_bias is not None:
        p["sel_bias"] = layer.expert_bias.detach().to("cpu").clone()
    return p


def _pairs(layer: MoELayer, p: dict) -> dict[str, tuple[Tensor | None, Tensor]]:
    pairs = {"router.weight": (layer.router.weight.grad, p["router_w"].grad)}
    if "router_b" in p:
        pairs["router.bias"] = (layer.router.bias.grad, p["router_b"].grad)
    for n, prm in layer.experts.named_parameters():
        pairs[f"experts.{n}"] = (prm.grad, p["experts"][n].grad)
    if layer.shared is not None:
        for n, prm in layer.shared.named_parameters():
            pairs[f"shared.{n}"] = (prm.grad, p["shared"][n].grad)
    if layer.shared_gate is not None:
        pairs["shared_gate.weight"] = (layer.shared_gate.weight.grad, p["shared_gate"].grad)
    return pairs


@pytest.mark.parametrize("name", list(CASES))
def test_family_option_matches_loop_reference(name: str, device: torch.device) -> None:
    """The layer in float64 on ``device``; the loop reference on the CPU."""
    opt = {**BASE, **CASES[name]}
    opt["act_ref"] = _gpt_oss_act if opt["activation"] == "gpt_oss" else _silu
    layer = _build(opt).to(device)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, M, generator=g, dtype=torch.float64)
    proj = torch.randn(2, 6, M, generator=g, dtype=torch.float64)
    loss_weight = 0.37

    xl = x.to(device, copy=True).requires_grad_(True)
    y = layer(xl)
    ((y * proj.to(device)).sum() + loss_weight * layer.aux_loss).backward()

    p = _params(layer)
    xr = x.clone().requires_grad_(True)
    y_ref, aux_ref, choices, kept = reference(xr, p, opt)
    ((y_ref * proj).sum() + loss_weight * aux_ref).backward()

    assert layer.last_plan.expert_index.tolist() == choices
    assert layer.last_plan.counts == kept
    torch.testing.assert_close(y.cpu(), y_ref)
    torch.testing.assert_close(layer.aux_loss.cpu(), aux_ref)
    torch.testing.assert_close(xl.grad.cpu(), xr.grad)
    for what, (ours, ref) in _pairs(layer, p).items():
        assert ours is not None and ref is not None, what
        torch.testing.assert_close(ours.cpu(), ref, msg=lambda m, what=what: f"{what}: {m}")
    if opt["limit"] is not None:  # both clamps of the GPT-OSS unit were active somewhere
        with torch.no_grad():
            pre_gate = x.view(-1, M) @ p["experts"]["w1"][0] + p["experts"]["b1"][0]
            pre_up = x.view(-1, M) @ p["experts"]["w3"][0] + p["experts"]["b3"][0]
        assert (pre_gate > opt["limit"]).any() and (pre_up.abs() > opt["limit"]).any()
    if opt["capacity_per"] == "sequence" or opt["cf"] > 0:
        assert layer.last_plan.num_dropped > 0, "the case should drop pairs to test the capacity"


def test_groups_change_the_choice_and_exclude_other_groups() -> None:
    """Tokens only get experts of their best groups; without the limit some tokens would pick others."""
    opt = {**BASE, **CASES["sigmoid groups, bias, scale (DeepSeek-V3)"]}
    layer = _build(opt)
    x = torch.randn(3, 8, M, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        layer(x)
        grouped = layer.last_plan.expert_index
        free = MoELayer(M, 8, H, k=3, score_func="sigmoid", balance="bias", capacity_factor=0.0, glu=True,
                        shared_experts=1, shared_hidden_dim=7, dtype=torch.float64, router_dtype=torch.float64,
                        group="single")
        free.load_state_dict(layer.state_dict())
        free(x)
    assert all(len({e // 2 for e in row}) <= 2 for row in grouped.tolist())  # 4 groups of 2, 2 eligible
    assert not torch.equal(free.last_plan.expert_index, grouped)


def test_sigmoid_bias_balance_updates_from_the_load_and_rate_zero_keeps_it() -> None:
    x = torch.randn(2, 8, M, generator=torch.Generator().manual_seed(4))
    for rate in (0.0, 0.01):
        torch.manual_seed(0)
        layer = MoELayer(M, 8, H, k=2, score_func="sigmoid", balance="bias", bias_update_rate=rate,
                         num_expert_groups=4, num_limited_groups=2, group="single")
        start = torch.linspace(-0.2, 0.2, 8)
        layer.expert_bias.copy_(start)
        layer(x)
        layer.update_expert_bias()  # once per optimizer step
        load = torch.bincount(layer.last_plan.expert_index.reshape(-1), minlength=8).float()
        expected = start + rate * torch.sign(load.mean() - load)
        assert torch.equal(layer.expert_bias, expected)
        layer.eval()
        layer(x)  # evaluation counts no load: the next update leaves the bias where it is
        layer.update_expert_bias()
        assert torch.equal(layer.expert_bias, expected)


def test_sigmoid_ties_go_to_the_lower_expert_and_group_index() -> None:
    """Equal scores: the lower expert index wins, and between equally rated groups the lower group."""
    layer = MoELayer(4, 8, 4, k=2, score_func="sigmoid", num_expert_groups=4, num_limited_groups=1,
                     capacity_factor=0.0, group="single")
    with torch.no_grad():
        layer.router.weight.zero_()  # every score 0.5: all experts and groups tie
        layer(torch.randn(3, 4))
    assert layer.last_plan.expert_index.tolist() == [[0, 1]] * 3


def test_per_sequence_capacity_needs_sequences_and_differs_from_per_call() -> None:
    layer = MoELayer(M, 4, H, k=1, capacity=2, capacity_per="sequence", group="single")
    with pytest.raises(ValueError, match=r"capacity_per='sequence' needs x of shape \[batch, seq, model_dim"):
        layer(torch.randn(10, M))
    aux = MoELayer(M, 4, H, k=1, aux_loss_type="sequence", group="single")
    with pytest.raises(ValueError, match="aux_loss_type='sequence' needs x"):
        aux(torch.randn(2, 3, 4, M))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(score_func="relu"), ValueError, "score_func must be 'softmax' or 'sigmoid'"),
    (dict(num_expert_groups=4), ValueError, "num_expert_groups and num_limited_groups go together"),
    (dict(num_expert_groups=3, num_limited_groups=1), ValueError, "num_expert_groups must divide num_experts"),
    (dict(num_expert_groups=4, num_limited_groups=5), ValueError, "num_limited_groups must be <="),
    (dict(num_expert_groups=4.0, num_limited_groups=1), TypeError, "num_expert_groups must be an int"),
    (dict(route_scale=0.0), ValueError, "route_scale must be finite and > 0"),
    (dict(route_scale="2"), TypeError, "route_scale must be a number"),
    (dict(router_bias=1), TypeError, "router_bias must be a bool"),
    (dict(router_bias=True, router="cosine"), ValueError, "router_bias needs the linear gate"),
    (dict(capacity_per="batch"), ValueError, "capacity_per must be 'call' or 'sequence'"),
    (dict(aux_loss_type="mixtral"), ValueError, "aux_loss_type must be one of"),
    (dict(router="expert_choice", score_func="sigmoid"), ValueError, "score_func needs a top-k router"),
    (dict(router="base", capacity_per="sequence"), ValueError, "capacity_per needs a top-k router"),
    (dict(shared_hidden_dim=0, shared_experts=1), ValueError, "shared_hidden_dim must be >= 1"),
    (dict(shared_gate=True), ValueError, "shared_gate .* needs shared_experts >= 1"),
    (dict(glu_limit=1.0), ValueError, "glu_limit .* needs glu=True"),
    (dict(glu_limit=-1.0, glu=True), ValueError, "glu_limit must be finite and > 0"),
    (dict(num_expert_groups=4, num_limited_groups=2, cross_node_share=0.5), ValueError,
     "cross_node_share cannot be combined with num_expert_groups"),
])
def test_bad_family_options_are_rejected(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        MoELayer(M, 8, H, k=2, group="single", **kwargs)


def test_bench_families_times_both_routings_against_their_floors() -> None:
    from flexmoe.apps.bench.config import BenchConfig
    from flexmoe.apps.bench.families import bench_families, format_families

    report = bench_families(BenchConfig(tokens=64, model_dim=16, hidden_dim=8, steps=1, warmup=0,
                                        capacity_factor=0.0))
    assert [r["routing"] for r in report["rows"]] == ["topk", "deepseek"]
    assert all(r["rows_computed"] == 64 * 8 and r["dropped_fraction"] == 0 and r["x_floor"] > 0
               for r in report["rows"])  # dropless: every (token, choice) pair computed
    assert "E=64 k=8" in report["config"] and "deepseek x floor / topk x floor" in format_families(report)


def test_plan_from_choices_lays_out_the_given_choices_with_zero_losses() -> None:
    """A plan from choices made elsewhere: every active pair one row, by expert then (choice, token) order; the
    caller owns the losses, so both are zero (not the z-loss of the placeholder logits)."""
    from flexmoe.routing.plan import plan_from_choices

    expert_index = torch.tensor([[2, 0], [0, 3], [2, 1]])
    weight = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    active = torch.tensor([[True, True], [True, False], [True, True]])
    plan = plan_from_choices(expert_index, weight, 4, active=active)
    # The reference order: experts ascending; within one, 1st choices (in token order) before 2nd choices.
    want = [(e, j, t) for e in range(4) for j in range(2) for t in range(3)
            if active[t, j] and int(expert_index[t, j]) == e]
    assert plan.row_token.tolist() == [t for _, _, t in want]
    assert plan.row_choice.tolist() == [j for _, j, _ in want]
    assert plan.counts == [2, 1, 2, 0]
    assert torch.equal(plan.row_weight, torch.stack([weight[t, j] for _, j, t in want]))
    assert float(plan.z_loss) == 0.0 and float(plan.aux_loss) == 0.0
    assert plan.num_skipped == 1 and plan.num_dropped == 0
    with pytest.raises(ValueError, match="expert_index must lie in"):
        plan_from_choices(torch.tensor([[4, 0]]), torch.ones(1, 2), 4)


@pytest.mark.parametrize("case", ["distinct", "many ties", "tie at the boundary"])
def test_top_k_of_many_scores_breaks_ties_towards_the_lower_expert(case: str, device: torch.device) -> None:
    """From 2^15 scores top_k asks torch.topk first; its answer must stay the reference's, ties included."""
    T, E, k = 512, 64, 8
    assert T * E >= _TOPK_MIN_SCORES  # the torch.topk path is the one under test
    g = torch.Generator().manual_seed(7)
    probs = torch.rand(T, E, generator=g, dtype=torch.float64)
    if case == "many ties":
        probs = (probs * 8).round() / 8  # 9 distinct values over 64 experts: ties everywhere
    elif case == "tie at the boundary":
        order = probs[3].argsort(descending=True)
        probs[3, order[k]] = probs[3, order[k - 1]]  # the k-th and (k+1)-th best of token 3 are equal
    values, indices = (t.cpu() for t in top_k(probs.to(device), k))
    for t in range(T):
        want = ref_top_k(probs[t].tolist(), k)
        assert indices[t].tolist() == want, f"token {t}"
        assert values[t].tolist() == [probs[t, e].item() for e in want]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["distinct", "many ties", "signed with zeros of both signs"])
def test_top_k_by_unique_keys_is_the_reference_top_k(case: str, dtype: torch.dtype, device: torch.device) -> None:
    """The compiled graph's top-k (no sort, no host sync) against the plain reference: ties to the lower expert."""
    T, E, k = 256, 64, 8
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(T, E, generator=g)
    if case == "many ties":
        scores = (scores * 8).round() / 8
    elif case == "signed with zeros of both signs":  # DeepSeek's bias-corrected scores can be negative
        scores = ((scores - 0.5) * 8).round() / 4
        scores[:, ::5] = 0.0
        scores[:, 1::5] = -0.0
        scores[0, :] = -3.0  # a whole row tied, negative
        scores[1, :] = -1.0
        scores[1, [5, 10, 20]] = torch.tensor([-0.0, -0.0, 0.0])  # the best three: zeros of both signs, tied
    scores = scores.to(dtype)
    values, indices = (t.cpu() for t in top_k_by_unique_keys(scores.to(device), k))
    assert values.dtype == dtype
    for t in range(T):
        want = ref_top_k(scores[t].float().tolist(), k)
        assert indices[t].tolist() == want, f"token {t}"
        assert values[t].tolist() == [scores[t, e].item() for e in want]


def _topk_ties_to_the_higher_index(input: Tensor, k: int, dim: int = -1, largest: bool = True,
                                   sorted: bool = True) -> torch.return_types.topk:
    """A legal ``torch.topk`` (it promises no order among equal values) that breaks ties towards the HIGHER index:
    a stable descending sort of the row reversed, so equal values come out last index first. input: ``[T, E]``."""
    assert dim in (-1, input.dim() - 1) and largest and sorted
    num = input.shape[-1]
    values, flipped = torch.sort(input.flip(-1), dim=-1, descending=True, stable=True)
    return torch.return_types.topk((values[..., :k], num - 1 - flipped[..., :k]))


def test_top_k_of_many_scores_does_not_lean_on_torch_topks_tie_order(monkeypatch, device: torch.device) -> None:
    """torch.topk may break a tie at the k-th place either way; with one that picks the higher index, top_k must
    still give the reference's lower index (it asks torch.topk for k + 1 values to see that tie)."""
    T, E, k = 512, 64, 8
    assert T * E >= _TOPK_MIN_SCORES  # the torch.topk path is the one under test
    probs = torch.rand(T, E, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    for t in (0, 3, T - 1):  # the k-th and (k+1)-th best of these tokens are equal, nothing else ties
        order = probs[t].argsort(descending=True)
        probs[t, order[k]] = probs[t, order[k - 1]]
    # The wrapper really answers differently from the reference at the boundary (else the test shows nothing).
    _, higher = _topk_ties_to_the_higher_index(probs, k)
    assert higher[3].tolist() != ref_top_k(probs[3].tolist(), k)
    monkeypatch.setattr(torch, "topk", _topk_ties_to_the_higher_index)
    values, indices = (t.cpu() for t in top_k(probs.to(device), k))
    for t in range(T):
        want = ref_top_k(probs[t].tolist(), k)
        assert indices[t].tolist() == want, f"token {t}"
        assert values[t].tolist() == [probs[t, e].item() for e in want]
