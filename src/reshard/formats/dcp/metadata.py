"""Reading a DCP folder's ``.metadata`` into records, and every check of the chunks against their tensors and files."""

from __future__ import annotations

import itertools
import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.errors import FormatError, UnsupportedError
from reshard.formats.dcp import bulk, columns
from reshard.formats.dcp.names import DATA_SUFFIX, NO_METADATA
from reshard.formats.dcp.records import (
    _FILESYSTEM,
    _META,
    METADATA_NAME,
    BytesItem,
    Chunk,
    ChunkTable,
    DcpMetadata,
    TensorMeta,
    _int_matrix,
    collector_paused,
)
from reshard.formats.dcp.unpickling import (
    _RECORD_CLASSES,
    _int_tuple,
    _int_tuples,
    _MetadataUnpickler,
    _Pickled,
    _TorchDtype,
    _unpickle,
)
from reshard.text import first_line

# -------------------------------------------------------------------------------- metadata


def read_dcp_metadata(folder: str | os.PathLike[str]) -> DcpMetadata:
    """Read and check ``<folder>/.metadata``: every tensor, chunk and value, and where they are.

    Raises ``FormatError`` (naming the file and what is wrong) for a pickle naming any global outside
    DCP's, a structure that is not DCP's, chunks outside their tensor, overlapping or leaving a gap,
    items in missing files or past their end; ``UnsupportedError`` for stream transforms, sparse
    layouts and dtypes reshard does not carry. Each tensor's chunks come as a ``ChunkTable`` (no
    Python object per chunk is kept: ``docs/pytorch.md`` has the time and memory per chunk).
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, METADATA_NAME)
    meta = _read_in_runs(folder, path)
    if meta is not None:
        _check_files(meta, path)
        return meta
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        if _holds_data_files(folder):
            raise FormatError(NO_METADATA, folder) from None
        raise FormatError("cannot read: No such file or directory", path) from None
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", path) from None
    with collector_paused():
        top = _unpickle(_MetadataUnpickler, raw, path, "the metadata pickle")
        del raw
        try:
            meta = _build_metadata(top, folder, path)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
            raise FormatError(f"not a DCP metadata pickle: {first_line(exc)}", path) from None
        del top
    _check_files(meta, path)
    return meta


def _holds_data_files(folder: str) -> bool:
    """Whether ``folder`` holds ``.distcp`` data files (without ``.metadata``: an unfinished save)."""
    try:
        return any(name.endswith(DATA_SUFFIX) for name in os.listdir(folder))
    except OSError:
        return False


BULK_MIN_BYTES = 4 << 20  # below this (some 30 000 chunks) the unpickler reads a .metadata in well under a second
_BULK_RUNS, _BULK_RUNS_PER_BYTE = 20000, 1 / 8192  # more runs than these are not the long runs bulk is for
last_read_in_runs = False  # whether the last read_dcp_metadata took the bulk path (for the tests)


def _read_in_runs(folder: str, path: str) -> DcpMetadata | None:
    """A large ``.metadata`` read in runs of like records (``bulk``), or None: a small one, or one the
    runs do not cover (the unpickler then reads it, and says what is wrong if anything is)."""
    global last_read_in_runs
    last_read_in_runs = False
    try:
        size = os.path.getsize(path)
        if size < BULK_MIN_BYTES:
            return None
        raw = _read_whole(path, size)
        if raw is None:
            return None
    except OSError:
        return None
    with collector_paused():
        try:
            top, strings = bulk.read_bulk(raw, max_runs=_BULK_RUNS + int(size * _BULK_RUNS_PER_BYTE))
            del raw
            meta = _build_metadata(top, folder, path, strings)
        except (bulk.GiveUp, FormatError, UnsupportedError, ValueError, TypeError, KeyError, OverflowError):
            return None
    last_read_in_runs = True
    return meta


def _read_whole(path: str, size: int) -> bytearray | None:
    """The file's ``size`` bytes (a read returns at most 2 GiB on Linux: read until all are in)."""
    raw = bytearray(size)
    view, done = memoryview(raw), 0
    with open(path, "rb", buffering=0) as fh:
        while done < size:
            got = fh.readinto(view[done:])
            if not got:
                return None  # shorter than it was a moment ago
            done += got
    view.release()
    return raw


