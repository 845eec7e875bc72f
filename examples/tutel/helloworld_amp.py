#!/usr/bin/env python3
"""Tutel's helloworld_amp on flexmoe: the helloworld model under automatic mixed precision.

Tutel's example uses CUDA's autocast (float16); on CPU this one uses CPU autocast with bfloat16 (the dtype
CPU autocast supports), the gate and routing staying in float32. Same arguments and per-step lines as
Tutel's ``tutel/examples/helloworld_amp.py`` (which calls ``init_data_model_parallel()`` with the default
backend: without CUDA, flexmoe falls back to gloo).
"""

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)
import torch
import torch.nn.functional as F

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "hidden_size", "num_local_experts", "dtype", "fp32_gate",
    "top", "l_aux_wt", "a2a_ffn_overlap_degree", "num_steps"], dtype=dict(type=str, default="float32"))

env = common.system.init_data_model_parallel()
rank, world, dist_print = env.global_rank, env.global_size, env.dist_print
device = env.local_device
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = common.moe_layer(args, rank, dist_print)

    def forward(self, x):
        return F.log_softmax(self._moe_layer(x).sum(dim=2).float(), dim=1)


model = ExampleModel().to(device)
dist_print(model)
optimizer, x, target, shared_params = common.start_run(model, args, world, device, dist_print)
num_global_experts = common.global_experts(args)
for step in range(args.num_steps):
    t_start = common.system.record_time()
    optimizer.zero_grad()
    with torch.autocast(device_type=device.type, dtype=amp_dtype):
        loss = F.nll_loss(model(x), target)
    if args.l_aux_wt:
        loss = loss + args.l_aux_wt * model._moe_layer.l_aux
    loss.backward()
    common.average_gradients(shared_params, world)
    optimizer.step()
    t_stop = common.system.record_time()
    common.print_step(dist_print, args, step, loss, t_stop - t_start, num_global_experts)
