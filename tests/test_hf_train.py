"""``flexmoe train --hf-arch`` / ``--hf-model`` / ``--export-hf`` (flexmoe.apps.hf_job), and a converted Hugging
Face model trained with expert parallelism on 2 real gloo ranks against one process.

The CLI runs are tiny (short sequences, a few steps of the shipped small configurations). The exported model is
loaded with plain ``transformers`` and must give the logits of the trained model, rebuilt from the run's last
checkpoint. The 2-rank runs feed each rank its half of every batch through ``wrap_ddp``; the reference is one
process holding every expert that runs both halves and averages their losses.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF job needs transformers (pip install -e .[hf]; CI installs it via .[test])")

from flexmoe.apps import cli  # noqa: E402
from flexmoe.apps.data import TokenData  # noqa: E402
from flexmoe.apps.hf_job import HFJobConfig, build_hf_model  # noqa: E402
from flexmoe.checkpoint import expert_param_names, latest_checkpoint, load_checkpoint  # noqa: E402
from flexmoe.hf.block import ConvertedMoeBlock  # noqa: E402
from flexmoe.launch import spawn_ranks  # noqa: E402
from flexmoe.layer import MoELayer, update_expert_biases  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# A few short steps of the shipped small configurations.
TINY = ["--batch-size", "4", "--block-size", "32", "--warmup", "2", "--lr", "1e-2", "--log-every", "2",
        "--eval-every", "4", "--eval-batches", "1", "--ckpt-every", "4", "--no-progress", "--no-plots"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(argv: list[str]) -> int:
    return cli.main(["train", *argv])


# ------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("arch", ["mixtral", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_hf_arch_run_writes_the_run_directory_and_learns(arch: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert _train(["--hf-arch", arch, "--out", str(out), "--steps", "12", *TINY[:-1]]) == 0
    records = _metrics(out)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    losses = [r["train_loss"] for r in records]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses  # ln(256) = 5.55 at the start
    assert all(len(r["expert_load"][0]) == 8 for r in records)  # per MoE layer, 8 experts
    assert sum(records[-1]["expert_load"][0]) == 4 * 32 * 2  # every (token, choice) computed: dropless
    for name in ("config.json", "summary.json", "loss.png", "expert_load.png"):
        assert (out / name).is_file(), name
    assert latest_checkpoint(out).name == "step_000012"
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["arch"] == arch and config["model"]["hf_config"]["model_type"] == arch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == arch and summary["steps"] == 12 and summary["params"] > summary["active_params"]
    if arch == "deepseek_v3":
        assert config["model"]["convert_options"] == {"bias_update_rate": 1e-3}
        assert records[-1]["balance_loss"] == 0.0  # no auxiliary loss: the bias balances
    else:
        assert records[-1]["balance_loss"] > 0.5  # HF's loss, about 1 per layer... summed over 4 layers


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_hf_arch_trains_under_compile_as_eager(arch: str, tmp_path: Path) -> None:
    """--compile on a converted Hugging Face model: the losses of the eager run, step by step (aot_eager keeps
    the test short). DeepSeek-V3's multi-head latent attention compiles with one key/value head per query head,
    as in its own config (hf_configs); GPT-OSS's clamped experts keep the three stages."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert _train(["--hf-arch", arch, "--out", str(eager), "--steps", "4", *TINY]) == 0
    assert _train(["--hf-arch", arch, "--out", str(compiled), "--steps", "4", "--compile", "aot_eager", *TINY]) == 0
    want, got = _metrics(eager), _metrics(compiled)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, 4]
    for a, b in zip(want, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5, abs=1e-6)
        assert (a.get("val_loss") is None) == (b.get("val_loss") is None)
        if a.get("val_loss") is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5, abs=1e-6)


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path: Path, capsys) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _train(["--hf-arch", "qwen3_moe", "--out", str(whole), "--steps", "8", *TINY]) == 0
    # The same run as if killed right after its checkpoint at step 4 (the newest one then).
    shutil.copytree(whole, split)
    shutil.rmtree(split / "checkpoints" / "step_000008")
    (split / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4, "path": "step_000004"}))
    (split / "summary.json").unlink()
    # Resumed without --hf-arch: the run directory says what it trains.
    assert _train(["--out", str(split), "--resume", "--no-progress"]) == 0
    assert "resumed from" in capsys.readouterr().out
    timing = ("elapsed_s", "tokens_per_s")
    untimed = [[{k: v for k, v in r.items() if k not in timing} for r in _metrics(run)] for run in (whole, split)]
    assert [r["step"] for r in untimed[1]] == [2, 4, 6, 8]
    assert untimed[1] == untimed[0]  # steps 6 and 8 re-run bit for bit
    assert json.loads((split / "summary.json").read_text())["final_val_loss"] == \
        json.loads((whole / "summary.json").read_text())["final_val_loss"]
    # Once finished, --resume changes nothing.
    before = (split / "metrics.jsonl").read_text()
    assert _train(["--hf-arch", "qwen3_moe", "--out", str(split), "--resume", "--no-progress"]) == 0
    assert "already complete" in capsys.readouterr().out
    assert (split / "metrics.jsonl").read_text() == before


