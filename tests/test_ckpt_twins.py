"""Twin ``.ckpt`` files (same records, other tensor data) are checked against an indexed one byte for byte,
not walked: the index is the same as walking them, and any difference outside the tensor contents
(a name, a dim, a type, a length) makes the file be indexed on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reshard.formats import ckpt, ckpt_twins
from reshard.sources import files as source_files


def _shapes(seed: int) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        ("embedding.weight", rng.standard_normal((40, 16)).astype(np.float32)),
        ("layers.0.attention.wq.weight", rng.standard_normal((16, 16)).astype(np.float32)),
        ("layers.0.norm.weight", rng.standard_normal(16).astype(np.float16)),
        ("adam_m.layers.0.attention.wq.weight", rng.standard_normal((16, 16)).astype(np.float32)),
        ("global_step", np.array([seed], np.int32)),
    ]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A process without remembered indexes or layouts; counts the files walked record by record."""
    walked = {"files": 0}
    monkeypatch.setattr(ckpt, "_TWINS", ckpt_twins.Twins())
    monkeypatch.setattr(ckpt._MEMO, "recall", lambda identity: None)
    real = ckpt._index

    def counting(*args: Any) -> Any:
        walked["files"] += 1
        return real(*args)

    monkeypatch.setattr(ckpt, "_index", counting)
    return walked


def _entries(path: Path) -> dict[str, Any]:
    index = ckpt.read_ckpt(path)
    try:
        return dict(index.entries)
    finally:
        index.close()


def _walked(path: Path) -> dict[str, Any]:
    """The index of ``path`` walked record by record, whatever was remembered."""
    scan_twins = ckpt._TWINS
    ckpt._TWINS = ckpt_twins.Twins()
    try:
        return _entries(path)
    finally:
        ckpt._TWINS = scan_twins


@pytest.mark.parametrize("write_crc", [False, True])
def test_twins_are_checked_not_walked_and_index_the_same(
    tmp_path: Path, fresh: dict[str, int], write_crc: bool
) -> None:
    paths = []
    for rank in range(4):
        paths.append(tmp_path / f"rank_{rank}.ckpt")
        ckpt.save_ckpt(paths[-1], _shapes(rank), write_crc=write_crc)
    found = [_entries(p) for p in paths]
    assert fresh["files"] == 1  # the others were checked against the first
    for path, entries in zip(paths, found, strict=True):
        assert entries == _walked(path)
        index = ckpt.read_ckpt(path)
        try:
            seed = int(np.asarray(index.array("global_step"))[0])
        finally:
            index.close()
        assert seed == paths.index(path)  # each file's own data, through the shared index


@pytest.mark.parametrize(
    "other",
    [
        # same size, same record lengths: only the bytes outside the contents tell them apart
        [("embedding.weigHt", np.zeros((40, 16), np.float32))],  # a name
        [("embedding.weight", np.zeros((16, 40), np.float32))],  # dims
        [("embedding.weight", np.zeros((20, 16), np.float64))],  # the type (and a dim: the same bytes)
    ],
    ids=["name", "dims", "type"],
)
def test_a_file_that_differs_outside_the_contents_is_indexed_on_its_own(
    tmp_path: Path, fresh: dict[str, int], other: list[tuple[str, np.ndarray]]
) -> None:
    first, second = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    ckpt.save_ckpt(first, [("embedding.weight", np.ones((40, 16), np.float32)), *_shapes(0)[1:]])
    ckpt.save_ckpt(second, other + _shapes(1)[1:])
    assert first.stat().st_size == second.stat().st_size
    _entries(first)
    entries = _entries(second)
    assert fresh["files"] == 2
    assert entries == _walked(second)
    assert entries[other[0][0]].shape == other[0][1].shape


def test_every_byte_outside_the_contents_is_compared(tmp_path: Path, fresh: dict[str, int]) -> None:
    first, second = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    ckpt.save_ckpt(first, _shapes(0))
    ckpt.save_ckpt(second, _shapes(1))
    entries = _entries(first)
    contents = {o for e in entries.values() for start, n in e.segments for o in range(start, start + n)}
    outside = [o for o in range(first.stat().st_size) if o not in contents]
    data = bytearray(second.read_bytes())
    twins = ckpt._TWINS
    for offset in outside:
        changed = bytearray(data)
        changed[offset] ^= 0x01
        second.write_bytes(bytes(changed))
        with open(second, "rb") as fh:
            assert twins.checked(fh.fileno(), len(data), len(data)) is None, offset
    second.write_bytes(bytes(data))
    with open(second, "rb") as fh:
        assert twins.checked(fh.fileno(), len(data), len(data)) == entries


