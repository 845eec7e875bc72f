"""flexmoe.upcycle: a dense model's MLPs become MoE layers whose initial logits are the dense model's."""

from __future__ import annotations

import argparse
import copy
import json
import re

import pytest
import torch

import flexmoe
from flexmoe.apps.models import GPT, GPTConfig
from flexmoe.layer import MoELayer

# (k, granularity) with E = 8: every combination of k in {1, 2, 8} and g in {1, 2, 4} where g divides k.
VALID = [(1, 1), (2, 1), (2, 2), (8, 1), (8, 2), (8, 4)]
FLOAT32_ROUNDING = dict(rtol=1e-5, atol=1e-6)


def _dense_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(dense=True, n_layer=2, n_embd=32, n_head=2, k=2, expert_hidden=32, block_size=16))
    with torch.no_grad():  # non-zero biases, so that the split of b2 over the slices is tested too
        for block in model.blocks:
            block.mlp.fc.bias.normal_(0.0, 0.5)
            block.mlp.proj.bias.normal_(0.0, 0.5)
    return model


def _tokens(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k,granularity", VALID)
def test_gpt_upcycled_logits_equal_dense(k: int, granularity: int) -> None:
    dense = _dense_gpt()
    idx = _tokens(256)
    expected, _ = dense(idx)
    moe = flexmoe.upcycle(copy.deepcopy(dense), num_experts=8, k=k, granularity=granularity)
    assert isinstance(moe, GPT) and all(isinstance(b.mlp, MoELayer) for b in moe.blocks)
    assert (moe.cfg.dense, moe.cfg.num_experts, moe.cfg.k, moe.cfg.expert_hidden) == (False, 8, k, 64 // granularity)
    for mode in (moe.train, moe.eval):  # the training forward too: nothing in it breaks the ties
        mode()
        got, _ = moe(idx)
        torch.testing.assert_close(got, expected, **FLOAT32_ROUNDING)
    # The config describes the upcycled model: a GPT built from it takes its state dict.
    GPT(moe.cfg).load_state_dict(moe.state_dict())


def _hf_dense(family: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return model_cls(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("k,granularity", VALID)
def test_hf_upcycled_logits_equal_dense(family: str, k: int, granularity: int) -> None:
    dense = _hf_dense(family)
    idx = _tokens(64)
    expected = dense(idx).logits
    moe = flexmoe.upcycle(copy.deepcopy(dense), num_experts=8, k=k, granularity=granularity)
    layers = [layer.mlp for layer in moe.model.layers]
    assert all(isinstance(m, MoELayer) and m.k == k and m.hidden_dim == 64 // granularity for m in layers)
    torch.testing.assert_close(moe(idx).logits, expected, **FLOAT32_ROUNDING)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("k,granularity", [(1, 1), (2, 2), (8, 4)])
def test_hf_upcycled_into_the_twin_family_equals_dense(family: str, k: int, granularity: int) -> None:
    from flexmoe.hf import ConvertedMoeBlock, upcycle_into_twin

    dense = _hf_dense(family)
    idx = _tokens(64)
    expected = dense(idx).logits
    moe = upcycle_into_twin(copy.deepcopy(dense), num_experts=8, k=k, granularity=granularity)
    blocks = [layer.mlp for layer in moe.model.layers]
    assert all(isinstance(b, ConvertedMoeBlock) for b in blocks)
    assert blocks[0].family == ("mixtral" if family == "llama" else "qwen3_moe")
    assert "model.layers.0.mlp.experts.gate_up_proj" in moe.state_dict()  # HF's twin's names
    torch.testing.assert_close(moe(idx).logits, expected, **FLOAT32_ROUNDING)


@pytest.mark.parametrize("twin", [False, True], ids=["moe-layer", "qwen3-moe"])
def test_hf_upcycled_unnormalized_softmax_weights(twin: bool) -> None:
    """Unnormalised weights (Qwen's norm_topk_prob=False): each chosen expert weighs 1/E, so the experts carry
    sigma = g * E / k."""
    from flexmoe.hf import upcycle_into_twin

    dense = _hf_dense("qwen3")
    idx = _tokens(64)
    upcycle_fn = upcycle_into_twin if twin else flexmoe.upcycle
    moe = upcycle_fn(copy.deepcopy(dense), num_experts=8, k=2, granularity=2, normalize_weights=False)
    layer = moe.model.layers[0].mlp
    assert (layer.moe if twin else layer).normalize_weights is False
    torch.testing.assert_close(moe(idx).logits, dense(idx).logits, **FLOAT32_ROUNDING)


@pytest.mark.parametrize("score_func,normalize_weights", [("softmax", True), ("softmax", False),
                                                        ("sigmoid", True), ("sigmoid", False)])
def test_hf_upcycled_with_route_scale_equals_dense(score_func: str, normalize_weights: bool) -> None:
    """route_scale = 2 multiplies every combine weight (1/k normalised, 1/E softmax, sigmoid(0) = 1/2 raw): the
    experts carry sigma = g / (k c route_scale), and the logits stay the dense model's."""
    dense = _hf_dense("qwen3")
    idx = _tokens(64)
    moe = flexmoe.upcycle(copy.deepcopy(dense), num_experts=8, k=2, granularity=2, route_scale=2.0,
                          score_func=score_func, normalize_weights=normalize_weights)
    layer = moe.model.layers[0].mlp
    assert (layer.routing_options.score_func, layer.routing_options.route_scale) == (score_func, 2.0)
    torch.testing.assert_close(moe(idx).logits, dense(idx).logits, **FLOAT32_ROUNDING)


def _router_grads(model: GPT) -> list[torch.Tensor | None]:
    return [layer.router.weight.grad for layer in model.moe_layers]


def test_gpt_router_learns_from_the_task_loss() -> None:
    """g = 2: the chosen experts hold different slices, so the task loss alone moves the zero router."""
    moe = flexmoe.upcycle(_dense_gpt(), num_experts=8, k=2, granularity=2)
    idx = _tokens(256)
    _, loss = moe(idx, idx.roll(-1, dims=1))
    loss.backward()
    for grad in _router_grads(moe):
        assert grad is not None and grad.abs().max() > 1e-6


def test_gpt_router_learns_from_the_balance_loss_and_routing_spreads() -> None:
    """g = 1: the k chosen copies are equal, so the task loss leaves the router still; the balance loss moves it,
    and after one optimizer step tokens no longer all pick experts 0..k-1."""
    moe = flexmoe.upcycle(_dense_gpt(), num_experts=8, k=2, granularity=1)
    idx = _tokens(256)
    moe(idx)
    assert all(layer.last_plan.load.tolist() == [32, 32, 0, 0, 0, 0, 0, 0] for layer in moe.moe_layers)
    moe.aux_loss().backward()
    grads = _router_grads(moe)
    assert all(g is not None and g.abs().max() > 1e-6 for g in grads)
    with torch.no_grad():
        for layer, grad in zip(moe.moe_layers, grads, strict=True):
            layer.router.weight -= 1.0 * grad
    moe(idx)
    assert any(layer.last_plan.load[2:].sum() > 0 for layer in moe.moe_layers)


@pytest.mark.parametrize("twin", [False, True], ids=["moe-layer", "mixtral"])
def test_hf_router_gets_gradient(twin: bool) -> None:
    from flexmoe.hf import upcycle_into_twin

    upcycle_fn = upcycle_into_twin if twin else flexmoe.upcycle
    moe = upcycle_fn(_hf_dense("llama"), num_experts=4, k=2, granularity=2)
    idx = _tokens(64)
    moe(idx, labels=idx).loss.backward()
    mlp = moe.model.layers[0].mlp
    grad = mlp.moe.router.hf_router.weight.grad if twin else mlp.router.weight.grad
    assert grad is not None and grad.abs().max() > 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=8, k=1, granularity=2), "k=1 must be a multiple of granularity=2"),
    (dict(num_experts=6, k=4, granularity=4), "num_experts=6 must be a multiple of granularity=4"),
    (dict(num_experts=4, k=8, granularity=1), "k must be in"),
    (dict(num_experts=8, k=3, granularity=3), "must be a multiple of granularity=3|must divide the MLP's hidden"),
    (dict(num_experts=8, k=2, granularity=1, capacity_factor=1.25), "capacity_factor=1.25 would drop tokens"),
    (dict(num_experts=8, k=2, granularity=1, router="cosine"), "router='topk'"),
    (dict(num_experts=8, k=2, granularity=1, num_experts_per_layer=3), "unknown GPTConfig fields"),
    (dict(num_experts=8, k=2, granularity=1, moe_every=2), "sets \\['moe_every'\\] itself"),
    (dict(num_experts=0, k=1, granularity=1), "num_experts"),
])
def test_bad_gpt_arguments_are_value_errors(kwargs: dict, match: str) -> None:
    dense = _dense_gpt()
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        flexmoe.upcycle(dense, **kwargs)
    assert all(isinstance(b.mlp, flexmoe.apps.models.moe_model.DenseMLP) for b in dense.blocks)
    assert all(torch.equal(before[k], v) for k, v in dense.state_dict().items())


@pytest.mark.parametrize("twin", [False, True], ids=["moe-layer", "mixtral"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(ties="topk"), "ties='lower'"),
    (dict(gate_noise=0.1), "gate_noise=0.0"),
    (dict(capacity=4), "capacity=None"),
    (dict(capacity_factor=1.0), "capacity_factor=1.0 would drop tokens"),
    (dict(granularity=3), "granularity=3 must divide|must be a multiple of granularity=3"),
])
def test_bad_hf_arguments_are_value_errors(twin: bool, kwargs: dict, match: str) -> None:
    from flexmoe.hf import upcycle_into_twin

    dense = _hf_dense("llama")
    upcycle_fn = upcycle_into_twin if twin else flexmoe.upcycle
    with pytest.raises(ValueError, match=match):
        upcycle_fn(dense, **{"num_experts": 4, "k": 2, "granularity": 1, **kwargs})
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in dense.model.layers)


