"""Reading parts of a ``save_pretrained`` directory's tensors, by the model's names (docs/architecture.md, "Hugging
Face models (flexmoe.hf)", "Loading by shard").

:class:`SafetensorsReader` is the one place that opens the files: ``read(key, box)`` reads the rectangle ``box``
of one stored tensor with ``safetensors.safe_open(...).get_slice``, nothing else of it. :class:`StoredTensors`
names the stored tensors as the HF model does. transformers writes some models in an older form than it holds
them: Qwen2/3-MoE, DeepSeek, OLMoE or Mixtral experts one tensor each (``experts.3.gate_proj.weight: [H, M]``),
merged on load into ``experts.gate_up_proj: [E, 2H, M]`` by the model's conversion mapping. A box of such a merged
tensor is read from the per-expert tensors it covers, and only the rows it covers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Box", "SafetensorsReader", "StoredTensors", "box_shape"]

Box = tuple[tuple[int, int], ...]  # per dim, [start, stop)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the tensor a box of ``box`` holds."""
    return tuple(stop - start for start, stop in box)


class SafetensorsReader:
    """The tensors of a ``save_pretrained`` directory: ``model.safetensors``, or the files its
    ``model.safetensors.index.json`` names. Opens each file once (``safe_open``), reads only the boxes asked for.
    A context manager (closes the files)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0  # of tensor data, over every read
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files: dict[str, Path] = {key: self.directory / name for key, name in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            self.files = {key: self.directory / SINGLE_FILE for key in self._open(self.directory / SINGLE_FILE).keys()}
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE} (a "
                                    f"save_pretrained directory with safetensors weights)")

    def keys(self) -> list[str]:
        """Every stored tensor's name."""
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``."""
        return tuple(self._open(self.files[key]).get_slice(key).get_shape())

    def read(self, key: str, box: Box) -> Tensor:
        """The rectangle ``box`` of stored tensor ``key`` (its stored dtype, on the CPU)."""
        part = self._open(self.files[key]).get_slice(key)
        tensor = part[:] if not box else part[tuple(slice(start, stop) for start, stop in box)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def files_bytes(self) -> int:
        """The size of the directory's safetensors files (headers included)."""
        return sum(path.stat().st_size for path in set(self.files.values()))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt").__enter__()
        return self._handles[path]


@dataclass
class _Merged:
    """A model tensor stored one tensor per expert: ``sources[i][e]`` is expert ``e``'s stored tensor of source
    pattern ``i``; the model's tensor is ``[E, ...]``, expert ``e`` the concatenation of its sources along dim 0."""

    sources: list[dict[int, str]] = field(default_factory=list)


class StoredTensors:
    """A directory's tensors named as the HF model ``model`` names them (its transformers conversion mapping
    applied to the stored names); ``read(name, box)`` reads a box of the model's tensor ``name``."""

    def __init__(self, reader: SafetensorsReader, model: Any) -> None:
        self.reader = reader
        self.direct: dict[str, str] = {}
        self.merged: dict[str, _Merged] = {}
        self.unsupported: dict[str, str] = {}
        transforms = _conversions(model)
        for stored in reader.keys():
            self._add(stored, transforms)

    def __contains__(self, name: str) -> bool:
        return name in self.direct or name in self.merged

    def read(self, name: str, box: Box) -> Tensor:
        """The rectangle ``box`` of the model's tensor ``name``."""
        if name in self.direct:
            return self.reader.read(self.direct[name], box)
        if name in self.unsupported:
            raise ValueError(f"{name} is stored in a form flexmoe.hf.load cannot read by parts: "
                             f"{self.unsupported[name]}")
        if name not in self.merged:
            raise KeyError(name)
        return self._read_merged(name, self.merged[name], box)

    def _read_merged(self, name: str, merged: _Merged, box: Box) -> Tensor:
        (e0, e1), (r0, r1), *rest = box
        experts = []
        for e in range(e0, e1):
            pieces, offset = [], 0
            for source in merged.sources:
                if e not in source:  # one expert's file entry is absent: never read around it
                    raise ValueError(f"the checkpoint lacks expert {e}'s tensor of {name} (it stores experts "
                                     f"{sorted(source)} of it, as {source[min(source)]}, ...)")
                key = source[e]
                rows = self.reader.shape(key)[0]
                lo, hi = max(r0, offset), min(r1, offset + rows)
                if lo < hi:  # only the rows of this source that the box covers
                    pieces.append(self.reader.read(key, ((lo - offset, hi - offset), *rest)))
                offset += rows
            experts.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        return torch.stack(experts)

    def _add(self, stored: str, transforms: list[Any]) -> None:
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

        name = stored
        for transform in transforms:
            renamed, pattern = transform.rename_source_key(name)
            if pattern is None:
                continue
            if not isinstance(transform, WeightConverter):
                name = renamed
                continue
            ops = [type(op) for op in transform.operations]
            dims = [getattr(op, "dim", None) for op in transform.operations]
            if ops not in ([MergeModulelist], [MergeModulelist, Concatenate]) or dims[0] != 0 \
                    or dims[1:] not in ([], [1]):
                self.unsupported[renamed] = f"transformers converts it with {[op.__name__ for op in ops]}"
                return
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
            if expert is None:
                self.unsupported[renamed] = f"{stored} has no expert index where {pattern!r} has '*'"
                return
            merged = self.merged.setdefault(renamed, _Merged())
            patterns = transform.source_patterns
            while len(merged.sources) < len(patterns):
                merged.sources.append({})
            merged.sources[patterns.index(pattern)][int(expert.group(1))] = stored
            return
        self.direct[name] = stored


def _conversions(model: Any) -> list[Any]:
    """The model's transformers weight conversions (renamings and merges applied to stored names on load)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))
