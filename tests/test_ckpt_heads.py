"""Indexing a ``.ckpt`` reads its magic, its trailer and each record head with small reads and parses
them from those bytes (the heads of small records from one read): the file's map is not touched (no
fault-around, no mapped page cache in the process's RSS), except for a head longer than one read, which
is parsed from the map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard.formats import ckpt, uncached
from tests.page_helpers import CountingMap


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[CountingMap]:
    maps: list[CountingMap] = []
    real = ckpt.map_file

    def map_file(path: Any) -> Any:
        buf, closer, size = real(path)
        counting = CountingMap(buf)
        maps.append(counting)
        return counting, closer, size

    monkeypatch.setattr(ckpt, "map_file", map_file)
    monkeypatch.setattr(ckpt._MEMO, "recall", lambda identity: None)  # index afresh
    return maps


def test_record_heads_are_parsed_from_their_reads_not_the_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.weight": rng.standard_normal((64, 48)).astype(np.float32) for i in range(5)}
    path = tmp_path / "model.ckpt"
    ckpt.save_ckpt(path, list(tensors.items()))
    maps = _counting(monkeypatch)
    index = ckpt.read_ckpt(path)
    try:
        assert maps[0].reads == 0  # the encryption magic, the crc trailer and the heads: small reads
        assert list(index.entries) == list(tensors)
        for name, value in tensors.items():
            assert index.entries[name].shape == value.shape
            ((offset, length),) = index.entries[name].segments
            assert maps[0].inner[offset : offset + length] == value.tobytes()
    finally:
        index.close()


def test_a_head_longer_than_one_read_is_parsed_from_the_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    long_name = "x" * (ckpt.RECORD_HEAD_PREFETCH_BYTES + 100) + ".weight"
    tensors = [("a.weight", np.arange(6, dtype=np.float32)), (long_name, np.ones((2, 3), np.float32))]
    path = tmp_path / "model.ckpt"
    ckpt.save_ckpt(path, tensors)
    maps = _counting(monkeypatch)
    index = ckpt.read_ckpt(path)
    try:
        assert list(index.entries) == ["a.weight", long_name]
        assert index.entries[long_name].shape == (2, 3)
        assert maps[0].reads > 1  # that head, through the map
    finally:
        index.close()


def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets ``read_ckpt`` read a head at."""
    offsets: list[int] = []
    real = uncached.read

    def read(fd: int, length: int, offset: int) -> bytes | bytearray:
        offsets.append(offset)
        return real(fd, length, offset)

    monkeypatch.setattr(uncached, "read", read)
    return offsets


def test_the_heads_of_small_records_share_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = [(f"norm.{i}", np.full(3, i, np.float32)) for i in range(40)]  # about 40 bytes a record
    tensors = [("big.0", np.zeros((128, 128), np.float32)), *small, ("big.1", np.ones((128, 128), np.float32))]
    path = tmp_path / "model.ckpt"
    ckpt.save_ckpt(path, tensors)
    maps = _counting(monkeypatch)
    offsets = _counting_reads(monkeypatch)
    index = ckpt.read_ckpt(path)
    try:
        assert list(index.entries) == [name for name, _ in tensors]
        for name, value in tensors:
            ((offset, length),) = index.entries[name].segments
            assert maps[0].inner[offset : offset + length] == value.tobytes()
        heads = offsets[2:]  # after the magic and the trailer
        assert len(heads) <= 3 < len(tensors)  # big.0's head, then one read for the small records and big.1's
        assert maps[0].reads == 0
    finally:
        index.close()


def test_a_head_running_past_a_shared_read_is_read_again_from_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head that starts in the bytes read for an earlier one and runs past them is read from its own
    start, not parsed from the map (a head longer than one read still is)."""
    small = [(f"s.{i:03d}", np.zeros(1, np.float32)) for i in range(100)]
    long_name = "y" * 1500 + ".weight"  # longer than the slack: it may start in a shared read
    path = tmp_path / "model.ckpt"
    tensors = [*small, (long_name, np.ones((2, 2), np.float32)), ("tail", np.arange(4, dtype=np.float32))]
    ckpt.save_ckpt(path, tensors)
    with ckpt.read_ckpt(path) as plain:
        record = plain.entries[long_name].segments[0][0] - len(long_name) - 30  # its head starts about here
    assert ckpt.HEAD_SLACK_BYTES < record < ckpt.RECORD_HEAD_PREFETCH_BYTES - ckpt.HEAD_SLACK_BYTES
    maps = _counting(monkeypatch)
    offsets = _counting_reads(monkeypatch)
    index = ckpt.read_ckpt(path)
    try:
        assert list(index.entries) == [name for name, _ in tensors]
        assert maps[0].reads == 0  # no head through the map
        assert any(abs(offset - record) < 40 for offset in offsets)  # read again where it starts
    finally:
        index.close()
