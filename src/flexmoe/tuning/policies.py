"""The decisions that need the cost model: the model-guided ``parallel="auto"`` chooser and FasterMoE's shadowing
rule. They plug into the interfaces of :mod:`flexmoe.parallel` (:class:`~flexmoe.parallel.Chooser`,
:class:`~flexmoe.parallel.ShadowPolicy`) and live here, beside the model, because :mod:`flexmoe.parallel` never
imports :mod:`flexmoe.tuning` (docs/architecture.md, "Rooms").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from flexmoe.parallel.auto import AutoContext, MeasuringChooser
from flexmoe.parallel.expert_parallel import ParallelSetting
from flexmoe.parallel.shadow import ShadowContext, ShadowPolicy, global_counts
from flexmoe.tuning.cost_model import LayerConfig, choose_shadowed, score_candidates
from flexmoe.tuning.profile import LOCAL_PROFILE_PATH, Profile, load_profile

__all__ = ["ModelGuidedChooser", "workload_config", "CostModelShadowPolicy", "DEFAULT_PUBLISHED_PROFILE",
           "resolve_shadow"]

#: The profile :class:`CostModelShadowPolicy` uses when none is given and this machine has no calibrated one.
DEFAULT_PUBLISHED_PROFILE = "a100-ndv4"


class ModelGuidedChooser(MeasuringChooser):
    """``parallel="auto"`` steered by the cost model: rank every candidate, time only the ``keep`` best.

    ``profile`` is a :class:`~flexmoe.tuning.profile.Profile` or a name for
    :func:`~flexmoe.tuning.profile.load_profile` (``"local"``: the one ``flexmoe calibrate`` wrote;
    ``"a100-ndv4"``; a JSON path). ``keep=1`` trusts the model outright (its best candidate runs from the
    first step). Each short list's model view and predicted seconds per candidate, best first, are appended to
    ``predictions`` so a report can show model and clock side by side. Like any chooser it keeps one layer's
    decisions: give each layer its own.
    """

    def __init__(self, profile: Profile | str, keep: int = 3, trials: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        super().__init__(trials=trials, prune=self._rank)
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        self.keep = keep
        self.predictions: list[tuple[LayerConfig, list[tuple[float, ParallelSetting]]]] = []

    def _rank(self, options: list[ParallelSetting], context: AutoContext) -> list[ParallelSetting]:
        config = workload_config(context)
        try:
            self.profile.compute_for(config.dtype)
        except KeyError:
            return options  # the profile has no roofline for this dtype (float64): measure everything
        scored = score_candidates(self.profile, config, options)
        self.predictions.append((config, scored))
        return [setting for _, setting in scored[: self.keep]]


def workload_config(context: AutoContext) -> LayerConfig:
    """The cost model's view of one forward: the busiest rank's rows as its tokens, the global load per expert.

    The counts are what was dispatched (capacity already applied), so the model sees a dropless layer
    (``capacity_factor=0``) with ``tokens = rows / k`` and the measured shares per expert.
    """
    counts = context.all_counts
    rows = max((sum(row) for row in counts), default=0)
    load = [float(sum(col)) for col in zip(*counts)] if counts else []
    return LayerConfig(
        tokens=max(1, math.ceil(rows / context.k)), model_dim=context.model_dim, hidden_dim=context.hidden_dim,
        experts=context.num_experts, k=context.k, capacity_factor=0.0,
        dtype=str(context.dtype).removeprefix("torch."), ranks=len(counts), glu=context.glu,
        expert_shares=tuple(load) if sum(load) > 0 else None,
    )


def _default_profile() -> Profile:
    return load_profile("local" if LOCAL_PROFILE_PATH.exists() else DEFAULT_PUBLISHED_PROFILE)


class CostModelShadowPolicy:
    """FasterMoE's decision: shadow the hottest experts while it makes the layer faster (per the cost model).

    profile: a :class:`~flexmoe.tuning.Profile`, a profile name for :func:`~flexmoe.tuning.load_profile`
        (``"a100-ndv4"``, ``"local"``, a JSON path), or None: this machine's calibrated profile
        (``flexmoe calibrate`` writes :data:`~flexmoe.tuning.profile.LOCAL_PROFILE_PATH`) when it exists, else
        the published :data:`DEFAULT_PUBLISHED_PROFILE`. The profile's identity is part of the layer's
        configuration check, so ranks that resolved different profiles fail at construction.
    max_shadowed: at most this many experts per step (None: no limit).

    The layer's counts are already after capacity, so the cost model sees them as a dropless layer whose
    per-expert shares are this step's global counts.
    """

    def __init__(self, profile: object | None = None, max_shadowed: int | None = None) -> None:
        if profile is None:
            profile = _default_profile()
        elif not isinstance(profile, Profile):
            profile = load_profile(profile)  # type: ignore[arg-type]
        self.profile = profile
        self.max_shadowed = max_shadowed

    def describe(self) -> str:
        digest = hashlib.sha1(self.profile.to_json().encode()).hexdigest()[:10]
        return f"CostModelShadowPolicy(profile={self.profile.name}@{digest}, max_shadowed={self.max_shadowed})"

    def choose(self, all_counts: Sequence[Sequence[int]], context: ShadowContext) -> list[int]:
        world = len(all_counts)
        counts = global_counts(all_counts)
        total = sum(counts)
        if world == 1 or context.layout.shards_per_expert > 1 or total == 0:
            return []
        config = LayerConfig(
            tokens=max(1, math.ceil(total / world / context.k)),  # mean tokens per rank
            model_dim=context.model_dim,
            hidden_dim=context.hidden_dim,
            experts=len(counts),
            k=context.k,
            capacity_factor=0.0,  # the counts are the rows actually computed: nothing left to drop
            dtype=self._cost_dtype(context.dtype),
            ranks=world,
            ranks_per_node=context.ranks_per_node,
            overlap_degree=context.overlap_degree,
            a2a=context.a2a,
            glu=context.glu,
        )
        return choose_shadowed(self.profile, config, counts, self.max_shadowed)

    def _cost_dtype(self, dtype: torch.dtype) -> str:
        """The dtype name the profile can price (float64 is priced at float32 rates if the profile lacks it)."""
        name = str(dtype).replace("torch.", "")
        try:
            self.profile.compute_for(name)
            return name
        except KeyError:
            return "float32"


def resolve_shadow(shadow: object) -> ShadowPolicy | None:
    """``shadow=`` of the layer -> a policy, or None for no shadowing (False / None); True is the cost model's."""
    if shadow is None or shadow is False:
        return None
    if shadow is True:
        return CostModelShadowPolicy()
    if isinstance(shadow, ShadowPolicy):
        return shadow
    raise TypeError(f"shadow must be False, True or a ShadowPolicy (an object with choose()), got {shadow!r}")
