"""Muon for expert stacks: :class:`Muon`, ``torch.optim.Muon`` for 2-D weights and for 3-D expert stacks.

Muon (Keller Jordan, 2024; Moonlight and Kimi K2 trained with it) keeps a momentum buffer per weight matrix and
steps along that buffer *orthogonalised*: a few Newton-Schulz iterations push every singular value of the matrix
toward 1. ``torch.optim.Muon`` takes 2-D weights only. An MoE layer stores its experts as one stack
``[E, M, H]`` (flexmoe's ``w1``, ``w2``, ``gate_up``): E independent matrices. :class:`Muon` orthogonalises each
expert's ``[M, H]`` on its own, all E in one batched Newton-Schulz, so a 3-D stack gets exactly what
``torch.optim.Muon`` would give each expert's matrix as a parameter of its own (same bits on CPU).

The update, for a parameter ``p`` with gradient ``g`` and momentum buffer ``B`` (torch.optim.Muon's, step for step):

    B <- momentum * B + (1 - momentum) * g
    U <- (1 - momentum) * g + momentum * B           (nesterov; else U <- B)
    O <- NS(U)                                       per matrix, in bfloat16, the wide orientation
    p <- p * (1 - lr * weight_decay) - adjusted_lr * O

``adjusted_lr`` scales ``lr`` by the matrix shape ``[A, B]`` as stored: ``sqrt(max(1, A / B))`` ("original", the
default) or ``0.2 * sqrt(max(A, B))`` ("match_rms_adamw": the update's RMS that of AdamW's, so AdamW's learning
rate and weight decay carry over). For a stack ``[E, M, H]`` the matrix is ``[M, H]``, as stored: flexmoe's
``w1 [E, M, H]`` is ``[in, out]`` per expert, the transpose of an ``nn.Linear`` weight, so "original" scales
``w2 [E, H, M]`` up by ``sqrt(H / M)`` where torch.optim.Muon on the two ``nn.Linear`` weights would scale the up
projection instead; "match_rms_adamw" (what ``flexmoe train --optimizer muon`` uses) is the same either way.

**The gated pair** ``gate_up [E, M, 2H]`` holds two matrices side by side, the gate's ``w1`` and the up
projection's ``w3``. A parameter group with ``"last_dim_parts": 2`` orthogonalises them apart, as two ``[M, H]``
(and scales the learning rate by ``[M, H]``), which is what the un-joined ``w1`` and ``w3`` get: the two
projections are different linear maps, and orthogonalising their concatenation would couple their spectra (each
half's singular values would no longer go to 1). :func:`~flexmoe.optim.muon_param_groups` sets it.

**Sharded parameters (DTensor, FSDP2).** Newton-Schulz needs each whole matrix. A DTensor sharded along a
leading dim of a stack (FSDP2's ``Shard(0)`` of ``[E, M, H]``: the expert dim) holds whole matrices locally, so
each rank orthogonalises its own experts: no communication, no extra memory. Any other layout (a 2-D weight's
``Shard(0)`` splits its rows; a stack with fewer experts than shards is split inside its matrices) is gathered:
each rank all-gathers the update in bfloat16 (the matrix's bytes / 2 per rank and step), runs Newton-Schulz on the
whole matrix (every rank the same work), and keeps its own slice. Under expert parallelism without FSDP every rank
holds whole experts as plain tensors: no communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["Muon", "newton_schulz", "adjusted_lr", "muon_group_step", "muon_defaults", "NS_COEFFICIENTS"]

# torch.optim.Muon's defaults (Keller Jordan's quintic: the slope at 0 as large as convergence allows).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: float = EPS) -> Tensor:
    """The orthogonalisation of each matrix of ``update: [..., A, B]`` (any leading dims: a batch of matrices),
    in bfloat16, returned ``[..., A, B]`` bfloat16: ``steps`` quintic iterations ``X <- a X + (b G + c G^2) X``
    with ``G = X X^T``, from ``X`` = the matrix over its Frobenius norm (at least ``eps``), in the wide
    orientation (a tall matrix is transposed for them and back)."""
    if update.dim() < 2:
        raise ValueError(f"update must have at least 2 dims [..., A, B], got shape {tuple(update.shape)}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be 3 numbers (a, b, c), got {coefficients!r}")
    if not 0 < steps < 100:
        raise ValueError(f"ns_steps must be in 1..99, got {steps}")
    a, b, c = coefficients
    shape = update.shape
    x = update.bfloat16().reshape(-1, *shape[-2:])  # [matrices, A, B]: baddbmm wants one batch dim
    tall = shape[-2] > shape[-1]
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + poly X
    if tall:
        x = x.mT
    return x.reshape(shape)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """``lr`` scaled for a matrix ``[rows, cols]`` as stored: ``sqrt(max(1, rows / cols))`` (None or "original"),
    ``0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw")."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def _orthogonalised_parts(update: Tensor, parts: int, group: MutableMapping[str, Any]) -> Tensor:
    """Newton-Schulz of each matrix of ``update: [..., M, parts * H]``, its last dim cut into ``parts`` matrices
    ``[M, H]`` (all of them one batch); same shape, bfloat16."""
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    if parts == 1:
        return newton_schulz(update, coefficients, steps, eps)
    split = update.unflatten(-1, (parts, update.shape[-1] // parts)).movedim(-2, -3)  # [..., parts, M, H]
    return newton_schulz(split, coefficients, steps, eps).movedim(-3, -2).flatten(-2)


def _orthogonalised(update: Tensor, parts: int, group: MutableMapping[str, Any]) -> Tensor:
    """:func:`_orthogonalised_parts` of ``update``, a plain tensor or a DTensor (then a DTensor of the same
    layout): locally where each rank holds whole matrices, else on the gathered matrix (the module's docstring)."""
    if not isinstance(update, DTensor):
        return _orthogonalised_parts(update, parts, group)
    matrix_dims = (update.dim() - 2, update.dim() - 1)
    whole_matrices = all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim not in matrix_dims)
                         for pl in update.placements)
    mesh, placements = update.device_mesh, update.placements
    if whole_matrices:
        local = _orthogonalised_parts(update.to_local(), parts, group)
    else:
        in_bf16 = update.bfloat16()  # what Newton-Schulz casts to first: gathering it is half the bytes
        assert isinstance(in_bf16, DTensor)
        full = _orthogonalised_parts(in_bf16.full_tensor(), parts, group)
        replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        local = replicated.redistribute(mesh, placements).to_local()  # Replicate -> Shard: a local slice
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=update.shape, stride=update.stride())