@pytest.mark.parametrize("upcycle_fn,kwargs,match", [
    ("twin", dict(normalize_weights=False), "normalize_weights=False has no Mixtral block"),
    ("twin", dict(route_scale=2.0), "fixed by the HF block's family"),
    ("layer", dict(activation="relu"), "takes \\['activation'\\] from the dense MLP"),
])
def test_bad_hf_options_of_each_form(upcycle_fn: str, kwargs: dict, match: str) -> None:
    from flexmoe.hf import upcycle_into_twin

    dense = _hf_dense("llama")
    with pytest.raises(ValueError, match=match):
        (upcycle_into_twin if upcycle_fn == "twin" else flexmoe.upcycle)(dense, num_experts=4, k=2, **kwargs)
    assert type(dense.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_unknown_models_are_refused() -> None:
    with pytest.raises(ValueError, match="has no dense MLP upcycle\\(\\) knows"):
        flexmoe.upcycle(torch.nn.Linear(4, 4), num_experts=4, k=1)
    with pytest.raises(TypeError, match="granularity must be an int"):
        flexmoe.upcycle(_dense_gpt(), num_experts=4, k=2, granularity=2.0)


def _train(argv: list[str]) -> int:
    from flexmoe.apps import train_command as train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return train.run(parser.parse_args(argv))


def _first_train_loss(run_dir) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]


