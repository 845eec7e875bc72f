"""The ranks of the DCP test across layouts with the training job's optimizer groups (tests/test_joined_gate_up.py).

A GPT of gated experts that holds each pair as one parameter (``gate_up``, ``gate_up_bias``) in one process, and
as two (``w1``/``w3``, ``b1``/``b3``) once :func:`flexmoe.sharding.parallelize` lays it out over 2 FSDP ranks; its
optimizer is the job's (:func:`flexmoe.apps.train_step.build_optimizer`: weight decay on matrices only, each group's
experts apart: four groups), each group given a learning rate of its own so that a group's hyperparameters can
only come back where that group's parameters are.

What a side reports (:func:`optimizer_report`) is read through torch's own full state dict (FQN-keyed, the
shards gathered), never through flexmoe's checkpoint code: each parameter's AdamW states and the hyperparameters
of the group that holds it, as JSON.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from flexmoe.apps.train_config import TrainConfig
from flexmoe.apps.train_step import build_optimizer
from fsdp_worker import batch, gpt, with_layer_options

LR = 1e-2
HYPER = ("lr", "weight_decay")  # the group hyperparameters compared


def glu_gpt(seed: int) -> nn.Module:
    """The tiny GPT of tests/fsdp_worker.py with gated silu experts that hold each pair as one parameter."""
    return with_layer_options(gpt(seed), glu=True, joined_gate_up=True, activation="silu")


def job_optimizer(model: nn.Module, source: bool) -> torch.optim.Optimizer:
    """The job's AdamW groups; ``source``: group i at learning rate ``LR * (i + 1)`` (weight decay 0.1 on
    matrices); else every group at other values (lr 0.5, decay 0.3) that a load must replace."""
    opt = build_optimizer(model, TrainConfig(lr=LR, weight_decay=0.1 if source else 0.3))
    assert len(opt.param_groups) == 4, [len(g["params"]) for g in opt.param_groups]
    for i, group in enumerate(opt.param_groups):
        group["lr"] = LR * (i + 1) if source else 0.5
    return opt


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 2) -> None:
    """``steps`` AdamW steps on this rank's batches: every parameter that routing reaches gets its states."""
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, rank)
        _, loss = model(x, y)
        (loss + model.regularization_loss()).backward()
        opt.step()


def optimizer_report(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {"exp_avg": [...], "exp_avg_sq": [...], "step": float}}, "group": {fqn: {"lr": ...,
    "weight_decay": ...}}, "model": {name: [...]}}`` by torch's full optimizer and model state dicts (collective
    under FSDP: every rank calls it; the model's by the halves' names in either layout, as its state dict)."""
    options = StateDictOptions(full_state_dict=True)
    full = get_optimizer_state_dict(model, opt, options=options)
    state = {name: {key: (value.tolist() if value.dim() else float(value)) for key, value in entries.items()}
             for name, entries in full["state"].items()}
    group = {name: {key: g[key] for key in HYPER} for g in full["param_groups"] for name in g["params"]}
    weights = {name: value.tolist() for name, value in get_model_state_dict(model, options=options).items()}
    return {"state": state, "group": group, "model": weights}


def _join_gloo() -> Any:
    import torch.distributed as dist

    from multiproc import kernels_by_rule

    torch.set_num_threads(1)
    kernels_by_rule()
    dist.init_process_group("gloo")
    return dist


def save_main(directory: str) -> dict[str, Any]:
    """A rank of 2 (FSDP, the pairs apart): 2 steps with the source groups, then a DCP checkpoint; the report."""
    from flexmoe.sharding import make_mesh, parallelize, save_sharded

    dist = _join_gloo()
    try:
        mesh = make_mesh(dp_shard=2)
        model = parallelize(glu_gpt(0), mesh)
        opt = job_optimizer(model, source=True)
        train(model, opt, dist.get_rank())
        save_sharded(directory, model, opt, mesh=mesh)
        return optimizer_report(model, opt)
    finally:
        dist.destroy_process_group()


def load_main(directory: str) -> dict[str, Any]:
    """A rank of 2 (FSDP, the pairs apart) that loads the checkpoint into a differently seeded model and an
    optimizer of other hyperparameters; the report."""
    from flexmoe.sharding import load_sharded, make_mesh, parallelize

    dist = _join_gloo()
    try:
        mesh = make_mesh(dp_shard=2)
        model = parallelize(glu_gpt(99), mesh)
        opt = job_optimizer(model, source=False)
        load_sharded(directory, model, opt, mesh=mesh)
        return optimizer_report(model, opt)
    finally:
        dist.destroy_process_group()
