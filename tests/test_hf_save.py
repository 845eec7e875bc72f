"""A converted Hugging Face model inside HF's own toolchain: its state dict, ``save_pretrained`` and ``Trainer``
checkpoints are HF's own names and layout, load back into a converted model (strict), refuse missing tensors,
and ``convert`` / ``to_hf`` keep every parameter's ``requires_grad``, dtype and device. Switch Transformers (one
``wi`` / ``wo`` Linear pair per expert, read and written through its family) goes through the same checks.

References are HF's own: the unconverted model's ``state_dict()`` and logits, HF's eager model trained alongside
(in one process on the whole batch for the 2-rank case, tests/hf_ep_worker.py), and plain
``AutoModelForCausalLM`` / ``AutoModelForSeq2SeqLM.from_pretrained`` of what was saved.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="flexmoe.hf needs transformers (pip install -e .[hf]; CI installs it via .[test])")

import flexmoe.hf as fh  # noqa: E402
from flexmoe.apps import cli  # noqa: E402
from test_hf_convert import (  # noqa: E402
    COMMON,
    FAMILIES,
    FAMILY_CONFIGS,
    TOL,
    batches,
    moe_blocks,
    tiny_model,
    tiny_switch,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def sgd_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> list[float]:
    """Steps of HF's causal-LM loss; the losses."""
    model.train()
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Evaluation logits; the labels give Switch's decoder its input (shifted right), a causal LM's logits ignore
    them."""
    model.eval()
    with torch.no_grad():
        return model(ids, labels=ids).logits


BLOCK = "model.layers.1.mlp."  # an MoE block in every family (DeepSeek's first layer is dense)
SWITCH = "switch_transformers"
SAVE_FAMILIES = [*FAMILIES, SWITCH]  # Switch: HF keeps one wi / wo Linear pair per expert, not fused tensors
SWITCH_BLOCK = "encoder.block.1.layer.1.mlp."  # Switch's sparse encoder block


def hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """HF's tiny model of ``family``: test_hf_convert's causal LMs, Switch's encoder-decoder."""
    return tiny_switch(seed) if family == SWITCH else tiny_model(family, seed)


def plain_from_pretrained(family: str, directory: str | Path) -> torch.nn.Module:
    """``from_pretrained`` of plain transformers, by the auto class of the model's kind."""
    auto = transformers.AutoModelForSeq2SeqLM if family == SWITCH else transformers.AutoModelForCausalLM
    return auto.from_pretrained(directory)


# --------------------------------------------------------------------------------------- HF's names on disk


