"""One optimizer for a whole model: :class:`MuonWithAdamW`, Muon on the matrices and AdamW on the rest.

Muon does not take every parameter (:mod:`flexmoe.optim.groups` says which); training needs one ``step()``,
one ``zero_grad()``, one state dict and one set of param groups for the learning-rate schedule, so the two live
in one :class:`torch.optim.Optimizer` whose groups each say which update they get (``"use_muon"``). Its state is
that of the two optimizers it stands for, parameter by parameter (``momentum_buffer`` for Muon's, ``step``,
``exp_avg``, ``exp_avg_sq`` for AdamW's), so flexmoe's checkpoints and DCP save and resume it as they do AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from flexmoe.optim.muon import EPS, NS_COEFFICIENTS, NS_STEPS, check_muon_param, loss_of, muon_defaults, muon_group_step

__all__ = ["MuonWithAdamW"]


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (:class:`~flexmoe.optim.Muon`'s update) for the groups with ``"use_muon": True``, AdamW
    (``torch.optim.AdamW``'s update: decoupled weight decay, bias-corrected moments) for those with ``False``.
    Every group must say which; :func:`~flexmoe.optim.muon_param_groups` makes the groups of a model.

    The arguments up to ``adjust_lr_fn`` are :class:`~flexmoe.optim.Muon`'s (``lr`` and ``weight_decay`` are
    both kinds' defaults); ``betas`` and ``adamw_eps`` are AdamW's; ``foreach`` as AdamW's (multi-tensor AdamW:
    each AdamW group's tensors must be one kind, all DTensors or none, :func:`flexmoe.sharding.split_expert_groups`).
    With ``adjust_lr_fn="match_rms_adamw"`` Muon's update has AdamW's RMS, so one learning rate (and one schedule)
    serves both, as in Moonlight.

    >>> opt = MuonWithAdamW(muon_param_groups(model), lr=2e-3, adjust_lr_fn="match_rms_adamw")
    >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        foreach: bool | None = None,
    ) -> None:
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not adamw_eps >= 0:
            raise ValueError(f"adamw_eps must be >= 0, got {adamw_eps}")
        defaults = {**muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn),
                    "betas": betas, "adamw_eps": adamw_eps, "foreach": foreach}
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            if not isinstance(group.get("use_muon"), bool):
                raise ValueError(f"params[{i}]: each param group must set 'use_muon' to True (Muon) or False "
                                 f"(AdamW), got {group.get('use_muon')!r}; flexmoe.optim.muon_param_groups makes them")
            if group["use_muon"]:
                for j, p in enumerate(group["params"]):
                    check_muon_param(p, group.get("last_dim_parts", 1), f"params[{i}]['params'][{j}]")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group; ``closure`` (optional) recomputes the loss, which is returned."""
        loss = loss_of(closure)
        for group in self.param_groups:
            if group["use_muon"]:
                muon_group_step(group, self.state)
            else:
                self._adamw_group_step(group)
        return loss

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step of ``group`` (its functional form), its state kept as AdamW keeps it."""
        params: list[Tensor] = []
        grads: list[Tensor] = []
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)  # on the host, as AdamW's (not capturable)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=group["foreach"], decoupled_weight_decay=True,
             amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["adamw_eps"], maximize=False)
