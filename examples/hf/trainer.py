# python examples/hf/trainer.py [OUT_DIR]: a small HF Qwen3-MoE converted to flexmoe, trained with
# transformers.Trainer in one process, saved with Trainer, reloaded with plain from_pretrained.
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import flexmoe.hf

VOCAB, LENGTH = 64, 16


def counting_sequences(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up from a random start by a random stride (1-3), modulo VOCAB: a pattern to learn."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": row, "labels": row} for row in ids]


def main(out: Path) -> tuple[torch.nn.Module, list[float]]:
    """Train 20 steps (a checkpoint at step 10), save the final model to ``out / "final"``; the trained model and
    its logged losses."""
    config = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    model = flexmoe.hf.convert(AutoModelForCausalLM.from_config(config), group="single")  # every expert here
    args = TrainingArguments(output_dir=str(out), max_steps=20, per_device_train_batch_size=16, learning_rate=1e-2,
                             logging_steps=1, save_steps=10, report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=counting_sequences(320))
    trainer.train()
    # The converted model's state dict is in HF's names and layout: Trainer's checkpoints and save_model are plain
    # transformers checkpoints, no flexmoe.hf.to_hf needed.
    trainer.save_model(str(out / "final"))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    plain = AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.stack([s["input_ids"] for s in counting_sequences(4, seed=1)])
    model.eval()
    with torch.no_grad():
        gap = float((plain(ids).logits - model(ids).logits).abs().max())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; plain from_pretrained's logits differ by {gap:.2e}")
    return model, losses


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/trainer"))
