"""flexmoe.compat.tutel against independent references.

* a dense float64 loop written here (Tutel's routing as its source reads: softmax, top-k, slots handed out
  choice by choice in token order, capacity ``k * int(cf * ceil(T / E))`` or the largest load, drops, gates
  normalized over the k choices, experts one token at a time) and a plain :class:`flexmoe.MoELayer` given the
  same weights;
* ``l_aux`` by hand (the GShard formula, and the importance + load loss);
* the seeded initial weights drawn here from ``torch.manual_seed`` in the order Tutel draws them;
* checkpoints through the converters both ways (one file and per-rank files);
* 2 real gloo ranks against one process (tests/tutel_worker.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe import MoELayer
from flexmoe.compat.tutel import convert, moe, net, system
from flexmoe.compat.tutel.gates import CosineTopKGate
from multiproc import failures_of, run_ranks

M, H, E = 8, 12, 4
WORKER = Path(__file__).with_name("tutel_worker.py")


def make_layer(k: int = 2, cf: float = 1.0, *, gate: str = "top", seeds=(1, 2, 3), double: bool = True,
               **kwargs) -> moe.moe_layer:
    layer = moe.moe_layer(
        gate_type={"type": gate, "k": k, "capacity_factor": cf},
        model_dim=M,
        experts={"type": "ffn", "num_experts_per_device": E, "hidden_size_per_expert": H,
                 "activation_fn": lambda x: F.relu(x)},
        seeds=seeds, **kwargs)
    return layer.double() if double else layer


def make_input(tokens: int = 20, seed: int = 7) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, M, generator=g, dtype=torch.float64)


def dense_reference(x: Tensor, wg: Tensor, fc1_w: Tensor, fc1_b: Tensor, fc2_w: Tensor, fc2_b: Tensor, *, k: int,
                    cf: float, batch_prioritized: bool = False, normalize: bool = True, postscore: bool = True,
                    expert_fn=None, logits: Tensor | None = None) -> tuple[Tensor, Tensor, int]:
    """(output [T, M], GShard l_aux, capacity): Tutel's routing and experts as plain loops. The gate's logits
    are ``x @ wg.T`` unless given."""
    logits = x @ wg.T if logits is None else logits
    T, E_ = logits.shape
    probs = torch.softmax(logits, dim=1)
    p = probs.detach()
    choices = [sorted(range(E_), key=lambda e: (-float(p[t, e]), e))[:k] for t in range(T)]
    order = list(range(T))
    if batch_prioritized:
        order.sort(key=lambda t: -float(p[t].max()))
    load, slot = [0] * E_, {}
    for c in range(k):
        for t in order:
            e = choices[t][c]
            slot[t, c] = load[e]
            load[e] += 1
    per_expert = math.ceil(T / E_)
    if cf > 0:
        capacity = k * int(cf * per_expert)
    elif cf == 0:
        capacity = max(load)
    else:
        capacity = min(max(load), k * int(-cf * per_expert))

    def ffn(e: int, v: Tensor) -> Tensor:
        if expert_fn is not None:
            return expert_fn(e, v)
        return torch.relu(v @ fc1_w[e].T + fc1_b[e]) @ fc2_w[e] + fc2_b[e]

    rows = []
    for t in range(T):
        w = torch.stack([probs[t, e] for e in choices[t]])
        if normalize and k > 1:
            w = w / w.sum()
        out = torch.zeros(x.shape[1], dtype=x.dtype)
        for c, e in enumerate(choices[t]):
            if slot[t, c] < capacity:
                out = out + (w[c] * ffn(e, x[t]) if postscore else ffn(e, w[c] * x[t]))
        rows.append(out)
    top1 = torch.tensor([choices[t][0] for t in range(T)])
    fraction = torch.stack([(top1 == e).double().mean() for e in range(E_)])
    l_aux = E_ * sum(probs[:, e].mean() * fraction[e] for e in range(E_))
    return torch.stack(rows), l_aux, capacity


def weights_of(layer) -> list[Tensor]:
    ex = layer.experts
    return [layer.gates[0].wg.weight, ex.batched_fc1_w, ex.batched_fc1_bias, ex.batched_fc2_w, ex.batched_fc2_bias]


def close(got: Tensor, want: Tensor, tol: float = 1e-10) -> bool:
    return got.shape == want.shape and float((got.detach() - want.detach()).abs().max()) <= tol


CONFIGS = [
    dict(k=1, cf=1.0),
    dict(k=2, cf=0.5),  # drops
    dict(k=2, cf=0.0),  # dropless
    dict(k=2, cf=-0.25),  # capped dropless
    dict(k=2, cf=0.5, batch_prioritized_routing=True),
    dict(k=2, cf=1.0, is_postscore=False),
    dict(k=3, cf=1.0, normalize_gate=False),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_equals_dense_reference_and_moelayer(config):
    config = dict(config)
    k, cf = config.pop("k"), config.pop("cf")
    layer = make_layer(k, cf, **config)
    x = make_input()
    y = layer(x)
    want, want_aux, capacity = dense_reference(
        x, *weights_of(layer), k=k, cf=cf, batch_prioritized=config.get("batch_prioritized_routing", False),
        normalize=config.get("normalize_gate", True), postscore=config.get("is_postscore", True))
    assert close(y, want), float((y - want).abs().max())
    assert close(y.l_aux, want_aux) and close(layer.l_aux, want_aux)
    if cf > 0:
        assert capacity < k * 20  # these configs really bound the slots

    plain = MoELayer(M, E, H, k=k, capacity=capacity, activation="relu", dtype=torch.float64,
                     router_dtype=torch.float64, normalize_weights=config.get("normalize_gate", True),
                     batch_prioritized=config.get("batch_prioritized_routing", False),
                     score_at="combine" if config.get("is_postscore", True) else "dispatch")
    plain.load_state_dict(convert.tutel_to_flexmoe(layer.state_dict()))
    assert close(plain(x), y)
    assert plain.last_plan.capacity == capacity


def test_gradients_equal_dense_reference():
    layer = make_layer(2, 0.5)
    x = make_input().requires_grad_(True)
    y = layer(x)
    ((y * torch.linspace(-1, 1, M, dtype=torch.float64)).sum() + 0.3 * y.l_aux).backward()
    copies = [w.detach().clone().requires_grad_(True) for w in weights_of(layer)]
    x_ref = x.detach().clone().requires_grad_(True)
    want, want_aux, _ = dense_reference(x_ref, *copies, k=2, cf=0.5)
    ((want * torch.linspace(-1, 1, M, dtype=torch.float64)).sum() + 0.3 * want_aux).backward()
    assert close(x.grad, x_ref.grad)
    for got, ref in zip(weights_of(layer), copies):
        assert close(got.grad, ref.grad), float((got.grad - ref.grad).abs().max())


def test_cosine_gate_equals_formula_and_converts():
    layer = make_layer(2, 1.0, gate="cosine_top")
    gate = layer.gates[0]
    x = make_input()
    projected = x @ gate.cosine_projector.weight.T + gate.cosine_projector.bias
    cosine = torch.stack([torch.stack([F.cosine_similarity(projected[t], gate.sim_matrix[:, e], dim=0)
                                       for e in range(E)]) for t in range(x.shape[0])])
    scale = min(float(gate.temperature.detach()), math.log(100.0))
    assert close(gate(x), cosine * math.exp(scale), 1e-12)
    assert gate.sim_matrix.shape == (256, E) and gate.temperature.shape == (1,)

    plain = MoELayer(M, E, H, k=2, capacity=10, activation="relu", dtype=torch.float64, router_dtype=torch.float64,
                     router=CosineTopKGate(M, E).double())
    plain.load_state_dict(convert.tutel_to_flexmoe(layer.state_dict()))
    assert close(plain(x), layer(x))


def test_swinv2_moe_configuration():
    """SwinV2-MoE's MLP: cosine_top gate in fp32 with proj_dim/init_t and gate noise, count_per_node, GELU,
    batch-prioritized routing, no gate normalization, the importance + load loss."""
    layer = moe.moe_layer(
        gate_type={"type": "cosine_top", "k": 2, "capacity_factor": 1.25, "gate_noise": 1.0, "fp32_gate": True,
                   "proj_dim": 16, "init_t": 0.5},
        model_dim=M, experts={"type": "ffn", "count_per_node": E, "hidden_size_per_expert": H,
                              "activation_fn": lambda x: F.gelu(x)},
        scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True), seeds=(1, 1, 1),
        batch_prioritized_routing=True, normalize_gate=False, is_gshard_loss=False).double()
    layer.experts.batched_fc2_bias.requires_grad = False
    x = make_input(24).view(2, 12, M)
    y = layer(x)  # training: noisy logits
    (y.square().mean() + 0.01 * y.l_aux).backward()
    for name, p in layer.gates.named_parameters():
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    assert all(hasattr(p, "skip_allreduce") for p in layer.experts.parameters())

    layer.eval()
    flat = x.reshape(-1, M)
    ex = layer.experts
    want, _, _ = dense_reference(
        flat, None, None, None, None, None, k=2, cf=1.25, batch_prioritized=True, normalize=False,
        logits=layer.gates[0](flat).detach(),
        expert_fn=lambda e, v: F.gelu(v @ ex.batched_fc1_w[e].T + ex.batched_fc1_bias[e]) @ ex.batched_fc2_w[e]
        + ex.batched_fc2_bias[e])
    assert close(layer(x).reshape(-1, M), want)


def test_load_importance_loss_by_hand():
    layer = make_layer(2, 1.0, is_gshard_loss=False)
    layer.gates[0].gate_noise = 1.0
    layer.eval()  # no noise drawn: the loss is a function of the logits alone
    x = make_input()
    y = layer(x)
    logits = (x @ layer.gates[0].wg.weight.T).detach()
    probs = torch.softmax(logits, dim=1)
    kth = torch.sort(logits, dim=1, descending=True).values[:, 1]
    sigma = 1.0 / E

    def cv2(v: list[float]) -> float:
        mean = sum(v) / len(v)
        var = sum((a - mean) ** 2 for a in v) / (len(v) - 1)
        return var / (mean ** 2 + 1e-10)

    importance = [float(probs[:, e].sum()) for e in range(E)]
    load = [sum(0.5 * (1 + math.erf(float(probs[t, e] - kth[t]) / (sigma * math.sqrt(2))))
                for t in range(x.shape[0])) for e in range(E)]
    assert abs(float(y.l_aux.detach()) - (cv2(importance) + cv2(load)) / 2) < 1e-5


def test_seeds_reproduce_tutels_draws():
    """seeds=(a, b, c): manual_seed(b), then per expert nn.Linear(M, H) and nn.Linear(H, M) (weight, bias);
    manual_seed(a + i) before gate i; manual_seed(c) at the end. nn.Linear draws U(+-1/sqrt(fan_in))."""
    a, b, c = 5, 6, 7
    layer = moe.moe_layer(
        gate_type=[{"type": "top", "k": 2}, {"type": "cosine_top", "k": 1, "proj_dim": 16}],
        model_dim=M, experts={"type": "ffn", "num_experts_per_device": 3, "hidden_size_per_expert": H},
        seeds=(a, b, c))
    after = torch.rand(3)

    def uniform(*shape: int, fan_in: int) -> Tensor:
        return torch.empty(*shape).uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    torch.manual_seed(b)
    for e in range(3):
        w1, b1, w2, b2 = uniform(H, M, fan_in=M), uniform(H, fan_in=M), uniform(M, H, fan_in=H), uniform(M, fan_in=H)
        ex = layer.experts
        assert torch.allclose(ex.batched_fc1_w[e], w1, atol=1e-7, rtol=0)
        assert torch.allclose(ex.batched_fc1_bias[e], b1, atol=1e-7, rtol=0)
        assert torch.allclose(ex.batched_fc2_w[e], w2.T, atol=1e-7, rtol=0)
        assert torch.allclose(ex.batched_fc2_bias[e], b2, atol=1e-7, rtol=0)
    torch.manual_seed(a)
    assert torch.allclose(layer.gates[0].wg.weight, uniform(3, M, fan_in=M), atol=1e-7, rtol=0)
    torch.manual_seed(a + 1)
    proj_w, proj_b = uniform(16, M, fan_in=M), uniform(16, fan_in=M)
    torch.randn(16, 3)  # drawn, then replaced by N(0, 0.01^2)
    sim = torch.empty(16, 3).normal_(0, 0.01)
    cosine = layer.gates[1]
    assert torch.allclose(cosine.cosine_projector.weight, proj_w, atol=1e-7, rtol=0)
    assert torch.allclose(cosine.cosine_projector.bias, proj_b, atol=1e-7, rtol=0)
    assert torch.equal(cosine.sim_matrix.detach(), sim)
    assert torch.allclose(cosine.temperature, torch.tensor([math.log(2.0)]))
    torch.manual_seed(c)
    assert torch.equal(after, torch.rand(3))
    assert [n for n, _ in layer.named_parameters()] == [
        "experts.batched_fc1_w", "experts.batched_fc2_w", "experts.batched_fc1_bias", "experts.batched_fc2_bias",
        "gates.0.wg.weight", "gates.1.temperature", "gates.1.sim_matrix", "gates.1.cosine_projector.weight",
        "gates.1.cosine_projector.bias"]
    assert all(getattr(p, "_tutel_expert", False) for _, p in layer.get_parameter_iterator("local_experts"))
    assert [n for n, _ in layer.get_parameter_iterator("gate")][0] == "0.wg.weight"


def test_checkpoints_convert_both_ways(tmp_path):
    torch.manual_seed(0)
    plain = MoELayer(M, E, H, k=2, capacity=6, activation="relu", dtype=torch.float64, router_dtype=torch.float64)
    x = make_input()
    want = plain(x)

    # flexmoe -> one Tutel file -> the Tutel layer: same outputs.
    layer = make_layer(2, 0.6, seeds=None)  # capacity 2 * int(0.6 * ceil(20 / 4)) = 6
    layer.load_state_dict(convert.flexmoe_to_tutel(plain.state_dict())[0])
    assert close(layer(x), want)

    # -> per-rank Tutel files (2 ranks of 2 experts, and 8 ranks sharing 4 experts) -> flexmoe: identical.
    for world in (2, 8):
        pattern = str(tmp_path / f"w{world}" / "ckpt-{rank}-of-{size}.pt")
        paths = convert.save_tutel_files(convert.flexmoe_to_tutel(plain.state_dict(), world), pattern)
        assert len(paths) == world and Path(paths[1]).name == f"ckpt-1-of-{world}.pt"
        back = convert.tutel_to_flexmoe(convert.load_tutel_files(pattern, world))
        assert back.keys() == plain.state_dict().keys()
        assert all(torch.equal(back[n], t) for n, t in plain.state_dict().items())

    # Tutel's sharded layout: rank r holds hidden slice r % 2 of expert r // 2, and slice r % 2 of its fc2 bias.
    ranks = convert.flexmoe_to_tutel(plain.state_dict(), 8)
    w1, b2 = plain.experts.w1.detach(), plain.experts.b2.detach()
    assert torch.equal(ranks[5]["experts.batched_fc1_w"][0], w1[2, :, 6:12].T)
    assert torch.equal(ranks[5]["experts.batched_fc2_bias"][0], b2[2, 4:8])
    assert ranks[5]["experts.batched_fc1_w"].shape == (1, H // 2, M)

    # A whole model: the layer under a prefix, other keys kept.
    model = nn.Module()
    model.proj = nn.Linear(M, M).double()
    model._moe_layer = layer
    flex = convert.tutel_to_flexmoe(model.state_dict())
    assert torch.equal(flex["proj.weight"], model.proj.weight) and "_moe_layer.experts.w1" in flex
    again = convert.flexmoe_to_tutel(flex)[0]
    assert again.keys() == model.state_dict().keys()


def test_checkpoint_checks():
    layer = make_layer(seeds=None)
    state = layer.state_dict()
    other = make_layer(seeds=None)
    legacy = {k: v for k, v in state.items() if k != "_num_global_experts"}
    other.load_state_dict(legacy)  # older Tutel files lack the expert count
    assert torch.equal(other.experts.batched_fc1_w, layer.experts.batched_fc1_w)
    wrong = dict(state, _num_global_experts=torch.tensor(8))
    with pytest.raises(ValueError, match="8 experts"):
        other.load_state_dict(wrong)
    glu = MoELayer(M, E, H, glu=True)
    with pytest.raises(ValueError, match="w3"):
        convert.flexmoe_to_tutel(glu.state_dict())
    cosine = MoELayer(M, E, H, router="cosine")
    with pytest.raises(ValueError, match="CosineRouter"):
        convert.flexmoe_to_tutel(cosine.state_dict())


class _CustomGate(nn.Module):
    def __init__(self, model_dim: int, num_global_experts: int, top_k: int = 1) -> None:
        super().__init__()
        self.my_wg = nn.Linear(model_dim, num_global_experts, bias=False)
        self.top_k = top_k

    def forward(self, x: Tensor) -> Tensor:
        return self.my_wg(x)


class _CustomExpert(nn.Module):
    """Tutel's custom expert protocol: x [E_local, C, M] -> [E_local, C, M]; the old name local_experts."""

    def __init__(self, model_dim: int, local_experts: int, sharded_count: int, scale: float) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(local_experts, model_dim, model_dim) * scale)

    def forward(self, x: Tensor, ctx) -> Tensor:
        assert ctx.num_global_experts == E
        return torch.tanh(torch.matmul(x, self.W))


