"""The records of a DCP checkpoint's ``.metadata``: plain frozen values, each tensor's chunks as numpy columns."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.dtypes import DType
from reshard.formats.dcp.names import (
    DATA_SUFFIX,
    DCP_VERSION,
    FORMAT,
    METADATA_NAME,
    SAFETENSORS,
    SHARDING_INFO_KEY,
    TORCH_SAVE,
)

_META = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"
_MAX_PICKLE_MEMBER = 1 << 20  # a data.pkl of one tensor is ~200 bytes; a larger one is not DCP's
_ZIP_LOCAL = b"PK\x03\x04"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cycle collector off: it would walk the millions of records of a large checkpoint's metadata
    again and again while they are made and turned into columns (they hold no cycles)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


# --------------------------------------------------------------------------------------- records


def chunk_name(fqn: str, offsets: Sequence[int]) -> str:
    """The unique index name of one chunk: ``fqn@o0,o1,...`` (its offsets in the global tensor)."""
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: ``offsets``/``sizes`` in the global tensor, and where its item is."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative path of its data file
    offset: int  # where the stored item starts in that file
    length: int
    transforms: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return chunk_name(self.fqn, self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """The chunks of one tensor as columns: row ``k`` is chunk ``k`` (no Python object per chunk).

    A checkpoint saved on thousands of ranks has tens of millions of chunks; a row costs
    ``16 x ndim + 20`` bytes here against some 300 bytes as a ``Chunk``, and the checks run on
    whole columns (``check_chunks``). The columns are read-only; stream transforms are not kept
    (the reader refuses them). Compare tables by their columns (``==`` is identity)."""

    offsets: np.ndarray  # (n, ndim) int64: each chunk's offsets in the global tensor
    sizes: np.ndarray  # (n, ndim) int64
    files: tuple[str, ...]  # the relative paths that file_ids index
    file_ids: np.ndarray  # (n,) int32
    starts: np.ndarray  # (n,) int64: where each stored item starts in its file
    lengths: np.ndarray  # (n,) int64

    def __post_init__(self) -> None:
        for column in (self.offsets, self.sizes, self.file_ids, self.starts, self.lengths):
            column.setflags(write=False)

    def __len__(self) -> int:
        return len(self.file_ids)

    @property
    def numels(self) -> np.ndarray:
        """Each chunk's element count (int64; ``check_chunks`` guards against overflow)."""
        return np.prod(self.sizes, axis=1, dtype=np.int64)

    def rows_in(self, relative_path: str) -> np.ndarray:
        """The row numbers of the chunks stored in one data file, in order."""
        if relative_path not in self.files:
            return np.zeros(0, dtype=np.intp)
        return np.flatnonzero(self.file_ids == self.files.index(relative_path))

    def chunk(self, fqn: str, row: int) -> Chunk:
        return Chunk(
            fqn,
            tuple(self.offsets[row].tolist()),
            tuple(self.sizes[row].tolist()),
            self.files[int(self.file_ids[row])],
            int(self.starts[row]),
            int(self.lengths[row]),
        )

    def chunks(self, fqn: str) -> tuple[Chunk, ...]:
        offsets, sizes = map(tuple, self.offsets.tolist()), map(tuple, self.sizes.tolist())
        files = [self.files[i] for i in self.file_ids.tolist()]
        rows = zip(offsets, sizes, files, self.starts.tolist(), self.lengths.tolist(), strict=True)
        with collector_paused():
            return tuple(Chunk(fqn, o, s, f, b, n) for o, s, f, b, n in rows)

    @classmethod
    def of(cls, chunks: Sequence[Chunk], ndim: int) -> ChunkTable:
        """The table of chunk records (their ranks must all be ``ndim``: ``check_chunks`` says so first)."""
        files = tuple(dict.fromkeys(c.file for c in chunks))
        ids = {rel: k for k, rel in enumerate(files)}
        return cls(
            _int_matrix([c.offsets for c in chunks], ndim),
            _int_matrix([c.sizes for c in chunks], ndim),
            files,
            np.fromiter((ids[c.file] for c in chunks), np.int32, len(chunks)),
            np.fromiter((c.offset for c in chunks), np.int64, len(chunks)),
            np.fromiter((c.length for c in chunks), np.int64, len(chunks)),
        )


def _int_matrix(rows: Sequence[Sequence[int]], ndim: int) -> np.ndarray:
    """``rows`` (each ``ndim`` Python ints) as an (n, ndim) int64 array; OverflowError past int64."""
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int64, len(rows) * ndim)
    return flat.reshape(len(rows), ndim)


