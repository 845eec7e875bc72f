#!/usr/bin/env python3
"""Tutel's helloworld_custom_gate_expert on flexmoe: a user-written gate and expert inside moe_layer.

The gate is any module ``forward(x: [T, M]) -> logits [T, E]`` with a ``top_k`` attribute; the expert any
module ``forward(x: [E_local, capacity, M], ctx) -> [E_local, capacity, M]`` (Tutel's protocol; ``ctx`` is the
layer). Same arguments and per-step lines as Tutel's ``tutel/examples/helloworld_custom_gate_expert.py``.
"""

import argparse

import torch
import torch.nn.functional as F

from flexmoe.compat.tutel import moe as tutel_moe, net, system  # Tutel: from tutel import moe as tutel_moe, net, system

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--num_tokens", type=int, default=512)
parser.add_argument("--model_dim", type=int, default=2048)
parser.add_argument("--num_local_experts", type=int, default=2)
parser.add_argument("--dtype", type=str, default="float32", choices=sorted(DTYPES))
parser.add_argument("--top", type=int, default=2)
parser.add_argument("--l_aux_wt", type=float, default=0.0)
parser.add_argument("--a2a_ffn_overlap_degree", type=int, default=1)
parser.add_argument("--num_steps", type=int, default=100)
parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--eval", default=False, action="store_true")
args = parser.parse_args()

env = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
rank, world, dist_print = env.global_rank, env.global_size, env.dist_print
device = env.local_device
torch.set_default_dtype(DTYPES[args.dtype])


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
        self._moe_layer = tutel_moe.moe_layer(
            gate_type={"type": "custom", "module": CustomGate, "top_k": args.top},
            experts={"type": "custom", "module": CustomExpert, "num_experts_per_device": args.num_local_experts,
                     "my_activ_type": "relu"},
            model_dim=args.model_dim,
            scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
            seeds=(1, rank + 1, 1),
            a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
        )

    def forward(self, x):
        return F.log_softmax(self._moe_layer(x).sum(dim=2), dim=1)


model = FullyCustomExampleModel().to(device)
dist_print(model)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
torch.manual_seed(0)
x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, dtype=torch.float32).to(
    device=device, dtype=torch.get_default_dtype())
target = torch.zeros(args.batch_size, dtype=torch.long, device=device)

dist_print(f"[Benchmark] world_size = {world}, dtype = {args.dtype}, model_dim = {args.model_dim}, "
           f"samples = {args.batch_size * args.num_tokens}, num_local_experts = {args.num_local_experts}, "
           f"topK = {args.top}, a2a_ffn_overlap_degree = {args.a2a_ffn_overlap_degree}, device = `{device}`")

shared_params = [p for p in model.parameters() if not hasattr(p, "skip_allreduce") and p.requires_grad]
for step in range(args.num_steps):
    t_start = system.record_time()
    if args.eval:
        with torch.no_grad():
            loss = F.nll_loss(model(x), target)
    else:
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), target)
        if args.l_aux_wt:
            loss = loss + args.l_aux_wt * model._moe_layer.l_aux
        loss.backward()
        for p in shared_params if world > 1 else []:
            p.grad = net.simple_all_reduce(p.grad / world)
        optimizer.step()
    t_stop = system.record_time()
    dist_print("STEP-%s: loss = %.5f, step_time = %.6f sec." % (step, float(loss.detach()), t_stop - t_start))
