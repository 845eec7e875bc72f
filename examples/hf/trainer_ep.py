# torchrun --nproc-per-node 2 examples/hf/trainer_ep.py [OUT_DIR]: examples/hf/trainer.py with one line changed,
# Trainer -> flexmoe.hf.ExpertParallelTrainer: each rank holds 4 / N of every block's experts, the rest is
# data-parallel; checkpoints and the final model are plain HF checkpoints, and a second run resumes from one.
import sys
from pathlib import Path

import torch
from trainer import VOCAB, counting_sequences  # examples/hf/trainer.py: the data and vocabulary
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

from flexmoe.hf import ExpertParallelTrainer


def main(out: Path) -> None:
    config = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                  output_router_logits=True, tie_word_embeddings=False)
    torch.manual_seed(0)  # the same initial model on every rank
    model = AutoModelForCausalLM.from_config(config)  # plain HF: the trainer converts it, experts over the ranks
    args = TrainingArguments(output_dir=str(out), max_steps=20, per_device_train_batch_size=8, learning_rate=1e-2,
                             max_grad_norm=1.0, logging_steps=5, save_steps=10, report_to="none", use_cpu=True,
                             disable_tqdm=True)
    trainer = ExpertParallelTrainer(model=model, args=args, train_dataset=counting_sequences(320))
    midway = out / "checkpoint-10"  # a second run resumes there and trains steps 11-20 again, to the same model
    trainer.train(resume_from_checkpoint=str(midway) if midway.is_dir() else None)
    trainer.save_model(str(out / "final"))  # every rank gathers, the main process writes
    if trainer.is_world_process_zero():
        logs = [e for e in trainer.state.log_history if "loss" in e]
        print(f"loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}; "
              f"max/mean expert load {logs[-1]['moe/max_over_mean']:.2f}")
        plain = AutoModelForCausalLM.from_pretrained(out / "final")  # plain transformers loads it
        print(f"final model reloaded by from_pretrained: {sum(p.numel() for p in plain.parameters())} parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/trainer-ep"))
