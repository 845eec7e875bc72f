# torchrun --nproc_per_node 2 examples/hf/train_ep.py: a small HF Mixtral whose 8 experts are spread over the ranks
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import flexmoe.hf
from flexmoe.apps.data import TokenData
from flexmoe.sharding import wrap_ddp

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every rank
config = AutoConfig.for_model("mixtral", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, output_router_logits=True)
model = flexmoe.hf.convert(AutoModelForCausalLM.from_config(config))  # each rank keeps 8 / world experts
ddp = wrap_ddp(model)  # data-parallel except the experts
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = TokenData.from_file(None, block_size=64)  # the bytes of the embedded tiny Shakespeare
for step in range(1, 51):
    x, _ = data.batch("train", 16, 64, seed=0, step=step, rows=slice(rank * 16 // world, (rank + 1) * 16 // world))
    loss = ddp(input_ids=x, labels=x).loss  # HF's LM loss + router_aux_loss_coef * its balance loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0:
        print(f"rank {rank} step {step}: loss {loss.item():.3f}", flush=True)
# HF's names and layout (plain AutoModelForCausalLM.from_pretrained loads it). Every rank calls it: the state dict
# gathers every rank's experts; rank 0 writes. The model stays converted and the optimizer could go on.
model.save_pretrained("runs/mixtral-ep", is_main_process=rank == 0)
del ddp  # DDP holds the process group: free it, so destroying the group joins gloo's threads (a clean exit)
dist.destroy_process_group()
