"""Writing a converted model in Hugging Face's format one block at a time (docs/architecture.md, "Hugging Face
models (flexmoe.hf)", "Loading by shard").

A model laid on a mesh (:func:`flexmoe.parallel.parallelize`) holds shards: ``save_pretrained`` would need every
tensor whole at once. :func:`save_pretrained` gathers one block (an FSDP unit: a decoder layer) at a time, its
state dict in HF's names (a converted block's state-dict hook gathers its experts), rank 0 writes it as one
safetensors file, and the block's whole tensors are dropped before the next; the tensors outside the blocks
(embeddings, final norm, head) go in one more file. An index names every tensor's file, as transformers'
sharded checkpoints do, so plain ``from_pretrained`` reads the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from flexmoe.hf.stored import INDEX_FILE
from flexmoe.sharding.dcp import own_tensors
from flexmoe.sharding.fsdp import default_blocks

__all__ = ["save_pretrained"]


@torch.no_grad()
def save_pretrained(model: Any, directory: str | Path) -> Path:
    """Write the converted HF model ``model`` (laid on a mesh or not) to ``directory`` in HF's format: config,
    generation config, one safetensors file per block and one for the rest, and their index; returns the
    directory. Every rank calls it (the shards and experts are gathered one block at a time); rank 0 writes.
    At most one block's tensors are whole on a rank at a time."""
    from safetensors.torch import save_file

    if not _is_hf_model(model):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel (converted by flexmoe.hf), got "
                        f"{type(model).__name__}")
    directory = Path(directory)
    writes = not dist.is_initialized() or dist.get_rank() == 0
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
    names = {id(m): n for n, m in model.named_modules()}
    blocks = default_blocks(model)
    files = [f"model-{i + 1:05d}-of-{len(blocks) + 1:05d}.safetensors" for i in range(len(blocks) + 1)]
    weight_map: dict[str, str] = {}
    total = 0
    for block, file in zip(blocks, files):
        tensors = _whole(block.state_dict(prefix=names[id(block)] + "."))
        total += _write(save_file, directory / file, tensors, weight_map, writes)
    inside = tuple(names[id(block)] + "." for block in blocks)
    rest = {name: t for name, t in own_tensors(model).items() if not name.startswith(inside)}
    total += _write(save_file, directory / files[-1], _whole(rest), weight_map, writes)
    if writes:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        model.config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()
    return directory


def _is_hf_model(model: Any) -> bool:
    return isinstance(model, nn.Module) and hasattr(model, "config")


def _whole(state: dict[str, Any]) -> dict[str, Tensor]:
    """``state``'s tensors whole (a DTensor gathered: a collective, in the same order on every rank)."""
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for name, t in state.items()}


def _write(save_file: Any, path: Path, tensors: dict[str, Tensor], weight_map: dict[str, str], writes: bool) -> int:
    """Write ``tensors`` to ``path`` (on the writing rank), note their file; their bytes."""
    for name in tensors:
        weight_map[name] = path.name
    if writes:
        save_file({n: t.contiguous().cpu().clone() for n, t in tensors.items()}, str(path), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())