def test_custom_gate_and_expert_equal_reference():
    torch.manual_seed(3)
    layer = moe.moe_layer(gate_type={"type": "custom", "module": _CustomGate, "top_k": 2},
                          experts={"type": "custom", "module": _CustomExpert, "num_experts_per_device": E,
                                   "scale": 0.3},
                          model_dim=M).double()
    assert sorted(n for n, _ in layer.named_parameters()) == ["experts.W", "gates.0.my_wg.weight"]
    x = make_input()
    y = layer(x, capacity_factor=0.5)
    W = layer.experts.W
    want, want_aux, _ = dense_reference(x, layer.gates[0].my_wg.weight, None, None, None, None, k=2, cf=0.5,
                                        expert_fn=lambda e, v: torch.tanh(v @ W[e]))
    assert close(y, want) and close(y.l_aux, want_aux)


def test_forward_options():
    layer = make_layer(2, 1.0)
    x = make_input(24).view(2, 12, M)
    # per-call top_k and capacity_factor (0 = dropless, as Tutel documents), result_func, gate list
    flat = x.reshape(-1, M)
    want, _, cap = dense_reference(flat, *weights_of(layer), k=1, cf=0.0)
    assert close(layer(x, top_k=1, capacity_factor=0.0), want.view(2, 12, M))
    # the overlap degree rounds the capacity up to a multiple of it, as Tutel pads it
    layer(flat, capacity_factor=0.4, a2a_ffn_overlap_degree=4)
    assert layer.a2a_ffn_overlap_degree == 4
    assert layer.last_plan.capacity == 4  # 2 * int(0.4 * 6) = 4, a multiple of 4
    layer(flat, capacity_factor=0.6, a2a_ffn_overlap_degree=4)
    assert layer.last_plan.capacity == 8  # 2 * int(0.6 * 6) = 6 -> 8
    layer(flat, adaptive_r=0)
    assert layer.adaptive_degree == 0 and layer.valid_rs == [0, 1]

    doubled = make_layer(2, 1.0, result_func=lambda y: y * 2)
    assert close(doubled(x), 2 * layer(x, a2a_ffn_overlap_degree=1))


