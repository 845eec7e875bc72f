#!/usr/bin/env python3
"""Tutel's helloworld_ddp on flexmoe: the helloworld model wrapped in torch's DistributedDataParallel.

DDP must not average the expert parameters (each rank holds different experts), so their names go to
``_ddp_params_and_buffers_to_ignore``; the gate is averaged by DDP. Same arguments and per-step lines as
Tutel's ``tutel/examples/helloworld_ddp.py``.
"""

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)
import torch
import torch.nn.functional as F

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "hidden_size", "num_local_experts", "dtype", "fp32_gate",
    "top", "l_aux_wt", "a2a_ffn_overlap_degree", "num_steps", "device"])

env, rank, world, dist_print, device = common.init(args)


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = common.moe_layer(args, rank, dist_print)

    def forward(self, x):
        return F.log_softmax(self._moe_layer(x).sum(dim=2), dim=1)


model = ExampleModel().to(device)
# DDP's documented hook for parameters it must leave alone: here, every expert parameter.
model._ddp_params_and_buffers_to_ignore = [n for n, p in model.named_parameters() if hasattr(p, "skip_allreduce")]
if env.is_distributed:
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
dist_print(model)

optimizer, x, target, _ = common.start_run(model, args, world, device, dist_print)  # DDP averages gradients

num_global_experts = common.global_experts(args)
last_times = []
for step in range(args.num_steps):
    t_start = common.system.record_time()
    optimizer.zero_grad()
    loss = F.nll_loss(model(x), target)
    loss.backward()  # DDP averages the gate's gradient
    optimizer.step()
    t_stop = common.system.record_time()
    common.print_step(dist_print, args, step, loss, t_stop - t_start, num_global_experts)
    last_times = (last_times + [t_stop - t_start])[-10:]

common.print_summary(dist_print, last_times)
