"""Joined experts (``joined_gate_up``, a converted HF block's default): the gated pair as one parameter,
``gate_up: [E, M, 2H]`` (``gate_up_bias: [E, 2H]``), ``w1``/``w3`` (``b1``/``b3``) its halves, the state dict and
checkpoints by the halves' names. References: plain experts (two parameters) and float64 loops written here."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from flexmoe.experts.modules import FeedForwardExperts

E, M, H = 3, 8, 4


def _experts(joined: bool = True, **kwargs: object) -> FeedForwardExperts:
    torch.manual_seed(0)
    return FeedForwardExperts(E, M, H, activation="silu", glu=True, joined_gate_up=joined,
                              **kwargs)  # type: ignore[arg-type]


def _dense(x: torch.Tensor, weights: dict[str, torch.Tensor], expert_of_row: list[int]) -> torch.Tensor:
    """Each row through its expert by plain float64 matmuls: silu(x w1 + b1) * (x w3 + b3) @ w2 + b2."""
    w = {n: t.double() for n, t in weights.items()}
    out = [(torch.nn.functional.silu(row @ w["w1"][e] + w["b1"][e]) * (row @ w["w3"][e] + w["b3"][e])) @ w["w2"][e]
           + w["b2"][e] for row, e in zip(x.double(), expert_of_row, strict=True)]
    return torch.stack(out)


def test_joined_experts_hold_one_parameter_whose_halves_are_w1_and_w3() -> None:
    joined, plain = _experts(), _experts(joined=False)
    assert [n for n, _ in joined.named_parameters()] == ["gate_up", "w2", "gate_up_bias", "b2"]
    assert joined.gate_up.shape == (E, M, 2 * H) and joined.gate_up_bias.shape == (E, 2 * H)
    # The halves are views of the parameter: the same memory, gate then up, as HF's gate_up_proj.
    assert joined.w1.data_ptr() == joined.gate_up.data_ptr()
    assert joined.w3.data_ptr() == joined.gate_up.data_ptr() + H * joined.gate_up.element_size()
    assert joined.b3.data_ptr() == joined.gate_up_bias.data_ptr() + H * joined.gate_up_bias.element_size()
    # Initialised half by half as plain experts' parameters are: the same values from the same seed.
    for name in ("w1", "w2", "w3", "b1", "b2", "b3"):
        assert torch.equal(getattr(joined, name), getattr(plain, name)), name
    # The state dict names the halves, in plain experts' order.
    assert list(joined.state_dict()) == list(plain.state_dict()) == ["w1", "w2", "w3", "b1", "b2", "b3"]
    assert plain.gate_up is None and plain.gate_up_bias is None
    with pytest.raises(AttributeError, match="w1 of joined experts is a half of gate_up"):
        joined.w1 = torch.nn.Parameter(torch.zeros(E, M, H))
    with pytest.raises(RuntimeError, match="leaf"):  # one flag for the pair, as HF's gate_up_proj
        joined.w3.requires_grad_(False)
    joined.gate_up.requires_grad_(False)
    assert not joined.w1.requires_grad and not joined.w3.requires_grad and joined.b1.requires_grad


def test_a_call_equals_plain_experts_and_hands_one_gradient_to_gate_up() -> None:
    joined, plain = _experts(), _experts(joined=False)
    counts = [3, 0, 4]
    x = torch.randn(sum(counts), M, generator=torch.Generator().manual_seed(1))
    outs = []
    for experts in (joined, plain):
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), xi.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    gate, up = joined.gate_up.grad.split(H, dim=-1)
    torch.testing.assert_close(gate, plain.w1.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(up, plain.w3.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(joined.gate_up_bias.grad, torch.cat([plain.b1.grad, plain.b3.grad], -1))


def test_state_dicts_load_across_the_two_layouts() -> None:
    joined, plain = _experts(), _experts(joined=False)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(-3.0)
    joined.load_state_dict(plain.state_dict())  # plain -> joined
    for name, tensor in plain.state_dict().items():
        assert torch.equal(getattr(joined, name), tensor), name
    back = _experts(joined=False)
    back.load_state_dict(joined.state_dict())  # joined -> plain
    for name, tensor in plain.state_dict().items():
        assert torch.equal(getattr(back, name), tensor), name
    # assign=True (meta-device loading): the joined parameter takes the loaded values, its halves follow.
    fresh = _experts()
    fresh.load_state_dict({n: t.clone() for n, t in plain.state_dict().items()}, assign=True)
    assert isinstance(fresh.gate_up, torch.nn.Parameter) and torch.equal(fresh.w3, plain.w3)
    assert fresh.w3.data_ptr() == fresh.gate_up.data_ptr() + H * 4
    # A half missing: reported by its own name; non-strict, the half given is loaded.
    partial = {n: t for n, t in plain.state_dict().items() if n != "w3"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "w3"'):
        _experts().load_state_dict(partial)
    target = _experts()
    w3_before = target.w3.clone()
    result = target.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["w3"] and result.unexpected_keys == []
    assert torch.equal(target.w1, plain.w1) and torch.equal(target.w3, w3_before)
    with pytest.raises(RuntimeError, match="size mismatch for w1"):
        _experts().load_state_dict({**partial, "w1": torch.zeros(E, M, H + 1)}, strict=False)


@pytest.mark.parametrize("change", ["double", "to-dtype", "deepcopy", "load_state_dict", "data-replaced",
                                    "inference-mode-first", "frozen-then-trained"])
def test_the_halves_follow_what_users_do_to_a_module(change: str) -> None:
    """After each change the halves are views of the current gate_up, with its values, and a training call gives
    the float64 reference's output and gate_up gradient (a stale kept view would give old values or none)."""
    experts = _experts()
    counts = [2, 3, 1]
    x = torch.randn(sum(counts), M, generator=torch.Generator().manual_seed(2))
    if change == "double":
        experts = experts.double()
    elif change == "to-dtype":
        experts = experts.to(torch.bfloat16).to(torch.float32)
    elif change == "deepcopy":
        experts.weights()
        original = experts
        experts = copy.deepcopy(experts)
        assert experts.gate_up.data_ptr() != original.gate_up.data_ptr()
    elif change == "load_state_dict":
        experts.weights()
        experts.load_state_dict({n: t * 2 for n, t in experts.state_dict().items()})
    elif change == "data-replaced":
        experts.weights()
        experts.gate_up.data = torch.randn(E, M, 2 * H)
    elif change == "inference-mode-first":
        with torch.inference_mode():
            experts(x, counts)
    else:
        experts.gate_up.requires_grad_(False)
        with torch.no_grad():
            experts(x, counts)
        experts.gate_up.requires_grad_(True)
    assert experts.w1.data_ptr() == experts.gate_up.data_ptr()
    assert experts.w1.requires_grad and experts.w3.requires_grad
    reference = {n: t.detach().double() for n, t in experts.state_dict().items()}
    gate_up = experts.gate_up.detach().double().requires_grad_()
    reference["w1"], reference["w3"] = gate_up[..., :H], gate_up[..., H:]
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    want = _dense(x.to(experts.gate_up.dtype), reference, expert_of_row)
    want.sum().backward()
    out = experts(x.to(experts.gate_up.dtype), counts)
    out.sum().backward()
    tol = 1e-5 if experts.gate_up.dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out.double(), want.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(experts.gate_up.grad.double(), gate_up.grad, rtol=tol, atol=tol)


