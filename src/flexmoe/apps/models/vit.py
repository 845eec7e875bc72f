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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.apps.models.moe_model import MoEModel, MoEModelConfig

__all__ = ["ViTConfig", "ViT", "patchify"]


@dataclass
class ViTConfig(MoEModelConfig):
    """Model configuration: the image, patch and pooling fields on top of :class:`MoEModelConfig`'s transformer
    and MoE fields, four of whose defaults it overrides. The defaults fit scikit-learn's 8x8 digits and train in
    about a minute on 2 cores."""

    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    pool: str = "mean"  # "mean" of the patch tokens, or "cls": a learned class token's final state
    n_embd: int = 64
    dropout: float = 0.1
    expert_hidden: int = 128
    router: str = "cosine"  # SwinV2-MoE's gate

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size != 0:
            raise ValueError(f"image_size={self.image_size} must divide by patch_size={self.patch_size}")
        super().__post_init__()
        if self.pool not in ("mean", "cls"):
            raise ValueError(f"pool must be 'mean' or 'cls', got {self.pool!r}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Tokens per image: the patches, and the class token with ``pool="cls"``."""
        return self.num_patches + (self.pool == "cls")


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """images: ``[B, C, H, W]`` -> patches ``[B, N, C * P * P]``, row-major over the patch grid."""
    b, c, h, w = images.shape
    p = patch_size
    x = images.reshape(b, c, h // p, p, w // p, p)  # [B, C, H/P, P, W/P, P]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, H/P, W/P, C, P, P]
    return x.reshape(b, (h // p) * (w // p), c * p * p)


class ViT(MoEModel):
    """``forward(images [B, C, H, W]) -> logits [B, K]`` (and the mean cross-entropy with ``labels [B]``).
    ``group``: as :class:`MoEModel`'s."""

    def __init__(self, cfg: ViTConfig, group: Any = None) -> None:
        super().__init__(cfg, group)
        self.patch_emb = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.n_embd)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.n_embd)) if cfg.pool == "cls" else None
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.num_tokens, cfg.n_embd))
        self._add_trunk(cfg, causal=False)
        self.head = nn.Linear(cfg.n_embd, cfg.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        # As the GPT (its linears are all this model has besides the layer norms, experts and router); the class
        # token and the position table are plain parameters.
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, 0.0, 0.02)
        nn.init.normal_(self.pos_emb, 0.0, 0.02)
        for name, module in self.named_modules():
            self._init_gpt_style(name, module)

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
        x = self._run_blocks(x + self.pos_emb)  # [B, tokens, D]
        pooled = x[:, 0] if self.cls_token is not None else x.mean(dim=1)  # [B, D]
        logits = self.head(self.ln_f(pooled))  # [B, K]
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss
