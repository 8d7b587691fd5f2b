"""Indexing a ``.ckpt`` reads each record head with one small ``pread`` and parses it from those bytes:
the file's map is not touched (no fault-around, no mapped page cache in the process's RSS), except for
a head longer than one read, which is parsed from the map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard.formats import ckpt
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
        assert maps[0].reads == 2  # the encryption magic and the crc trailer: no record head
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