def test_a_file_of_another_size_or_end_has_no_twin(tmp_path: Path, fresh: dict[str, int]) -> None:
    paths = [tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "c.ckpt"]
    ckpt.save_ckpt(paths[0], _shapes(0))
    ckpt.save_ckpt(paths[1], [*_shapes(0), ("extra", np.zeros(3, np.float32))])
    ckpt.save_ckpt(paths[2], _shapes(0), write_crc=True)
    found = [_entries(path) for path in paths]
    assert fresh["files"] == 3
    assert found == [_walked(path) for path in paths]


def test_a_range_outside_the_bytes_parsed_leaves_no_layout() -> None:
    recorder = ckpt_twins.Recorder()
    recorder.take(b"abcdef", 100, 100, 103)
    assert recorder.pieces == [(100, b"abc")]
    recorder.take(b"abcdef", 100, 104, 108)  # runs past the bytes parsed
    assert recorder.layout({}) is None
    too_long = ckpt_twins.Recorder()
    too_long.take(bytes(ckpt_twins.PIECE_BYTES + 1), 0, 0, ckpt_twins.PIECE_BYTES + 1)
    assert too_long.layout({}) is None


def test_pieces_are_grouped_into_reads_of_at_most_read_bytes() -> None:
    recorder = ckpt_twins.Recorder()
    for offset in (0, 100, 4050, 9000, 9050):
        recorder.take(bytes(10_000), 0, offset, offset + 50)
    layout = recorder.layout({})
    assert layout is not None
    assert [(offset, length, len(pieces)) for offset, length, pieces in layout.reads] == [
        (0, 150, 2),
        (4050, 50, 1),
        (9000, 100, 2),
    ]


def test_layouts_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    twins = ckpt_twins.Twins()
    layout = ckpt_twins.Layout(((0, 1, ((0, b"x"),)),), {})
    for size in range(ckpt_twins.KEPT_LAYOUTS + 5):
        twins.offer(size, size, layout)
    assert len(twins._layouts) == ckpt_twins.KEPT_LAYOUTS
    assert (0, 0) not in twins._layouts  # the oldest went first


def test_indexed_takes_the_first_file_of_each_size_first_and_keeps_the_order(
    tmp_path: Path, fresh: dict[str, int]
) -> None:
    paths = []
    for rank in range(6):  # two stages of three twins, interleaved
        paths.append(tmp_path / f"rank_{rank}.ckpt")
        extra = [("stage1.weight", np.zeros(7, np.float32))] if rank % 2 else []
        ckpt.save_ckpt(paths[-1], _shapes(rank) + extra)
    found = source_files.indexed([(str(p), rank) for rank, p in enumerate(paths)], None)
    assert [f.rank for f in found] == list(range(6))
    assert fresh["files"] == 2
    assert [("stage1.weight" in f.tensors) for f in found] == [False, True] * 3


def test_indexed_raises_the_first_error_in_file_order(tmp_path: Path, fresh: dict[str, int]) -> None:
    paths = [tmp_path / f"rank_{rank}.ckpt" for rank in range(4)]
    for rank, path in enumerate(paths):
        ckpt.save_ckpt(path, _shapes(rank))
    paths[2].write_bytes(paths[2].read_bytes()[:-7])  # another size: indexed first, and truncated
    paths[3].write_bytes(b"not a checkpoint at all")
    with pytest.raises(Exception) as raised:
        source_files.indexed([(str(p), rank) for rank, p in enumerate(paths)], None)
    assert str(paths[2]) in str(raised.value)


def test_only_ckpt_files_wait_for_a_twin(tmp_path: Path) -> None:
    paths = []
    for name in ("a.safetensors", "b.safetensors", "c.ckpt", "d.ckpt", "missing.ckpt"):
        path = tmp_path / name
        if name != "missing.ckpt":
            path.write_bytes(b"x" * 10)
        paths.append(str(path))
    assert source_files._first_of_each_size(paths) == ([0, 1, 2, 4], [3])