def _state(obj: Any, kind: str, path: str, form: type = dict) -> Any:
    if not isinstance(obj, _Pickled) or obj.global_name != f"{kind}":
        found = obj.global_name if isinstance(obj, _Pickled) else type(obj).__name__
        raise FormatError(f"expected a {kind.rsplit('.', 1)[-1]}, found {found}", path)
    state = getattr(obj, "state", None)
    if state is None and form is dict:
        return {}  # NEWOBJ without BUILD: an instance of no fields
    if not isinstance(state, form):
        raise FormatError(f"a {kind.rsplit('.', 1)[-1]} has its state in an unknown form", path)
    return state


_STATE = operator.attrgetter("state")


def _states(objs: list[Any], kind: str, path: str) -> list[dict[Any, Any]]:
    """The dict states of many instances of one allowed class (checked as ``_state`` does, in bulk)."""
    cls = _RECORD_CLASSES[tuple(kind.rsplit(".", 1))]  # type: ignore[index]
    try:
        if set(map(type, objs)) <= {cls}:
            states = list(map(_STATE, objs))
            if set(map(type, states)) <= {dict}:
                return states
    except AttributeError:  # an instance without BUILD: _state says what
        pass
    return [_state(obj, kind, path) for obj in objs]


def _column(states: list[dict[Any, Any]], name: str, default: Any = None) -> list[Any]:
    """``state.get(name, default)`` of every state (the faster ``itemgetter`` when all have it)."""
    try:
        return list(map(operator.itemgetter(name), states))
    except KeyError:
        return list(map(operator.methodcaller("get", name, default), states))


def _build_metadata(top: Any, folder: str, path: str, strings: bulk.Strings | None = None) -> DcpMetadata:
    """The records of an unpickled ``.metadata``, or (``strings`` given) of what ``bulk`` read: its
    runs joined into the same columns (``columns``)."""
    state = _state(top, f"{_META}.Metadata", path)
    entries = state.get("state_dict_metadata")
    storage = state.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise FormatError("metadata has no state_dict_metadata / storage_data dictionaries", path)
    byte_value: Callable[[str], tuple[str, int, int] | None]
    tensor_meta: Callable[[str, Any], TensorMeta]
    if strings is None:
        slow = _storage_index(storage, path)
        byte_value, tensor_meta = slow.byte_value, lambda fqn, entry: _tensor_meta(fqn, entry, slow, path)
    else:
        fast = columns.storage_index(storage, strings, _check_relative, path)
        byte_value, tensor_meta = fast.byte_value, lambda fqn, entry: _tensor_from_columns(fqn, entry, fast, path)
    del storage
    tensors: dict[str, TensorMeta] = {}
    byte_items: dict[str, BytesItem] = {}
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise FormatError(f"state dict key {fqn!r} is not a string", path)
        if isinstance(entry, _Pickled) and entry.global_name == f"{_META}.BytesStorageMetadata":
            item = byte_value(fqn)
            if item is None:
                raise FormatError(f"value {fqn!r} has no storage entry", path)
            byte_items[fqn] = BytesItem(fqn, *item)
        else:
            tensors[fqn] = tensor_meta(fqn, _state(entry, f"{_META}.TensorStorageMetadata", path))
    planner, version = state.get("planner_data"), state.get("version")
    return DcpMetadata(folder, tensors, byte_items, planner, version if isinstance(version, str) else None)


def _tensor_from_columns(fqn: str, state: Any, where: columns.StorageIndex, path: str) -> TensorMeta:
    dtype, shape, requires_grad = _tensor_header(fqn, state, path)
    offsets, sizes = columns.chunk_columns(state.get("chunks"), len(shape))
    meta = TensorMeta(fqn, dtype, shape, columns.chunk_table(fqn, offsets, sizes, where), requires_grad)
    check_chunks(meta, path)
    return meta


StorageKey = tuple[str, tuple[int, ...] | None]


@dataclass(frozen=True)
class _StorageColumns:
    """``storage_data`` as columns: row ``k`` is the k-th entry; ``rows`` finds a row by its key."""

    rows: dict[StorageKey, int]
    files: tuple[str, ...]
    file_ids: np.ndarray  # int32
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64

    def item(self, row: int) -> tuple[str, int, int]:
        return self.files[int(self.file_ids[row])], int(self.starts[row]), int(self.lengths[row])

    def byte_value(self, fqn: str) -> tuple[str, int, int] | None:
        """Where the non-tensor value ``fqn`` is: its file, start and length (None: no entry)."""
        row = self.rows.get((fqn, None))
        return None if row is None else self.item(row)


