#!/usr/bin/env python3
"""Tutel's helloworld on flexmoe: one MoE layer trained to push every sample's mass onto token 0.

Same command-line arguments and the same per-step lines as Tutel's ``tutel/examples/helloworld.py``; the
only Tutel-specific line is the import (in ``_common.py``). Run it as Tutel's (CPU: ``--device cpu``)::

    python examples/tutel/helloworld.py --device cpu --num_steps 10
    python -m torch.distributed.run --nproc_per_node=2 examples/tutel/helloworld.py --device cpu

The model: ``log_softmax(sum_m moe(x)[b, t, m], over t)``; the loss: NLL of token 0, plus
``l_aux_wt * l_aux``. Data: ``x ~ N(0, 1)`` of shape ``[batch_size, num_tokens, model_dim]`` drawn after
``torch.manual_seed(0)``; layer weights drawn from ``seeds = (1, rank + 1, 1)``, as Tutel's example does.
"""

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)
import torch
import torch.nn.functional as F

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "hidden_size", "num_local_experts", "dtype", "fp32_gate",
    "top", "l_aux_wt", "a2a_ffn_overlap_degree", "allreduce_degree", "num_steps", "parallel_type",
    "checkpoint_path", "device", "use_2dh", "eval", "capacity_factor", "megablocks_size", "use_tensorcore",
    "expert_type"])

if args.use_tensorcore:
    torch.backends.cuda.matmul.allow_tf32 = True

env, rank, world, dist_print, device = common.init(args)


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
common.train(model, model._moe_layer, args, world, device, dist_print)

if checkpoint_path:
    torch.save(model.state_dict(), checkpoint_path)
