"""``ExpertParallelTrainer``: ``transformers.Trainer`` with each rank holding ``E / N`` experts (docs/architecture.md,
"Hugging Face models (flexmoe.hf)"; README, "Hugging Face models").

Plain ``Trainer`` cannot train a model whose experts are spread over the ranks: Accelerate would wrap it in a DDP
that averages the ranks' *different* experts, Trainer saves from the main process alone while the converted
model's state dict is a collective gather, it writes rank 0's optimizer state only, it restores no expert on
resume (transformers' non-strict load of the per-expert file) and its gradient norm is one rank's. This subclass
changes exactly those points and leaves the rest (data sharding, gradient accumulation, schedules, evaluation,
``predict``, autocast, gradient checkpointing, callbacks) to Trainer:

* the model is converted (:func:`flexmoe.hf.convert`, its defaults: the experts over the world) unless it is
  already, and wrapped with :func:`flexmoe.sharding.wrap_ddp` (the non-expert parameters data-parallel, each
  rank's experts its own, their gradients the gradient of the ranks' mean loss; where expert-parallel groups of
  consecutive ranks tile the world, each expert's gradient is also summed over its replicas before the step);
* ``save_model``, the periodic checkpoints and ``push_to_hub`` gather the state dict on every rank and the main
  process writes it: plain HF checkpoints that ``from_pretrained`` loads;
* each rank writes its own optimizer state (``rank{r}-of-{N}-optimizer.pt``: its experts' moments);
* ``resume_from_checkpoint`` fills every rank's experts from the checkpoint's HF tensors (:func:`flexmoe.hf.load.
  fill`, strict: a missing tensor is a ``ValueError`` naming it), then Trainer restores the schedule, the RNG
  states and the data position;
* ``max_grad_norm`` clips by the global norm: the experts' squares summed over the expert-parallel ranks, the
  data-parallel parameters (equal on every rank after DDP's all-reduce) counted once;
* the MoE layers' balance metrics and the model's auxiliary loss are averaged over the ranks and the micro-batches
  since the last log, and logged with the loss (``moe/aux_loss``, ``moe/max_over_mean``, ...).

A model laid out by :func:`flexmoe.sharding.parallelize` (FSDP2 beside the experts) is taken as it is: FSDP2
reduces the gradients (no DDP), :func:`flexmoe.hf.save_pretrained` writes one block whole at a time, the optimizer
files hold each rank's shards, and the norm sums every rank's shards (meshes without ``dp_replicate``).

In one process (no ``torch.distributed``, or ``convert(..., group="single")``) it is Trainer plus those logs.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import Trainer

from flexmoe.hf.block import ConvertedMoeBlock
from flexmoe.hf.convert import convert
from flexmoe.hf.export import save_pretrained
from flexmoe.hf.load import fill
from flexmoe.hf.stored import SafetensorsReader, StoredTensors
from flexmoe.model_routing import balance_metrics
from flexmoe.sharding.ddp import wrap_ddp
from flexmoe.sharding.model_experts import expert_parameters, named_moe_layers

__all__ = ["ExpertParallelTrainer", "global_grad_norm"]

SCHEDULER_FILE = "scheduler.pt"  # Trainer's name for the scheduler's state (transformers' SCHEDULER_NAME)
TRAINING_ARGS_FILE = "training_args.bin"  # and for its arguments (TRAINING_ARGS_NAME)


def _optimizer_file(rank: int, world: int) -> str:
    """Rank ``rank``'s optimizer state in a checkpoint of ``world`` ranks."""
    return f"rank{rank}-of-{world}-optimizer.pt"


