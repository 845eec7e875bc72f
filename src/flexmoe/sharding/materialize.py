"""Materialising a model built on ``torch.device("meta")``: each rank allocates only what it holds, and a seeded
initialisation gives the same global weights at every mesh shape (one process included).

The global value of every tensor is a function of the seed and the tensor's name alone:

* an expert of an :class:`~flexmoe.MoELayer` (built-in experts) is drawn on its own, from a seed of (seed, the
  experts' module name, the global expert index), whole, and this rank keeps its hidden slice of it;
* every other module's own parameters and buffers are drawn together, whole, from a seed of (seed, the module's
  name), by ``init(name, module)`` (default: the module's ``reset_parameters()``; buffers start at zero), and this
  rank keeps its FSDP shard of each.

So at most one module's (or one expert's) whole tensors exist at a time beside the rank's own shards. The draws
run on the CPU generator, so the weights are the same on any device.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from flexmoe.experts import FeedForwardExperts
from flexmoe.layer import MoELayer
from flexmoe.parallel.layout import HIDDEN_DIM
from flexmoe.sharding.ddp import GRAD_DIVISOR, divide_gradients
from flexmoe.sharding.model_experts import named_moe_layers

__all__ = ["materialize", "allocate", "reset_module"]

InitFn = Callable[[str, nn.Module], None]


def reset_module(name: str, module: nn.Module) -> None:
    """The default ``init``: ``module.reset_parameters()``; an error for a module with parameters but without it
    (buffers alone stay at zero)."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    elif next(module.parameters(recurse=False), None) is not None:
        raise ValueError(f"materialize: module {name or '<root>'} ({type(module).__name__}) has parameters but no "
                         f"reset_parameters(); pass init=a function init(name, module) that initialises it")


@torch.no_grad()
def materialize(model: nn.Module, *, seed: int, device: torch.device | str | None = None,
                init: InitFn = reset_module) -> nn.Module:
    """Allocate ``model``'s meta tensors on ``device`` (default: the CPU, or the device of the FSDP mesh of a
    model laid out by :func:`~flexmoe.sharding.parallelize`) and initialise them from ``seed`` (see the module
    docstring). ``init(name, module)`` initialises one module's own parameters, laid out whole (e.g. the
    GPT's :meth:`~flexmoe.apps.models.gpt.GPT.init_module`). Returns ``model``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not callable(init):
        raise TypeError(f"init must be a callable init(name, module), got {type(init).__name__}")
    allocate(model, device)
    experts = _layer_experts(model)
    for name, module in model.named_modules():
        if id(module) in experts:
            _init_experts(name, experts[id(module)], seed)
        elif next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) \
                is not None:
            _init_whole(name, module, seed, init)
    return model


def allocate(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Give ``model``'s meta tensors uninitialised storage on ``device`` (default: the CPU, or the device of the FSDP
    mesh of a model laid out by :func:`~flexmoe.sharding.parallelize`), each rank only its shards; returns
    ``model``. Its values are to be written next (:func:`materialize`, or :func:`flexmoe.hf.load`)."""
    # to_empty replaces every meta parameter by a new one: the gradient division of divide_gradients moves along.
    divisors = {n: getattr(p, GRAD_DIVISOR) for n, p in model.named_parameters() if hasattr(p, GRAD_DIVISOR)}
    model.to_empty(device=device or _mesh_device(model))
    params = dict(model.named_parameters())
    for name, divisor in divisors.items():
        divide_gradients([params[name]], divisor)
    return model


def _layer_experts(model: nn.Module) -> dict[int, MoELayer]:
    """The built-in experts of every MoE layer (by id), with their layer."""
    return {id(layer.experts): layer for _, layer in named_moe_layers(model)
            if isinstance(layer.experts, FeedForwardExperts)}


def _init_experts(name: str, layer: MoELayer, seed: int) -> None:
    """Each of this rank's experts drawn whole from its own seed, this rank's hidden slice kept."""
    experts = layer.experts
    assert isinstance(experts, FeedForwardExperts)  # _layer_experts picks only these
    layout, rank = layer.layout, layer.ep_group.rank
    params = dict(experts.state_dict(keep_vars=True))  # joined experts' gate_up by its halves, w1 and w3 (views)
    # [E_local, ...] each: a DTensor's shape is the global one of its mesh, here the ep-local experts
    local = {n: torch.empty(p.shape, dtype=p.dtype) for n, p in params.items()}
    hidden = layout.hidden_slice(rank)
    for j, e in enumerate(layout.experts_of_rank(rank)):
        one = FeedForwardExperts(1, experts.model_dim, layer.hidden_dim, glu=experts.glu,
                                 bias=experts.b1 is not None, dtype=next(iter(local.values())).dtype,
                                 device="meta").to_empty(device="cpu")
        with _seeded(f"{name}[{e}]", seed):
            one.reset_parameters()
        for n, p in one.named_parameters():
            dim = HIDDEN_DIM[n]
            part = p[0] if dim is None else p[0].narrow(dim - 1, hidden.start, hidden.stop - hidden.start)
            local[n][j].copy_(part)
    for n, p in params.items():
        _keep_local(p, local[n])


def _init_whole(name: str, module: nn.Module, seed: int, init: InitFn) -> None:
    """The module's own parameters and buffers drawn whole by ``init``, this rank's shard of each kept."""
    params = dict(module.named_parameters(recurse=False))
    buffers = {n: b for n, b in module.named_buffers(recurse=False) if b is not None}
    whole_params = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    for n, p in params.items()}
    whole_buffers = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in buffers.items()}
    try:
        for n, whole in whole_params.items():
            module._parameters[n] = whole
        for n, zeros in whole_buffers.items():
            module._buffers[n] = zeros
        with _seeded(name, seed):
            init(name, module)
        drawn = {**{n: module._parameters[n] for n in params}, **{n: module._buffers[n] for n in buffers}}
    finally:
        for n, p in params.items():
            module._parameters[n] = p
        for n, b in buffers.items():
            module._buffers[n] = b
    for n, target in {**params, **buffers}.items():
        value = drawn[n]
        assert value is not None  # init replaced a tensor by None: a broken init function
        _keep_local(target, value.detach())


def _keep_local(target: Tensor, whole: Tensor) -> None:
    """Copy this rank's part of ``whole`` (the global tensor) into ``target`` (a DTensor's shard, or all of it)."""
    if isinstance(target, DTensor):
        part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(part)
    else:
        target.copy_(whole)


class _seeded:
    """Draw from the CPU generator seeded by (seed, name), restoring its state after (other devices untouched)."""

    def __init__(self, name: str, seed: int) -> None:
        self.value = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)

    def __enter__(self) -> None:
        self.state = torch.default_generator.get_state()
        torch.default_generator.manual_seed(self.value)

    def __exit__(self, *exc: object) -> None:
        torch.default_generator.set_state(self.state)


def _mesh_device(model: nn.Module) -> torch.device:
    """The device of the first DTensor parameter's mesh (a model laid out by parallelize), else the CPU."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return torch.device(p.device_mesh.device_type)
    return torch.device("cpu")
