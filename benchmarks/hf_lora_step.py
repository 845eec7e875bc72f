"""One training step (forward + backward) of a converted tiny Qwen3-MoE, with and without LoRA on its experts.

    PYTHONPATH=src .venv/bin/python benchmarks/hf_lora_step.py [--steps 300] [--lora]

The model is the tests' tiny Qwen3-MoE (2 layers, M=16, E=4, k=2, H=12, batch 2 x 12 tokens, float32, one
thread), converted with ``flexmoe.hf.convert``; with ``--lora`` PEFT's LoRA (r=2) on ``experts.w1/w2/w3``. It
prints the median and the fastest time of one step over ``--steps`` steps after 30 warm-up steps (on a
loaded machine the fastest is the steadier of the two). Run it with another ``src``
on PYTHONPATH to compare two versions of flexmoe: at this size the layer's per-call overhead is what shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import flexmoe.hf as fh

CONFIG = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None,
              pad_token_id=None, bos_token_id=None, intermediate_size=20, moe_intermediate_size=12, num_experts=4,
              num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lora", action="store_true", help="LoRA (r=2) on the experts' w1, w2, w3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = fh.convert(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)), group="single")
    if args.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=[], init_lora_weights=False,
                                                           target_parameters=["experts.w1", "experts.w2",
                                                                              "experts.w3"]))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.train()
    times = []
    for step in range(30 + args.steps):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        if step >= 30:
            times.append(time.perf_counter() - start)
    print(f"{'lora' if args.lora else 'plain'}: median {statistics.median(times) * 1e3:.3f} ms, "
          f"fastest {min(times) * 1e3:.3f} ms per step ({args.steps} steps)")


if __name__ == "__main__":
    main()