@pytest.mark.parametrize("family", SAVE_FAMILIES)
def test_state_dict_is_hfs_own_keys_shapes_and_values(family):
    ref = hf_model(family)
    model = fh.convert(copy.deepcopy(ref), group="single")
    want, got = ref.state_dict(), model.state_dict()
    assert list(got) == list(want), sorted(set(got) ^ set(want))  # HF's keys, in HF's order
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("family", SAVE_FAMILIES)
def test_save_pretrained_mid_training_loads_in_plain_transformers_and_training_goes_on(family, tmp_path):
    """No to_hf: save_pretrained of the converted model in the middle of training, HF's eager model trained
    alongside as the reference; the optimizer keeps the live parameters, so training goes on as HF's."""
    ref = hf_model(family)
    model = fh.convert(copy.deepcopy(ref), group="single")
    data = batches(6, seed=21)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    torch.testing.assert_close(sgd_steps(model, opt, data[:3]), sgd_steps(ref, ref_opt, data[:3]), rtol=1e-4,
                               atol=1e-5)
    model.save_pretrained(tmp_path)
    ids = batches(1, seed=8)[0]
    plain = plain_from_pretrained(family, tmp_path)
    assert not moe_blocks(plain)
    torch.testing.assert_close(logits(plain, ids), logits(ref, ids), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), **TOL)
    torch.testing.assert_close(sgd_steps(model, opt, data[3:]), sgd_steps(ref, ref_opt, data[3:]), rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", SAVE_FAMILIES)
def test_an_hf_state_dict_loads_back_into_a_converted_model(family):
    """HF's state dict of another model (other seed) loads strictly into a converted one: the converted model
    then computes that model's logits, and saves that model's state dict again."""
    other = hf_model(family, seed=5)
    model = fh.convert(hf_model(family), group="single")
    assert not model.load_state_dict(other.state_dict(), strict=True).missing_keys
    ids = batches(1, seed=8)[0]
    torch.testing.assert_close(logits(model, ids), logits(other, ids), **TOL)
    for name, tensor in other.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_expert_or_router_tensors_are_errors_naming_them(family):
    model = fh.convert(tiny_model(family), group="single")
    full = tiny_model(family, seed=5).state_dict()
    block = BLOCK
    router = block + ("router" if family == "gpt_oss" else "gate") + ".weight"
    no_experts = {k: v for k, v in full.items() if not k.startswith(block + "experts.")}
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{block}experts\.gate_up_proj.*"):
        model.load_state_dict(no_experts)
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{router}"):
        model.load_state_dict({k: v for k, v in full.items() if k != router})
    # One of the experts' fused tensors without the other: an error even when not strict.
    with pytest.raises(RuntimeError, match=rf"{block}experts: .*missing \['{block}experts\.down_proj'\]"):
        model.load_state_dict({k: v for k, v in full.items() if k != block + "experts.down_proj"}, strict=False)
    # A tensor of another model's shape (2 experts, not all): named, not loaded.
    cut = {**full, block + "experts.down_proj": full[block + "experts.down_proj"][:2]}
    with pytest.raises(RuntimeError, match=rf"{block}experts: .*size mismatch for down_proj"):
        model.load_state_dict(cut)
    # Not strict: reported under HF's names, and the layer keeps its experts (never initialised anew).
    experts = model.get_submodule(block + "moe.experts")
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    result = model.load_state_dict(no_experts, strict=False)
    assert block + "experts.gate_up_proj" in result.missing_keys
    assert not any(".moe." in k for k in result.missing_keys), result.missing_keys
    for name, p in experts.named_parameters():
        assert torch.equal(p, before[name]), name


def test_switch_missing_or_partial_experts_are_errors_naming_them():
    """Switch's experts are one HF module each: a missing one, or one expert's ``wo`` without the rest, is named."""
    model = fh.convert(tiny_switch(), group="single")
    full = tiny_switch(seed=5).state_dict()
    block = SWITCH_BLOCK
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{block}experts\.expert_0\.wi\.weight"):
        model.load_state_dict({k: v for k, v in full.items() if not k.startswith(block + "experts.")})
    with pytest.raises(RuntimeError, match=rf"{block}experts: .*missing \['{block}experts\.expert_2\.wo\.weight'\]"):
        model.load_state_dict({k: v for k, v in full.items() if k != block + "experts.expert_2.wo.weight"},
                              strict=False)


def test_hf_model_from_a_directory_of_flexmoe_internal_names_is_a_usage_error(tmp_path, capsys):
    """What save_pretrained of a converted model used to write (``...mlp.moe.experts.w1``): the job refuses it
    instead of fine-tuning randomly initialised experts; so too a checkpoint missing its experts."""
    from safetensors.torch import save_file

    internal, partial = tmp_path / "internal", tmp_path / "partial"
    config = transformers.AutoConfig.for_model("olmoe", **{**COMMON, "vocab_size": 256}, **FAMILY_CONFIGS["olmoe"])
    model = fh.convert(transformers.AutoModelForCausalLM.from_config(config), group="single")  # byte tokens
    for directory in (internal, partial):
        model.config.save_pretrained(directory)
    save_file({k: v.detach().contiguous() for k, v in model.named_parameters()}, internal / "model.safetensors",
              metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if ".experts." not in k},
              partial / "model.safetensors", metadata={"format": "pt"})
    for directory, expected in ((internal, "flexmoe's internal names instead"), (partial, "at random")):
        assert cli.main(["train", "--hf-model", str(directory), "--out", str(tmp_path / "run"), "--steps", "1",
                         "--block-size", "8", "--no-progress", "--no-plots"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own loading report
        assert err.startswith(f"error: --hf-model {directory}: the checkpoint lacks"), err
        assert expected in err, err
        assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------- frozen stays frozen


def _freeze(model: torch.nn.Module, family: str) -> dict[str, bool]:
    """Freeze the second layer's router, fused gate_up_proj and shared expert's up_proj (HF's names); the
    flags of every parameter of the block."""
    block = model.get_submodule("model.layers.1.mlp")
    getattr(block, "router" if family == "gpt_oss" else "gate").weight.requires_grad_(False)
    block.experts.gate_up_proj.requires_grad_(False)
    shared = getattr(block, "shared_expert", getattr(block, "shared_experts", None))
    if shared is not None:
        shared.up_proj.weight.requires_grad_(False)
    return {name: p.requires_grad for name, p in block.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_and_to_hf_keep_requires_grad(family):
    ref = tiny_model(family)
    flags = _freeze(ref, family)
    model = fh.convert(copy.deepcopy(ref), group="single")
    moe = model.model.layers[1].mlp.moe
    assert not moe.experts.w1.requires_grad and not moe.experts.w3.requires_grad and moe.experts.w2.requires_grad
    if moe.shared is not None:
        assert moe.shared.w1.requires_grad and not moe.shared.w3.requires_grad and moe.shared.w2.requires_grad
    # Trained side by side with HF's model frozen alike: the same steps, the frozen tensors unchanged.
    data = batches(3, seed=4)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    torch.testing.assert_close(sgd_steps(model, opt, data), sgd_steps(ref, ref_opt, data), rtol=1e-4, atol=1e-5)
    fh.to_hf(model)
    block = model.get_submodule("model.layers.1.mlp")
    assert {name: p.requires_grad for name, p in block.named_parameters()} == flags
    trained = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(block.experts.gate_up_proj, tiny_model(family).model.layers[1].mlp.experts.gate_up_proj)


def test_switch_convert_and_to_hf_keep_requires_grad():
    """Switch: the router and every expert's ``wi`` frozen in HF's model; flexmoe's ``w1`` (all the ``wi``) is
    frozen, ``w2`` not, training matches HF's frozen alike, and to_hf gives each expert's Linear its flag back."""
    ref = tiny_switch()
    block = ref.get_submodule(SWITCH_BLOCK[:-1])
    block.router.classifier.weight.requires_grad_(False)
    for e in range(block.experts.num_experts):
        block.experts[f"expert_{e}"].wi.weight.requires_grad_(False)
    flags = {name: p.requires_grad for name, p in ref.named_parameters()}
    model = fh.convert(copy.deepcopy(ref), group="single")
    moe = model.get_submodule(SWITCH_BLOCK + "moe")
    assert not moe.experts.w1.requires_grad and moe.experts.w2.requires_grad
    assert not moe.router.hf_router.classifier.weight.requires_grad
    data = batches(3, seed=4)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    torch.testing.assert_close(sgd_steps(model, opt, data), sgd_steps(ref, ref_opt, data), rtol=1e-4, atol=1e-5)
    fh.to_hf(model)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    trained = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-4, atol=1e-5, msg=name)
    fresh = tiny_switch().get_submodule(SWITCH_BLOCK + "experts.expert_1.wi")
    assert torch.equal(model.get_submodule(SWITCH_BLOCK + "experts.expert_1.wi").weight, fresh.weight)


def test_switch_experts_frozen_one_by_one_are_refused():
    """flexmoe holds every expert's ``wi`` in one ``w1``: one frozen expert among trainable ones is named, before
    any block is emptied (the decoder's block is the model's second)."""
    ref = tiny_switch()
    decoder_block = ref.decoder.block[1].layer[2].mlp
    decoder_block.experts["expert_1"].wo.weight.requires_grad_(False)
    want = dict(ref.state_dict())
    with pytest.raises(ValueError, match=r"experts: \['expert_1\.wo\.weight'\] are frozen .* moe\.experts\.w2"):
        fh.convert(ref, group="single")
    assert not moe_blocks(ref)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_to_hf_refuses_w1_and_w3_frozen_apart():
    """Converted blocks hold w1 and w3 as one parameter, gate_up (one flag, as HF's gate_up_proj): a half cannot be
    frozen alone. Laid apart (joined_gate_up=False) they can, and to_hf refuses to merge different flags."""
    joined = fh.convert(tiny_model("mixtral"), group="single").model.layers[1].mlp.moe.experts
    with pytest.raises(RuntimeError, match="leaf"):
        joined.w1.requires_grad_(False)
    joined.gate_up.requires_grad_(False)
    assert not joined.w1.requires_grad and not joined.w3.requires_grad
    model = fh.convert(tiny_model("mixtral"), group="single", joined_gate_up=False)
    model.model.layers[1].mlp.moe.experts.w1.requires_grad_(False)
    with pytest.raises(ValueError, match=r"moe\.experts\.w1 \(requires_grad=False\) and moe\.experts\.w3 "
                                         r"\(requires_grad=True\) are one HF tensor, experts\.gate_up_proj"):
        fh.to_hf(model)
    assert len(moe_blocks(model)) == 2  # refused before any block went back


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_convert_and_to_hf_keep_dtype(family):
    ref = tiny_model(family).to(torch.bfloat16)
    ref.set_experts_implementation("eager")  # HF's grouped_mm wants 16-byte strides, H=12 in bf16 has 24
    model = fh.convert(copy.deepcopy(ref), group="single")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = batches(1)[0]
    torch.testing.assert_close(logits(model, ids), logits(ref, ids), rtol=2e-2, atol=2e-2)
    fh.to_hf(model)
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in ref.named_parameters()}


def test_a_shared_expert_in_another_dtype_is_refused():
    model = tiny_model("qwen2_moe")
    model.model.layers[0].mlp.shared_expert.to(torch.float64)
    with pytest.raises(ValueError, match=r"Qwen2MoeSparseMoeBlock\.shared_expert .*float64.*float32"):
        fh.convert(model, group="single")


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_only_lora_then_convert_leaves_the_experts_frozen(family):
    """PEFT freezes every base weight; converting the PEFT model keeps them frozen, so a step moves the LoRA
    weights only (before this, convert made every expert trainable again)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=2, target_modules=["o_proj"],
                                                                     init_lora_weights=False))
    fh.convert(lora, group="single")
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    sgd_steps(lora, torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.05), batches(1))
    for name, p in lora.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), name


# -------------------------------------------------------------------------------------------- Trainer


def test_trainer_example_trains_saves_and_plain_transformers_reloads(tmp_path):
    """examples/hf/trainer.py: transformers.Trainer trains a converted model; what Trainer saves (final model and
    its mid-run checkpoint) is HF's format: plain from_pretrained gives the converted model's logits."""
    path = Path(__file__).resolve().parents[1] / "examples" / "hf" / "trainer.py"
    spec = importlib.util.spec_from_file_location("trainer_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, losses = example.main(tmp_path)
    assert losses[-1] < losses[0] - 0.3, losses
    assert moe_blocks(model)  # still converted: Trainer saved it as it is
    ids = batches(1, seed=8)[0]
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not moe_blocks(plain)
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), **TOL)
    checkpoint = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-10")
    assert not moe_blocks(checkpoint)
    assert not torch.allclose(logits(checkpoint, ids), logits(model, ids), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------- expert parallelism


@pytest.mark.slow
def test_two_ranks_save_pretrained_midway_loads_in_plain_transformers_and_training_goes_on(tmp_path):
    """Experts over 2 gloo ranks: save_pretrained in the middle of training on every rank (the state dict gathers
    every expert), plain from_pretrained gives HF's one-process model's logits, the saved state dict loads back
    into a model converted over the ranks, and training goes on as HF's."""
    from flexmoe.launch import spawn_ranks
    from hf_ep_worker import save_rank_main

    ranks = spawn_ranks(2, save_rank_main, [SAVE_FAMILIES, str(tmp_path)], timeout=400, check=True,
                        what="save_pretrained of a converted model with 2 expert-parallel ranks")
    failures = [f"rank {r.rank}: {f}" for r in ranks for f in r.value["failures"]]
    assert not failures, "\n".join(failures)
    assert [r.value["rank"] for r in ranks] == [0, 1]
