"""Load balancing without an auxiliary loss (DeepSeek-V3, Wang et al., 2024 "Auxiliary-Loss-Free Load Balancing").

Each expert e has a bias ``b_e`` that is added to the router probabilities *only to select* the top-k experts;
the combine weights stay the unbiased probabilities, so the bias steers traffic without entering the model's
output or its gradients. After every training step the bias moves against the observed imbalance:

    b_e <- b_e + rate * sign(mean_load - load_e)

an overloaded expert (load above the mean) becomes less attractive, an idle one more. ``load_e`` counts the
(token, choice) pairs selected for e before capacity drops; under expert parallelism it is the load summed over
the ranks, so every rank applies the same update and the biases stay identical.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["bias_update", "load_imbalance"]


def bias_update(bias: Tensor, load: Tensor, rate: float) -> Tensor:
    """The next bias ``[E]``: ``bias + rate * sign(mean(load) - load)``. load: ``[E]`` pair counts."""
    load = load.to(bias.dtype)
    return bias + rate * (load.mean() - load).sign()


def load_imbalance(load: Tensor) -> float:
    """``max(load) / mean(load)``: 1 for a perfectly balanced load (and for no load at all). load: ``[E]``."""
    mean = float(load.double().mean())
    return float(load.max()) / mean if mean > 0 else 1.0