# embedding_bag computes no-grad calls only (the chooser never gives it autograd): no training case.
KERNEL_CASES = [(kernel, change) for kernel in ("loop", "segmented", "grouped_mm", "embedding_bag", "joined_unit")
                for change in ("none", "edited-in-place", "swapped-parameter", "training")
                if (kernel, change) != ("embedding_bag", "training")]


@pytest.mark.parametrize("kernel, change", KERNEL_CASES)
def test_every_kernel_computes_with_the_joined_parameter_as_it_is_now(kernel: str, change: str) -> None:
    """Every kernel computes the experts' function of the values gate_up holds at the call: after an in-place
    edit (an optimizer's step), with another tensor in its place (``torch.func.functional_call``), and under
    autograd (the gradient reaching gate_up), against a float64 loop."""
    experts = _experts()
    experts.kernels = type(experts.kernels).for_options(kernel, None)
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), M, generator=torch.Generator().manual_seed(1))
    expert_of_row = [e for e, n in enumerate(counts) for _ in range(n)]
    experts.weights()  # views kept before the change
    call_params: dict[str, torch.Tensor] = {}
    if change == "edited-in-place":
        with torch.no_grad():
            experts.gate_up.mul_(-2.0)
            experts.gate_up_bias.add_(0.5)
    elif change == "swapped-parameter":
        call_params = {"gate_up": torch.randn(E, M, 2 * H, generator=torch.Generator().manual_seed(3))}
    gate_up = call_params.get("gate_up", experts.gate_up).detach().double().requires_grad_()
    reference = {n: t.detach() for n, t in experts.state_dict().items()}
    reference["w1"], reference["w3"] = gate_up[..., :H], gate_up[..., H:]
    want = _dense(x, reference, expert_of_row)
    if change == "training":
        out = experts(x, counts)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))  # dense (grouped_mm's backward)
        (out * upstream).sum().backward()
        (want * upstream.double()).sum().backward()
        torch.testing.assert_close(experts.gate_up.grad.double(), gate_up.grad, rtol=1e-5, atol=1e-6)
    else:
        with torch.no_grad():
            out = torch.func.functional_call(experts, call_params, (x, counts)) if call_params else experts(x, counts)
    torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_converted_block_trains_on_gate_up_without_a_copy(family: str) -> None:
    """A converted block (joined by default) computes HF's function in training on the read-free path with no
    ``cat`` of w1 and w3 (nor of the biases, GPT-OSS): HF's output and input gradient (HF's own block is the
    reference), its gate_up gradient the halves of a block converted with ``joined_gate_up=False``, and HF's
    state dict back."""
    import flexmoe.hf
    from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation
    from flexmoe.apps.bench.host_reads import OpCounter

    shape = HFShape("count", tokens=5, model_dim=64, experts=8, k=4, hidden_dim=32, groups=1, limited_groups=1)
    hf = set_experts_implementation(build_hf_block(family, shape, 0), "grouped_mm")
    joined = flexmoe.hf.convert(copy.deepcopy(hf), expert_kernel="grouped_mm")
    apart = flexmoe.hf.convert(copy.deepcopy(hf), expert_kernel="grouped_mm", joined_gate_up=False)
    assert "gate_up" in dict(joined.moe.experts.named_parameters())
    assert "w1" in dict(apart.moe.experts.named_parameters())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(joined.state_dict()[name], tensor), name
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, block in (("hf", hf), ("joined", joined), ("apart", apart)):
        xi = x.clone().requires_grad_()
        with OpCounter() as counted:
            out = block_output(block(xi))
            out.backward(torch.ones_like(out))
        results[name] = (out.detach(), xi.grad, counted.by_name.get("aten.cat.default", 0))
    for name in ("joined", "apart"):
        torch.testing.assert_close(results[name][:2], results["hf"][:2], rtol=1e-5, atol=1e-6)
    # The pair laid apart is joined by a copy per call (w1 | w3, and b1 | b3 where the experts have biases); the
    # joined parameter is read as it lies: every other cat (the routing's) is the same in both.
    pairs = 2 if family == "gpt_oss" else 1
    assert results["apart"][2] == results["joined"][2] + pairs
    experts, apart_experts = joined.moe.experts, apart.moe.experts
    gate, up = experts.gate_up.grad.split(32, dim=-1)
    torch.testing.assert_close(gate, apart_experts.w1.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up, apart_experts.w3.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_experts, num_tokens", [(8, 64), (64, 64), (8, 1)])
def test_a_converted_block_decodes_on_gate_up_without_a_copy(family: str, num_experts: int,
                                                             num_tokens: int) -> None:
    """A converted block's eval forward without autograd (T=64: the read-free path's grouped GEMMs; T=1: its
    gathered weights, one gather of gate_up) reads gate_up where it lies: no ``cat`` dispatched, HF's output
    (HF's own block is the reference). After ``gate_up.data`` is replaced it computes with the new values (a
    block converted with ``joined_gate_up=False`` and given the same values is the reference), and a deep copy
    keeps its own."""
    import flexmoe.hf
    from flexmoe.apps.bench.hf_blocks import HFShape, block_output, build_hf_block, set_experts_implementation
    from flexmoe.apps.bench.host_reads import OpCounter

    shape = HFShape("count", tokens=num_tokens, model_dim=64, experts=num_experts, k=4, hidden_dim=32, groups=1,
                    limited_groups=1)
    hf = set_experts_implementation(build_hf_block(family, shape, 0), "grouped_mm").eval()
    block = flexmoe.hf.convert(copy.deepcopy(hf)).eval()
    experts = block.moe.experts
    x = torch.randn(1, num_tokens, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), OpCounter() as counted:
        out = block_output(block(x))
    assert counted.host_reads == [] and counted.by_name["aten.cat.default"] == 0, counted.by_name
    if num_tokens == 1:  # the gathered route: gate_up and w2 gathered once each (GPT-OSS: their biases too)
        assert counted.by_name["aten.index_select.default"] == (4 if family == "gpt_oss" else 2), counted.by_name
    with torch.no_grad():
        torch.testing.assert_close(out, block_output(hf(x)), rtol=1e-5, atol=1e-6)

    twin = copy.deepcopy(block)
    apart = flexmoe.hf.convert(copy.deepcopy(hf), joined_gate_up=False).eval()
    new_gate_up = torch.randn(experts.gate_up.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    experts.gate_up.data = new_gate_up.clone()
    with torch.no_grad():
        apart.moe.experts.w1.copy_(new_gate_up[..., :32])
        apart.moe.experts.w3.copy_(new_gate_up[..., 32:])
        torch.testing.assert_close(block_output(block(x)), block_output(apart(x)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(block_output(twin(x)), out, rtol=0, atol=0)  # the copy kept its values


def test_laying_the_pair_apart_gives_plain_parameters_with_the_same_values_and_flag() -> None:
    experts = _experts()
    experts.gate_up.requires_grad_(False)
    values = {n: t.clone() for n, t in experts.state_dict().items()}
    experts.lay_gated_pairs_apart()
    assert not experts.joined_gate_up and experts.gate_up is None
    assert [n for n, _ in experts.named_parameters()] == ["w1", "w2", "w3", "b1", "b2", "b3"]
    assert all(p.is_contiguous() for p in experts.parameters())
    assert not experts.w1.requires_grad and not experts.w3.requires_grad and experts.b1.requires_grad
    for name, tensor in experts.state_dict().items():
        assert torch.equal(tensor, values[name]), name
    experts.w1 = torch.nn.Parameter(torch.zeros(E, M, H))  # plain now: a half may be replaced


def test_a_dcp_checkpoint_of_joined_experts_loads_into_plain_ones_with_the_optimizer(tmp_path) -> None:
    """save_sharded / load_sharded (one process) name the halves, model and AdamW states alike: a checkpoint of a
    layer holding gate_up loads into one holding w1 and w3 apart (what FSDP2 holds), the
    optimizer's states cut into halves, and back."""
    from flexmoe.sharding import load_sharded, save_sharded

    source, source_opt = _trained_layer(True, 0)
    save_sharded(tmp_path / "ckpt", source, source_opt)
    for joined, seed in ((False, 1), (True, 2)):
        target, target_opt = _trained_layer(joined, seed)
        load_sharded(tmp_path / "ckpt", target, target_opt)
        _assert_same_states(source, source_opt, target, target_opt)


def test_the_training_job_gives_gate_up_bias_no_weight_decay() -> None:
    """build_optimizer decays matrices only: gate_up decays, gate_up_bias (b1 | b3) does not, as b1 and b3."""
    from flexmoe import MoELayer
    from flexmoe.apps.train_config import TrainConfig
    from flexmoe.apps.train_step import build_optimizer

    layer = MoELayer(M, 4, H, k=2, glu=True, joined_gate_up=True)
    groups = build_optimizer(layer, TrainConfig(weight_decay=0.1, lr=1e-3)).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(layer.experts.gate_up) in decayed and id(layer.experts.w2) in decayed
    assert id(layer.experts.gate_up_bias) not in decayed and id(layer.experts.b2) not in decayed


def _trained_layer(joined: bool, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A gated layer after one AdamW step (its states exist), joined or apart, from ``seed``."""
    from flexmoe import MoELayer

    torch.manual_seed(seed)
    layer = MoELayer(M, 4, H, k=2, glu=True, activation="silu", joined_gate_up=joined)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    layer(torch.randn(6, M)).sum().backward()
    opt.step()
    return layer, opt


def _assert_same_states(source: torch.nn.Module, source_opt: torch.optim.Optimizer, target: torch.nn.Module,
                        target_opt: torch.optim.Optimizer) -> None:
    """The same state dict, and each half's AdamW states the halves of gate_up's (plain target) or gate_up's."""
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    state = source_opt.state[source.experts.gate_up]
    if target.experts.joined_gate_up:
        assert torch.equal(target_opt.state[target.experts.gate_up]["exp_avg"], state["exp_avg"])
        return
    for half, name in enumerate(("w1", "w3")):
        got = target_opt.state[getattr(target.experts, name)]
        assert torch.equal(got["exp_avg"], state["exp_avg"].split(H, dim=-1)[half]), name
        assert torch.equal(got["exp_avg_sq"], state["exp_avg_sq"].split(H, dim=-1)[half]), name
        assert float(got["step"]) == float(state["step"])


def test_a_training_checkpoint_of_joined_experts_resumes_into_plain_ones(tmp_path) -> None:
    """flexmoe's own checkpoints (the training job's) name the halves in the model and the optimizer states: a
    run saved holding gate_up resumes holding w1 and w3 apart (joined_gate_up=False), and back."""
    from flexmoe.checkpoint import load_checkpoint, save_checkpoint

    source, source_opt = _trained_layer(True, 0)
    source.cfg = SimpleNamespace(to_dict=dict)  # the job's models carry their config; a bare layer an empty one
    path = save_checkpoint(tmp_path, model=source, optimizer=source_opt, step=1)
    for joined, seed in ((False, 1), (True, 2)):
        target, target_opt = _trained_layer(joined, seed)
        load_checkpoint(path, model=target, optimizer=target_opt, restore_rng=False)
        _assert_same_states(source, source_opt, target, target_opt)


def test_materialize_draws_joined_experts_as_plain_ones() -> None:
    """flexmoe.sharding.materialize of a layer built on meta: joined experts get the values plain experts get from
    the same seed (each expert drawn whole, by name)."""
    from flexmoe import MoELayer
    from flexmoe.sharding import materialize

    layers = [materialize(MoELayer(M, 4, H, k=2, glu=True, device="meta", joined_gate_up=joined), seed=7)
              for joined in (True, False)]
    assert "experts.gate_up" in dict(layers[0].named_parameters())
    for name, tensor in layers[1].state_dict().items():
        assert torch.equal(layers[0].state_dict()[name], tensor), name


def test_the_weights_stay_one_object_across_optimizer_steps() -> None:
    """An optimizer's in-place step changes gate_up's values, not what its halves are: weights() stays the same
    object (what the kept read-free decision keys on, as for plain experts), and the next call computes with the
    new values (the float64 loop)."""
    experts = _experts()
    opt = torch.optim.SGD(experts.parameters(), lr=0.5)
    counts = [2, 2, 1]
    x = torch.randn(sum(counts), M, generator=torch.Generator().manual_seed(5))
    before = experts.weights()
    experts(x, counts).sum().backward()
    opt.step()
    assert experts.weights() is before
    reference = {n: t.detach() for n, t in experts.state_dict().items()}
    want = _dense(x, reference, [e for e, n in enumerate(counts) for _ in range(n)])
    with torch.no_grad():
        torch.testing.assert_close(experts(x, counts).double(), want, rtol=1e-5, atol=1e-6)


def _halves_of(name: str) -> tuple[str, ...]:
    """The names the pair apart gives a joined parameter's halves (by hand: gate_up -> w1, w3), else the name."""
    prefix, _, last = name.rpartition(".")
    pair = {"gate_up": ("w1", "w3"), "gate_up_bias": ("b1", "b3")}.get(last)
    return tuple(f"{prefix}.{half}" for half in pair) if pair else (name,)


def _assert_same_optimizer(apart: dict, joined: dict) -> None:
    """Two optimizer reports (dcp_layouts_worker.optimizer_report) of one state, the pairs apart and joined: every
    joined parameter's AdamW moments are its halves' side by side (the step the same), and the group that holds
    it has the hyperparameters of the group that holds each half; and the model's weights are the same."""
    assert apart["model"].keys() == joined["model"].keys() and any(".w3" in name for name in apart["model"])
    for name, value in apart["model"].items():
        assert torch.equal(torch.tensor(value), torch.tensor(joined["model"][name])), name
    expected = {half for name in joined["state"] for half in _halves_of(name)}
    assert set(apart["state"]) == expected and set(apart["group"]) == set(apart["state"])
    assert any(len(_halves_of(name)) == 2 for name in joined["state"])
    for name, entries in joined["state"].items():
        halves = _halves_of(name)
        for key in ("exp_avg", "exp_avg_sq"):
            want = torch.cat([torch.tensor(apart["state"][h][key]) for h in halves], dim=-1)
            assert torch.equal(torch.tensor(entries[key]), want), (name, key)
        assert all(apart["state"][h]["step"] == entries["step"] for h in halves), name
        assert all(apart["group"][h] == joined["group"][name] for h in halves), (name, joined["group"][name])


@pytest.mark.slow
def test_dcp_across_layouts_keeps_each_job_optimizer_groups_states_and_hyperparameters(tmp_path) -> None:
    """DCP with the training job's optimizer (build_optimizer: four groups, here each at a learning rate of its own,
    decay on matrices only): saved by 2 FSDP ranks (pairs apart) after 2 steps, loaded in one process holding
    gate_up and gate_up_bias; and saved in one process, loaded by 2 FSDP ranks. The loading side's optimizer starts
    at other hyperparameters; after the load each half's states and its group's lr and weight decay are the
    saving side's (torch's full optimizer state dict on both sides), gate_up's and gate_up_bias' halves each in
    their own group."""
    from dcp_layouts_worker import glu_gpt, job_optimizer, load_main, optimizer_report, save_main, train
    from flexmoe.launch import spawn_ranks
    from flexmoe.sharding import load_sharded, save_sharded

    saved = spawn_ranks(2, save_main, [str(tmp_path / "fsdp")], timeout=300.0, what="DCP save by 2 FSDP ranks")
    model = glu_gpt(99)
    opt = job_optimizer(model, source=False)
    load_sharded(tmp_path / "fsdp", model, opt)
    _assert_same_optimizer(saved[0].value, optimizer_report(model, opt))
    decayed = {g["weight_decay"] for g in saved[0].value["group"].values()}
    assert decayed == {0.1, 0.0}

    model = glu_gpt(0)
    opt = job_optimizer(model, source=True)
    train(model, opt, rank=0)
    save_sharded(tmp_path / "joined", model, opt)
    loaded = spawn_ranks(2, load_main, [str(tmp_path / "joined")], timeout=300.0, what="DCP load by 2 FSDP ranks")
    for rank in loaded:
        _assert_same_optimizer(rank.value, optimizer_report(model, opt))
