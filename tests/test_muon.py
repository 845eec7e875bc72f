"""flexmoe.optim: Muon on 2-D weights and 3-D expert stacks, the gated pair, the parameter split, the combined
optimizer and its checkpoints, against torch.optim.Muon / torch.optim.AdamW and a float64 per-matrix loop written
here."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from flexmoe import MoELayer
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.checkpoint import load_checkpoint, save_checkpoint
from flexmoe.optim import Muon, MuonWithAdamW, muon_param_groups

A, B, C = 3.4445, -4.7750, 2.0315  # torch.optim.Muon's default Newton-Schulz coefficients


# ---------------------------------------------------------------------------------- the float64 reference


def reference_ns(m: Tensor, steps: int = 5) -> Tensor:
    """Newton-Schulz of one matrix in float64, written out: the wide orientation, X over its Frobenius norm."""
    x = m.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(float(x.norm()), 1e-7)
    for _ in range(steps):
        g = x @ x.T
        x = A * x + (B * g + C * g @ g) @ x
    return x.T if tall else x


class ReferenceMuon:
    """Muon on a list of float64 matrices, one at a time: EMA momentum, nesterov, decoupled weight decay,
    lr x sqrt(max(1, rows / cols))."""

    def __init__(self, matrices: list[Tensor], lr: float, weight_decay: float, momentum: float = 0.95,
                 nesterov: bool = True) -> None:
        self.params = [m.double().clone() for m in matrices]
        self.bufs = [torch.zeros_like(m) for m in self.params]
        self.lr, self.wd, self.mu, self.nesterov = lr, weight_decay, momentum, nesterov

    def step(self, grads: list[Tensor]) -> None:
        for p, buf, g in zip(self.params, self.bufs, grads):
            g = g.double()
            buf.mul_(self.mu).add_((1 - self.mu) * g)
            update = (1 - self.mu) * g + self.mu * buf if self.nesterov else buf
            rows, cols = p.shape
            p.mul_(1 - self.lr * self.wd).sub_(self.lr * math.sqrt(max(1.0, rows / cols)) * reference_ns(update))


def grads_for(step: int, shape: tuple[int, ...]) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)


# bf16 Newton-Schulz against float64: each entry of the orthogonalised update (of size ~1/sqrt(cols)) to a few
# bf16 ulps; times lr, summed over the steps.
def bf16_tolerance(step_size: float, steps: int, cols: int) -> float:
    return 0.04 / math.sqrt(cols) * step_size * steps


# ---------------------------------------------------------------------------------- Muon itself


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("options", [{}, {"nesterov": False, "weight_decay": 0.0},
                                     {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}])
def test_a_2d_weight_steps_as_torch_muon_bit_for_bit(shape: tuple[int, int], options: dict) -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(shape))
    w_torch = nn.Parameter(w.detach().clone())
    ours, theirs = Muon([w], lr=0.02, **options), torch.optim.Muon([w_torch], lr=0.02, **options)
    for step in range(4):
        w.grad = grads_for(step, shape).float()
        w_torch.grad = w.grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(w, w_torch)
    assert torch.equal(ours.state[w]["momentum_buffer"], theirs.state[w_torch]["momentum_buffer"])


@pytest.mark.parametrize("shape", [(4, 16, 48), (3, 48, 16)])
def test_a_3d_stack_steps_as_torch_muon_on_each_expert_matrix(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    stack = nn.Parameter(torch.randn(shape))
    per_expert = [nn.Parameter(m.clone()) for m in stack.detach()]
    ours, theirs = Muon([stack], lr=0.03), torch.optim.Muon(per_expert, lr=0.03)
    for step in range(3):
        stack.grad = grads_for(step, shape).float()
        for e, p in enumerate(per_expert):
            p.grad = stack.grad[e].clone()
        ours.step()
        theirs.step()
    assert torch.equal(stack.detach(), torch.stack([p.detach() for p in per_expert]))


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_3d_stack_matches_the_float64_per_matrix_loop(nesterov: bool) -> None:
    shape, lr, wd, steps = (3, 32, 20), 0.02, 0.1, 5
    torch.manual_seed(2)
    stack = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    start = stack.detach().clone()
    ref = ReferenceMuon(list(stack.detach()), lr, wd, nesterov=nesterov)
    opt = Muon([stack], lr=lr, weight_decay=wd, nesterov=nesterov)
    for step in range(steps):
        stack.grad = grads_for(step, shape)
        opt.step()
        ref.step(list(stack.grad))
    # the momentum is float64 arithmetic on both sides; the update went through bf16 Newton-Schulz
    assert torch.allclose(opt.state[stack]["momentum_buffer"], torch.stack(ref.bufs), rtol=1e-12, atol=1e-14)
    tol = bf16_tolerance(lr * math.sqrt(32 / 20), steps, 20)
    err = (stack.detach() - torch.stack(ref.params)).abs().max().item()
    assert err < tol, err
    # the steps moved the weights by far more than that tolerance: a wrong update would show
    assert (torch.stack(ref.params) - start).abs().max() > 20 * tol


def test_newton_schulz_pushes_singular_values_toward_one_as_the_reference() -> None:
    from flexmoe.optim import newton_schulz

    m = torch.randn(4, 24, 64, generator=torch.Generator().manual_seed(3))
    got = newton_schulz(m).double()
    want = torch.stack([reference_ns(x) for x in m])
    assert (got - want).abs().max() < 0.02
    s = torch.linalg.svdvals(want)
    assert s.min() > 0.5 and s.max() < 1.3  # the quintic's band around 1, not UV^T exactly


def test_the_gated_pair_as_one_parameter_steps_as_its_two_halves_apart() -> None:
    """gate_up [E, M, 2H] with last_dim_parts=2 gets what w1 [E, M, H] and w3 [E, M, H] get as parameters of
    their own (torch.optim.Muon, per expert), learning rate scaled by [M, H]; as one [M, 2H] it would differ."""
    E, M, H = 3, 16, 24
    torch.manual_seed(4)
    gate_up = nn.Parameter(torch.randn(E, M, 2 * H))
    halves = [nn.Parameter(m.clone()) for half in gate_up.detach().chunk(2, dim=-1) for m in half]
    joined_as_one = nn.Parameter(gate_up.detach().clone())
    ours = Muon([{"params": [gate_up], "last_dim_parts": 2}], lr=0.02)
    theirs = torch.optim.Muon(halves, lr=0.02)
    one = Muon([joined_as_one], lr=0.02)
    for step in range(3):
        gate_up.grad = grads_for(step, (E, M, 2 * H)).float()
        joined_as_one.grad = gate_up.grad.clone()
        for i, g in enumerate(m for half in gate_up.grad.chunk(2, dim=-1) for m in half):
            halves[i].grad = g.clone()
        ours.step()
        theirs.step()
        one.step()
    w1 = torch.stack([p.detach() for p in halves[:E]])
    w3 = torch.stack([p.detach() for p in halves[E:]])
    assert torch.equal(gate_up.detach(), torch.cat([w1, w3], dim=-1))
    assert (joined_as_one.detach() - gate_up.detach()).abs().max() > 1e-3


def test_muon_refuses_what_it_cannot_orthogonalise_by_name() -> None:
    with pytest.raises(ValueError, match=r"params'\]\[0\].*shape \(2, 3, 4, 5\)"):
        Muon([nn.Parameter(torch.zeros(2, 3, 4, 5))])
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        Muon([nn.Parameter(torch.zeros(7))])
    with pytest.raises(ValueError, match="last_dim_parts"):
        Muon([{"params": [nn.Parameter(torch.zeros(2, 3, 5))], "last_dim_parts": 2}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([nn.Parameter(torch.zeros(2, 3))], adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="momentum"):
        Muon([nn.Parameter(torch.zeros(2, 3))], momentum=-1.0)
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAdamW([{"params": [nn.Parameter(torch.zeros(2, 3))]}])


def test_muon_has_torch_muons_defaults() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    ours, theirs = Muon([p]).defaults, torch.optim.Muon([p]).defaults
    assert ours == theirs


# ---------------------------------------------------------------------------------- the split and the combined


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, num_experts=4,
                         expert_hidden=24, k=2, moe_every=1, capacity_factor=0.0))


class GatedBlock(nn.Module):
    """An embedding, a norm, a joined-gated-pair MoE layer (gate_up [E, M, 2H], with biases) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.moe = MoELayer(8, 4, 12, k=2, glu=True, activation="silu", joined_gate_up=True, group="single",
                            capacity_factor=0.0)
        self.out = nn.Linear(8, 16)
        self.cfg = SimpleNamespace(to_dict=dict)  # what flexmoe.checkpoint records of a model's configuration

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.moe(self.norm(self.emb(ids))))


def test_muon_param_groups_puts_each_parameter_where_the_recipe_says() -> None:
    model = tiny_gpt()
    groups = muon_param_groups(model, head=model.head)
    named = {id(p): n for n, p in model.named_parameters()}
    by_group = [sorted(named[id(p)] for p in g["params"]) for g in groups]
    assert [g["use_muon"] for g in groups] == [True, False, False]
    assert sorted(n for names in by_group for n in names) == sorted(named.values())  # each exactly once
    muon, decay, no_decay = by_group
    assert "blocks.0.attn.qkv.weight" in muon and "blocks.1.mlp.experts.w1" in muon and \
        "blocks.1.mlp.experts.w2" in muon and "blocks.0.mlp.router.weight" in muon
    assert decay == ["head.weight", "pos_emb.weight", "tok_emb.weight"]
    assert "blocks.0.mlp.experts.b1" in no_decay and "ln_f.weight" in no_decay and \
        "blocks.0.attn.qkv.bias" in no_decay and groups[2]["weight_decay"] == 0.0
    to_adamw = muon_param_groups(model, head=model.head, router_to_adamw=True)
    assert "blocks.0.mlp.router.weight" in [named[id(p)] for p in to_adamw[1]["params"]]


def test_the_joined_gated_pair_is_its_own_group_of_two_matrices() -> None:
    model = GatedBlock()
    groups = muon_param_groups(model, head=model.out)
    assert groups[1]["params"] == [model.moe.experts.gate_up] and groups[1]["last_dim_parts"] == 2
    assert any(p is model.moe.experts.gate_up_bias for p in groups[3]["params"])


