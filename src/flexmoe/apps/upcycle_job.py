"""``flexmoe train --upcycle-from RUN``: continue a finished dense run of the GPT as an MoE model
(:func:`flexmoe.upcycle`; docs/architecture.md, "Upcycling").

The dense run's newest checkpoint gives the weights; ``--num-experts``, ``--k`` and ``--granularity`` the MoE
layers (every block, ``moe_every=1``, experts of hidden ``dense_hidden / granularity``), and ``--capacity-factor``
(default 0, dropless: a capacity would drop tokens at the start) and ``--aux-loss-coef`` their routing. The new
run starts at step 0 with its own optimizer and learning-rate schedule; with ``--compare-dense`` the dense
model continues from the same weights on the same batches into ``OUT/dense``, the baseline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from flexmoe.apps.errors import UsageError
from flexmoe.apps.models.gpt import GPT, GPTConfig
from flexmoe.checkpoint import CheckpointError, latest_checkpoint, read_checkpoint
from flexmoe.upcycle import upcycle

__all__ = ["UpcycleStart", "upcycle_start", "UPCYCLE_MODEL_FIELDS"]

# The model fields an upcycled run takes from the command line; the rest are the dense run's.
UPCYCLE_MODEL_FIELDS = ("num_experts", "k", "capacity_factor", "aux_loss_coef")


@dataclass
class UpcycleStart:
    """Where an upcycled run starts: the dense run's model and weights, and the upcycled model's (global form)."""

    dense_config: GPTConfig
    dense_state: dict[str, Tensor]
    moe_config: GPTConfig
    moe_state: dict[str, Tensor]


def upcycle_start(run_dir: str | Path, granularity: int, model_flags: dict[str, Any]) -> UpcycleStart:
    """Read the dense run in ``run_dir`` (its ``config.json`` and newest checkpoint) and upcycle it.

    model_flags: the model fields the command line set (:func:`flexmoe.apps.train.model_flag_values`); only
    :data:`UPCYCLE_MODEL_FIELDS` may be among them. Raises :class:`UsageError` naming the problem: no such run, a
    run that is not dense, no checkpoint, other model flags, sizes :func:`flexmoe.upcycle` refuses."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise UsageError(f"--upcycle-from {run_dir}: no {config_path} (give the --out of a `flexmoe train --dense` "
                         f"run)")
    model = json.loads(config_path.read_text()).get("model", {})
    if not model.get("dense", False) or "hf_config" in model:
        raise UsageError(f"--upcycle-from {run_dir}: not a dense GPT run (its config.json has dense="
                         f"{model.get('dense', False)}); upcycle a run trained with `flexmoe train --dense`")
    others = sorted(set(model_flags) - set(UPCYCLE_MODEL_FIELDS))
    if others:
        raise UsageError(f"--upcycle-from takes the model's shape from the dense run; leave out the model flags "
                         f"{['--' + name.replace('_', '-') for name in others]} (it may set --num-experts, --k, "
                         f"--capacity-factor, --aux-loss-coef and --granularity)")
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise UsageError(f"--upcycle-from {run_dir}: the run has no checkpoint to start from")
    try:
        weights = read_checkpoint(checkpoint).model
    except CheckpointError as error:
        raise UsageError(f"--upcycle-from {run_dir}: {error}") from None
    dense_config = GPTConfig.from_dict(model)
    dense = GPT(dense_config)
    dense.load_state_dict(weights)
    options = dict(model_flags)
    num_experts = options.pop("num_experts", GPTConfig.num_experts)
    k = options.pop("k", GPTConfig.k)
    try:
        moe = upcycle(dense, num_experts=num_experts, k=k, granularity=granularity, **options)
    except ValueError as error:
        raise UsageError(f"--upcycle-from: {error}") from None
    assert isinstance(moe, GPT)  # upcycle returns the model it was given
    return UpcycleStart(dense_config, weights, moe.cfg, {name: t.detach() for name, t in moe.state_dict().items()})
