"""The embedded corpus and the deterministic batches."""

from __future__ import annotations

import hashlib

import pytest
import torch

from flexmoe.apps import data as data_mod
from flexmoe.apps.data import CORPUS_BYTES, CORPUS_MD5, CorpusError, TokenData, decode, encode, load_corpus


def test_embedded_corpus_is_tiny_shakespeare() -> None:
    text = load_corpus()
    assert len(text) == CORPUS_BYTES == 1_115_394
    assert hashlib.md5(text).hexdigest() == CORPUS_MD5 == "6fb458f1232090904fb40fe944165e91"
    assert text.startswith(b"First Citizen:")


def test_corpus_verification_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_mod, "CORPUS_MD5", "0" * 32)
    with pytest.raises(CorpusError, match="fails verification.*md5"):
        load_corpus()


def test_split_and_batches_are_deterministic() -> None:
    d = TokenData.from_file(None, block_size=64)
    assert len(d.train) + len(d.val) == CORPUS_BYTES
    assert len(d.val) == int(CORPUS_BYTES * 0.1)
    x1, y1 = d.batch("train", 8, 64, seed=3, step=17)
    x2, y2 = d.batch("train", 8, 64, seed=3, step=17)
    assert x1.shape == (8, 64) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    x3, _ = d.batch("train", 8, 64, seed=3, step=18)
    assert not torch.equal(x1, x3)
    # A rank's rows are its slice of the global batch.
    xr, yr = d.batch("train", 8, 64, seed=3, step=17, rows=slice(4, 8))
    assert torch.equal(xr, x1[4:]) and torch.equal(yr, y1[4:])


def test_any_text_file(tmp_path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("hello world, héllo again\n" * 40)
    d = TokenData.from_file(path, block_size=16)
    assert d.source == str(path)
    assert decode(encode("héllo")) == "héllo"
    with pytest.raises(CorpusError, match="too small for one batch"):
        TokenData.from_file(path, block_size=512)
    with pytest.raises(CorpusError, match="no such file"):
        TokenData.from_file(tmp_path / "missing.txt", block_size=16)


def test_unusable_data_files_name_the_file_and_what_works(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(CorpusError, match=f"--data {empty}: the file is empty; give a text file"):
        TokenData.from_file(empty, block_size=16)
    with pytest.raises(CorpusError, match=f"--data {tmp_path}: is a directory"):
        TokenData.from_file(tmp_path, block_size=16)


@pytest.mark.parametrize("block_size", [16, 32, 127])
def test_the_size_the_error_asks_for_is_the_smallest_that_works(tmp_path, block_size: int) -> None:
    """Checked against the split rule by brute force: the last 10% (rounded down) is validation, each split
    needs block_size + 2 bytes."""
    smallest = next(n for n in range(1, 100 * block_size)
                    if int(n * 0.1) >= block_size + 2 and n - int(n * 0.1) >= block_size + 2)
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * (smallest - 1))
    with pytest.raises(CorpusError, match=f"use a file of at least {smallest} bytes"):
        TokenData.from_file(path, block_size=block_size)
    path.write_bytes(b"x" * smallest)
    TokenData.from_file(path, block_size=block_size)
