"""What saving in HF's names costs a converted model: ``state_dict()``, ``save_pretrained`` and ``load_state_dict``
of HF's state dict, converted model beside HF's own, side by side in one run.

    python benchmarks/hf_save.py [--family qwen3_moe] [--repeats 3]

A converted block's state dict writes its experts into scratch HF modules (one copy of the expert weights, made
per call), where HF's model hands out references to its parameters; ``save_pretrained`` then writes both the same
way. Prints the best of ``--repeats`` for each, in seconds, at one thread.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import flexmoe.hf as fh

# A mid-size model: 4 MoE layers of 64 experts (M=512, H=256), ~100M expert parameters.
SIZES = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, tie_word_embeddings=False)
FAMILY_SIZES = {
    "qwen3_moe": dict(intermediate_size=1024, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8),
    "deepseek_v3": dict(intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=64,
                        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=32,
                        qk_nope_head_dim=32, v_head_dim=64),
}


def best_of(repeats: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", choices=sorted(FAMILY_SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = AutoConfig.for_model(args.family, **SIZES, **FAMILY_SIZES[args.family])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    converted = fh.convert(copy.deepcopy(hf), group="single")
    state = {k: v.clone() for k, v in hf.state_dict().items()}  # other tensors: loading really copies
    print(f"{args.family}: {sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M parameters, best of {args.repeats} "
          f"(seconds)")
    print(f"{'':18} {'HF':>8} {'converted':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as out:
        rows = {
            "state_dict()": [lambda m=m: m.state_dict() for m in (hf, converted)],
            "save_pretrained": [lambda m=m, d=d: m.save_pretrained(f"{out}/{d}") for m, d in ((hf, "a"),
                                                                                               (converted, "b"))],
            "load_state_dict": [lambda m=m: m.load_state_dict(state) for m in (hf, converted)],
        }
        for name, (on_hf, on_converted) in rows.items():
            a, b = best_of(args.repeats, on_hf), best_of(args.repeats, on_converted)
            print(f"{name:18} {a:8.3f} {b:10.3f} {b / a:6.1f}")


if __name__ == "__main__":
    main()