def check_muon_param(p: Tensor, parts: int, where: str) -> None:
    """A ValueError naming ``where`` unless ``p`` is a matrix ``[M, H]`` or a stack ``[E, M, H]`` whose last dim
    cuts into ``parts`` equal matrices."""
    if p.dim() not in (2, 3):
        raise ValueError(f"{where}: Muon takes matrices [M, H] and expert stacks [E, M, H], got a parameter of "
                         f"shape {tuple(p.shape)}; give it to AdamW (flexmoe.optim.muon_param_groups)")
    if not isinstance(parts, int) or parts < 1 or p.shape[-1] % parts:
        raise ValueError(f"{where}: last_dim_parts must be a positive int dividing the last dim of shape "
                         f"{tuple(p.shape)}, got {parts!r}")
    if torch.is_complex(p):
        raise ValueError(f"{where}: Muon does not take complex parameters")


@torch.no_grad()
def muon_group_step(group: MutableMapping[str, Any], state: MutableMapping[Tensor, Any]) -> None:
    """One Muon step of every parameter of ``group`` (a param group with Muon's hyperparameters) that has a
    gradient; ``state``: the optimizer's per-parameter state, where each one's ``momentum_buffer`` lives."""
    lr = float(group["lr"])
    momentum, weight_decay, parts = group["momentum"], group["weight_decay"], group.get("last_dim_parts", 1)
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        grad = p.grad
        param_state = state[p]
        if "momentum_buffer" not in param_state:
            param_state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = param_state["momentum_buffer"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        ortho = _orthogonalised(update, parts, group)
        rows, cols = p.shape[-2], p.shape[-1] // parts
        p.mul_(1 - lr * weight_decay)
        p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` (same arguments, defaults and update) that also takes 3-D expert stacks ``[E, M, H]``:
    each expert's matrix ``[M, H]`` is orthogonalised on its own, the E of them batched. A param group may set
    ``"last_dim_parts"``: each tensor's last dim holds that many matrices side by side, orthogonalised apart
    (``gate_up [E, M, 2H]``: 2). Plain tensors and DTensors (FSDP2): the module's docstring says what a sharded
    parameter costs. Give embeddings, norms, biases and the output head to AdamW
    (:func:`~flexmoe.optim.muon_param_groups`, :class:`~flexmoe.optim.MuonWithAdamW`)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        super().__init__(params, muon_defaults(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
                                               adjust_lr_fn))
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                check_muon_param(p, group.get("last_dim_parts", 1), f"param_groups[{i}]['params'][{j}]")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every group; ``closure`` (optional) recomputes the loss, which is returned."""
        loss = loss_of(closure)
        for group in self.param_groups:
            muon_group_step(group, self.state)
        return loss


def loss_of(closure: Any) -> Any:
    """What an optimizer's ``step(closure)`` returns: the loss ``closure`` recomputes with gradients on (None
    without one), before the step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def muon_defaults(lr: float, weight_decay: float, momentum: float, nesterov: bool,
                  ns_coefficients: tuple[float, float, float], eps: float, ns_steps: int,
                  adjust_lr_fn: str | None) -> dict[str, Any]:
    """Muon's hyperparameters as an optimizer's defaults; a ValueError naming the first one out of range
    (torch.optim.Muon's checks)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("lr: a Tensor learning rate must have 1 element")
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not momentum >= 0:
        raise ValueError(f"momentum must be >= 0, got {momentum}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")
    return {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