def test_the_combined_optimizer_is_torch_muon_plus_torch_adamw_bit_for_bit() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.Embedding(16, 12), nn.Linear(12, 20), nn.LayerNorm(20), nn.Linear(20, 16))
    twin = copy.deepcopy(model)
    ours = MuonWithAdamW(muon_param_groups(model, head=model[3]), lr=0.01, betas=(0.9, 0.95), adamw_eps=1e-6)
    muon_p = [twin[1].weight]
    adamw_p = [p for p in twin.parameters() if p is not twin[1].weight]
    no_decay = [p for p in adamw_p if p.dim() < 2]
    muon = torch.optim.Muon(muon_p, lr=0.01)
    adamw = torch.optim.AdamW([{"params": [p for p in adamw_p if p.dim() == 2]},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m, opts in ((model, [ours]), (twin, [muon, adamw])):
            loss = m(ids).square().mean()
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
    for step in range(first, last):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_state_dict_round_trip_resumes_as_the_uninterrupted_run() -> None:
    model, resumed = GatedBlock(), GatedBlock()
    opt = MuonWithAdamW(muon_param_groups(model, head=model.out), lr=0.01)
    run_steps(model, opt, 0, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    run_steps(model, opt, 3, 5)
    resumed.load_state_dict(saved_model)
    opt2 = MuonWithAdamW(muon_param_groups(resumed, head=resumed.out), lr=0.01)
    opt2.load_state_dict(saved_opt)
    run_steps(resumed, opt2, 3, 5)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_flexmoe_checkpoints_save_and_resume_muons_momentum(tmp_path) -> None:
    """flexmoe.checkpoint writes the momentum buffers (gate_up's by its halves' names, as AdamW's moments) and
    loads them back: the resumed run equals the uninterrupted one."""
    model, resumed = GatedBlock(), GatedBlock()
    opt = MuonWithAdamW(muon_param_groups(model, head=model.out), lr=0.01)
    run_steps(model, opt, 0, 3)
    path = save_checkpoint(tmp_path, model=model, optimizer=opt, step=3)
    saved_buffer = opt.state[model.moe.experts.gate_up]["momentum_buffer"].clone()
    run_steps(model, opt, 3, 5)
    opt2 = MuonWithAdamW(muon_param_groups(resumed, head=resumed.out), lr=0.01)
    load_checkpoint(path, model=resumed, optimizer=opt2)
    restored = opt2.state[resumed.moe.experts.gate_up]["momentum_buffer"]
    assert restored.abs().sum() > 0 and torch.equal(restored, saved_buffer)
    run_steps(resumed, opt2, 3, 5)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------- 2 gloo ranks


def test_sharded_parameters_step_as_torch_muon_on_each_whole_matrix_at_2_ranks() -> None:
    """DTensors sharded as FSDP2 shards them (whole experts per rank: orthogonalised locally; a matrix's rows or
    one expert's columns split: gathered) end 3 steps bit-equal to torch.optim.Muon on each whole matrix in one
    process; each momentum buffer stays sharded as its parameter. One expert split over the 2 ranks' hidden
    units is refused by name."""
    from multiproc import check_ranks_pass
    from muon_worker import rank_main

    check_ranks_pass(2, rank_main, ["dtensor_layouts"], what="Muon on DTensors at 2 ranks")


@pytest.mark.slow
def test_the_gpt_under_expert_parallelism_and_fsdp2_trains_with_muon_as_one_process() -> None:
    """flexmoe.sharding.parallelize at ep=2 (each rank its 4 experts, plain tensors: no communication in Muon;
    the rest FSDP2-sharded: gathered) and at dp_shard=2 (experts FSDP2-sharded along the expert dim: local),
    MuonWithAdamW for 4 steps: the losses and every weight equal one process's to bf16 Newton-Schulz rounding."""
    from multiproc import check_ranks_pass
    from muon_worker import rank_main

    check_ranks_pass(2, rank_main, ["parallelized_gpt"], what="Muon under parallelize at 2 ranks", timeout=600)