def _trained_model(run: Path):
    """The run's model (converted, one process) with the weights of its last checkpoint."""
    cfg = HFJobConfig.from_dict(json.loads((run / "config.json").read_text())["model"])
    model, _ = build_hf_model(cfg, seed=0, pretrained=False)
    load_checkpoint(latest_checkpoint(run), model=model, restore_rng=False)
    return model.eval()


@pytest.mark.parametrize("arch", ["gpt_oss", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_export_loads_in_plain_transformers_with_the_trained_logits(arch: str, tmp_path: Path) -> None:
    run, export = tmp_path / "run", tmp_path / "export"
    assert _train(["--hf-arch", arch, "--out", str(run), "--steps", "4", "--export-hf", str(export), *TINY]) == 0
    plain = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert not any(type(m).__module__.startswith("flexmoe") for m in plain.modules())
    trained = _trained_model(run)
    x = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = trained.hf(input_ids=x).logits
        theirs = plain(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # The training moved the weights: the export is not the initial model.
    fresh, _ = build_hf_model(trained.cfg, seed=1337, pretrained=False)
    with torch.no_grad():
        assert (fresh.hf(input_ids=x).logits - ours).abs().max() > 1e-3


def test_hf_model_trains_in_training_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """from_pretrained gives a model in eval, and convert keeps each block's mode: the loop puts every module in
    training mode before its first step (router jitter, bias updates and dropout are training's)."""
    from flexmoe.apps import train_loop

    saved = tmp_path / "saved"
    transformers.AutoModelForCausalLM.from_config(_tiny_config("mixtral")).save_pretrained(saved)
    seen: dict = {}
    real = train_loop.build_optimizer

    def capture(model, tcfg):  # the modes at the first forward (the run's last evaluation sets training after it)
        def first_forward(module, args):
            seen.setdefault("eval", [name for name, m in module.named_modules() if not m.training])
            seen.setdefault("blocks", sum(isinstance(m, ConvertedMoeBlock) for m in module.modules()))

        model.register_forward_pre_hook(first_forward)
        return real(model, tcfg)

    monkeypatch.setattr(train_loop, "build_optimizer", capture)
    assert _train(["--hf-model", str(saved), "--out", str(tmp_path / "b"), "--steps", "2", *TINY]) == 0
    assert seen["blocks"] > 0
    assert seen["eval"] == []


def test_hf_model_fine_tunes_a_saved_model_and_exports_it_again(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert _train(["--hf-arch", "olmoe", "--out", str(tmp_path / "a"), "--steps", "2", "--export-hf", str(first),
                   *TINY]) == 0
    assert _train(["--hf-model", str(first), "--out", str(tmp_path / "b"), "--steps", "2", "--export-hf",
                   str(second), *TINY]) == 0
    # The fine-tuning started from the saved weights: its first loss is that of the saved model, not ln(256).
    start = transformers.AutoModelForCausalLM.from_pretrained(first)
    run_a, run_b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert run_b[0]["train_loss"] < run_a[0]["train_loss"]
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model"]["hf_model"] == str(first)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(second)
    moved = max((a - b).abs().max() for a, b in zip(start.state_dict().values(), reloaded.state_dict().values()))
    assert moved > 0


def _save_model_with_tokenizer(directory: Path, text: str, vocab_size: int) -> None:
    """A small OLMoE and a BPE tokenizer of ``vocab_size`` tokens trained on ``text``, saved in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from flexmoe.apps.hf_configs import small_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(small_config("olmoe")).save_pretrained(directory)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]").save_pretrained(directory)


@pytest.mark.slow
def test_hf_model_with_a_tokenizer_trains_on_its_tokens(tmp_path: Path, capsys) -> None:
    text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak.\n" * 400
    (tmp_path / "data.txt").write_text(text)
    model_dir, export = tmp_path / "model", tmp_path / "export"
    _save_model_with_tokenizer(model_dir, text, vocab_size=120)
    out = tmp_path / "run"
    assert _train(["--hf-model", str(model_dir), "--data", str(tmp_path / "data.txt"), "--out", str(out),
                   "--steps", "2", "--export-hf", str(export), *TINY]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["tokenizer"] == str(model_dir) and "tokenized by" in config["data"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)  # exported beside the model
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text) / 2 and max(ids) < 120  # words, not bytes
    assert "validation" in capsys.readouterr().out
    # A tokenizer larger than the model's vocabulary cannot feed it.
    big = tmp_path / "big"
    _save_model_with_tokenizer(big, text + " ".join(f"w{i}" for i in range(400)), vocab_size=600)
    capsys.readouterr()
    err = _usage_error(["--hf-model", str(big), "--data", str(tmp_path / "data.txt"), "--out", str(tmp_path / "r2")],
                       capsys)
    assert "more than the model's vocabulary of 256" in err, err


def _usage_error(argv: list[str], capsys) -> str:
    assert _train(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,expected", [
    (["--hf-arch", "llama"], "--hf-arch llama: unknown; choose one of mixtral"),
    (["--hf-arch", "switch_transformers"], "--hf-arch switch_transformers: not offered: Switch Transformers is an "
                                           "encoder-decoder"),
    (["--hf-arch", "mixtral", "--hf-model", "x"], "--hf-arch and --hf-model exclude each other"),
    (["--hf-model", "no/such/dir"], "--hf-model no/such/dir: no such directory"),
    (["--hf-arch", "mixtral", "--n-layer", "2"], "--n-layer is a flag of the MoE GPT"),
    (["--hf-arch", "mixtral", "--compare-dense"], "--compare-dense is a flag of the MoE GPT"),
    (["--hf-arch", "mixtral", "--dense"], "--dense is a flag of the MoE GPT"),
    (["--export-hf", "x"], "--export-hf needs --hf-arch NAME or --hf-model DIR"),
    (["--hf-arch", "mixtral", "--block-size", "100000"], "longer than the model's max_position_embeddings"),
])
def test_bad_combinations_are_one_line_usage_errors(argv: list[str], expected: str, tmp_path: Path,
                                                     capsys) -> None:
    err = _usage_error([*argv, "--out", str(tmp_path / "run")], capsys)
    assert expected in err, err
    assert not (tmp_path / "run").exists()


def test_hf_model_needs_a_save_pretrained_directory(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    err = _usage_error(["--hf-model", str(tmp_path / "empty"), "--out", str(tmp_path / "run")], capsys)
    assert "no config.json" in err


def test_hf_model_refuses_an_encoder_decoder_model(tmp_path: Path, capsys) -> None:
    config = transformers.SwitchTransformersConfig(vocab_size=256, d_model=16, d_ff=12, d_kv=8, num_heads=2,
                                                   num_layers=2, num_decoder_layers=2, num_experts=4)
    config.save_pretrained(tmp_path / "switch")
    err = _usage_error(["--hf-model", str(tmp_path / "switch"), "--out", str(tmp_path / "run")], capsys)
    assert "an encoder-decoder model (switch_transformers): Switch Transformers is an encoder-decoder" in err


def test_resuming_another_model_is_refused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert _train(["--hf-arch", "mixtral", "--out", str(out), "--steps", "2", *TINY]) == 0
    err = _usage_error(["--hf-arch", "olmoe", "--out", str(out), "--resume"], capsys)
    assert "holds a run of mixtral, not of olmoe" in err
    err = _usage_error(["--hf-arch", "mixtral", "--out", str(out)], capsys)
    assert "already exists" in err
    assert cli.main(["generate", "--run", str(out)]) == 2
    assert "trained a Hugging Face model (mixtral), not the MoE GPT" in capsys.readouterr().err
    export = tmp_path / "notes"
    export.mkdir()
    (export / "mine.txt").write_text("keep")
    err = _usage_error(["--hf-arch", "mixtral", "--out", str(out), "--resume", "--export-hf", str(export)], capsys)
    assert "holding other files" in err and (export / "mine.txt").read_text() == "keep"


# ------------------------------------------------------------------------- 2 ranks = one process


def _tiny_config(family: str):
    """A tiny model of ``family`` (2 layers, width 32) for the 2-rank comparison."""
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if family == "mixtral":
        extra = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.05)
    else:  # DeepSeek-V3: 8 experts in 4 groups, the best 2 groups per token, a shared expert, scaled weights
        extra = dict(num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
                     norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=16,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return transformers.AutoConfig.for_model(family, **{**common, **extra})


def _ep_model(family: str, group):
    """The converted tiny model (DeepSeek-V3: a bias that moves fast, starting from random values)."""
    options = {"bias_update_rate": 0.02} if family == "deepseek_v3" else {}
    cfg = HFJobConfig(hf_config=_tiny_config(family).to_dict(), block_size=16, convert_options=options)
    model, _ = build_hf_model(cfg, seed=5, pretrained=False, group=group)
    g = torch.Generator().manual_seed(9)
    for layer in model.moe_layers:
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.randn(layer.expert_bias.shape, generator=g) * 0.05)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: 4 sequences of 16 byte tokens and their next tokens."""
    tokens = torch.randint(256, (4, 17), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


STEPS = 3


def _record_and_step(model: Any, optimizer: torch.optim.Optimizer, report: dict,
                     keep: Callable[[torch.Tensor], Any]) -> None:
    """After a step's backward: append every gradient and the selection biases after their update to ``report``
    (each as ``keep(tensor)``), then the optimizer's step."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name in [n for n in grads if n.endswith(".gate_up")]:  # a joined pair by its halves' names (as checkpoints)
        gate_up, prefix = grads.pop(name), name[:-len("gate_up")]
        grads[prefix + "w1"], grads[prefix + "w3"] = gate_up.chunk(2, dim=-1)
    report["grads"].append({n: keep(g) for n, g in grads.items()})
    update_expert_biases(model)
    report["biases"].append([keep(m.expert_bias) for m in model.moe_layers if m.expert_bias is not None])
    optimizer.step()
    optimizer.zero_grad()


def ep_rank(family: str) -> dict:
    """One of 2 ranks: the converted model over the world (each rank its experts), wrap_ddp, this rank's half of
    every batch; per step the loss, the gradients (experts: this rank's) and the selection biases."""
    import torch.distributed as dist

    from flexmoe.sharding.ddp import wrap_ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model = _ep_model(family, dist.group.WORLD)
    ddp = wrap_ddp(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report: dict = {"losses": [], "grads": [], "biases": [], "experts": sorted(expert_param_names(model))}
    for step in range(STEPS):
        x, y = _batch(step)
        half = slice(2 * rank, 2 * rank + 2)
        _, loss = ddp(x[half], y[half])
        total = loss + model.regularization_loss()
        total.backward()
        report["losses"].append(float(total.detach()))
        _record_and_step(model, optimizer, report, keep=torch.Tensor.tolist)  # plain lists cross the process
    # DDP holds the process group: free it first, so that destroying the group joins gloo's threads. Freed only
    # at the return, after the destroy, its last reference took the group down in a destructor that hung
    # (docs/architecture.md, "Clean exits").
    del ddp
    gc.collect()
    dist.destroy_process_group()
    return report


def _one_process(family: str) -> dict:
    """The reference: one process holding every expert runs both halves of every batch, mean of their losses."""
    model = _ep_model(family, None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report: dict = {"losses": [], "grads": [], "biases": []}
    for step in range(STEPS):
        x, y = _batch(step)
        halves = []
        for rank in range(2):
            half = slice(2 * rank, 2 * rank + 2)
            _, loss = model(x[half], y[half])
            halves.append(loss + model.regularization_loss())
        ((halves[0] + halves[1]) / 2).backward()
        report["losses"].append([float(h.detach()) for h in halves])
        _record_and_step(model, optimizer, report, keep=torch.Tensor.clone)
    return report


def _check_two_ranks_equal_one_process(family: str) -> None:
    ranks = [r.value for r in spawn_ranks(2, ep_rank, [family], timeout=150, what=f"2-rank {family}")]
    ref = _one_process(family)
    experts = set(ranks[0]["experts"])
    assert experts, "the converted model has spread experts"
    for step in range(STEPS):
        # Each rank's loss is its half's; the biases steer the selection, so equal losses need equal biases.
        for rank in range(2):
            assert ranks[rank]["losses"][step] == pytest.approx(ref["losses"][step][rank], rel=1e-5, abs=1e-6), \
                f"step {step} rank {rank}"
        for name, grad in ref["grads"][step].items():
            got = [torch.tensor(r["grads"][step][name]) for r in ranks]
            if name in experts:  # rank r holds experts r*E/2 .. (r+1)*E/2 - 1
                got_global = torch.cat(got, dim=0)
            else:  # replicated: all-reduced to the same mean on both ranks
                torch.testing.assert_close(got[0], got[1], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
                got_global = got[0]
            scale = float(grad.abs().max()) or 1.0
            torch.testing.assert_close(got_global, grad, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m, n=name, s=step: f"step {s} grad {n}: {m}")
        for rank in range(2):
            for got, want in zip(ranks[rank]["biases"][step], ref["biases"][step]):
                torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-7)
    if family == "deepseek_v3":
        # The bias did move (by the update rate per step), so the comparison covered its update.
        moe = [m for m in _ep_model(family, None).moe_layers if isinstance(m, MoELayer)]
        assert (ref["biases"][-1][0] - moe[0].expert_bias).abs().max() > 0.01


def test_two_ranks_equal_one_process_mixtral() -> None:
    _check_two_ranks_equal_one_process("mixtral")


@pytest.mark.slow
def test_two_ranks_equal_one_process_deepseek_v3_groups_and_bias() -> None:
    _check_two_ranks_equal_one_process("deepseek_v3")


@pytest.mark.slow
def test_train_nproc_2_with_expert_parallelism(tmp_path: Path) -> None:
    """``flexmoe train --hf-arch --nproc 2``: experts spread over 2 ranks; the run resumes at 1 rank."""
    out = tmp_path / "run"
    assert _train(["--hf-arch", "mixtral", "--out", str(out), "--steps", "4", "--nproc", "2", *TINY]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2
    assert _train(["--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert [r["step"] for r in _metrics(out)] == [2, 4, 6]


@pytest.mark.slow
def test_readme_expert_parallel_example_trains_and_saves_a_plain_hf_model(tmp_path: Path) -> None:
    """examples/hf/train_ep.py, quoted in the README, under torchrun with 2 ranks: it learns, exits cleanly, and
    what it saves is a plain transformers Mixtral holding every rank's trained experts."""
    example = Path(__file__).resolve().parents[1] / "examples" / "hf" / "train_ep.py"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", str(example)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    lines = re.findall(r"rank (\d) step (\d+): loss ([\d.]+)", done.stdout)
    printed = {(int(r), int(s)): float(v) for r, s, v in lines}
    assert sorted(printed) == [(r, s) for r in (0, 1) for s in (10, 20, 30, 40, 50)]
    for rank in (0, 1):
        assert printed[rank, 50] < printed[rank, 10] - 0.2

    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "mixtral-ep")
    assert type(saved.model.layers[0].mlp).__module__.startswith("transformers.")  # HF's block, not flexmoe's
    torch.manual_seed(0)
    fresh = transformers.AutoModelForCausalLM.from_config(saved.config)
    # Rank 0's rows of the last step: the saved model (after that step's update) does at least as well as the
    # loss printed before it; a model missing rank 1's experts would not.
    x, _ = TokenData.from_file(None, block_size=64).batch("train", 16, 64, seed=0, step=50, rows=slice(0, 8))
    with torch.no_grad():
        saved_loss = float(saved(input_ids=x, labels=x).loss)
        fresh_loss = float(fresh(input_ids=x, labels=x).loss)
    assert saved_loss < printed[0, 50] + 0.01
    assert saved_loss < fresh_loss - 1.5
