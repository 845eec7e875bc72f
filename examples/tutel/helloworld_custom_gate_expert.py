#!/usr/bin/env python3
"""Tutel's helloworld_custom_gate_expert on flexmoe: a user-written gate and expert inside moe_layer.

The gate is any module ``forward(x: [T, M]) -> logits [T, E]`` with a ``top_k`` attribute; the expert any
module ``forward(x: [E_local, capacity, M], ctx) -> [E_local, capacity, M]`` (Tutel's protocol; ``ctx`` is the
layer). Same arguments and per-step lines as Tutel's ``tutel/examples/helloworld_custom_gate_expert.py``.
"""

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)
import torch
import torch.nn.functional as F

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "num_local_experts", "dtype", "top", "l_aux_wt",
    "a2a_ffn_overlap_degree", "num_steps", "device", "eval"])

env, rank, world, dist_print, device = common.init(args)


class CustomGate(torch.nn.Module):
    """A linear gate written by the user: ``logits = x @ my_wg.weight.T``."""

    def __init__(self, model_dim, num_global_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.my_wg = torch.nn.Linear(model_dim, num_global_experts, bias=False)

    def forward(self, x):
        return self.my_wg(x)


class CustomExpert(torch.nn.Module):
    """One ``[M, M]`` matrix per local expert, then an activation: ``act(x @ W[e])``."""

    def __init__(self, model_dim, num_experts_per_device, sharded_count, my_activ_type):
        super().__init__()
        if sharded_count > 1:
            raise ValueError("this expert is not written to be sharded over ranks")
        self.W = torch.nn.Parameter(torch.empty(num_experts_per_device, model_dim, model_dim))
        self.activation = F.relu if my_activ_type == "relu" else (lambda h: h)
        with torch.no_grad():
            self.W.normal_(0, 0.001)

    def forward(self, x, ctx):
        return self.activation(torch.matmul(x, self.W))


class FullyCustomExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = common.moe_layer(
            args, rank,
            gate_type={"type": "custom", "module": CustomGate, "top_k": args.top},
            experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": args.num_local_experts,
                     "my_activ_type": "relu"},
        )

    def forward(self, x):
        return F.log_softmax(self._moe_layer(x).sum(dim=2), dim=1)


model = FullyCustomExampleModel().to(device)
dist_print(model)
optimizer, x, target, shared_params = common.start_run(model, args, world, device, dist_print)
for step in range(args.num_steps):
    t_start = common.system.record_time()
    loss = common.train_step(model, model._moe_layer, optimizer, x, target, args, shared_params, world)
    t_stop = common.system.record_time()
    dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec." % (step, float(loss.detach()), t_stop - t_start))
