"""What ``bulk.read_bulk`` read, made into the records ``read_dcp_metadata`` returns, column by column.

The runs hold each field as a numpy column; this joins them into the storage index (every entry's
tensor, offsets, file, start and length as arrays) and each tensor's ``ChunkTable`` without a Python
object per chunk: a tensor's storage rows are found by one stable sort of all entries by tensor, and
matched to its chunks by their offsets, in order when they come in order (as torch writes them) and
by sorting both otherwise. Anything the slow reader would say more about (an entry that is not a
string, a chunk without its entry, a duplicate, stream transforms) is a ``GiveUp``: the caller reads the
file with the unpickler then, which says what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.formats.dcp.bulk import CHUNK_CLASS, INDEX_CLASS, INFO_CLASS, GiveUp, Run, Strings
from reshard.formats.dcp.records import ChunkTable
from reshard.formats.dcp.runs import _Col, _Ref

# ------------------------------------------------------------------------------- storage entries


@dataclass
class _Part:
    """Consecutive storage entries as columns (a run's rows, or one entry the machine read whole)."""

    fqns: np.ndarray  # each row's name, an id in the machine's ``Strings``
    offsets: np.ndarray | None  # (rows, ndim) int64, or None: entries of byte values
    files: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def _names(value: Any, run: Run | None, rows: int, strings: Strings) -> np.ndarray:
    if isinstance(value, _Ref) and run is not None:
        return run.strings[value.k]
    if type(value) is not str:
        raise GiveUp("a name that is not a string")
    return np.full(rows, strings.id(value), dtype=np.int32)


def _ints(value: Any, run: Run | None) -> np.ndarray:
    if isinstance(value, _Col) and run is not None:
        return run.values[value.k]
    if run is None and type(value) is int:
        return np.array([value], dtype=np.int64)
    raise GiveUp("an integer field of another form")


def _offset_matrix(value: Any, run: Run | None, rows: int) -> np.ndarray:
    if type(value) is not tuple:
        raise GiveUp("offsets that are not a tuple")
    if not value:
        return np.zeros((rows, 0), dtype=np.int64)
    return np.stack([_ints(v, run) for v in value], axis=1)


def _states(key: Any, value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    if type(key) is not INDEX_CLASS or type(value) is not INFO_CLASS:
        raise GiveUp("a storage entry of other classes")
    k, v = getattr(key, "state", None), getattr(value, "state", None)
    if type(k) is not dict or type(v) is not dict:
        raise GiveUp("a storage entry without its fields")
    if v.get("transform_descriptors") not in (None, [], ()):
        raise GiveUp("stream transforms")
    return k, v


def _part(key: Any, value: Any, strings: Strings) -> _Part:
    run = key if isinstance(key, Run) else None
    rows = run.rows if run is not None else 1
    if run is not None:
        key, value = run.template.objects
    k, v = _states(key, value)
    offset = k.get("offset")
    return _Part(
        _names(k.get("fqn"), run, rows, strings),
        None if offset is None else _offset_matrix(offset, run, rows),
        _names(v.get("relative_path"), run, rows, strings),
        _ints(v.get("offset"), run),
        _ints(v.get("length"), run),
    )


@dataclass
class StorageIndex:
    """Every storage entry as columns; ``rows_of`` finds a tensor's, ``byte_value`` a byte value's."""

    strings: Strings  # fqn ids are ids of these
    files: tuple[str, ...]
    file_ids: np.ndarray  # int32
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray  # (n, widest) int64, zero past each row's ndim
    ndims: np.ndarray  # int16; -1: a byte value's entry (offset None)
    bounds: np.ndarray  # rows of fqn id f are order[bounds[f]:bounds[f + 1]]
    order: np.ndarray

    def rows_of(self, fqn: str, ndim: int) -> np.ndarray:
        f = self.strings.known(fqn)
        if f is None or f + 1 >= len(self.bounds):
            return np.zeros(0, dtype=np.intp)
        rows = self.order[self.bounds[f] : self.bounds[f + 1]]
        return rows[self.ndims[rows] == ndim]

    def byte_value(self, fqn: str) -> tuple[str, int, int] | None:
        rows = self.rows_of(fqn, -1)
        if not len(rows):
            return None
        row = int(rows.max())  # the last entry of a key, as a dict keeps it
        return self.files[int(self.file_ids[row])], int(self.starts[row]), int(self.lengths[row])


def _file_numbers(ids: np.ndarray, strings: Strings) -> tuple[tuple[str, ...], np.ndarray]:
    """The files the rows name, numbered in the order they first appear (as the slow reader numbers them)."""
    if not len(ids):
        return (), ids
    first = np.full(len(strings.names), len(ids), dtype=np.int64)
    np.minimum.at(first, ids, np.arange(len(ids), dtype=np.int64))  # each name's first row
    named = np.flatnonzero(first < len(ids))
    ordered = named[np.argsort(first[named], kind="stable")]
    renumber = np.zeros(len(strings.names), dtype=np.int32)
    renumber[ordered] = np.arange(len(ordered), dtype=np.int32)
    return tuple(strings.names[i] for i in ordered.tolist()), renumber[ids]


def storage_index(storage: dict[Any, Any], strings: Strings, check_relative: Any, path: str) -> StorageIndex:
    parts = [_part(key, value, strings) for key, value in storage.items()]
    fqn_column = np.concatenate([p.fqns for p in parts]) if parts else np.zeros(0, dtype=np.int32)
    files, file_ids = _file_numbers(np.concatenate([p.files for p in parts]) if parts else fqn_column, strings)
    for rel in files:
        check_relative(rel, path)
    widest = max((p.offsets.shape[1] for p in parts if p.offsets is not None), default=0)
    offsets = np.zeros((len(fqn_column), widest), dtype=np.int64)
    ndims = np.empty(len(fqn_column), dtype=np.int16)
    row = 0
    for p in parts:
        rows = len(p.starts)
        if p.offsets is None:
            ndims[row : row + rows] = -1
        else:
            offsets[row : row + rows, : p.offsets.shape[1]] = p.offsets
            ndims[row : row + rows] = p.offsets.shape[1]
        row += rows
    starts = np.concatenate([p.starts for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    lengths = np.concatenate([p.lengths for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    if (starts < 0).any() or (lengths < 0).any():
        raise GiveUp("a negative offset or length")
    order = np.argsort(fqn_column, kind="stable")
    bounds = np.searchsorted(fqn_column[order], np.arange(len(strings.names) + 1))
    return StorageIndex(strings, files, file_ids, starts, lengths, offsets, ndims, bounds, order)


# ----------------------------------------------------------------------------------------- chunks


def _chunk_part(item: Any, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    run = item if isinstance(item, Run) else None
    record = run.template.objects[0] if run is not None else item
    if type(record) is not CHUNK_CLASS or type(getattr(record, "state", None)) is not dict:
        raise GiveUp("a chunk of another class")
    rows = run.rows if run is not None else 1
    offsets = _offset_matrix(record.state.get("offsets"), run, rows)
    sizes = _offset_matrix(record.state.get("sizes"), run, rows)
    if offsets.shape[1] != ndim or sizes.shape[1] != ndim:
        raise GiveUp("a chunk of another rank")
    return offsets, sizes


def chunk_columns(chunks: Any, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """A tensor's chunk list (runs and records) as its offsets and sizes, (n, ndim) int64 each."""
    if type(chunks) is not list:
        raise GiveUp("chunks that are not a list")
    if not chunks:
        empty = np.zeros((0, ndim), dtype=np.int64)
        return empty, empty
    parts = [_chunk_part(item, ndim) for item in chunks]
    return np.concatenate([o for o, _ in parts]), np.concatenate([s for _, s in parts])


def _lexorder(matrix: np.ndarray) -> np.ndarray:
    return np.lexsort(matrix.T[::-1]) if matrix.shape[1] else np.arange(len(matrix))


def chunk_table(fqn: str, offsets: np.ndarray, sizes: np.ndarray, where: StorageIndex) -> ChunkTable:
    """The ``ChunkTable`` of one tensor: each chunk joined to the storage entry of its offsets."""
    ndim = offsets.shape[1]
    rows = where.rows_of(fqn, ndim)
    if len(rows) != len(offsets):
        raise GiveUp("chunks and storage entries do not pair")
    stored = where.offsets[rows, :ndim]
    if not (stored == offsets).all():
        mine, theirs = _lexorder(offsets), _lexorder(stored)
        if not (stored[theirs] == offsets[mine]).all() or (
            len(theirs) > 1 and (stored[theirs[1:]] == stored[theirs[:-1]]).all(axis=1).any()
        ):
            raise GiveUp("chunks and storage entries do not pair")
        paired = np.empty_like(rows)
        paired[mine] = rows[theirs]
        rows = paired
    ids = where.file_ids[rows]
    present = np.zeros(len(where.files), dtype=bool)
    present[ids] = True
    used = np.flatnonzero(present)  # the files the tensor has chunks in, in the storage's order
    renumber = np.cumsum(present, dtype=np.int32) - 1
    files = where.files if len(used) == len(where.files) else tuple(map(where.files.__getitem__, used.tolist()))
    return ChunkTable(
        offsets,
        sizes,
        files,  # every tensor in every file (FSDP): one tuple shared, and checked once (_check_files)
        renumber[ids],
        where.starts[rows],
        where.lengths[rows],
    )


__all__ = ["StorageIndex", "chunk_columns", "chunk_table", "storage_index"]
