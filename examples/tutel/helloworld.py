#!/usr/bin/env python3
"""Tutel's helloworld on flexmoe: one MoE layer trained to push every sample's mass onto token 0.

Same command-line arguments and the same per-step lines as Tutel's ``tutel/examples/helloworld.py``; the
only Tutel-specific line is the import. Run it as Tutel's (CPU: ``--device cpu``)::

    python examples/tutel/helloworld.py --device cpu --num_steps 10
    python -m torch.distributed.run --nproc_per_node=2 examples/tutel/helloworld.py --device cpu

The model: ``log_softmax(sum_m moe(x)[b, t, m], over t)``; the loss: NLL of token 0, plus
``l_aux_wt * l_aux``. Data: ``x ~ N(0, 1)`` of shape ``[batch_size, num_tokens, model_dim]`` drawn after
``torch.manual_seed(0)``; layer weights drawn from ``seeds = (1, rank + 1, 1)``, as Tutel's example does.
"""

import torch
import torch.nn.functional as F

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "hidden_size", "num_local_experts", "dtype", "fp32_gate",
    "top", "l_aux_wt", "a2a_ffn_overlap_degree", "allreduce_degree", "num_steps", "parallel_type",
    "checkpoint_path", "device", "use_2dh", "eval", "capacity_factor", "megablocks_size", "use_tensorcore",
    "expert_type"])

if args.use_tensorcore:
    torch.backends.cuda.matmul.allow_tf32 = True

env = common.init(args)
rank, world, dist_print = env.global_rank, env.global_size, env.dist_print
device = env.local_device


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = common.moe_layer(
            args, rank, dist_print,
            gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate,
                       "capacity_factor": args.capacity_factor},
            experts={"type": args.expert_type, "num_experts_per_device": args.num_local_experts,
                     "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda h: F.relu(h)},
            parallel_type=args.parallel_type,
            use_2dh=args.use_2dh,
        )

    def forward(self, x):
        y = self._moe_layer(x, megablocks_size=args.megablocks_size) if args.megablocks_size > 0 \
            else self._moe_layer(x)
        return F.log_softmax(y.sum(dim=2), dim=1)


model = ExampleModel().to(device)
dist_print(model)
checkpoint_path = common.load_checkpoint(model, args, rank, world)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
x, target = common.sample_batch(args, device)
common.print_benchmark(dist_print, args, world, device)

shared_params = [] if args.allreduce_degree == -1 else common.shared_params(model)
num_global_experts = common.global_experts(args)
last_times = []
for step in range(args.num_steps):
    t_start = common.system.record_time()
    loss = common.train_step(model, model._moe_layer, optimizer, x, target, args, shared_params, world)
    t_stop = common.system.record_time()
    common.print_step(dist_print, args, step, loss, t_stop - t_start, num_global_experts)
    last_times = (last_times + [t_stop - t_start])[-10:]

common.print_summary(dist_print, last_times)

if checkpoint_path:
    torch.save(model.state_dict(), checkpoint_path)
