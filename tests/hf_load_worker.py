"""Ranks of the flexmoe.hf.load cases (tests/test_hf_load.py): build tiny HF MoE checkpoints, load one onto a mesh
recording every read, and return the logits of a fixed batch."""

from __future__ import annotations

from pathlib import Path

import torch

from flexmoe.hf.stored import Box, SafetensorsReader

VOCAB = 64


class RecordingReader(SafetensorsReader):
    """A reader that keeps every ``(stored key, box)`` it reads."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__(directory)
        self.reads: list[tuple[str, Box]] = []

    def read(self, key: str, box: Box) -> torch.Tensor:
        self.reads.append((key, box))
        return super().read(key, box)


def hf_config(family: str, tied: bool = False):
    """The tiny Qwen3-MoE or DeepSeek-V3 of the FSDP tests; DeepSeek-V3 with a dense first layer."""
    from fsdp_worker import tiny_hf_config

    dense_first = {"first_k_dense_replace": 1} if family == "deepseek_v3" else {}
    return tiny_hf_config(family, VOCAB, tie_word_embeddings=tied, **dense_first)


def save_checkpoint(family: str, directory: Path, *, tied: bool = False, max_shard_size: str | None = "20KB") -> None:
    """A seeded HF model of ``family`` saved to ``directory`` (sharded unless ``max_shard_size`` is None);
    DeepSeek-V3's selection bias random (HF initialises it to zero)."""
    import transformers

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, tied))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)


def tokens() -> torch.Tensor:
    """A fixed batch ``[2, 12]``."""
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def logits_of(model) -> list:
    with torch.no_grad():
        return model(tokens()).logits.tolist()


def train_step(model, rank: int) -> None:
    """One SGD step on this rank's batch (so that an export shows trained weights, not the loaded ones)."""
    model.train()
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
    model(x, labels=x).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.eval()


def load_main(directory: str, ep: int, dp_shard: int, export: str | None = None) -> dict:
    """A rank: load ``directory`` onto ep x dp_shard, recording its reads; its logits of the fixed batch. Then,
    with ``export``, one training step and flexmoe.hf.save_pretrained to that directory (and its new logits)."""
    import torch.distributed as dist

    from flexmoe.hf import load, save_pretrained
    from flexmoe.sharding import make_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        reader = RecordingReader(directory)
        model = load(directory, make_mesh(ep=ep, dp_shard=dp_shard), reader=reader)
        out = {"logits": logits_of(model), "reads": [[key, [list(r) for r in box]] for key, box in reader.reads]}
        if export is not None:
            train_step(model, dist.get_rank())
            save_pretrained(model, export)
            out["trained_logits"] = logits_of(model)
        return out
    finally:
        dist.destroy_process_group()
