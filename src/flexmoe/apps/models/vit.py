"""A small vision transformer whose MLP is an :class:`~flexmoe.MoELayer` with the cosine router every
``moe_every`` blocks (as in SwinV2-MoE), and its dense twin.

An image is cut into ``patch_size x patch_size`` patches, each linearly embedded, and learned position
embeddings added; the mean of the final patch states (``pool="mean"``) or a learned class token prepended to the
patches (``pool="cls"``, its final state) is classified. As in
:mod:`flexmoe.apps.models.gpt`, the twin has a dense MLP of hidden ``k * expert_hidden`` in every block, so
both models spend the same FLOPs per token; the MoE model only holds more parameters.

Shapes: B batch, C channels, H = W ``image_size``, P ``patch_size``, N = (H / P)^2 patches, D ``n_embd``,
K ``num_classes``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.apps.models.gpt import DenseMLP
from flexmoe.apps.models.moe_model import MoEModel, build_moe_mlp

__all__ = ["ViTConfig", "ViT", "patchify"]


@dataclass
class ViTConfig:
    """Model configuration. The defaults fit scikit-learn's 8x8 digits and train in about a minute on 2 cores.

    ``group`` is the expert-parallel process group of the MoE layers (None: one process holds every expert);
    a runtime setting, not saved.
    """

    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.1
    pool: str = "mean"  # "mean" of the patch tokens, or "cls": a learned class token's final state
    # Mixture of experts. dense=True builds the twin: every MLP dense with hidden k * expert_hidden.
    dense: bool = False
    moe_every: int = 2
    num_experts: int = 8
    expert_hidden: int = 128
    k: int = 2
    capacity_factor: float = 1.25
    router: str = "cosine"  # SwinV2-MoE's gate
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    group: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size != 0:
            raise ValueError(f"image_size={self.image_size} must divide by patch_size={self.patch_size}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must divide by n_head={self.n_head}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")
        if self.pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {self.pool!r}")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k must be in [1, num_experts={self.num_experts}], got {self.k}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Tokens per image: the patches, and the class token with ``pool="cls"``."""
        return self.num_patches + (self.pool == "cls")

    @property
    def dense_hidden(self) -> int:
        """Hidden size of every dense MLP: k * expert_hidden, the active width of an MoE layer."""
        return self.k * self.expert_hidden

    def is_moe_layer(self, index: int) -> bool:
        """Blocks moe_every-1, 2*moe_every-1, ... are MoE (every other block with moe_every=2)."""
        return not self.dense and (index + 1) % self.moe_every == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (without the runtime ``group``)."""
        out = asdict(self) if self.group is None else {f.name: getattr(self, f.name) for f in fields(self)}
        out.pop("group", None)
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any], **overrides: Any) -> "ViTConfig":
        """Build from :meth:`to_dict` output; unknown keys are an error (a config from another version)."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown ViTConfig fields {unknown}")
        return cls(**{**values, **overrides})

    def dense_twin(self) -> "ViTConfig":
        """The same model with dense MLPs of equal active compute."""
        return ViTConfig.from_dict({**self.to_dict(), "dense": True}, group=None)


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """images: ``[B, C, H, W]`` -> patches ``[B, N, C * P * P]``, row-major over the patch grid."""
    b, c, h, w = images.shape
    p = patch_size
    x = images.reshape(b, c, h // p, p, w // p, p)  # [B, C, H/P, P, W/P, P]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, H/P, W/P, C, P, P]
    return x.reshape(b, (h // p) * (w // p), c * p * p)


class SelfAttention(nn.Module):
    """Multi-head self-attention over all tokens (no causal mask: every patch sees the whole image)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, D]`` -> ``[B, L, D]``."""
        b, l, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, l, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, l, d))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``; the MLP is MoE or dense."""

    def __init__(self, cfg: ViTConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.is_moe = cfg.is_moe_layer(index)
        self.mlp: nn.Module = build_moe_mlp(cfg) if self.is_moe else DenseMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, D]`` -> ``[B, L, D]``."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class ViT(MoEModel):
    """``forward(images [B, C, H, W]) -> logits [B, K]`` (and the mean cross-entropy with ``labels [B]``)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_emb = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.n_embd)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.n_embd)) if cfg.pool == "cls" else None
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.num_tokens, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # As the GPT: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer); experts and the router
        # keep MoELayer's own initialisation.
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, 0.0, 0.02)
        nn.init.normal_(self.pos_emb, 0.0, 0.02)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and ".experts" not in name and "router" not in name:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj") else 0.02
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """images: ``[B, C, H, W]`` -> (logits ``[B, K]``, mean cross-entropy over ``labels [B]`` or None).

        The loss is the classification loss only; training adds :meth:`regularization_loss`.
        """
        cfg = self.cfg
        if images.shape[1:] != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"images must be [B, {cfg.channels}, {cfg.image_size}, {cfg.image_size}], "
                             f"got {list(images.shape)}")
        x = self.patch_emb(patchify(images, cfg.patch_size))  # [B, N, D]
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # [B, N + 1, D]
        x = self.drop(x + self.pos_emb)  # [B, tokens, D]
        for block in self.blocks:
            x = block(x)
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)  # [B, D]
        logits = self.head(self.ln_f(pooled))  # [B, K]
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss
