"""The bulk reader of large ``.metadata`` files against the unpickler: the same records, or it steps aside.

``formats/dcp/bulk.py`` reads runs of like records with numpy instead of unpickling each; it must give
exactly what the allowlisting unpickler gives, and for anything it does not cover (or any damage to
the file) leave the file to the unpickler, which then says what is wrong. These tests read each
file both ways (the size threshold set to 0 for one, out of reach for the other) and compare.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import dtypes
from reshard.errors import ReshardError
from reshard.formats import dcp
from reshard.formats.dcp import metadata as reader


def both_ways(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object, bool]:
    """What the bulk path and the unpickler read (a record, or the error's text), and whether bulk ran."""
    outcomes = []
    used = False
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(reader, "BULK_MIN_BYTES", threshold)
        try:
            outcomes.append(summary(dcp.read_dcp_metadata(folder)))
        except ReshardError as exc:
            outcomes.append(("error", str(exc)))
        if threshold == 0:
            used = reader.last_read_in_runs
    return outcomes[0], outcomes[1], used


def summary(meta: dcp.DcpMetadata) -> tuple[object, ...]:
    tensors = []
    for fqn, t in meta.tensors.items():
        table = t.table
        columns = tuple(getattr(table, c).tolist() for c in ("offsets", "sizes", "file_ids", "starts", "lengths"))
        tensors.append((fqn, t.dtype.ms_name, t.shape, t.requires_grad, table.files, columns))
    return tuple(tensors), tuple(sorted(meta.byte_items.items())), repr(meta.planner_data), meta.version


def write(folder: Path, tensors: list[dcp.TensorMeta], byte_items: list[dcp.BytesItem] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    ends: dict[str, int] = {}
    for t in tensors:
        for c in t.chunks:
            ends[c.file] = max(ends.get(c.file, 0), c.offset + c.length)
    for b in byte_items:
        ends[b.file] = max(ends.get(b.file, 0), b.offset + b.length)
    for rel, size in ends.items():
        with open(folder / rel, "wb") as fh:
            fh.truncate(size)
    dcp.write_metadata(folder, tensors, byte_items, planner_data={t.fqn: (t.fqn,) for t in tensors})
    return folder


def row_sharded(fqn: str, rows: list[int], columns: int, ranks: list[int], start: int = 0) -> dcp.TensorMeta:
    """A tensor cut along its first axis into chunks of ``rows`` rows, chunk k on rank ``ranks[k]``."""
    chunks, at, offset = [], 0, start
    for n, r in zip(rows, ranks, strict=True):
        length = n * columns * 4 + 512
        chunks.append(dcp.Chunk(fqn, (at, 0), (n, columns), f"__{r}_0.distcp", offset, length))
        at, offset = at + n, offset + length
    return dcp.TensorMeta(fqn, dtypes.FLOAT32, (at, columns), chunks)


def fsdp_model(params: int, ranks: int, rows: int = 1, big_offsets: bool = False) -> list[dcp.TensorMeta]:
    base = (1 << 33) if big_offsets else 0  # items past 4 GiB: their offsets take LONG1 opcodes
    return [
        row_sharded(f"layers.{p}.weight", [rows] * ranks, 8, list(range(ranks)), base + p * 10_000)
        for p in range(params)
    ]


@pytest.mark.parametrize(
    "params,ranks,rows,big",
    [(3, 5, 1, False), (4, 300, 1, False), (2, 1500, 50, False), (5, 40, 2, True), (260, 4, 1, False)],
)
def test_reshard_written_files_read_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, params: int, ranks: int, rows: int, big: bool
) -> None:
    # 300 ranks: memo indexes past 255; 1 500 ranks: batches of 1 000 items and offsets past 65 535
    folder = write(tmp_path / "ckpt", fsdp_model(params, ranks, rows, big))
    fast, slow, used = both_ways(folder, monkeypatch)
    assert used and fast == slow


def test_every_kind_of_tensor_and_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = [
        dcp.Chunk("grid", (i * 2, j * 3), (2, 3), f"__{i * 2 + j}_0.distcp", 0, 100) for i in range(2) for j in range(2)
    ]
    tensors = [
        dcp.TensorMeta("scalar", dtypes.FLOAT32, (), [dcp.Chunk("scalar", (), (), "__0_0.distcp", 200, 8)]),
        dcp.TensorMeta("grid", dtypes.BFLOAT16, (4, 6), grid),
        row_sharded("uneven", [3, 1, 2], 5, [0, 1, 2], 400),
        dcp.TensorMeta(
            "stack", dtypes.FLOAT16, (2, 3, 4), [dcp.Chunk("stack", (0, 0, 0), (2, 3, 4), "__1_0.distcp", 900, 60)]
        ),
        dcp.TensorMeta("empty", dtypes.INT64, (0, 4), [dcp.Chunk("empty", (0, 0), (0, 4), "__2_0.distcp", 990, 8)]),
    ]
    values = [dcp.BytesItem("step", "__0_1.distcp", 0, 12), dcp.BytesItem("rng", "__0_1.distcp", 12, 30)]
    fast, slow, used = both_ways(write(tmp_path / "ckpt", tensors, values), monkeypatch)
    assert used and fast == slow


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=40), min_size=1, max_size=6), st.data())
def test_random_chunkings_read_the_same(
    tmp_path_factory: pytest.TempPathFactory, cuts: list[list[int]], data: st.DataObject
) -> None:
    tensors = []
    for p, rows in enumerate(cuts):
        ranks = data.draw(st.lists(st.integers(0, 600), min_size=len(rows), max_size=len(rows)))
        tensors.append(row_sharded(f"m.{p}.w", rows, data.draw(st.integers(1, 70_000)), ranks, p * 7))
    folder = write(tmp_path_factory.mktemp("random"), tensors)
    with pytest.MonkeyPatch.context() as monkeypatch:
        fast, slow, used = both_ways(folder, monkeypatch)
    assert used and fast == slow


