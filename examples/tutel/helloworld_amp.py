#!/usr/bin/env python3
"""Tutel's helloworld_amp on flexmoe: the helloworld model under automatic mixed precision.

Tutel's example uses CUDA's autocast (float16); on CPU this one uses CPU autocast with bfloat16 (the dtype
CPU autocast supports), the gate and routing staying in float32. Same arguments and per-step lines as
Tutel's ``tutel/examples/helloworld_amp.py`` (which calls ``init_data_model_parallel()`` with the default
backend: without CUDA, flexmoe falls back to gloo).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexmoe.compat.tutel import moe as tutel_moe, system  # Tutel: from tutel import moe as tutel_moe, system

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--num_tokens", type=int, default=512)
parser.add_argument("--model_dim", type=int, default=2048)
parser.add_argument("--hidden_size", type=int, default=2048)
parser.add_argument("--num_local_experts", type=int, default=2)
parser.add_argument("--dtype", type=str, default="float32")
parser.add_argument("--fp32_gate", default=False, action="store_true")
parser.add_argument("--top", type=int, default=2)
parser.add_argument("--l_aux_wt", type=float, default=0.0)
parser.add_argument("--a2a_ffn_overlap_degree", type=int, default=1)
parser.add_argument("--num_steps", type=int, default=100)
args = parser.parse_args()

env = system.init_data_model_parallel()
rank, world, dist_print = env.global_rank, env.global_size, env.dist_print
device = env.local_device
amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": args.top, "fp32_gate": args.fp32_gate},
            experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                     "hidden_size_per_expert": args.hidden_size, "activation_fn": lambda h: F.relu(h)},
            model_dim=args.model_dim,
            scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
            seeds=(1, rank + 1, 1),
            a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
        )
        experts = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="local_experts"))
        gate = sum(p.numel() for _, p in self._moe_layer.get_parameter_iterator(param_type="gate"))
        dist_print(f"[Statistics] param count for MoE local_experts = {experts}, param count for MoE gate = {gate}.\n")

    def forward(self, x):
        return F.log_softmax(self._moe_layer(x).sum(dim=2).float(), dim=1)


model = ExampleModel().to(device)
dist_print(model)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
torch.manual_seed(0)
x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, dtype=torch.float32).to(device)
target = torch.zeros(args.batch_size, dtype=torch.long, device=device)

dist_print(f"[Benchmark] world_size = {world}, dtype = {args.dtype}, model_dim = {args.model_dim}, "
           f"hidden_size = {args.hidden_size}, samples = {args.batch_size * args.num_tokens}, "
           f"num_local_experts = {args.num_local_experts}, topK = {args.top}, "
           f"a2a_ffn_overlap_degree = {args.a2a_ffn_overlap_degree}, device = `{device}`")

shared_params = [p for p in model.parameters() if not hasattr(p, "skip_allreduce") and p.requires_grad]
num_global_experts = tutel_moe.moe_layer.global_expert_count(args.num_local_experts,
                                                             group=system.get_local_session().model_group)
for step in range(args.num_steps):
    t_start = system.record_time()
    optimizer.zero_grad()
    with torch.autocast(device_type=device.type, dtype=amp_dtype):
        loss = F.nll_loss(model(x), target)
    if args.l_aux_wt:
        loss = loss + args.l_aux_wt * model._moe_layer.l_aux
    loss.backward()
    for p in shared_params if world > 1 else []:
        p.grad /= world
        dist.all_reduce(p.grad)
    optimizer.step()
    t_stop = system.record_time()
    flops = args.batch_size * args.num_tokens * args.model_dim * args.hidden_size * 4 * 3 \
        * min(args.top, num_global_experts)
    dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec, perf = %.2f tflops."
               % (step, float(loss.detach()), t_stop - t_start, flops * 1e-12 / (t_stop - t_start)))
