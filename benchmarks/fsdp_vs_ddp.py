"""FSDP2 + expert parallelism (``parallelize``) against replication + expert parallelism (``wrap_ddp``), side by side.

    .venv/bin/python benchmarks/fsdp_vs_ddp.py [--world 2] [--steps 20]

Launches ``--world`` ranks itself (gloo on 127.0.0.1, one torch thread each) and builds the training job's GPT
(its default configuration unless flags say otherwise) twice from one seed: experts over all ranks with the rest
replicated by ``wrap_ddp``, and the same laid on ``make_mesh(ep=world)`` by ``parallelize``. It times a training
step (forward, backward, AdamW) of each in turn, round-robin so that load from other processes hits both alike,
and prints per mode (``parallelize`` twice: resharding each block after its forward, the default, and keeping
its parameters gathered until backward) the median step time (the slowest rank's, each step), its ratio to
``wrap_ddp``, and the bytes of parameters, gradients and AdamW states each rank holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.launch import spawn_ranks
from flexmoe.parallel import local_state_bytes, make_mesh, parallelize, wrap_ddp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks to launch")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (after 3 warm-up steps)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--n-embd", type=int, default=GPTConfig.n_embd)
    p.add_argument("--num-experts", type=int, default=GPTConfig.num_experts)
    p.add_argument("--expert-hidden", type=int, default=GPTConfig.expert_hidden)
    return p.parse_args()


def rank_main(args: dict) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cfg = dict(n_layer=args["n_layer"], n_embd=args["n_embd"], num_experts=args["num_experts"],
                   expert_hidden=args["expert_hidden"])
        torch.manual_seed(0)
        ddp_model = GPT(GPTConfig(**cfg, group=dist.group.WORLD))
        torch.manual_seed(0)
        fsdp_model = parallelize(GPT(GPTConfig(**cfg)), make_mesh(ep=world))
        torch.manual_seed(0)
        kept = parallelize(GPT(GPTConfig(**cfg)), make_mesh(ep=world), reshard_after_forward=False)
        modes = {"wrap_ddp": (wrap_ddp(ddp_model), ddp_model), "parallelize": (fsdp_model, fsdp_model),
                 "parallelize, kept gathered": (kept, kept)}
        opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, (_, model) in modes.items()}
        times: dict[str, list[float]] = {name: [] for name in modes}
        held: dict[str, int] = {}
        g = torch.Generator().manual_seed(rank)
        for step in range(3 + args["steps"]):
            x = torch.randint(0, 256, (args["batch"], 128), generator=g)
            for name, (wrapped, model) in modes.items():
                dist.barrier()
                t0 = time.perf_counter()
                _, loss = wrapped(x, x)
                (loss + model.regularization_loss()).backward()
                opts[name].step()
                seconds = torch.tensor([time.perf_counter() - t0])
                held[name] = local_state_bytes(model, opts[name])
                opts[name].zero_grad(set_to_none=True)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                if step >= 3:
                    times[name].append(float(seconds))
        return {"median_s": {n: statistics.median(t) for n, t in times.items()}, "state_bytes": held}
    finally:
        dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    results = [r.value for r in spawn_ranks(args.world, rank_main, [vars(args)], timeout=1800.0)]
    base = results[0]["median_s"]["wrap_ddp"]
    print(f"{args.world} ranks, GPT n_layer={args.n_layer} n_embd={args.n_embd} E={args.num_experts} "
          f"H={args.expert_hidden}, {args.batch} x 128 tokens per rank, median of {args.steps} steps")
    print(f"{'mode':<28} {'step s':>8} {'vs ddp':>7}  state bytes per rank")
    for name, seconds in results[0]["median_s"].items():
        per_rank = [r["state_bytes"][name] for r in results]
        print(f"{name:<28} {seconds:8.4f} {seconds / base:7.3f}  {per_rank}")


if __name__ == "__main__":
    main()