def test_damaged_files_read_the_same_or_fail_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes flipped, dropped or doubled anywhere: the bulk path never reads something else."""
    folder = write(tmp_path / "ckpt", fsdp_model(6, 320, 2))
    original = (folder / dcp.METADATA_NAME).read_bytes()
    rng = random.Random(20261202)
    ran = 0
    for _ in range(150):
        data = bytearray(original)
        at = rng.randrange(len(data))
        change = rng.choice(("flip", "drop", "double"))
        if change == "flip":
            data[at] ^= 1 << rng.randrange(8)
        elif change == "drop":
            del data[at]
        else:
            data.insert(at, data[at])
        (folder / dcp.METADATA_NAME).write_bytes(bytes(data))
        fast, slow, used = both_ways(folder, monkeypatch)
        assert fast == slow, (change, at)
        ran += used
    assert ran  # most damage is in the bulk, where the fast path may still read what the damage says


def test_a_hostile_global_in_the_bulk_is_refused_as_the_unpickler_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write(tmp_path / "ckpt", fsdp_model(2, 300))
    data = (folder / dcp.METADATA_NAME).read_bytes()
    name = b"torch.distributed.checkpoint.metadata\nChunkStorageMetadata\n"  # a GLOBAL opcode's lines
    assert name in data
    (folder / dcp.METADATA_NAME).write_bytes(data.replace(name, b"os\nsystem\n"))
    fast, slow, _ = both_ways(folder, monkeypatch)
    assert fast == slow and fast[0] == "error"


def test_too_many_short_runs_leave_it_to_the_unpickler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write(tmp_path / "ckpt", fsdp_model(4, 300))
    monkeypatch.setattr(reader, "BULK_MIN_BYTES", 0)
    monkeypatch.setattr(reader, "_BULK_RUNS", 3)
    monkeypatch.setattr(reader, "_BULK_RUNS_PER_BYTE", 0.0)
    meta = dcp.read_dcp_metadata(folder)
    assert not reader.last_read_in_runs and len(meta.tensors) == 4


def test_small_files_take_the_unpickler(tmp_path: Path) -> None:
    folder = write(tmp_path / "ckpt", fsdp_model(2, 3))
    assert os.path.getsize(folder / dcp.METADATA_NAME) < reader.BULK_MIN_BYTES
    dcp.read_dcp_metadata(folder)
    assert not reader.last_read_in_runs


def test_chunk_columns_are_int64_and_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "BULK_MIN_BYTES", 0)
    meta = dcp.read_dcp_metadata(write(tmp_path / "ckpt", fsdp_model(2, 300)))
    table = meta.tensors["layers.1.weight"].table
    assert table.offsets.dtype == np.int64 and table.file_ids.dtype == np.int32
    assert not table.offsets.flags.writeable


def test_a_file_is_read_whole_however_short_each_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read returns at most 2 GiB on Linux: a 2.4 GB .metadata is read in several."""
    folder = write(tmp_path / "ckpt", fsdp_model(3, 300))
    real_open = open

    class Short:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.fh = real_open(*args, **kwargs)  # type: ignore[call-overload]

        def __enter__(self) -> Short:
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

        def readinto(self, view: memoryview) -> int:
            return self.fh.readinto(view[:1000])

        def read(self, size: int = -1) -> bytes:
            return self.fh.read(size)

    monkeypatch.setattr(reader, "open", Short, raising=False)
    fast, slow, used = both_ways(folder, monkeypatch)
    assert used and fast == slow