def _storage_index(storage: dict[Any, Any], path: str) -> _StorageColumns:
    keys = _states(list(storage), f"{_META}.MetadataIndex", path)
    infos = _states(list(storage.values()), f"{_FILESYSTEM}._StorageInfo", path)
    fqns, offsets = _column(keys, "fqn"), _column(keys, "offset")
    rels, starts, lengths = _column(infos, "relative_path"), _column(infos, "offset"), _column(infos, "length")
    # torch leaves transform_descriptors out when there are none: states of three keys have none
    extra = not set(map(len, infos)) <= {3}
    transforms = _column(infos, "transform_descriptors") if extra else [None] * len(infos)
    del keys, infos
    typed = all(set(map(type, v)) <= {t} for v, t in ((fqns, str), (rels, str), (starts, int), (lengths, int)))
    if not typed or any(transforms):
        for entry in zip(fqns, rels, starts, lengths, transforms, strict=True):  # the first bad entry says what
            _check_storage_entry(*entry, path)
    start_column = np.fromiter(starts, np.int64, len(starts))
    length_column = np.fromiter(lengths, np.int64, len(lengths))
    if (start_column < 0).any() or (length_column < 0).any():
        first = int(np.flatnonzero((start_column < 0) | (length_column < 0))[0])
        raise FormatError(f"storage entry {fqns[first]!r} has a negative offset or length", path)
    file_index = {rel: k for k, rel in enumerate(dict.fromkeys(rels))}
    for rel in file_index:
        _check_relative(rel, path)
    file_ids = np.fromiter(map(file_index.__getitem__, rels), np.int32, len(rels))
    offsets = [o if o is None or type(o) is tuple else tuple(o) for o in offsets]
    rows = dict(zip(zip(fqns, offsets, strict=True), range(len(fqns)), strict=True))
    return _StorageColumns(rows, tuple(file_index), file_ids, start_column, length_column)


def _check_storage_entry(fqn: Any, rel: Any, start: Any, length: Any, transforms: Any, path: str) -> None:
    if not isinstance(fqn, str) or not isinstance(rel, str) or type(start) is not int or type(length) is not int:
        raise FormatError(f"storage entry {fqn!r} is malformed", path)
    if start < 0 or length < 0:
        raise FormatError(f"storage entry {fqn!r} has a negative offset or length", path)
    _check_relative(rel, path)
    if transforms:
        raise UnsupportedError(
            f"{fqn!r} is stored through stream transforms {list(transforms)} (reshard reads none)", path
        )


def _inside_folder(rel: str) -> bool:
    """A relative path that stays inside the checkpoint folder (no absolute path, drive or ``..``)."""
    parts = rel.replace("\\", "/").split("/")
    return bool(rel) and not rel.startswith(("/", "\\")) and ".." not in parts and ":" not in parts[0]


def _check_relative(rel: str, path: str) -> None:
    if not _inside_folder(rel):
        raise FormatError(f"data file {rel!r} is not a path inside the checkpoint folder", path)


def _tensor_header(fqn: str, state: Any, path: str) -> tuple[dtypes.DType, tuple[int, ...], bool]:
    """A tensor entry's dtype, global shape and ``requires_grad``."""
    props = _state(state.get("properties"), f"{_META}.TensorProperties", path, tuple)
    if len(props) != 5:
        raise FormatError(f"tensor {fqn!r} has properties in an unknown form", path)
    torch_dtype, layout, requires_grad, _memory_format, _pinned = props
    if not isinstance(torch_dtype, _TorchDtype):
        raise FormatError(f"tensor {fqn!r} has no dtype", path)
    if layout != "torch.strided":
        raise UnsupportedError(f"tensor {fqn!r} has layout {layout} (reshard reads dense tensors only)", path)
    return dtypes.from_torch_name(torch_dtype.name, path), _int_tuple(state.get("size", ())), bool(requires_grad)


def _tensor_meta(fqn: str, state: Any, where: _StorageColumns, path: str) -> TensorMeta:
    dtype, shape, requires_grad = _tensor_header(fqn, state, path)
    boxes = _states(list(state.get("chunks") or ()), f"{_META}.ChunkStorageMetadata", path)
    offsets, sizes = _int_tuples(_column(boxes, "offsets", ())), _int_tuples(_column(boxes, "sizes", ()))
    rows = np.fromiter(map(where.rows.get, zip(itertools.repeat(fqn), offsets), itertools.repeat(-1)), np.int64)
    if (rows < 0).any():
        first = int(np.flatnonzero(rows < 0)[0])
        raise FormatError(f"tensor {fqn!r} chunk at {list(offsets[first])} has no storage entry", path)
    _check_ranks(fqn, offsets, sizes, len(shape), path)
    used, file_ids = np.unique(where.file_ids[rows], return_inverse=True)
    table = ChunkTable(
        _int_matrix(offsets, len(shape)),
        _int_matrix(sizes, len(shape)),
        tuple(map(where.files.__getitem__, used.tolist())),
        file_ids.astype(np.int32),
        where.starts[rows],
        where.lengths[rows],
    )
    meta = TensorMeta(fqn, dtype, shape, table, requires_grad)
    check_chunks(meta, path)
    return meta


def _check_ranks(
    fqn: str, offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], ndim: int, path: str | None
) -> None:
    if set(map(len, offsets)) | set(map(len, sizes)) <= {ndim}:
        return
    for o, s in zip(offsets, sizes, strict=True):
        if len(o) != ndim or len(s) != ndim:
            raise FormatError(f"tensor {fqn!r} chunk at {list(o)} has the wrong rank", path)


def check_chunks(meta: TensorMeta, path: str | None = None) -> None:
    """The chunks of ``meta`` lie inside the tensor and tile it exactly (no overlap, no gap).

    Checked on whole columns of its ``ChunkTable``: bounds, then overlaps (intervals when the chunks
    are cut along one axis, a grid of the cuts otherwise), then the volume."""
    if meta._table is None:  # records made in memory: their ranks before they become columns
        chunks = meta.chunks
        _check_ranks(meta.fqn, [c.offsets for c in chunks], [c.sizes for c in chunks], len(meta.shape), path)
    try:
        table = meta.table
        shape = np.array(meta.shape, dtype=np.int64).reshape(1, len(meta.shape))
    except OverflowError:
        raise FormatError(f"tensor {meta.fqn!r} has a size or chunk offset past 2**63", path) from None
    offsets, sizes = table.offsets, table.sizes
    outside = ((offsets < 0) | (sizes < 0) | (offsets > shape) | (sizes > shape - offsets)).any(axis=1)
    if outside.any():
        k = int(np.flatnonzero(outside)[0])
        raise FormatError(
            f"tensor {meta.fqn!r} chunk at {offsets[k].tolist()} of {sizes[k].tolist()} lies outside "
            f"its shape {list(meta.shape)}",
            path,
        )
    volume = math.prod(meta.shape)
    if volume * max(1, len(table)) < 1 << 63:  # every chunk inside: each numel and their sum fit in int64
        numels = table.numels
        total, nonempty = int(numels.sum()), numels > 0
    else:  # absurd shapes: exact Python integers
        numels_exact = [math.prod(s) for s in sizes.tolist()]
        total, nonempty = sum(numels_exact), np.array([n > 0 for n in numels_exact], dtype=bool)
    _check_tiling(meta, offsets[nonempty], sizes[nonempty], path)
    if total != volume:
        raise FormatError(f"tensor {meta.fqn!r}: its chunks do not cover it ({total} of {volume} elements)", path)


_GRID_CELLS = 1 << 22  # largest grid of chunk cuts checked cell by cell


def _check_tiling(meta: TensorMeta, offsets: np.ndarray, sizes: np.ndarray, path: str | None) -> None:
    """No two non-empty chunks overlap: as intervals when they are cut along one axis, else on the grid
    of every chunk's cuts (``check_chunks`` then compares their volume with the tensor's)."""
    if math.prod(meta.shape) == 0:
        return
    if not meta.shape:
        if len(offsets) > 1:
            raise FormatError(f"tensor {meta.fqn!r} has {len(offsets)} chunks of its one element", path)
    elif (axis := _only_cut_axis(meta.shape, offsets, sizes)) is not None:  # Shard(k), FSDP: intervals on one axis
        _check_intervals(meta, offsets, sizes, axis, path)
    else:
        _check_grid(meta, offsets, sizes, path)


