"""The training corpus: tiny Shakespeare shipped inside the package, or any text file, as byte-level tokens.

Tokens are raw bytes (vocabulary 256), so any file works without building or storing a vocabulary, and
tiny Shakespeare (pure ASCII) reads as characters. Batches are a pure function of ``(seed, step)``: a run
resumed at step s draws exactly the batches an uninterrupted run draws, whatever happened before.
"""

from __future__ import annotations

import hashlib
import lzma
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "CORPUS_MD5",
    "CORPUS_BYTES",
    "VOCAB_SIZE",
    "CorpusError",
    "load_corpus",
    "load_text_bytes",
    "TokenData",
    "encode",
    "decode",
]

CORPUS_NAME = "tinyshakespeare.txt.xz"
CORPUS_MD5 = "6fb458f1232090904fb40fe944165e91"
CORPUS_BYTES = 1_115_394
VOCAB_SIZE = 256


class CorpusError(RuntimeError):
    """The embedded corpus (or a --data file) is missing, damaged or too small."""


def load_corpus() -> bytes:
    """The embedded tiny Shakespeare, decompressed and verified (size and md5)."""
    resource = resources.files("flexmoe.apps").joinpath("corpus").joinpath(CORPUS_NAME)
    try:
        raw = resource.read_bytes()
    except (FileNotFoundError, OSError) as exc:
        raise CorpusError(f"embedded corpus {resource} is missing; reinstall flexmoe") from exc
    try:
        text = lzma.decompress(raw)
    except lzma.LZMAError as exc:
        raise CorpusError(f"embedded corpus {resource} is not valid xz data ({exc}); reinstall flexmoe") from exc
    digest = hashlib.md5(text).hexdigest()
    if len(text) != CORPUS_BYTES or digest != CORPUS_MD5:
        raise CorpusError(
            f"embedded corpus {resource} fails verification: {len(text)} bytes with md5 {digest}, "
            f"expected {CORPUS_BYTES} bytes with md5 {CORPUS_MD5}; reinstall flexmoe"
        )
    return text


def load_text_bytes(path: str | Path | None) -> bytes:
    """The bytes of ``path``, or of the embedded corpus when ``path`` is None."""
    if path is None:
        return load_corpus()
    path = Path(path)
    what_works = "give a text file (any bytes), or leave --data out for the embedded tiny Shakespeare"
    if path.is_dir():
        raise CorpusError(f"--data {path}: is a directory; {what_works}")
    if not path.is_file():
        raise CorpusError(f"--data {path}: no such file; {what_works}")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"--data {path}: cannot be read ({exc.strerror}); {what_works}") from None
    if not raw:
        raise CorpusError(f"--data {path}: the file is empty; {what_works}")
    return raw


def encode(text: str | bytes) -> Tensor:
    """Text -> byte tokens ``[N]`` (long)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(tokens: Tensor | list[int]) -> str:
    """Byte tokens -> text (invalid UTF-8 shown as U+FFFD)."""
    values = tokens.tolist() if isinstance(tokens, Tensor) else tokens
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


@dataclass
class TokenData:
    """A token stream split into train (the first ``1 - val_fraction``) and validation (the rest).

    train, val: ``[N_train]``, ``[N_val]`` tokens (uint8 bytes, or long ids of a tokenizer).
    """

    train: Tensor
    val: Tensor
    source: str

    @classmethod
    def from_file(cls, path: str | Path | None, *, block_size: int, val_fraction: float = 0.1) -> TokenData:
        """The bytes of ``path`` (None: the embedded tiny Shakespeare) as tokens."""
        raw = load_text_bytes(path)
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        source = "tinyshakespeare (embedded)" if path is None else str(path)
        return cls.from_tokens(tokens, source=source, block_size=block_size, val_fraction=val_fraction,
                               from_data_flag=path is not None)

    @classmethod
    def from_tokens(cls, tokens: Tensor, *, source: str, block_size: int, val_fraction: float = 0.1,
                    from_data_flag: bool = True, unit: str = "bytes") -> TokenData:
        """Any token stream ``[N]`` (bytes, or a tokenizer's ids, counted in ``unit``) split into train and
        validation; raises :class:`CorpusError` when a split cannot hold one window of ``block_size + 2`` tokens."""
        n_val = int(len(tokens) * val_fraction)
        train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        # Each split must hold at least one (input, target) window of block_size + 1 tokens.
        for name, split in (("train", train), ("validation", val)):
            if len(split) < block_size + 2:
                needed = _min_bytes(block_size, val_fraction)
                raise CorpusError(
                    f"{'--data ' if from_data_flag else ''}{source}: too small for one batch: {len(tokens)} {unit} "
                    f"leave {len(split)} for the {name} split, which needs block_size + 2 = {block_size + 2}; "
                    f"use a file of at least {needed} {unit} or a smaller --block-size"
                )
        return cls(train=train, val=val, source=source)

    def batch(
        self, split: str, batch_size: int, block_size: int, *, seed: int, step: int, rows: slice | None = None
    ) -> tuple[Tensor, Tensor]:
        """Inputs and next-token targets, each ``[B, L]`` long, for training step ``step``.

        The offsets come from a generator seeded by ``(seed, step)`` only, so the data order is reproducible
        on resume. ``rows`` picks this rank's part of the global batch (data parallelism): every rank draws
        the same global offsets and keeps its own slice, so W ranks together see what one process sees.
        """
        data = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(_mix(seed, step, 0 if split == "train" else 1))
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
        if rows is not None:
            starts = starts[rows]
        offsets = torch.arange(block_size + 1)
        windows = data[starts[:, None] + offsets].long()  # [B, L + 1]
        return windows[:, :-1], windows[:, 1:]


def _min_bytes(block_size: int, val_fraction: float) -> int:
    """The smallest file whose train and validation splits both hold one window of ``block_size + 2`` bytes."""
    n = 2 * (block_size + 2)
    while min(int(n * val_fraction), n - int(n * val_fraction)) < block_size + 2:
        n += 1
    return n


def _mix(seed: int, step: int, stream: int) -> int:
    """A 63-bit generator seed from (seed, step, stream), so that nearby pairs give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