class TensorMeta:
    """A tensor of the state dict: dtype, global shape and the chunks that tile it.

    ``chunks`` is given either as ``Chunk`` records or as a ``ChunkTable`` (what the reader makes);
    both ``chunks`` and ``table`` are there to read, each built from the other on first use."""

    __slots__ = ("_chunks", "_table", "dtype", "fqn", "requires_grad", "shape")

    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    requires_grad: bool
    _chunks: tuple[Chunk, ...] | None
    _table: ChunkTable | None

    def __init__(
        self,
        fqn: str,
        dtype: DType,
        shape: tuple[int, ...],
        chunks: Sequence[Chunk] | ChunkTable = (),
        requires_grad: bool = False,
    ) -> None:
        table = chunks if isinstance(chunks, ChunkTable) else None
        records = None if isinstance(chunks, ChunkTable) else tuple(chunks)
        for name, value in (
            ("fqn", fqn),
            ("dtype", dtype),
            ("shape", tuple(shape)),
            ("requires_grad", requires_grad),
            ("_table", table),
            ("_chunks", records),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TensorMeta is frozen: cannot set {name}")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (by Ray, multiprocessing) as its columns or records
        held = self._table if self._table is not None else self._chunks
        return (TensorMeta, (self.fqn, self.dtype, self.shape, held, self.requires_grad))

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        if self._chunks is None:
            assert self._table is not None
            object.__setattr__(self, "_chunks", self._table.chunks(self.fqn))
        assert self._chunks is not None
        return self._chunks

    @property
    def table(self) -> ChunkTable:
        """The chunks as columns (made from the records on first use: ``check_chunks`` checks their ranks first)."""
        if self._table is None:
            object.__setattr__(self, "_table", ChunkTable.of(self.chunks, len(self.shape)))
        assert self._table is not None
        return self._table

    @property
    def chunk_count(self) -> int:
        return len(self._table) if self._table is not None else len(self.chunks)

    def _key(self) -> tuple[Any, ...]:
        return (self.fqn, self.dtype, self.shape, self.chunks, self.requires_grad)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorMeta) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"TensorMeta(fqn={self.fqn!r}, dtype={self.dtype!r}, shape={self.shape!r}, "
            f"chunks=<{self.chunk_count} chunks>, requires_grad={self.requires_grad!r})"
        )


@dataclass(frozen=True)
class BytesItem:
    """A non-tensor value: opaque ``torch.save`` bytes, carried byte for byte and never unpickled."""

    fqn: str
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True)
class DcpMetadata:
    """What a ``.metadata`` says, checked against the folder's files."""

    folder: str
    tensors: dict[str, TensorMeta]
    byte_items: dict[str, BytesItem]
    planner_data: Any = None  # plain values (DefaultSavePlanner: fqn -> key path); None when absent
    version: str | None = None

    @functools.cached_property
    def files(self) -> tuple[str, ...]:
        """The data files the metadata refers to, sorted."""
        distinct = {id(t.table.files): t.table.files for t in self.tensors.values()}  # often one tuple shared
        names = {rel for files in distinct.values() for rel in files}
        return tuple(sorted(names | {b.file for b in self.byte_items.values()}))

    def chunks_in(self, relative_path: str) -> list[tuple[TensorMeta, np.ndarray]]:
        """The chunks stored in one data file: per tensor (in order) its rows of ``tensor.table``."""
        return self._rows_by_file.get(relative_path, [])

    @functools.cached_property
    def _rows_by_file(self) -> dict[str, list[tuple[TensorMeta, np.ndarray]]]:
        """Every data file's chunks, found in one pass (not one pass over all chunks per file)."""
        out: dict[str, list[tuple[TensorMeta, np.ndarray]]] = {}
        for tensor in self.tensors.values():
            table = tensor.table
            order = np.argsort(table.file_ids, kind="stable")
            bounds = np.searchsorted(table.file_ids[order], np.arange(len(table.files) + 1))
            for k, rel in enumerate(table.files):
                rows = order[bounds[k] : bounds[k + 1]]
                if len(rows):
                    out.setdefault(rel, []).append((tensor, rows))
        return out


__all__ = [
    "DATA_SUFFIX",
    "DCP_VERSION",
    "FORMAT",
    "METADATA_NAME",
    "SAFETENSORS",
    "SHARDING_INFO_KEY",
    "TORCH_SAVE",
    "BytesItem",
    "Chunk",
    "ChunkTable",
    "DcpMetadata",
    "TensorMeta",
    "chunk_name",
    "collector_paused",
]
