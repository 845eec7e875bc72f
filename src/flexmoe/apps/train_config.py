"""The training loop's settings (:class:`TrainConfig`), shared by every training job: the MoE GPT
(:mod:`flexmoe.apps.train`), the vision MoE (:mod:`flexmoe.apps.vision`) and the Hugging Face models
(:mod:`flexmoe.apps.hf_job`). Each job's model has a configuration of its own; this one holds what the loop
(:mod:`flexmoe.apps.train_loop`) reads. It is saved in a run's ``config.json`` (``"train"``) and its checkpoints,
so it holds plain values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainConfig", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer's values (flexmoe.apps.train_step.build_optimizer)


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping settings (the model's are in the job's model configuration)."""

    steps: int = 1000  # about 3.5 minutes for the MoE model on 2 cores
    batch_size: int = 16  # global rows per step, split over ranks and micro-batches
    micro_batches: int = 1  # gradient accumulation per rank
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # "adamw", or "muon": Muon on the hidden matrices and expert stacks, AdamW on the rest (flexmoe.optim), one lr
    optimizer: str = "adamw"
    seed: int = 1337
    data: str | None = None
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    target_loss: float | None = None
    stop_at_target: bool = False
    plots: bool = True
    progress: bool = True
    compile: str | None = None  # a torch.compile backend ("inductor", "aot_eager", ...); None: eager
    device: str = "cpu"  # where the model and its batches live ("cpu", "cuda", "cuda:1", ...)
    # The mesh (flexmoe.apps.sharded_job): FSDP2 over all ranks, experts over ep ranks (None: all).
    fsdp: bool = False
    ep: int | None = None
    activation_checkpointing: bool = False
    param_dtype: str = "float32"  # under fsdp: the dtype blocks compute in (FSDP2's mixed precision)
    # --upcycle-from: the dense run this MoE run starts from (flexmoe.apps.upcycle_job), and each expert's share
    # of the dense MLP (1/granularity of its hidden units).
    upcycle_from: str | None = None
    granularity: int = 1
    # With the model's redundant_experts: re-place the replicas from the recent load every N steps (0: never).
    replace_every: int = 0
    # Faults (flexmoe.apps.ranks, flexmoe.apps.faults): the bound in seconds on every collective (None: torch's
    # default), and a fault injected on purpose ("KIND:RANK:STEP", for the fault tests and the restart benchmark).
    collective_timeout: float | None = None
    inject_fault: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
