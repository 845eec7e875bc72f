"""Optimizers for MoE models: :class:`Muon` (``torch.optim.Muon`` that also takes expert stacks ``[E, M, H]``),
:class:`MuonWithAdamW` (Muon on the matrices, AdamW on the rest, one optimizer) and :func:`muon_param_groups`
(which parameters go where)."""

from flexmoe.optim.combined import MuonWithAdamW
from flexmoe.optim.groups import muon_param_groups
from flexmoe.optim.muon import Muon, newton_schulz

__all__ = ["Muon", "MuonWithAdamW", "muon_param_groups", "newton_schulz"]
