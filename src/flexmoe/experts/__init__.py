"""The expert stage: the experts' modules, their kernels, and the one object that decides how a call's experts
run (docs/architecture.md, "Expert compute").

* :mod:`~flexmoe.experts.modules`: :class:`FeedForwardExperts`, :class:`ExpertOptions` and the expert protocol
  (what ``flexmoe.experts`` exports, as before it was a package);
* :mod:`~flexmoe.experts.stage`: :class:`~flexmoe.experts.stage.ExpertStage`, a layer call's route and kernel;
* :mod:`~flexmoe.experts.weights`, :mod:`~flexmoe.experts.kernels`, :mod:`~flexmoe.experts.row_kernels`,
  :mod:`~flexmoe.experts.segment_ffn`: the kernels over rows sorted by expert, and
  :mod:`~flexmoe.experts.chooser`, which times them;
* :mod:`~flexmoe.experts.fused`, :mod:`~flexmoe.experts.padded_op`, :mod:`~flexmoe.experts.padded_fused_op`,
  :mod:`~flexmoe.experts.grouped_op`: the fused route and the custom ops a compiled call runs;
* :mod:`~flexmoe.experts.shared_gate`: Qwen2-MoE's gate on the shared experts.

Only the modules' names are imported here: the stage imports flexmoe.parallel, which imports the experts' modules.
"""

from flexmoe.experts.modules import (
    ExpertOptions,
    ExpertsCall,
    FeedForwardExperts,
    activation_derivative,
    activation_into,
    activation_name,
    check_glu_limit,
    differentiated_weights,
    expert_ffn,
    resolve_activation,
)

__all__ = ["ExpertOptions", "FeedForwardExperts", "ExpertsCall", "differentiated_weights", "expert_ffn",
           "check_glu_limit", "resolve_activation", "activation_name", "activation_derivative", "activation_into"]
