"""A decoder-only transformer language model whose MLP is an :class:`~flexmoe.MoELayer` every ``moe_every``
layers, and its dense twin.

The twin has the same width and depth and a dense MLP of hidden size ``k * expert_hidden`` in every layer, so
both models spend the same FLOPs per token (the MoE model runs k experts of hidden ``expert_hidden`` per token);
the MoE model only holds more parameters. Non-MoE layers of the MoE model use the same dense MLP as the twin.

Shapes: B batch, L sequence length (<= block_size), D ``n_embd``, V ``vocab_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexmoe.apps.models.moe_model import MoEModel, MoEModelConfig
from flexmoe.parallel.materialize import reset_module

__all__ = ["GPTConfig", "GPT"]


@dataclass
class GPTConfig(MoEModelConfig):
    """Model configuration: the vocabulary and context on top of :class:`MoEModelConfig`'s transformer and MoE
    fields (its defaults are the GPT's). The defaults train in about three minutes on two CPU cores."""

    vocab_size: int = 256
    block_size: int = 128
    aux_loss_type: str = "switch"  # "global": the balance loss of the whole data-parallel batch and step
    # Expert parallelism over nodes (ranks_per_node comes from torchrun, see MoELayer): the all-to-all
    # algorithm, and the topology-aware gate's share of (token, choice) pairs sent off the node (None: off).
    a2a: str = "flat"
    cross_node_share: float | None = None
    # Replica slots per rank for hot experts (flexmoe.parallel.replicas), under expert parallelism.
    redundant_experts: int = 0


class GPT(MoEModel):
    """Byte/char-level GPT. ``forward(idx [B, L]) -> logits [B, L, V]`` (and the LM loss with targets).
    ``group``: as :class:`MoEModel`'s."""

    def __init__(self, cfg: GPTConfig, group: Any = None) -> None:
        super().__init__(cfg, group)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self._add_trunk(cfg, causal=True)
        # Not tied to tok_emb: safetensors stores each tensor once, and at V=256 tying saves little.
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, module in self.named_modules():
            self._init_gpt_style(name, module)

    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise submodule ``name``'s own parameters as this model does, for
        :func:`flexmoe.parallel.materialize` (a GPT built on the meta device)."""
        if not self._init_gpt_style(name, module):
            reset_module(name, module)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """idx: ``[B, L]`` long -> (logits ``[B, L, V]``, mean cross-entropy over ``targets [B, L]`` or None).

        The returned loss is the language-model loss only; add :meth:`aux_loss` for training.
        """
        seq = idx.shape[1]
        if seq > self.cfg.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self._run_blocks(self.tok_emb(idx) + self.pos_emb(pos))
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            # In float32 when the blocks compute in a lower precision (FSDP2's mixed precision).
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend ``idx [B, L0]`` by sampling ``max_new_tokens`` tokens -> ``[B, L0 + max_new_tokens]``."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
