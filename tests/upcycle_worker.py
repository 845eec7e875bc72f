"""One rank of the expert-parallel upcycling test (tests/test_upcycle.py): a tiny dense Llama, the same on every
rank, upcycled with its experts spread over the 2 gloo ranks; returns how far its logits are from the dense
model's, on this rank's own tokens."""

from __future__ import annotations

import torch
import torch.distributed as dist

import flexmoe


def run_rank(k: int, granularity: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    dense = LlamaForCausalLM(config).eval()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + rank))
    expected = dense(idx).logits
    moe = flexmoe.upcycle(dense, num_experts=8, k=k, granularity=granularity)  # group: the world
    layer = moe.model.layers[0].mlp
    got = moe(idx).logits
    out = {"local_experts": layer.experts.w1.shape[0], "max_diff": float((got - expected).abs().max()),
           "scale": float(expected.abs().max())}
    dist.destroy_process_group()
    return out
