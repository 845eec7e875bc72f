"""A model laid on a device mesh: built on meta, sharded with FSDP2 and expert parallelism, trained, checkpointed
with torch.distributed.checkpoint, resumed on another mesh, and exported to flexmoe's own checkpoint format.

    python -m torch.distributed.run --standalone --nproc_per_node=4 examples/fsdp/train_sharded.py train
    python -m torch.distributed.run --standalone --nproc_per_node=2 examples/fsdp/train_sharded.py resume
    python examples/fsdp/train_sharded.py export

``train``: 4 ranks as ep=2 x dp_shard=2, 30 steps, a DCP checkpoint in runs/sharded/dcp-30. ``resume``: 2 ranks as
ep=2, loads it (model and AdamW), 30 more steps, runs/sharded/dcp-60. ``export``: one process loads that and writes
it as a flexmoe checkpoint (runs/sharded/export; experts in global form, loadable at any world size).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from flexmoe.apps.data import TokenData
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.checkpoint import save_checkpoint
from flexmoe.sharding import load_sharded, make_mesh, materialize, parallelize, save_sharded

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=64, num_experts=4, expert_hidden=64, block_size=64)
RUN = "runs/sharded"
BATCH = 16  # global sequences per step


def build(mesh) -> GPT:
    """The GPT built on meta, laid on ``mesh`` (None: one process) and materialised: each rank allocates its shards."""
    with torch.device("meta"):
        model = GPT(CONFIG)
    if mesh is not None:
        model = parallelize(model, mesh)
    return materialize(model, seed=0, init=model.init_module)


def train(model: GPT, opt: torch.optim.Optimizer, first: int, steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = TokenData.from_file(None, block_size=CONFIG.block_size)
    per = BATCH // world
    for step in range(first, first + steps):
        rows = slice(rank * per, (rank + 1) * per)  # this rank's sequences of the global batch
        x, y = data.batch("train", BATCH, CONFIG.block_size, seed=0, step=step, rows=rows)
        _, loss = model(x, y)
        (loss + model.regularization_loss()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0:
            print(f"rank {rank} step {step + 1}: loss {loss.item():.4f}", flush=True)


def main(stage: str) -> None:
    torch.manual_seed(0)
    if stage == "export":
        model = build(None)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        load_sharded(f"{RUN}/dcp-60", model, opt)
        save_checkpoint(f"{RUN}/export", model=model, optimizer=opt, step=60)
        print(f"exported to {RUN}/export", flush=True)
        return
    dist.init_process_group("gloo")
    try:
        mesh = make_mesh(ep=2, dp_shard=-1)
        model = build(mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        first = 0
        if stage == "resume":
            load_sharded(f"{RUN}/dcp-30", model, opt, mesh=mesh)
            first = 30
        train(model, opt, first, 30)
        save_sharded(f"{RUN}/dcp-{first + 30}", model, opt, mesh=mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("train", "resume", "export"):
        raise SystemExit(f"usage: {sys.argv[0]} train|resume|export")
    main(sys.argv[1])
