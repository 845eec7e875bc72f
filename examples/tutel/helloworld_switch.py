#!/usr/bin/env python3
"""Tutel's helloworld_switch on flexmoe: the helloworld model, switching the parallel setting every step.

Step i runs with ``adaptive_r = valid_rs[(i // 8) % len(valid_rs)]`` and ``a2a_ffn_overlap_degree = i % 8 + 1``
(and ``capacity_factor = --cap_factor``), as Tutel's example does; the settings change speed, and the overlap
degree also pads the capacity to a multiple of itself (Tutel's alignment rule), so drops may change. Same
arguments and per-step lines as Tutel's ``tutel/examples/helloworld_switch.py``.
"""

import _common as common  # the parts all helloworld examples share (examples/tutel/_common.py)
import torch
import torch.nn.functional as F

args = common.parse_args(__doc__.splitlines()[0], [
    "local_rank", "batch_size", "num_tokens", "model_dim", "hidden_size", "num_local_experts", "dtype", "fp32_gate",
    "top", "l_aux_wt", "a2a_ffn_overlap_degree", "allreduce_degree", "num_steps", "cap_factor", "checkpoint_path",
    "device", "use_2dh", "eval"])

env, rank, world, dist_print, device = common.init(args)


class ExampleModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._moe_layer = common.moe_layer(args, rank, dist_print, use_2dh=args.use_2dh)
        self.calls = 0

    def forward(self, x):
        valid_rs = self._moe_layer.valid_rs
        r, degree = valid_rs[(self.calls // 8) % len(valid_rs)], self.calls % 8 + 1
        self.calls += 1
        y = self._moe_layer(x, capacity_factor=args.cap_factor, adaptive_r=r, a2a_ffn_overlap_degree=degree)
        return F.log_softmax(y.sum(dim=2), dim=1)


model = ExampleModel().to(device)
dist_print(model)
checkpoint_path = common.load_checkpoint(model, args, rank, world)
layer = model._moe_layer
common.train(model, layer, args, world, device, dist_print,
             step_note=lambda: " (f = %.1f, r = %d, o = %d)" % (args.cap_factor, layer.adaptive_degree,
                                                               layer.a2a_ffn_overlap_degree))

if checkpoint_path:
    torch.save(model.state_dict(), checkpoint_path)
