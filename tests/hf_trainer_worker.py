"""One rank of the ``flexmoe.hf.ExpertParallelTrainer`` cases in tests/test_hf_trainer.py (run by
flexmoe.launch.spawn_ranks): a tiny HF Qwen3-MoE trained by plain ``transformers.Trainer`` in one process, or by
``ExpertParallelTrainer`` with its experts over the ranks, on the same data; the rank reports its logs."""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

VOCAB, LENGTH = 64, 16


def tiny_config(**overrides: Any) -> Any:
    """A Qwen3-MoE of 2 layers, 4 experts of width 32, top-2 (every rank of 2 holds 2 experts)."""
    from transformers import AutoConfig

    options = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                   num_experts_per_tok=2, tie_word_embeddings=False)
    return AutoConfig.for_model("qwen3_moe", **{**options, **overrides})


def counting_sequences(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Sequences counting up from a random start by a random stride (1-3) modulo VOCAB."""
    import torch

    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def train_main(directory: str, kind: str, options: dict[str, Any]) -> dict[str, Any]:
    """Train ``options["steps"]`` optimizer steps with ``kind`` ("plain": ``Trainer``, one process; "ep":
    ``ExpertParallelTrainer``) writing checkpoints under ``directory`` and the final model to ``directory/final``;
    evaluate and predict. The global batch is ``options["batch"]`` rows per micro-batch whatever the world."""
    return _in_world(lambda world, out: _train(directory, kind, options, world, out))


def _in_world(work: Callable[[int, dict[str, Any]], None]) -> dict[str, Any]:
    """Join the gloo group if there are several ranks, run ``work(world, report)``, leave; the rank's report
    (``failures``: the traceback, if ``work`` raised)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from multiproc import kernels_by_rule

    kernels_by_rule()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {"rank": int(os.environ.get("RANK", "0")), "failures": []}
    try:
        work(world, out)
    except Exception:
        out["failures"].append(traceback.format_exc())
    if world > 1:
        dist.destroy_process_group()
    return out


def _train(directory: str, kind: str, options: dict[str, Any], world: int, out: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from flexmoe.hf import ExpertParallelTrainer, convert
    from flexmoe.hf.block import ConvertedMoeBlock

    torch.manual_seed(options.get("model_seed", 0))
    model = AutoModelForCausalLM.from_config(tiny_config(**options.get("config", {})))
    if options.get("ep_size"):  # expert-parallel groups of ep_size consecutive ranks: replicas of each expert
        import torch.distributed as dist

        size = options["ep_size"]
        groups = [dist.new_group(list(range(b * size, (b + 1) * size))) for b in range(world // size)]
        model = convert(model, group=groups[dist.get_rank() // size])
    if options.get("mesh"):  # laid out with FSDP2 beside the experts: {"ep": .., "dp_shard": ..}
        from flexmoe.sharding import make_mesh, parallelize

        model = parallelize(convert(model, group="single"), make_mesh(**options["mesh"], device_type="cpu"))
    args = TrainingArguments(
        output_dir=directory, max_steps=options["steps"], per_device_train_batch_size=options["batch"] // world,
        per_device_eval_batch_size=4 // world, gradient_accumulation_steps=options.get("accumulate", 1),
        learning_rate=1e-2, max_grad_norm=options.get("max_grad_norm", 1.0), logging_steps=1,
        save_steps=options.get("save_steps", options["steps"]), report_to="none", use_cpu=True, disable_tqdm=True,
        bf16=options.get("bf16", False), gradient_checkpointing=options.get("checkpointing", False),
        dataloader_drop_last=True, seed=3)
    trainer_class = Trainer if kind == "plain" else ExpertParallelTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=counting_sequences(64),
                            eval_dataset=counting_sequences(8, seed=1))
    blocks = [m for m in trainer.model.modules() if isinstance(m, ConvertedMoeBlock)]
    out["experts_held"] = [int(b.moe.experts.w1.shape[0]) for b in blocks]  # the layer's (a sharded one's global)
    out["eval_before"] = trainer.evaluate()["eval_loss"]  # before train(): the model not wrapped yet
    resume = options.get("resume")
    trainer.train(resume_from_checkpoint=os.path.join(directory, resume) if resume else None)
    trainer.save_model(os.path.join(directory, options.get("final", "final")))
    history = trainer.state.log_history
    out["losses"] = {int(e["step"]): e["loss"] for e in history if "loss" in e}
    out["grad_norms"] = {int(e["step"]): e["grad_norm"] for e in history if "grad_norm" in e}
    out["moe_logs"] = [{k: v for k, v in e.items() if k.startswith("moe/")} for e in history if "loss" in e]
    out["eval_loss"] = trainer.evaluate()["eval_loss"]
    predicted = trainer.predict(counting_sequences(8, seed=2))
    out["predictions"] = torch.as_tensor(predicted.predictions).tolist()


def word_tokenizer() -> Any:
    """A tokenizer of the VOCAB words ``t0`` .. ``t63`` and ``<pad>`` (id VOCAB, also the end of text, which no
    counting sequence holds: TRL masks the pad token out of the labels): what TRL asks of one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({**{f"t{i}": i for i in range(VOCAB)}, "<pad>": VOCAB}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<pad>", unk_token="<pad>")


def sft_main(directory: str, kind: str) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` ("plain", one process) or ``ExpertParallelTrainer`` mixed into it ("ep") on the
    counting sequences, pre-tokenized; the rank's logged losses."""
    return _in_world(lambda world, out: _sft(directory, kind, world, out))


def _sft(directory: str, kind: str, world: int, out: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from flexmoe.hf import ExpertParallelTrainer

    class EPSFTTrainer(ExpertParallelTrainer, SFTTrainer):
        """TRL's trainer on expert parallelism: the usual mix-in."""

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=VOCAB + 1))
    rows = Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in counting_sequences(64)])
    # Micro-batches of 4 rows everywhere (one process accumulates 2): TRL's fused LM head computes the loss of 8
    # rows and of 2 x 4 with a different rounding, which Adam's first steps magnify past 1e-5 in one process too.
    args = SFTConfig(output_dir=directory, max_steps=3, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2 // world, learning_rate=1e-2, logging_steps=1,
                     save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, max_length=LENGTH,
                     dataloader_drop_last=True, seed=3,
                     router_aux_loss_coef=0.0)  # the balance loss of 2 ranks' rows is not that of all: leave it out
    trainer_class = SFTTrainer if kind == "plain" else EPSFTTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=rows, processing_class=word_tokenizer())
    trainer.train()
    out["losses"] = {int(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
    out["moe_logged"] = all("moe/max_over_mean" in e for e in trainer.state.log_history if "loss" in e)