TINY_DENSE = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--k", "2",
              "--expert-hidden", "32", "--batch-size", "4", "--no-progress", "--no-plots", "--eval-batches", "1"]


@pytest.mark.usefixtures("one_thread")
def test_train_upcycle_from_continues_the_dense_run(tmp_path) -> None:
    """--upcycle-from RUN --compare-dense: the upcycled model and the continued dense model start from the dense
    run's weights, so their first step's loss (same batch, before any update) agrees to float32 rounding."""
    dense_run, out = tmp_path / "dense", tmp_path / "up"
    assert _train(["--dense", "--out", str(dense_run), "--steps", "3", *TINY_DENSE]) == 0
    assert _train(["--upcycle-from", str(dense_run), "--num-experts", "4", "--k", "2", "--granularity", "2",
                   "--compare-dense", "--seed", "5", "--out", str(out), "--steps", "2", "--log-every", "1",
                   "--eval-batches", "1", "--batch-size", "4", "--no-progress", "--no-plots"]) == 0
    moe_loss, dense_loss = _first_train_loss(out), _first_train_loss(out / "dense")
    assert abs(moe_loss - dense_loss) < 1e-5
    # Not the dense run's first step: the weights came from its checkpoint, not from the seed.
    assert abs(dense_loss - _first_train_loss(dense_run)) > 1e-3
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["dense"], model["moe_every"], model["num_experts"], model["expert_hidden"]) == (False, 1, 4, 32)