def _only_cut_axis(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> int | None:
    """The one axis the chunks are cut along (each whole on every other axis), or None."""
    whole = (offsets == 0) & (sizes == np.array(shape, dtype=np.int64))
    cut = np.flatnonzero(~whole.all(axis=0))
    return None if len(cut) > 1 else int(cut[0]) if len(cut) else 0


def _overlap(meta: TensorMeta, offsets: Sequence[int], path: str | None) -> FormatError:
    return FormatError(f"tensor {meta.fqn!r} chunk at {list(offsets)} overlaps another chunk", path)


def _check_intervals(meta: TensorMeta, offsets: np.ndarray, sizes: np.ndarray, axis: int, path: str | None) -> None:
    order = np.argsort(offsets[:, axis], kind="stable")
    starts = offsets[order, axis]
    ends = starts + sizes[order, axis]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if len(clash):
        raise _overlap(meta, offsets[order[clash[0] + 1]].tolist(), path)


def _check_grid(meta: TensorMeta, offsets: np.ndarray, sizes: np.ndarray, path: str | None) -> None:
    ends = offsets + sizes
    cuts = [np.unique(np.concatenate(([0, d], offsets[:, i], ends[:, i]))) for i, d in enumerate(meta.shape)]
    cells = math.prod(len(axis) - 1 for axis in cuts)
    # a real tiling has one cell per chunk; more cells than a few per chunk (or than _GRID_CELLS) are
    # not worth marking: pairwise disjointness, then the volume says coverage
    if cells > min(_GRID_CELLS, 64 * len(offsets) + 4096):
        _check_disjoint(meta, offsets.tolist(), sizes.tolist(), path)
        return
    low = np.stack([np.searchsorted(axis, offsets[:, i]) for i, axis in enumerate(cuts)], axis=1)
    high = np.stack([np.searchsorted(axis, ends[:, i]) for i, axis in enumerate(cuts)], axis=1)
    dims = tuple(len(axis) - 1 for axis in cuts)
    if (high - low == 1).all():  # every chunk one cell (a regular mesh): a cell twice is an overlap
        cell = np.ravel_multi_index(tuple(low.T), dims)
        order = np.argsort(cell, kind="stable")
        again = order[1:][cell[order[1:]] == cell[order[:-1]]]
        if len(again):
            raise _overlap(meta, offsets[int(again.min())].tolist(), path)
        return
    grid = np.zeros(dims, dtype=np.int32)
    for k, (lo, hi) in enumerate(zip(low.tolist(), high.tolist(), strict=True)):
        window = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        grid[window] += 1
        if grid[window].max() > 1:
            raise _overlap(meta, offsets[k].tolist(), path)


def _check_disjoint(meta: TensorMeta, offsets: list[list[int]], sizes: list[list[int]], path: str | None) -> None:
    boxes = sorted(zip(offsets, sizes, strict=True))
    for k, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[k + 1 :]:
            if b_off[0] >= a_off[0] + a_size[0]:
                break
            if all(
                bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                raise _overlap(meta, b_off, path)


def _check_files(meta: DcpMetadata, path: str) -> None:
    sizes: dict[str, int] = {}
    for rel in meta.files:
        file = os.path.join(meta.folder, rel)
        try:
            sizes[rel] = os.stat(file).st_size
        except OSError as exc:
            raise FormatError(f"data file {rel!r} named by the metadata is missing ({exc.strerror})", path) from None
    file_sizes: dict[int, tuple[tuple[str, ...], np.ndarray]] = {}  # by the files tuple, often shared
    for tensor in meta.tensors.values():
        table = tensor.table
        known = file_sizes.get(id(table.files))
        if known is None or known[0] is not table.files:
            known = file_sizes[id(table.files)] = (table.files, np.array([sizes[rel] for rel in table.files], np.int64))
        room = known[1][table.file_ids] - table.starts
        past = np.flatnonzero(table.lengths > room)
        if len(past):
            _past_the_end(meta, table.chunk(tensor.fqn, int(past[0])), sizes)
    for item in meta.byte_items.values():
        if item.offset + item.length > sizes[item.file]:
            _past_the_end(meta, item, sizes)


def _past_the_end(meta: DcpMetadata, item: Chunk | BytesItem, sizes: dict[str, int]) -> None:
    raise FormatError(
        f"{item.fqn!r} is stored at bytes {item.offset}..{item.offset + item.length} but the file has "
        f"{sizes[item.file]} bytes (truncated)",
        os.path.join(meta.folder, item.file),
    )


__all__ = ["StorageKey", "check_chunks", "read_dcp_metadata"]