class ExpertParallelTrainer(Trainer):
    """``transformers.Trainer`` for a model whose experts are spread over the ranks (``torchrun --nproc-per-node
    N``: each rank holds ``E / N`` experts of every MoE block). Takes Trainer's arguments; ``model`` is an HF MoE
    model, plain (converted here with :func:`flexmoe.hf.convert`'s defaults, the experts over the world) or
    already converted. TRL's trainers take it as a base: ``class EPSFTTrainer(ExpertParallelTrainer, SFTTrainer)``.

    Raises ``TypeError`` for a ``model`` that is no ``nn.Module`` (``model_init`` is not supported: pass the
    model), ``ValueError`` for an ``optimizers=`` optimizer built on a model not converted yet (its parameters are
    replaced by the conversion: convert first, then build it) and for a laid-out model not converted first, and
    ``NotImplementedError`` for ``fsdp=`` / ``deepspeed=`` arguments (they would shard the experts as ordinary
    parameters: pass a model laid out by :func:`flexmoe.sharding.parallelize` instead) and for a mesh with
    ``dp_replicate`` > 1.

    Data-parallel replicas of the experts: a model converted with ``group=`` an expert-parallel group of ``P``
    consecutive ranks (``[b * P, (b + 1) * P)``, the world tiled by such groups, as ``make_mesh``'s ``ep`` dim)
    holds every expert once per group; each expert's gradient is then averaged over its replicas as well.
    """

    def __init__(self, model: nn.Module | None = None, *args: Any, **kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a transformers MoE model (an nn.Module; model_init is not supported), "
                            f"got {type(model).__name__}")
        converted = _holds_converted_blocks(model)
        self._sharded = any(isinstance(p, DTensor) for p in model.parameters())  # laid out by parallelize
        if self._sharded:
            _check_sharded(model, converted)
        super().__init__(model, *args, **kwargs)  # sets up torch.distributed under torchrun (TrainingArguments)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise NotImplementedError(
                "ExpertParallelTrainer does not take TrainingArguments(fsdp=...) or deepspeed=: they would shard "
                "the experts as ordinary parameters. For sharding beside the experts pass the model laid out by "
                "flexmoe.sharding.parallelize(flexmoe.hf.convert(model, group='single'), make_mesh(ep=.., "
                "dp_shard=..)) (or flexmoe.hf.load(directory, mesh))")
        if not converted:
            if self.optimizer is not None:
                raise ValueError("optimizers=: the optimizer was built on the model before flexmoe.hf.convert, "
                                 "which replaces its MoE parameters; convert the model first, then build it")
            convert(self._net)
        # Data-parallel replicas of this rank's experts, if any (a laid-out model's FSDP2 reduces over them itself).
        self._replicas = None if self._sharded else _replica_group(self._net)
        self._moe_sums: dict[str, float] = {}
        self._moe_count = 0

    # ---- what is spread -------------------------------------------------------------------------------------

    @property
    def _net(self) -> nn.Module:
        """The (unwrapped) model; Trainer types ``self._net`` as optional."""
        assert isinstance(self.model, nn.Module)  # __init__ refuses anything else
        return self.model

    def _spread(self) -> bool:
        """Whether some MoE layer holds only this rank's experts, or the model is sharded (the collective paths
        are needed)."""
        return self._sharded or any(layer.ep_group.distributed for _, layer in named_moe_layers(self._net))

    # ---- wrapping: DDP beside the experts, Accelerate's autocast ----------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """In training with spread experts: Accelerate's autocast and device placement on the model (no DDP of
        its own), then :func:`~flexmoe.sharding.wrap_ddp`. Trainer sees a wrapped model and prepares only the
        optimizer. Evaluation runs the model itself, as Trainer does under DDP."""
        if not training or not self._spread():
            return super()._wrap_model(model, training, dataloader)
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model or isinstance(model, _Laid):
            return model  # wrapped by an earlier train()
        if model not in self.accelerator._models:  # not prepared for an evaluation before training
            self.accelerator.prepare_model(model, device_placement=not self._sharded, evaluation_mode=True)
        if self._sharded:
            return _Laid(model)  # FSDP2 reduces the gradients itself; the wrapper keeps Accelerate's DDP off
        chosen = {"find_unused_parameters": self.args.ddp_find_unused_parameters,  # Trainer's DDP arguments
                  "broadcast_buffers": self.args.ddp_broadcast_buffers, "bucket_cap_mb": self.args.ddp_bucket_cap_mb}
        return wrap_ddp(model, expert_replicas=self._replicas is not None,
                        **{k: v for k, v in chosen.items() if v is not None})

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """Trainer's optimizer; on a laid-out model over its sharded parameters: an evaluation before training
        leaves the units FSDP2 keeps gathered after forward (the last block, the root) holding whole tensors in
        their place, so every unit is resharded first."""
        self._reshard()
        return super().create_optimizer(model)

    def _reshard(self) -> None:
        """Every FSDP2 unit of a laid-out model back to its sharded parameters (no-op otherwise)."""
        if self._sharded:
            from torch.distributed.fsdp import FSDPModule

            for module in self._net.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # ---- gradient norm ------------------------------------------------------------------------------------

    def _sum_expert_replicas(self) -> None:
        """Sum each expert's gradient over its data-parallel replicas (each holds its part of the mean, wrap_ddp's
        ``expert_replicas``). Once per optimizer step: Trainer calls ``_clip_grad_norm`` (when clipping) or else
        ``_get_grad_norm`` with no norm, before every step."""
        if self._replicas is None:
            return
        for _, p, layer in expert_parameters(self._net):
            if layer.ep_group.distributed and p.grad is not None:
                dist.all_reduce(p.grad, group=self._replicas)

    def _clip_grad_norm(self, model: nn.Module) -> Tensor:
        if not self._spread():
            return super()._clip_grad_norm(model)
        self._sum_expert_replicas()
        norm = global_grad_norm(self._net)
        scale = (self.args.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ rule
        for p in self._net.parameters():
            if p.grad is not None:
                _local(p.grad).mul_(scale.to(p.grad.device))
        return norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if not self._spread():
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is not None:  # _clip_grad_norm's, which summed the replicas
            return grad_norm
        self._sum_expert_replicas()
        return global_grad_norm(self._net)

    # ---- saving -------------------------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every rank gathers the state dict (HF's names, every expert), the main process writes it."""
        if self._sharded:  # one block whole at a time (flexmoe.hf.save_pretrained), then Trainer's other files
            directory = str(output_dir or self.args.output_dir)
            save_pretrained(self._net, directory)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(directory)
                torch.save(self.args, os.path.join(directory, TRAINING_ARGS_FILE))
            return
        if self._spread():
            if state_dict is None:
                state_dict = self._net.state_dict()  # a collective: every rank's experts
            if not self.args.should_save:
                return
        super()._save(output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Each rank its optimizer state (its experts' moments differ), the main process the scheduler's; the
        ranks wait for each other, so a checkpoint with ``trainer_state.json`` (written next) is complete."""
        if not self._spread():
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        rank, world = dist.get_rank(), dist.get_world_size()
        assert self.optimizer is not None and self.lr_scheduler is not None  # created before any save
        state = _map_states(self.optimizer, self.optimizer.state_dict(), _to_local)
        torch.save(state, os.path.join(output_dir, _optimizer_file(rank, world)))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the scheduler's "save the optimizer too" reminder
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
        dist.barrier()

    # ---- resuming -----------------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Every parameter and persistent buffer from the checkpoint's HF tensors, this rank's experts of each MoE
        block, strictly (``ValueError`` naming the tensors the checkpoint lacks)."""
        model = self._net if model is None else model
        if not _holds_converted_blocks(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._reshard()  # fill the sharded parameters, not whole copies an evaluation left in their place
        with SafetensorsReader(resume_from_checkpoint) as files:
            fill(model, StoredTensors(files, model))

    def _load_best_model(self) -> None:
        if not _holds_converted_blocks(self._net) or self.state.best_model_checkpoint is None:
            return super()._load_best_model()
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """This rank's optimizer state and the scheduler's. A checkpoint without optimizer states
        (``save_only_model``) restores none, as in Trainer; one written by another number of ranks is refused."""
        if checkpoint is None or not self._spread():
            return super()._load_optimizer_and_scheduler(checkpoint)
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = Path(checkpoint) / _optimizer_file(rank, world)
        if not mine.is_file():
            others = sorted(p.name for p in Path(checkpoint).glob("*optimizer.pt"))
            if others:
                raise ValueError(f"resume_from_checkpoint={checkpoint!r} holds optimizer states {others}, not "
                                 f"{mine.name}: resume with the number of ranks that wrote it")
            return
        assert self.optimizer is not None and self.lr_scheduler is not None  # created before the resume
        state = torch.load(mine, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(_map_states(self.optimizer, state, _like_parameter))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint) / SCHEDULER_FILE, weights_only=True))

    # ---- logging ------------------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """Trainer's loss; in training, also adds this micro-batch's auxiliary loss and balance metrics to the
        sums logged next."""
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        if self._net.training:
            self._add_moe_metrics(outputs)
        return (loss, outputs) if return_outputs else loss

    def _add_moe_metrics(self, outputs: Any) -> None:
        metrics = _layer_mean(balance_metrics(self._net))
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else None
        if isinstance(aux, Tensor):
            metrics["aux_loss"] = float(aux.detach())
        for name, value in metrics.items():
            self._moe_sums[name] = self._moe_sums.get(name, 0.0) + value
        self._moe_count += 1

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log; a training log (one with ``loss``) also gets ``moe/<metric>``: the mean over the ranks
        and the micro-batches since the last one (every rank logs the training loss at the same step, so the
        all-reduce is met)."""
        if "loss" in logs and self._moe_count:
            names = sorted(self._moe_sums)
            sums = torch.tensor([self._moe_sums[n] for n in names] + [float(self._moe_count)], dtype=torch.float64)
            if dist.is_available() and dist.is_initialized() and self._spread():
                dist.all_reduce(sums)
            logs.update({f"moe/{n}": float(sums[i] / sums[-1]) for i, n in enumerate(names)})
            self._moe_sums, self._moe_count = {}, 0
        super().log(logs, *args, **kwargs)


class _Laid(nn.Module):
    """A model laid out by :func:`flexmoe.sharding.parallelize`, as Trainer's wrapped model: FSDP2 reduces its
    gradients, so Accelerate must not prepare (DDP-wrap) it; this passes every call through."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _check_sharded(model: nn.Module, converted: bool) -> None:
    """A model laid out by ``parallelize``: converted first, and no dense parameter replicated (HSDP)."""
    if not converted:
        raise ValueError("a model laid out by flexmoe.sharding.parallelize must be converted first "
                         "(flexmoe.hf.convert(model, group='single'), then parallelize)")
    replicated = [name for name, p in model.named_parameters()
                  if isinstance(p, DTensor) and any(not placement.is_shard() for placement in p.placements)]
    if replicated:
        raise NotImplementedError(f"parameters {replicated[:3]} are replicated over a mesh dim (dp_replicate > 1):"
                                  f" ExpertParallelTrainer takes meshes of dp_shard and ep only")


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, or the tensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _to_local(value: Any, parameter: Tensor) -> Any:
    return _local(value) if isinstance(value, Tensor) else value


def _like_parameter(value: Any, parameter: Tensor) -> Any:
    """A saved local optimizer state as a DTensor laid as ``parameter`` where that is one (moments; a scalar
    ``step`` stays as it is)."""
    if isinstance(parameter, DTensor) and isinstance(value, Tensor) and value.dim() > 0:
        return DTensor.from_local(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                                  run_check=False, shape=parameter.shape, stride=parameter.stride())
    return value


def _map_states(optimizer: Any, state_dict: dict[str, Any], fn: Any) -> dict[str, Any]:
    """``state_dict`` (an optimizer's) with ``fn(value, parameter)`` applied to every per-parameter state value;
    its states are keyed by the parameters' positions over the param groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = {i: {k: fn(v, params[i]) for k, v in s.items()} for i, s in state_dict["state"].items()}
    return {**state_dict, "state": states}


def _layer_mean(per_layer: dict[str, float]) -> dict[str, float]:
    """``{"<layer>/<metric>": v}`` -> ``{"<metric>": mean over the layers}``."""
    by_metric: dict[str, list[float]] = {}
    for key, value in per_layer.items():
        by_metric.setdefault(key.rsplit("/", 1)[-1], []).append(value)
    return {metric: sum(values) / len(values) for metric, values in by_metric.items()}


def _holds_converted_blocks(model: nn.Module) -> bool:
    return any(isinstance(m, ConvertedMoeBlock) for m in model.modules())


def _replica_group(model: nn.Module) -> Any:
    """The group of this rank's expert replicas: the ranks holding the same experts in the other expert-parallel
    groups (None when the experts are spread over the whole world, or not spread).

    The expert-parallel groups must tile the world in blocks of consecutive ranks, as ``make_mesh``'s ``ep`` dim
    does (ranks ``[b * P, (b + 1) * P)``), every layer the same; else ``NotImplementedError``. Collective: every
    rank makes every replica group (``dist.new_group``), in the same order."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    spread = {tuple(layer.ep_group.global_ranks) for _, layer in named_moe_layers(model) if layer.ep_group.distributed}
    if not spread or spread == {tuple(range(world))}:
        return None
    ranks = next(iter(spread))
    size = len(ranks)
    if len(spread) > 1 or world % size or list(ranks) != list(range(ranks[0], ranks[0] + size)) or ranks[0] % size:
        raise NotImplementedError(
            f"the MoE layers spread their experts over ranks {sorted(spread)}: ExpertParallelTrainer takes experts "
            f"spread over the world, or over blocks of consecutive ranks that tile it (world {world}), the same for "
            f"every layer (make_mesh's ep dim)")
    mine = None
    for local in range(size):  # every rank makes every group, in the same order
        group = dist.new_group([local + block * size for block in range(world // size)])
        if local == dist.get_rank() % size:
            mine = group
    return mine


@torch.no_grad()
def global_grad_norm(model: nn.Module) -> Tensor:
    """The L2 norm of every gradient of ``model`` as one vector over all ranks: each spread expert tensor's
    squares summed over its expert-parallel group (a collective there; a ``b2`` that every hidden shard of an
    expert copies, once), every other gradient (equal on every rank after DDP's all-reduce) counted once.

    Returns a float32 scalar on the parameters' device (accumulated in float64)."""
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")  # type: ignore[union-attr]
    # Every spread layer's group gets its sum, gradients here or not: the all-reduces must match on every rank.
    groups: dict[int, tuple[Any, Tensor]] = {}
    where: dict[int, int | None] = {}  # spread parameter -> its group's key (None: a copy counted elsewhere)
    for name, p, layer in expert_parameters(model):
        if not layer.ep_group.distributed:
            continue
        group = layer.ep_group.group
        groups.setdefault(id(group), (group, torch.zeros((), dtype=torch.float64, device=device)))
        copied_bias = name.endswith(".b2") and layer.layout.shard_of_rank(layer.ep_group.rank) != 0
        where[id(p)] = None if copied_bias else id(group)
    total = torch.zeros((), dtype=torch.float64, device=device)
    if any(isinstance(p, DTensor) for p in params):  # laid out by parallelize: every rank a distinct part of all
        for p in params:
            total += _local(p.grad).double().square().sum()  # type: ignore[arg-type]
        dist.all_reduce(total)
        return total.sqrt().float()
    for p in params:
        sq = p.grad.double().square().sum()  # type: ignore[union-attr]
        if id(p) not in where:
            total += sq
        elif (key := where[id(p)]) is not None:
            groups[key][1].add_(sq)
    for group, spread in groups.values():  # the same groups in the same order on every rank
        dist.all_reduce(spread, group=group)
        total += spread
    return total.sqrt().float()
