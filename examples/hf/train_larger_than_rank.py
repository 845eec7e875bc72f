"""A Hugging Face MoE model larger than one rank (here a tiny Qwen3-MoE, to run anywhere): its sharded checkpoint
loaded by shard onto a 4-rank mesh, trained, checkpointed with torch.distributed.checkpoint, resumed on 2 ranks,
exported to HF's format one block at a time, and reloaded by plain ``transformers``.

    python examples/hf/train_larger_than_rank.py save
    python -m torch.distributed.run --standalone --nproc_per_node=4 examples/hf/train_larger_than_rank.py train
    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/hf/train_larger_than_rank.py resume
    python examples/hf/train_larger_than_rank.py check

``save``: the pretrained model, ``save_pretrained`` in small files (runs/hf_larger/pretrained). ``train``: 4 ranks
as ep=2 x dp_shard=2 each read only their experts and shards of it (``flexmoe.hf.load``), 10 AdamW steps, a DCP
checkpoint (runs/hf_larger/dcp-10). ``resume``: 2 ranks as ep=2 load it (model and AdamW), 10 more steps, then
``flexmoe.hf.save_pretrained`` writes runs/hf_larger/export and rank 0 the logits of a fixed batch. ``check``: plain
``from_pretrained`` of the export gives those logits.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexmoe.apps.data import TokenData
from flexmoe.hf import load, save_pretrained
from flexmoe.sharding import load_sharded, make_mesh, save_sharded, split_expert_groups

RUN = "runs/hf_larger"
BLOCK = 32  # tokens per sequence
BATCH = 8  # global sequences per step


def save() -> None:
    """The "pretrained" model: a seeded Qwen3-MoE (8 experts, k=2) on byte tokens, saved in ~40 KB files."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=BLOCK, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(f"{RUN}/pretrained", max_shard_size="40KB")
    print(f"saved to {RUN}/pretrained", flush=True)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TokenData.from_file(None, block_size=BLOCK)
    per = BATCH // world
    model.train()
    for step in range(first, first + steps):
        rows = slice(rank * per, (rank + 1) * per)  # this rank's sequences of the global batch
        x, y = data.batch("train", BATCH, BLOCK, seed=0, step=step, rows=rows)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 5 == 0:
            print(f"rank {rank} step {step + 1}: loss {loss.item():.4f}", flush=True)
    model.eval()


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, BLOCK), generator=torch.Generator().manual_seed(1))


def check() -> None:
    """Plain transformers reads the export and computes what the trained, sharded model computed."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(f"{RUN}/export", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(fixed_batch()).logits
    trained = torch.load(f"{RUN}/trained_logits.pt")
    diff = (logits - trained).abs().max().item()
    print(f"max |logits difference| between plain HF and the trained model: {diff:.2e}", flush=True)
    if diff > 1e-5:
        raise SystemExit("the exported model does not compute the trained model's logits")


def main(stage: str) -> None:
    if stage == "save":
        return save()
    if stage == "check":
        return check()
    dist.init_process_group("gloo")
    try:
        mesh = make_mesh(ep=2, dp_shard=-1)  # 4 ranks: ep=2 x dp_shard=2; 2 ranks: ep=2
        model = load(f"{RUN}/pretrained", mesh)  # each rank reads its experts' rows and its shards only
        # Each group one kind of tensor (at 2 ranks the experts are plain tensors beside DTensors), the same groups
        # at every mesh: the multi-tensor AdamW runs, and the DCP checkpoint loads at the other mesh.
        groups = split_expert_groups(model, [{"params": list(model.parameters())}])
        opt = torch.optim.AdamW(groups, lr=3e-3, foreach=True)
        first = 0
        if stage == "resume":
            load_sharded(f"{RUN}/dcp-10", model, opt, mesh=mesh)  # saved at 4 ranks, loaded at 2
            first = 10
        train(model, opt, first, 10)
        save_sharded(f"{RUN}/dcp-{first + 10}", model, opt, mesh=mesh)
        if stage == "resume":
            save_pretrained(model, f"{RUN}/export")  # gathers one block at a time; rank 0 writes
            with torch.no_grad():
                logits = model(fixed_batch()).logits
            if dist.get_rank() == 0:
                torch.save(logits, f"{RUN}/trained_logits.pt")
                print(f"exported to {RUN}/export", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("save", "train", "resume", "check"):
        raise SystemExit(f"usage: {sys.argv[0]} save|train|resume|check")
    main(sys.argv[1])
