"""The training loop every job shares: the MoE GPT (:mod:`flexmoe.apps.train`), the Hugging Face models
(:mod:`flexmoe.apps.hf_job`) and the vision MoE (:mod:`flexmoe.apps.vision`).

A job builds its model (on this rank: under expert parallelism holding its experts, under ``--fsdp`` laid on a
mesh) and a :class:`Task` (its data: each step's batch and the held-out evaluation), then calls
:func:`train_model`. The loop owns everything else, the same for every job: AdamW and its schedule, DDP, the
micro-batches, gradient clipping, the per-step updates of the MoE layers (selection biases, global balance,
replicas: :func:`flexmoe.apps.train_step.optimizer_step`), metrics, checkpoints, ``--resume``, Ctrl-C, plots and
the summary (:mod:`flexmoe.apps.run_files`).

Reproducibility: the batch of step s is a function of (seed, s) only, the learning rate a function of s, and
checkpoints hold the optimizer and RNG states, so a resumed run continues exactly as an uninterrupted one.

Faults: a rank that dies ends the others' collectives at once (a closed connection); one that hangs ends them after
``--collective-timeout`` seconds, with a :class:`~flexmoe.apps.collective_watch.CollectiveTimeout` naming the
ranks that did not answer and the part of the step that waited. Either way the launcher restarts the workers
(``--max-restarts``), which resume from the newest complete checkpoint, on as many ranks as it started (each
record's ``world_size``; the first record on another world size than the checkpoint's says ``world_size_changed``).
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from flexmoe.apps import sharded_job
from flexmoe.apps.collective_watch import timeout_error
from flexmoe.apps.data import TokenData
from flexmoe.apps.errors import UsageError
from flexmoe.apps.faults import fault_at
from flexmoe.apps.interrupt import Interrupted, StopSignals
from flexmoe.apps.models.moe_model import MoEModel
from flexmoe.apps.ranks import all_reduce_host, init_distributed
from flexmoe.apps.run_files import (
    RunResult,
    finished_run,
    latest_run_checkpoint,
    load_run_checkpoint,
    remove_run_files,
    rewrite_metrics,
    save_run_checkpoint,
    write_plots,
)
from flexmoe.apps.train_config import TrainConfig
from flexmoe.apps.train_step import (
    StepStats,
    build_optimizer,
    compile_model,
    forward_backward,
    mean_over_ranks,
    optimizer_step,
    set_lr,
)
from flexmoe.model_routing import balance_metrics
from flexmoe.parallel.ddp import wrap_ddp
from flexmoe.parallel.groups import default_ranks_per_node
from flexmoe.parallel.replicas import placement_record, replica_slots

__all__ = ["Task", "TokenTask", "init_distributed", "rank_rows", "step_bar", "train_model"]


class Task(ABC):
    """What a job trains on: each step's batch and the held-out evaluation; the loop does the rest.

    ``source`` names the data in ``config.json``; the metrics count ``unit`` (``"tokens"``, ``"images"``) per step,
    shown as ``rate_name`` in the progress bar; ``loss_unit`` labels the loss plots.
    """

    source: str
    unit: str = "tokens"
    rate_name: str = "tok/s"
    loss_unit: str = "nats / byte"

    @abstractmethod
    def describe(self) -> str:
        """The data in words, for the run's first line (e.g. ``"digits: 1,437 train / 360 held-out images"``)."""

    @abstractmethod
    def batch(self, step: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
        """This rank's rows of the global batch of 1-based step ``step`` (inputs and targets, on the CPU): a
        function of the seed and ``step`` only."""

    @abstractmethod
    def evaluate(self, model: MoEModel, rank: int, world: int) -> dict[str, float]:
        """The held-out numbers of ``model`` (in eval mode while it runs), the same on every rank: ``val_loss``
        and whatever else the job reports (recorded in the metrics and the summary)."""

    @abstractmethod
    def units_per_step(self) -> int:
        """How many ``unit`` one step trains on, over all ranks."""

    @abstractmethod
    def tokens_per_step(self) -> int:
        """How many tokens one step trains on, over all ranks."""

    def eval_text(self, numbers: dict[str, float]) -> str:
        """:meth:`evaluate`'s numbers for the run's last line."""
        return f"val loss {numbers['val_loss']:.4f}"


class TokenTask(Task):
    """A language model on token sequences (:class:`TokenData`): ``x, y: [rows, block_size]``, ``y`` the next
    tokens of ``x``; evaluated on ``tcfg.eval_batches`` fixed validation batches (the same at every evaluation and
    every seed)."""

    def __init__(self, data: TokenData, tcfg: TrainConfig, block_size: int) -> None:
        self.data, self.tcfg, self.block_size = data, tcfg, block_size
        self.source = data.source

    def describe(self) -> str:
        return f"{self.data.source}: {len(self.data.train):,} train / {len(self.data.val):,} validation bytes"

    def batch(self, step: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
        tcfg = self.tcfg
        rows = rank_rows(tcfg.batch_size, rank, world)
        return self.data.batch("train", tcfg.batch_size, self.block_size, seed=tcfg.seed, step=step, rows=rows)

    @torch.no_grad()
    def evaluate(self, model: MoEModel, rank: int, world: int) -> dict[str, float]:
        tcfg = self.tcfg
        model.eval()
        rows = rank_rows(tcfg.batch_size, rank, world)
        total = 0.0
        for i in range(tcfg.eval_batches):
            x, y = self.data.batch("val", tcfg.batch_size, self.block_size, seed=0, step=i, rows=rows)
            _, loss = model(x.to(tcfg.device), y.to(tcfg.device))
            total += loss.item()
        model.train()
        return {"val_loss": mean_over_ranks(total / tcfg.eval_batches, world)}

    def units_per_step(self) -> int:
        return self.tcfg.batch_size * self.block_size

    def tokens_per_step(self) -> int:
        return self.units_per_step()


def rank_rows(batch_size: int, rank: int, world: int) -> slice:
    """The rows of a global batch of ``batch_size`` that rank ``rank`` of ``world`` trains on."""
    if batch_size % world:
        raise UsageError(f"--batch-size {batch_size} must divide by the number of ranks {world}")
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


def step_bar(tcfg: TrainConfig, start: int, label: str, show: bool = True) -> Any:
    """A tqdm bar over the run's steps, already at ``start``; None without ``tcfg.progress`` or ``show``."""
    if not (show and tcfg.progress):
        return None
    from tqdm import tqdm

    return tqdm(total=tcfg.steps, initial=start, desc=label, unit="step", dynamic_ncols=True)


def train_model(model: MoEModel, task: Task, tcfg: TrainConfig, out: str | Path, *, label: str,
                model_config: dict[str, Any], param_counts: tuple[int, int], resume: bool = False,
                mesh: DeviceMesh | None = None) -> RunResult:
    """Train ``model`` on ``task`` into run directory ``out`` (metrics, checkpoints, plots, summary); returns its
    final numbers (on every rank).

    ``model`` is built on this rank (under expert parallelism: holding its experts) and its ``forward(x, y)``
    returns ``(output, loss)`` for a batch of ``task``. ``model_config`` goes into config.json, ``param_counts``
    is (parameters, parameters active per token) of the whole model. ``mesh``: the model was laid on it by
    :func:`flexmoe.parallel.parallelize` (``--fsdp``): no DDP, and DCP checkpoints
    (:mod:`flexmoe.apps.sharded_job`).
    """
    run = _Run(model, task, tcfg, Path(out), label, mesh)
    finished = run.resume() if resume else None
    if finished is not None:
        return finished
    run.start(model_config, param_counts)
    run.loop()
    return run.finish()


class _Run:
    """One call of :func:`train_model`: the model, its optimizer and where the run stands."""

    def __init__(self, model: MoEModel, task: Task, tcfg: TrainConfig, out: Path, label: str,
                 mesh: DeviceMesh | None) -> None:
        self.model, self.task, self.tcfg, self.out, self.label, self.mesh = model, task, tcfg, out, label, mesh
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.device = torch.device(tcfg.device)
        self.optimizer = build_optimizer(model, tcfg)
        # Replicated parameters are all-reduced by DDP; spread experts are left out (their gradients already
        # hold every rank's tokens through the all-to-all).
        self.ddp = wrap_ddp(model) if self.world > 1 and mesh is None else None
        torch.manual_seed(tcfg.seed + 1)  # training-time randomness (dropout, router noise), same at any world size
        self.start_step, self.elapsed = 0, 0.0
        self.target: dict[str, Any] | None = None  # where the val loss first reached --target-loss
        self.resumed_from: Path | None = None
        self.records: list[dict[str, Any]] = []  # the saved metrics a resumed run keeps
        self.step = 0
        self.train_loss = float("nan")
        self.numbers: dict[str, float] = {"val_loss": float("nan")}  # the last evaluation's
        self.last_eval_step = -1
        self.state_bytes: list[int] | None = None  # per rank, counted at the first step
        self.phase = ""  # the part of the step running now, named when one of its collectives times out
        self.stop_signals = StopSignals()
        self.world_size_changed: dict[str, int] | None = None  # set by start(): the resumed run's old world size
        # The nodes the MoE layers see: torchrun's LOCAL_WORLD_SIZE ranks per node (None: not under torchrun).
        self.ranks_per_node = (model.moe_layers[0].parallel_options.ranks_per_node if model.moe_layers
                               else default_ranks_per_node())
        self.params, self.active_params = 0, 0
        self.bar: Any = None
        # Wall-clock bookkeeping (set when the loop starts): the run's start (less the time before a resume), and
        # the time and step of the last metrics record (for the throughput).
        self.t0 = self.t_last = 0.0
        self.step_last = 0

    def say(self, msg: str) -> None:
        """Print ``msg`` on rank 0 (through the progress bar while it is shown)."""
        if self.rank == 0:
            (self.bar.write(msg) if self.bar is not None else print(msg, flush=True))

    def resume(self) -> RunResult | None:
        """Load the newest checkpoint, if any; the run's result if that checkpoint ends a finished run."""
        ckpt = latest_run_checkpoint(self.out, sharded=self.mesh is not None)
        if ckpt is None:
            return None
        meta = load_run_checkpoint(ckpt, self.model, self.optimizer, self.mesh)
        self.start_step, self.elapsed, self.target = meta["step"], meta.get("elapsed_s", 0.0), meta.get("target")
        finished = finished_run(self.out, self.start_step, self.tcfg, self.target)
        if finished is not None:
            self.say(f"[{self.label}] {self.out} is already complete (step {self.start_step} of {self.tcfg.steps}); "
                     f"nothing to do (--steps N with a larger N extends it)")
            return finished
        self.say(f"[{self.label}] resumed from {ckpt} at step {self.start_step}")
        self.resumed_from = ckpt
        return None

    def start(self, model_config: dict[str, Any], param_counts: tuple[int, int]) -> None:
        """Rank 0 writes config.json (a new run first removes an old run's files) and keeps the metrics up to the
        resumed step; every rank compiles the model if asked."""
        self.params, self.active_params = param_counts
        out, world, label = self.out, self.world, self.label
        if self.rank == 0:
            if world > 1:
                rpn = self.ranks_per_node
                nodes = f"{world // rpn} node(s) of {rpn}" if rpn else "one node"
                print(f"[{label}] {world} ranks on {nodes}", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            previous = json.loads((out / "config.json").read_text()).get("world_size") \
                if self.resumed_from is not None and (out / "config.json").is_file() else None
            if previous is not None and previous != world:
                self.world_size_changed = {"from": previous, "to": world, "resumed_at_step": self.start_step}
                print(f"[{label}] world size changed from {previous} to {world} ranks: resumed at step "
                      f"{self.start_step}, the checkpoint cut for {world} ranks", flush=True)
            if self.resumed_from is None:
                # A new run in an existing directory (the command line allows it with --overwrite only) replaces
                # the old run's files, and only those.
                remove_run_files(out)
            (out / "config.json").write_text(json.dumps(
                {"model": model_config, "train": asdict(self.tcfg), "world_size": world,
                 "ranks_per_node": self.ranks_per_node, "data": self.task.source}, indent=1))
            self.records = rewrite_metrics(out / "metrics.jsonl", self.start_step) if self.resumed_from else []
            if self.resumed_from is None:
                print(f"[{label}] {self.params:,} parameters, {self.active_params:,} active per token; "
                      f"{self.task.describe()}", flush=True)
        compile_model(self.model, self.tcfg, label, self.rank,
                      blocks=None if self.mesh is None else sharded_job.blocks(self.model))

    def loop(self) -> None:
        """Train from the start (or resumed) step to ``tcfg.steps``: Ctrl-C / SIGTERM save at the end of the
        step, then raise :class:`Interrupted`."""
        tcfg = self.tcfg
        # Training mode for every module: a model from HF's from_pretrained (--hf-model) comes in eval, and its
        # converted blocks with it (no router jitter, no bias updates, no dropout).
        self.model.train()
        self.bar = step_bar(tcfg, self.start_step, self.label, show=self.rank == 0)
        log_file = open(self.out / "metrics.jsonl", "a") if self.rank == 0 else None
        self.t0 = time.perf_counter() - self.elapsed
        self.t_last, self.step_last = time.perf_counter(), self.start_step
        self.step = self.start_step
        stop_signals = self.stop_signals
        saved: Path | None = None
        try:
            stop_signals.install()
            for step in range(self.start_step + 1, tcfg.steps + 1):
                self.step = step
                started = time.monotonic()
                try:
                    record = self.train_step(step)
                    if record is not None and log_file is not None:
                        log_file.write(json.dumps(record) + "\n")
                        log_file.flush()
                    if self.bar is not None:
                        self.bar.update(1)
                    stop = tcfg.stop_at_target and self.target is not None
                    self.phase = "the stop signals' all-reduce"
                    signum = stop_signals.received(self.world)
                    if step % tcfg.ckpt_every == 0 or step == tcfg.steps or stop or signum:
                        self.phase = "the checkpoint's save"
                        saved = self.save(step)
                except RuntimeError as exc:
                    timed_out = timeout_error(exc, tcfg.collective_timeout, started, rank=self.rank,
                                              world=self.world, step=step, phase=self.phase)
                    if timed_out is None:
                        raise  # not a collective that waited past the bound (a dead peer ends it at once)
                    raise timed_out from exc
                if signum:
                    raise Interrupted.after_step(self.label, signum, step, tcfg.steps, saved)
                if stop:
                    break
        finally:
            stop_signals.restore()
            if self.bar is not None:
                self.bar.close()
            if log_file is not None:
                log_file.close()

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step`` (collective); its path on the rank that wrote it. ``--inject-fault kill-in-save``
        kills its rank after the checkpoint's files are written and before it is complete."""
        tcfg = self.tcfg
        extra = {"elapsed_s": time.perf_counter() - self.t0, "target": self.target, "train": asdict(tcfg),
                 "world_size": self.world}
        fault = fault_at(tcfg.inject_fault, "kill-in-save", self.rank, step)
        return save_run_checkpoint(self.out, self.model, self.optimizer, self.mesh, step, extra,
                                   tcfg.keep_checkpoints, before_commit=None if fault is None else fault.fire)

    def train_step(self, step: int) -> dict[str, Any] | None:
        """One optimizer step; its metrics record where ``step`` is logged (None elsewhere)."""
        tcfg, model = self.tcfg, self.model
        kill = fault_at(tcfg.inject_fault, "kill", self.rank, step)
        if kill is not None:
            kill.fire()
        lr = set_lr(self.optimizer, step, tcfg)
        x, y = self.task.batch(step, self.rank, self.world)
        hang = fault_at(tcfg.inject_fault, "hang", self.rank, step)
        if hang is not None:
            hang.fire(self.stop_signals)
        self.phase = "the forward and backward pass (the experts' all-to-all, the gradients' all-reduce)"
        stats = forward_backward(model, self.ddp, x.to(self.device), y.to(self.device), tcfg.micro_batches)
        self.phase = "the optimizer step (the gradients' norm, the MoE layers' updates)"
        placement_before = optimizer_step(model, self.optimizer, tcfg, step, self.world, self.mesh is not None)
        if self.state_bytes is None:
            self.state_bytes = sharded_job.state_bytes_per_rank(model, self.optimizer)
            msg = f"[{self.label}] state bytes per rank (parameters, gradients, AdamW): {self.state_bytes}"
            if tcfg.param_dtype != "float32":
                msg += (f"; blocks compute in {tcfg.param_dtype} (FSDP2 mixed precision), weights, "
                        f"gradient reduction and AdamW in float32")
            self.say(msg)
        self.optimizer.zero_grad(set_to_none=True)
        is_eval = step % tcfg.eval_every == 0 or step == tcfg.steps
        if not (is_eval or step % tcfg.log_every == 0):
            return None
        self.phase = "the metrics' all-reduce"
        return self.record(step, stats, lr, placement_before, is_eval)

    def record(self, step: int, stats: StepStats, lr: float, placement_before: list[Any],
               is_eval: bool) -> dict[str, Any]:
        """The metrics record of logged step ``step`` (means over ranks and micro-batches; loads summed)."""
        tcfg, model, world, unit = self.tcfg, self.model, self.world, self.task.unit
        self.train_loss = mean_over_ranks(stats.loss / tcfg.micro_batches, world)
        balance = mean_over_ranks(stats.balance / tcfg.micro_batches, world)
        drop = mean_over_ranks(stats.drop / tcfg.micro_batches, world)
        load, demand = stats.load, stats.demand
        if world > 1 and load.numel():
            all_reduce_host(load)
            all_reduce_host(demand)
        now = time.perf_counter()
        rate = (step - self.step_last) * self.task.units_per_step() / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, step
        record: dict[str, Any] = {
            "step": step, "train_loss": self.train_loss, "balance_loss": balance, "drop_rate": drop, "lr": lr,
            unit: step * self.task.units_per_step(), "elapsed_s": now - self.t0, f"{unit}_per_s": rate,
            "world_size": world,
        }
        if self.world_size_changed is not None:  # the first record after a resume on another number of ranks
            record["world_size_changed"], self.world_size_changed = self.world_size_changed, None
        if load.numel():
            record["expert_load"] = load.long().tolist()
            record["expert_demand"] = demand.long().tolist()
            # Before the evaluation below routes other tokens through the layers.
            record["balance"] = {k: mean_over_ranks(v, world) for k, v in balance_metrics(model).items()}
            if placement_before:
                record["placement"] = placement_record(placement_before, replica_slots(model), record["expert_load"])
        if is_eval:
            self.phase = "the evaluation"
            self.evaluate(step, record)
        if self.bar is not None:
            post = {"loss": f"{self.train_loss:.3f}", self.task.rate_name: f"{rate:,.0f}"}
            if model.moe_layers:
                post.update(bal=f"{balance:.3f}", drop=f"{drop:.3f}")
            post.update({k: f"{v:.3f}" for k, v in self.numbers.items() if self.last_eval_step > 0})
            self.bar.set_postfix(post, refresh=False)
        return record

    def evaluate(self, step: int, record: dict[str, Any]) -> None:
        """Evaluate at ``step`` into ``record``; the first evaluation at or below ``--target-loss`` is the target."""
        tcfg = self.tcfg
        self.numbers = self.task.evaluate(self.model, self.rank, self.world)
        self.last_eval_step = step
        record.update(self.numbers)
        val_loss = self.numbers["val_loss"]
        if tcfg.target_loss is None or self.target is not None or val_loss > tcfg.target_loss:
            return
        tokens = step * self.task.tokens_per_step()
        self.target = {"target_loss": tcfg.target_loss, "step": step, "tokens": tokens,
                       "wall_time_s": time.perf_counter() - self.t0, "val_loss": val_loss}
        self.say(f"[{self.label}] reached val loss {val_loss:.4f} <= {tcfg.target_loss} at the evaluation of step "
                 f"{step} (evaluated every {tcfg.eval_every} steps): {self.target['wall_time_s']:.1f} s, "
                 f"{tokens:,} tokens")
        record["target_reached"] = True

    def finish(self) -> RunResult:
        """Evaluate the final weights (unless the last step did), write summary.json and the plots."""
        tcfg, step, target = self.tcfg, self.step, self.target
        if self.last_eval_step != step:  # resumed at the end, or nothing to do: evaluate the final weights once
            self.numbers = self.task.evaluate(self.model, self.rank, self.world)
            if self.rank == 0 and math.isnan(self.train_loss) and self.records:
                self.train_loss = self.records[-1]["train_loss"]
        wall = time.perf_counter() - self.t0
        tokens = step * self.task.tokens_per_step()
        val_loss = self.numbers["val_loss"]
        counted = {} if self.task.unit == "tokens" else {self.task.unit: step * self.task.units_per_step()}
        summary = {
            "model": self.label, "steps": step, "final_val_loss": val_loss,
            **{k: v for k, v in self.numbers.items() if k != "val_loss"}, "final_train_loss": self.train_loss,
            "wall_time_s": wall, "tokens": tokens, **counted, "params": self.params,
            "active_params": self.active_params, "world_size": self.world, "ranks_per_node": self.ranks_per_node,
            "target": target, "state_bytes_per_rank": self.state_bytes,
        }
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            if tcfg.plots:
                write_plots(self.out, self.label, loss_unit=self.task.loss_unit)
            reached = ""
            if target:
                reached = (f"; target {tcfg.target_loss} reached at the evaluation of step {target['step']} after "
                           f"{target['wall_time_s']:.1f} s and {target['tokens']:,} tokens")
            elif tcfg.target_loss is not None:
                reached = f"; target {tcfg.target_loss} not reached"
            print(f"[{self.label}] done: step {step}, {self.task.eval_text(self.numbers)}, {wall:.1f} s{reached}",
                  flush=True)
        return RunResult(val_loss, self.train_loss, step, wall, tokens, target, summary)