def test_bad_arguments():
    experts = {"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": H}
    with pytest.raises(ValueError, match="gate type"):
        moe.moe_layer(gate_type={"type": "nope"}, model_dim=M, experts=experts)
    with pytest.raises(TypeError, match="gate of type 'top'"):
        moe.moe_layer(gate_type={"type": "top", "kk": 2}, model_dim=M, experts=experts)
    with pytest.raises(ValueError, match="experts type"):
        moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts={"type": "moe"})
    with pytest.raises(TypeError, match="unexpected arguments"):
        moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=experts, gate_kind="x")
    with pytest.raises(ValueError, match="divide the world size"):
        moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=dict(experts, num_experts_per_device=-2))
    with pytest.raises(ValueError, match="parallel_type"):
        moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=experts, parallel_type="fast")
    with pytest.raises(ValueError, match="output_dim"):
        moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=dict(experts, output_dim=M + 1))
    layer = moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=experts)
    with pytest.raises(ValueError, match="model_dim=8"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="gate_index"):
        layer(torch.randn(3, M), gate_index=1)
    with pytest.raises(ValueError, match="adaptive_r"):
        layer(torch.randn(3, M), adaptive_r=2)
    no_noise = moe.moe_layer(gate_type={"type": "top"}, model_dim=M, experts=experts, is_gshard_loss=False)
    with pytest.raises(ValueError, match="gate_noise"):
        no_noise(torch.randn(3, M))


def test_system_and_net_single_process(tmp_path):
    env = system.init_data_model_parallel(backend="gloo")
    assert (env.global_size, env.global_rank, env.model_size, env.local_device) == (1, 0, 1, torch.device("cpu"))
    assert system.get_local_session() is env
    path = system.apply_rank_size_from_pattern(str(tmp_path / "d" / "x-{rank}-{size}.pt"), rank=3, size=4)
    assert path.endswith("d/x-3-4.pt") and (tmp_path / "d").is_dir()
    t = torch.arange(6.0).view(3, 2)
    assert net.simple_all_reduce(t) is t and torch.equal(net.all_to_all(t, 1, 0), t)
    assert torch.equal(net.zero_gather(t.view(-1), full_shape=[2, 3]), torch.arange(6.0).view(2, 3))
    piece, shape = net.zero_scatter(t, net.simple_split)
    assert torch.equal(piece, t.view(-1)) and shape == t.shape


def test_two_ranks_equal_one_process(tmp_path):
    reports = run_ranks(WORKER, "layer", 2, tmp_path)
    assert not failures_of(reports)
    assert all(rep.get("checked", 0) == 7 for rep in reports)