@pytest.mark.usefixtures("one_thread")
def test_train_upcycle_from_refuses_bad_runs_and_flags(tmp_path, capsys) -> None:
    from flexmoe.apps import cli

    dense_run = tmp_path / "dense"
    assert _train(["--dense", "--out", str(dense_run), "--steps", "1", *TINY_DENSE]) == 0
    moe_run = tmp_path / "moe"
    moe_run.mkdir()
    (moe_run / "config.json").write_text(json.dumps({"model": {"dense": False}}))
    base = ["train", "--out", str(tmp_path / "up"), "--steps", "1"]
    cases = [
        (["--upcycle-from", str(moe_run)], "not a dense GPT run"),
        (["--upcycle-from", str(tmp_path / "none")], "no .*config.json"),
        (["--upcycle-from", str(dense_run), "--k", "3", "--granularity", "2"], "k=3 must be a multiple"),
        (["--upcycle-from", str(dense_run), "--n-layer", "3"], "leave out the model flags \\['--n-layer'\\]"),
        (["--upcycle-from", str(dense_run), "--dense"], "--dense excludes it"),
        (["--granularity", "2"], "--granularity slices the dense MLPs of --upcycle-from"),
        (["--hf-arch", "mixtral", "--upcycle-from", str(dense_run)], "--upcycle-from is a flag of the MoE GPT"),
        (["--hf-arch", "mixtral", "--granularity", "2"], "--granularity is a flag of the MoE GPT"),
        (["--hf-arch", "mixtral", "--aux-loss-type", "global"], "--aux-loss-type is a flag of the MoE GPT"),
    ]
    for flags, match in cases:
        assert cli.main([*base, *flags]) == 2
        assert re.search(match, capsys.readouterr().err), flags


def test_vit_upcycled_logits_equal_dense() -> None:
    from flexmoe.apps.models.vit import ViT, ViTConfig

    torch.manual_seed(0)
    dense = ViT(ViTConfig(dense=True, n_layer=2)).eval()
    images = torch.randn(2, dense.cfg.channels, dense.cfg.image_size, dense.cfg.image_size)
    expected = dense(images)
    moe = flexmoe.upcycle(copy.deepcopy(dense), num_experts=4, k=2, granularity=2)
    assert moe.cfg.router == "topk" and not moe.cfg.dense  # the ViT's cosine router cannot start tied
    torch.testing.assert_close(moe(images), expected, **FLOAT32_ROUNDING)


@pytest.mark.slow
@pytest.mark.parametrize("k,granularity", [(2, 2), (8, 4)])
def test_hf_upcycled_under_expert_parallelism_equals_dense(k: int, granularity: int) -> None:
    """2 gloo ranks, 4 of the 8 experts each: every rank's logits are the dense model's on its own tokens."""
    from flexmoe.launch import spawn_ranks
    from upcycle_worker import run_rank

    ranks = spawn_ranks(2, run_rank, [k, granularity], timeout=120, what="upcycling under expert parallelism")
    for rank in ranks:
        assert rank.value["local_experts"] == 4
        assert rank.value["max_diff"] <= 1e-5 * max(1.0, rank.value["scale"]), rank.value
