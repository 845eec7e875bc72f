"""The performance model: calibrate a machine, predict an MoE layer's time, choose its settings.

* :mod:`flexmoe.tuning.profile`: :class:`Profile` (JSON round trip), published profiles in ``profiles/``;
* :mod:`flexmoe.tuning.cost_model`: :func:`predict` / :func:`layer_time` and the choosers
  :func:`rank_candidates` (for ``parallel="auto"``) and :func:`choose_shadowed` (FasterMoE shadowing);
* :mod:`flexmoe.tuning.policies`: the decisions that need the model, plugged into the layer:
  :class:`ModelGuidedChooser` (``parallel="auto"``) and :class:`CostModelShadowPolicy` (``shadow=True``);
* commands: ``flexmoe calibrate``, ``flexmoe validate-model``, ``flexmoe simulate``, ``flexmoe fit-a2a``
  (:mod:`flexmoe.tuning.a2a_measured`: the all-to-all fitted to a cluster's alltoall_perf logs).
"""

from flexmoe.tuning.cost_model import (
    Breakdown,
    LayerConfig,
    choose_shadowed,
    layer_time,
    predict,
    prune_candidates,
    rank_candidates,
    score_candidates,
)
from flexmoe.tuning.policies import (
    DEFAULT_PUBLISHED_PROFILE,
    CostModelShadowPolicy,
    ModelGuidedChooser,
    resolve_shadow,
    workload_config,
)
from flexmoe.tuning.profile import ComputeSpec, LinkSpec, Profile, available_profiles, load_profile

__all__ = [
    "ModelGuidedChooser",
    "CostModelShadowPolicy",
    "DEFAULT_PUBLISHED_PROFILE",
    "resolve_shadow",
    "workload_config",
    "Breakdown",
    "ComputeSpec",
    "LayerConfig",
    "LinkSpec",
    "Profile",
    "available_profiles",
    "choose_shadowed",
    "layer_time",
    "load_profile",
    "predict",
    "prune_candidates",
    "rank_candidates",
    "score_candidates",
]
