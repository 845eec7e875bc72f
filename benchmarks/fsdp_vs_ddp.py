"""FSDP2 + expert parallelism (``parallelize``) against replication + expert parallelism (``wrap_ddp``), side by side.

    .venv/bin/python benchmarks/fsdp_vs_ddp.py [--world 2] [--steps 20] [--model gpt|qwen3_moe]

Launches ``--world`` ranks itself (gloo on 127.0.0.1, one torch thread each) and builds the training job's GPT
(its default configuration unless flags say otherwise), or with ``--model qwen3_moe`` a small Qwen3-MoE-shaped
Hugging Face model converted by flexmoe.hf (4 layers, width 128, 8 experts of 256, k=2, GQA), twice from one
seed: experts over all ranks with the rest replicated by ``wrap_ddp``, and the same laid on ``make_mesh(ep=world)``
by ``parallelize``. It times a training step (forward, backward, AdamW: multi-tensor, over
:func:`~flexmoe.sharding.split_expert_groups`, as the training job's) of each in turn, round-robin so that load
from other processes hits both alike, and prints per mode (``parallelize`` twice: resharding each block after its
forward, the default, and keeping its parameters gathered until backward) the median step time (the slowest rank's,
each step), its ratio to ``wrap_ddp``, and the bytes of parameters, gradients and AdamW states each rank holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.launch import spawn_ranks
from flexmoe.sharding import local_state_bytes, make_mesh, parallelize, split_expert_groups, wrap_ddp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks to launch")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (after 3 warm-up steps)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--n-embd", type=int, default=GPTConfig.n_embd)
    p.add_argument("--num-experts", type=int, default=GPTConfig.num_experts)
    p.add_argument("--expert-hidden", type=int, default=GPTConfig.expert_hidden)
    p.add_argument("--model", choices=("gpt", "qwen3_moe"), default="gpt")
    return p.parse_args()


def build(args: dict, group: object) -> torch.nn.Module:
    """The model from seed 0, its experts over ``group`` ("single": every expert here)."""
    if args["model"] == "gpt":
        torch.manual_seed(0)
        cfg = dict(n_layer=args["n_layer"], n_embd=args["n_embd"], num_experts=args["num_experts"],
                   expert_hidden=args["expert_hidden"])
        return GPT(GPTConfig(**cfg), group=None if group == "single" else group)
    import transformers

    from flexmoe.apps.hf_job import HFJobConfig, build_hf_model

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=args["n_embd"], num_hidden_layers=args["n_layer"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=args["n_embd"] // 4, intermediate_size=512,
        moe_intermediate_size=args["expert_hidden"], num_experts=args["num_experts"], num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None)
    model, _ = build_hf_model(HFJobConfig(hf_config=config.to_dict(), block_size=128), seed=0, pretrained=False,
                              group=group)
    return model


def rank_main(args: dict) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ddp_model = build(args, dist.group.WORLD)
        fsdp_model = parallelize(build(args, "single"), make_mesh(ep=world))
        kept = parallelize(build(args, "single"), make_mesh(ep=world), reshard_after_forward=False)
        modes = {"wrap_ddp": (wrap_ddp(ddp_model), ddp_model), "parallelize": (fsdp_model, fsdp_model),
                 "parallelize, kept gathered": (kept, kept)}
        # The training job's kind of optimizer (flexmoe.apps.train.build_optimizer): multi-tensor AdamW over groups
        # of one kind of tensor each, for every mode alike.
        opts = {name: torch.optim.AdamW(split_expert_groups(model, [{"params": list(model.parameters())}]),
                                        lr=1e-3, foreach=True) for name, (_, model) in modes.items()}
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
    print(f"{args.world} ranks, {args.model} n_layer={args.n_layer} n_embd={args.n_embd} E={args.num_experts} "
          f"H={args.expert_hidden}, {args.batch} x 128 tokens per rank, median of {args.steps} steps")
    print(f"{'mode':<28} {'step s':>8} {'vs ddp':>7}  state bytes per rank")
    for name, seconds in results[0]["median_s"].items():
        per_rank = [r["state_bytes"][name] for r in results]
        print(f"{name:<28} {seconds:8.4f} {seconds / base:7.3f}  {per_rank}")


if __name__ == "__main__":
    main()
