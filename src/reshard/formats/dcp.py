"""PyTorch Distributed Checkpoint (DCP) folders, read and written without torch.

A DCP checkpoint is a folder: ``.metadata`` (one pickle, written last: its presence marks a complete
save) and data files ``__<rank>_<k>.distcp``. The metadata lists, per state-dict key (fqn), either a
tensor (dtype, global shape, and its *chunks*: boxes of the global tensor given by offsets and sizes,
any number, uneven, each stored once) or a non-tensor value saved as opaque ``torch.save`` bytes; and,
per chunk or value, where its bytes are (relative file, byte offset, length, stream transforms).

Why no ``pickle.load``: a pickle can run any code, and these files come from users. Both pickles DCP
uses are read by unpicklers whose ``find_class`` allows exactly the globals DCP (and ``torch.save``)
name and maps each to an inert stand-in; any other global is refused with one ``FormatError`` naming
the file and the global, before anything runs. The stand-ins become plain frozen records
(``DcpMetadata``, ``TensorMeta``, ``BytesItem``) after validation: every chunk inside its tensor,
chunks neither overlapping nor leaving a gap, every stored item inside an existing file.

Why columns: a checkpoint saved by thousands of ranks has tens of millions of chunks (4,096 ranks x
5,000 fully sharded parameters: 20 M). One Python object per chunk, built and checked one by one,
cost some 20 us each. So each tensor's chunks are a ``ChunkTable`` (numpy columns: offsets, sizes,
file, byte offset, length), filled from the unpickler's records in bulk, and every check runs on whole
columns; ``TensorMeta.chunks`` (``Chunk`` records) is built only when asked for. The C unpickler is
fed in blocks (``_PickleInput``), the allowed classes keep their pickled state without a ``__dict__``,
and the cycle collector is paused while the records exist. ``docs/pytorch.md`` has the figures.

A chunk's bytes come in one of torch's two serializations, told apart by what starts at the item's
offset: ``torch_save`` (the default) stores each chunk as a complete ``torch.save`` ZIP archive whose
``data.pkl`` rebuilds the tensor from storage member ``data/<key>``, stored uncompressed, so its raw
little-endian bytes can be found and handed out in place; ``safetensors`` makes each file a
safetensors blob (after any non-tensor values) holding one chunk per fqn, with ``DCP_SHARDING_INFO``
naming each chunk's offsets. ``index_distcp`` gives, per data file, a ``TensorIndex`` like every other
reader's (one entry per chunk, named ``chunk_name(fqn, offsets)``, zero-copy over a memory map), so the
executors copy chunk bytes as they copy any tensor. Non-tensor values are never unpickled: they are
byte ranges to carry. Stream transforms (``transform_descriptors``, e.g. zstd) are refused.

Writing (``distcp_layout`` + ``distcp_finish``, or ``save_dcp`` for values in memory) uses the
``torch_save`` serialization: it is what ``FileSystemReader`` of torch 2.13 loads (it cannot load its
own ``safetensors`` serialization: it hands every tensor item to ``torch.load``). Each chunk is a ZIP
archive with the members torch writes (``data.pkl`` emitted opcode by opcode naming torch's globals,
``data/0`` aligned to 64 bytes, ``version``, ``byteorder``, ...), laid out before any data exists so the
executor fills ``data/0`` in place; the CRC-32 of each ``data/0`` is patched in afterwards. ZIP64
records are used for members or archives past 4 GiB, as torch does. ``write_metadata`` writes the
``.metadata`` pickle (the same globals torch's has) to ``.metadata.tmp`` and renames it, last.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import itertools
import json
import math
import operator
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import FormatError, ReshardError, UnsupportedError, UsageError
from reshard.formats.base import (
    ByteLayout,
    Segment,
    TensorEntry,
    TensorIndex,
    map_file,
    pwrite_all,
    value_bytes,
    write_file,
)
from reshard.text import first_line

FORMAT = "dcp"
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"  # torch 2.13's CURRENT_DCP_VERSION
TORCH_SAVE = "torch_save"
SAFETENSORS = "safetensors"
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"  # the safetensors serialization's per-tensor saved_offsets

_META = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"
_MAX_PICKLE_MEMBER = 1 << 20  # a data.pkl of one tensor is ~200 bytes; a larger one is not DCP's
_ZIP_LOCAL = b"PK\x03\x04"


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
        names = {rel for t in self.tensors.values() for rel in t.table.files}
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


# ------------------------------------------------------------------- allowlisting unpicklers


class _Pickled:
    """An instance of an allowed class: NEWOBJ makes it (``object.__new__``) and BUILD hands it its
    pickled state, which it keeps as is (no copy into a ``__dict__``); no code of ours or torch's runs
    but this one assignment."""

    __slots__ = ("state",)
    global_name = ""

    def __setstate__(self, state: Any) -> None:
        self.state = state


@dataclass(frozen=True)
class _TorchDtype:
    name: str


@dataclass(frozen=True)
class _StorageClass:
    dtype_name: str | None  # None: torch.storage.UntypedStorage (sizes in bytes)


@dataclass(frozen=True)
class _Storage:
    storage_class: _StorageClass
    key: str
    numel: int


@dataclass(frozen=True)
class _Rebuilt:
    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype_name: str


def _record_class(module: str, name: str) -> type[_Pickled]:
    return type(name, (_Pickled,), {"__slots__": (), "global_name": f"{module}.{name}"})


_RECORD_CLASSES: dict[tuple[str, str], type[_Pickled]] = {
    (module, name): _record_class(module, name)
    for module, names in (
        (
            _META,
            (
                "Metadata",
                "TensorStorageMetadata",
                "TensorProperties",
                "ChunkStorageMetadata",
                "MetadataIndex",
                "StorageMeta",
                "BytesStorageMetadata",
            ),
        ),
        (_FILESYSTEM, ("_StorageInfo",)),
        (_PLANNER, ("SavePlan", "WriteItem", "TensorWriteData")),
    )
    for name in names
}


def _int_tuple(values: Any) -> tuple[int, ...]:
    items = tuple(values)
    if items and set(map(type, items)) != _INT_ONLY:
        raise ValueError(f"a size of non-integers {items!r}")
    return items


_INT_ONLY = {int}


def _int_tuples(values: list[Any]) -> list[tuple[int, ...]]:
    """Many ``_int_tuple`` at once (checked in bulk when they are tuples already, as torch.Size makes them)."""
    if set(map(type, values)) <= {tuple} and set(map(type, itertools.chain.from_iterable(values))) <= _INT_ONLY:
        return values
    return [_int_tuple(v) for v in values]


def _layout(name: Any) -> str:
    return str(name)


def _enum_value(value: Any) -> Any:
    return value


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


_TORCH_DTYPE_NAMES = frozenset(d.numpy_name for d in dtypes.ALL if d not in (dtypes.INT4, dtypes.STR))

_METADATA_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): tuple,  # checked where used as a shape, offsets or sizes
    ("torch.serialization", "_get_layout"): _layout,
    (_META, "_MEM_FORMAT_ENCODING"): _enum_value,
    (_PLANNER, "WriteItemType"): _enum_value,
    **{("pathlib", n): _path for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``: the DCP classes as inert records, ``torch.Size`` as tuples."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORD_CLASSES:
            return _RECORD_CLASSES[(module, name)]
        if (module, name) in _METADATA_FUNCTIONS:
            return _METADATA_FUNCTIONS[(module, name)]
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return _TorchDtype(name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


class _Refused(pickle.UnpicklingError):
    """A global outside the allowlist (the message is its dotted name)."""


# torch.save's legacy typed storage classes; dtypes without one are saved as UntypedStorage (v3).
_STORAGE_CLASSES: dict[str, str] = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}
_DTYPE_OF_STORAGE = {cls: name for name, cls in _STORAGE_CLASSES.items()}


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage) or storage.storage_class.dtype_name is None:
        raise ValueError("_rebuild_tensor_v2 without a typed storage")
    return _Rebuilt(storage, int(offset), _int_tuple(size), _int_tuple(stride), storage.storage_class.dtype_name)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_: Any
) -> _Rebuilt:
    if not isinstance(storage, _Storage) or not isinstance(dtype, _TorchDtype):
        raise ValueError("_rebuild_tensor_v3 without a storage and a dtype")
    return _Rebuilt(storage, int(offset), _int_tuple(size), _int_tuple(stride), dtype.name)


def _no_hooks(*args: Any) -> dict[str, Any]:
    if args:
        raise ValueError("backward hooks in a saved tensor")
    return {}


class _TensorUnpickler(pickle.Unpickler):
    """Reads the ``data.pkl`` of a ``torch.save`` archive holding one tensor."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return _no_hooks
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageClass(None)
        if module == "torch" and name in _DTYPE_OF_STORAGE:
            return _StorageClass(_DTYPE_OF_STORAGE[name])
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return _TorchDtype(name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError("a persistent id that is not a storage")
        _, storage_class, key, _location, numel = pid
        if not isinstance(storage_class, _StorageClass) or not isinstance(key, str) or type(numel) is not int:
            raise ValueError("a malformed storage id")
        return _Storage(storage_class, key, numel)


_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    struct.error,
    RecursionError,
    MemoryError,
    OverflowError,
    UnicodeDecodeError,
)


def _unpickle(unpickler: type[pickle.Unpickler], data: bytes, path: str, what: str) -> Any:
    """Unpickle ``data`` from a ``_PickleInput``."""
    try:
        return unpickler(_PickleInput(data)).load()
    except _Refused as exc:
        raise FormatError(
            f"{what} names {exc}, which a DCP checkpoint never does: refused, nothing run", path
        ) from None
    except _UNPICKLE_ERRORS as exc:
        raise FormatError(f"{what} is not a DCP pickle: {first_line(exc)}", path) from None


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


class _PickleInput:
    """The pickle's bytes as the file the C unpickler reads. With ``peek`` it takes them in blocks of
    128 KiB (over ``io.BytesIO`` it calls ``read`` once per opcode: 3x slower); ``read`` never hands
    out more than there is, so a length field of a corrupt pickle allocates nothing."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def peek(self, size: int = 1) -> bytes:
        return self._data[self._pos : self._pos + max(size, 1)]

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else min(len(self._data), self._pos + size)
        block = self._data[self._pos : end]
        self._pos = end
        return block

    def readline(self) -> bytes:
        end = self._data.find(b"\n", self._pos)
        return self.read(-1 if end < 0 else end + 1 - self._pos)


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
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
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


def _build_metadata(top: Any, folder: str, path: str) -> DcpMetadata:
    state = _state(top, f"{_META}.Metadata", path)
    entries = state.get("state_dict_metadata")
    storage = state.get("storage_data")
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise FormatError("metadata has no state_dict_metadata / storage_data dictionaries", path)
    where = _storage_index(storage, path)
    del storage, state
    tensors: dict[str, TensorMeta] = {}
    byte_items: dict[str, BytesItem] = {}
    planner = top.state.get("planner_data")
    version = top.state.get("version")
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise FormatError(f"state dict key {fqn!r} is not a string", path)
        if isinstance(entry, _Pickled) and entry.global_name == f"{_META}.BytesStorageMetadata":
            row = where.rows.get((fqn, None))
            if row is None:
                raise FormatError(f"value {fqn!r} has no storage entry", path)
            byte_items[fqn] = BytesItem(fqn, *where.item(row))
        else:
            tensors[fqn] = _tensor_meta(fqn, _state(entry, f"{_META}.TensorStorageMetadata", path), where, path)
    return DcpMetadata(folder, tensors, byte_items, planner, version if isinstance(version, str) else None)


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


def _tensor_meta(fqn: str, state: Any, where: _StorageColumns, path: str) -> TensorMeta:
    props = _state(state.get("properties"), f"{_META}.TensorProperties", path, tuple)
    if len(props) != 5:
        raise FormatError(f"tensor {fqn!r} has properties in an unknown form", path)
    torch_dtype, layout, requires_grad, _memory_format, _pinned = props
    if not isinstance(torch_dtype, _TorchDtype):
        raise FormatError(f"tensor {fqn!r} has no dtype", path)
    if layout != "torch.strided":
        raise UnsupportedError(f"tensor {fqn!r} has layout {layout} (reshard reads dense tensors only)", path)
    dtype = dtypes.from_torch_name(torch_dtype.name, path)
    shape = _int_tuple(state.get("size", ()))
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
    meta = TensorMeta(fqn, dtype, shape, table, bool(requires_grad))
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
    for tensor in meta.tensors.values():
        table = tensor.table
        room = np.array([sizes[rel] for rel in table.files], dtype=np.int64)[table.file_ids] - table.starts
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


# ------------------------------------------------------------------------------ data files


def index_distcp(meta: DcpMetadata, relative_path: str) -> TensorIndex:
    """The chunks stored in one data file as a ``TensorIndex`` (entries named ``chunk_name``), zero-copy.

    Each chunk's serialization is recognised at its item's offset; its tensor bytes are located
    without unpickling anything but the allowlisted ``data.pkl``. Raises ``FormatError`` naming the
    file when an item is not what the metadata says (dtype, shape, a view that is not contiguous,
    members compressed or past the item's end).
    """
    path = os.path.join(meta.folder, relative_path)
    buffer, closer, size = map_file(path)
    try:
        chunks = [(t, t.table.chunk(t.fqn, int(row))) for t, rows in meta.chunks_in(relative_path) for row in rows]
        blobs: dict[int, _SafetensorsBlob] = {}
        entries: dict[str, TensorEntry] = {}
        for tensor, chunk in chunks:
            if chunk.offset + chunk.length > size:
                raise FormatError(f"{chunk.name!r} runs past the end of the file (truncated)", path)
            if bytes(buffer[chunk.offset : chunk.offset + 4]) == _ZIP_LOCAL:
                segment = _torch_save_segment(buffer, tensor, chunk, path)
            else:
                if chunk.offset not in blobs:
                    blobs[chunk.offset] = _safetensors_blob(buffer, chunk.offset, size, path)
                segment = blobs[chunk.offset].segment(tensor, chunk, path)
            entries[chunk.name] = TensorEntry(chunk.name, tensor.dtype, chunk.sizes, (segment,))
    except BaseException:
        closer()
        raise
    return TensorIndex(path, FORMAT, buffer, entries, {}, closer, file_backed=True)


def open_distcp(path: str | os.PathLike[str]) -> TensorIndex:
    """Index one ``.distcp`` file by its path alone (as every other reader is opened): its folder's
    ``.metadata`` says what it holds. The metadata of the last few folders is kept, keyed by its
    size and modification time, so opening each of a checkpoint's files reads the pickle once."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    try:
        stat = os.stat(os.path.join(folder, METADATA_NAME))
    except OSError as exc:
        raise FormatError(f"no {METADATA_NAME} beside it ({exc.strerror})", path) from None
    meta = _cached_metadata(folder, stat.st_size, stat.st_mtime_ns)
    if name not in meta.files:
        raise FormatError(f"{METADATA_NAME} of its folder names no chunk or value in it", path)
    return index_distcp(meta, name)


@functools.lru_cache(maxsize=4)
def _cached_metadata(folder: str, _size: int, _mtime_ns: int) -> DcpMetadata:
    return read_dcp_metadata(folder)


def serialization_of(meta: DcpMetadata, relative_path: str) -> str | None:
    """``torch_save`` or ``safetensors`` for a data file with tensors (None for values only)."""
    for tensor, rows in meta.chunks_in(relative_path):
        with open(os.path.join(meta.folder, relative_path), "rb") as fh:
            fh.seek(int(tensor.table.starts[rows[0]]))
            return TORCH_SAVE if fh.read(4) == _ZIP_LOCAL else SAFETENSORS
    return None


class _BoundedView(io.RawIOBase):
    """A read-only, seekable file over ``buffer[start:start + length]`` (one chunk's ZIP archive)."""

    def __init__(self, buffer: Any, start: int, length: int) -> None:
        self._view = memoryview(buffer)[start : start + length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        data = self._view[self._pos : self._pos + len(target)]
        target[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the archive")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._view.release()
        super().close()


def _torch_save_segment(buffer: Any, tensor: TensorMeta, chunk: Chunk, path: str) -> Segment:
    what = f"chunk {chunk.name!r} (bytes {chunk.offset}..{chunk.offset + chunk.length})"
    view = _BoundedView(buffer, chunk.offset, chunk.length)
    try:
        archive = zipfile.ZipFile(view)
        members = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in members if name == "data.pkl" or name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise FormatError(f"{what} is a ZIP archive without one data.pkl", path)
        info = members[pickles[0]]
        if info.file_size > _MAX_PICKLE_MEMBER:
            raise FormatError(f"{what} has a data.pkl of {info.file_size} bytes (one tensor's is tiny)", path)
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
            raise FormatError(f"{what} has a compressed or encrypted data.pkl (torch stores it plainly)", path)
        rebuilt = _unpickle(_TensorUnpickler, archive.read(info), path, f"the data.pkl of {what}")
        prefix = pickles[0][: -len("data.pkl")]
        if not isinstance(rebuilt, _Rebuilt):
            raise FormatError(f"{what} does not hold a tensor", path)
        member = members.get(f"{prefix}data/{rebuilt.storage.key}")
        if member is None:
            raise FormatError(f"{what} has no storage member data/{rebuilt.storage.key}", path)
        start = _member_data_offset(buffer, chunk, member, path, what)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        OSError,
        EOFError,
        ValueError,
        struct.error,
        NotImplementedError,
    ) as exc:
        raise FormatError(f"{what} is not a torch.save archive: {first_line(exc)}", path) from None
    finally:
        view.close()
    return _view_segment(tensor, chunk, rebuilt, member.file_size, start, path, what)


def _member_data_offset(buffer: Any, chunk: Chunk, member: zipfile.ZipInfo, path: str, what: str) -> int:
    if member.compress_type != zipfile.ZIP_STORED or member.compress_size != member.file_size:
        raise FormatError(f"{what} has a compressed storage member (torch stores them uncompressed)", path)
    local = chunk.offset + member.header_offset
    header = bytes(buffer[local : local + 30])
    if len(header) < 30 or header[:4] != _ZIP_LOCAL:
        raise FormatError(f"{what} has a storage member whose local header is missing", path)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = local + 30 + name_len + extra_len
    if start + member.file_size > chunk.offset + chunk.length:
        raise FormatError(f"{what} has a storage member running past the chunk's end", path)
    return start


def _view_segment(
    tensor: TensorMeta, chunk: Chunk, rebuilt: _Rebuilt, storage_bytes: int, start: int, path: str, what: str
) -> Segment:
    dtype = dtypes.from_torch_name(rebuilt.dtype_name, path)
    if dtype is not tensor.dtype:
        raise FormatError(
            f"{what} holds {rebuilt.dtype_name}, the metadata says {dtypes.torch_name(tensor.dtype)}", path
        )
    if rebuilt.size != chunk.sizes:
        raise FormatError(
            f"{what} holds a tensor of shape {list(rebuilt.size)}, the metadata says {list(chunk.sizes)}", path
        )
    itemsize = dtype.itemsize
    declared = rebuilt.storage.numel * (itemsize if rebuilt.storage.storage_class.dtype_name else 1)
    if declared != storage_bytes:
        raise FormatError(f"{what} has a storage of {storage_bytes} bytes, its data.pkl says {declared}", path)
    if not _contiguous(rebuilt.size, rebuilt.stride):
        raise UnsupportedError(
            f"{what} is a non-contiguous view (strides {list(rebuilt.stride)}), which reshard does not read", path
        )
    nbytes = chunk.numel * itemsize
    if rebuilt.storage_offset < 0 or rebuilt.storage_offset * itemsize + nbytes > storage_bytes:
        raise FormatError(f"{what} views bytes outside its storage", path)
    return (start + rebuilt.storage_offset * itemsize, nbytes)


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if len(size) != len(stride):
        return False
    expected = 1
    for dim, step in zip(reversed(size), reversed(stride), strict=True):
        if dim != 1 and step != expected:
            return dim == 0 or math.prod(size) == 0
        expected *= dim
    return True


@dataclass(frozen=True)
class _SafetensorsBlob:
    """The safetensors serialization's blob at one offset of a data file: fqn -> (dtype, shape, data)."""

    entries: dict[str, tuple[str, tuple[int, ...], int, int]]  # fqn -> (code, shape, abs start, end)
    saved_offsets: dict[str, tuple[int, ...]]

    def segment(self, tensor: TensorMeta, chunk: Chunk, path: str) -> Segment:
        what = f"chunk {chunk.name!r}"
        entry = self.entries.get(chunk.fqn)
        if entry is None:
            raise FormatError(f"{what} is not in the safetensors data at byte {chunk.offset}", path)
        code, shape, start, end = entry
        if dtypes.from_st_code(code, path) is not tensor.dtype and not (code == "I8" and tensor.dtype is dtypes.INT8):
            raise FormatError(f"{what} is stored as {code}, the metadata says {dtypes.torch_name(tensor.dtype)}", path)
        if shape != chunk.sizes or self.saved_offsets.get(chunk.fqn, chunk.offsets) != chunk.offsets:
            raise FormatError(
                f"{what} is stored with shape {list(shape)} at other offsets than the metadata says", path
            )
        if end - start != chunk.numel * tensor.dtype.itemsize or end - start != chunk.length:
            raise FormatError(f"{what} has {end - start} stored bytes, the metadata says {chunk.length}", path)
        return (start, end - start)


def _safetensors_blob(buffer: Any, offset: int, size: int, path: str) -> _SafetensorsBlob:
    what = f"the data at byte {offset}"
    if offset + 8 > size:
        raise FormatError(f"{what} is neither a torch.save archive nor safetensors (truncated)", path)
    (header_len,) = struct.unpack("<Q", buffer[offset : offset + 8])
    if header_len > 100_000_000 or offset + 8 + header_len > size:
        raise FormatError(f"{what} is neither a torch.save archive nor safetensors", path)
    try:
        header = json.loads(bytes(buffer[offset + 8 : offset + 8 + header_len]).decode("utf-8"))
        meta = header.pop("__metadata__", None) or {}
        saved = {k: _int_tuple(v["saved_offsets"]) for k, v in json.loads(meta.get(SHARDING_INFO_KEY, "{}")).items()}
        data = offset + 8 + header_len
        entries = {}
        for name, info in header.items():
            begin, end = (int(x) for x in info["data_offsets"])
            if not 0 <= begin <= end or data + end > size:
                raise ValueError(f"tensor {name!r} lies outside the file")
            entries[name] = (str(info["dtype"]), _int_tuple(info["shape"]), data + begin, data + end)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise FormatError(
            f"{what} is neither a torch.save archive nor DCP safetensors: {first_line(exc)}", path
        ) from None
    return _SafetensorsBlob(entries, saved)


def read_bytes_item(meta: DcpMetadata, fqn: str) -> bytes:
    """The opaque bytes of a non-tensor value (never unpickled)."""
    item = meta.byte_items[fqn]
    path = os.path.join(meta.folder, item.file)
    try:
        with open(path, "rb") as fh:
            fh.seek(item.offset)
            data = fh.read(item.length)
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", path) from None
    if len(data) != item.length:
        raise FormatError(f"value {fqn!r} runs past the end of the file (truncated)", path)
    return data


# ---------------------------------------------------------------------------------- pickles out


class _PickleOut:
    """Emits pickle opcodes (protocol 2) naming globals by module and name; memoizes globals and strings."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self._memo: dict[tuple[str, Any], int] = {}

    def _remember(self, key: tuple[str, Any]) -> None:
        index = len(self._memo)
        self._memo[key] = index
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def _recall(self, key: tuple[str, Any]) -> bool:
        index = self._memo.get(key)
        if index is None:
            return False
        self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
        return True

    def global_(self, module: str, name: str) -> None:
        if not self._recall(("global", (module, name))):
            self.out += b"c" + f"{module}\n{name}\n".encode("ascii")
            self._remember(("global", (module, name)))

    def value(self, value: Any) -> None:
        """A plain value: None, bool, int, float, str, tuple, list, dict (of plain values)."""
        if value is None:
            self.out += b"N"
        elif value is True or value is False:
            self.out += b"\x88" if value else b"\x89"
        elif type(value) is int:
            self.int_(value)
        elif type(value) is float:
            self.out += b"G" + struct.pack(">d", value)
        elif type(value) is str:
            self.str_(value)
        elif type(value) in (tuple, list):
            self.out += b"(" if type(value) is tuple else b"]("
            for item in value:
                self.value(item)
            self.out += b"t" if type(value) is tuple else b"e"
        elif type(value) is dict:
            self.out += b"}("
            for key, item in value.items():
                self.value(key)
                self.value(item)
            self.out += b"u"
        else:
            raise UsageError(f"cannot write {type(value).__name__} values into a DCP pickle")

    def int_(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def str_(self, value: str) -> None:
        if self._recall(("str", value)):
            return
        raw = value.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw
        self._remember(("str", value))

    def obj(self, module: str, name: str, state: Callable[[], None] | None) -> None:
        """``module.name`` made by NEWOBJ with no arguments, then BUILD with the state ``state`` emits (if any)."""
        self.global_(module, name)
        self.out += b")\x81"
        if state is not None:
            state()
            self.out += b"b"

    def call(self, module: str, name: str, *args: Any) -> None:
        """``module.name(*args)`` (REDUCE) with plain arguments."""
        self.global_(module, name)
        self.value(tuple(args))
        self.out += b"R"

    def size(self, values: Sequence[int]) -> None:
        self.call("torch", "Size", tuple(int(v) for v in values))

    def done(self) -> bytes:
        return bytes(self.out + b".")


def tensor_pickle(dtype: DType, shape: Sequence[int]) -> bytes:
    """The ``data.pkl`` torch.save writes for a contiguous tensor in storage ``0`` of its own size."""
    name = dtypes.torch_name(dtype)
    numel = math.prod(shape)
    strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    out = _PickleOut()
    typed = _STORAGE_CLASSES.get(name)
    out.global_("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3")
    out.out += b"(("
    out.str_("storage")
    if typed:
        out.global_("torch", typed)
    else:
        out.global_("torch.storage", "UntypedStorage")
    out.str_("0")
    out.str_("cpu")
    out.int_(numel if typed else numel * dtype.itemsize)
    out.out += b"tQ"  # the persistent id tuple, BINPERSID
    out.int_(0)
    out.value(tuple(int(d) for d in shape))
    out.value(tuple(strides))
    out.out += b"\x89"
    out.call("collections", "OrderedDict")
    if not typed:
        out.global_("torch", name)
    out.out += b"tR"
    return out.done()


# -------------------------------------------------------------------------------- ZIP archives out

_ZIP64_AT = 0xFFFFFFFF  # sizes and offsets from here on need ZIP64 records
_ALIGN = 64  # torch.save aligns storage members to 64 bytes from the archive's start
_ARCHIVE = "archive"  # the record prefix torch.save uses for streams


@dataclass(frozen=True)
class _Member:
    name: str
    offset: int  # of its local header, from the archive's start
    data_start: int  # of its data, from the archive's start
    size: int
    crc: int | None  # None: the storage member, patched in after the data is written
    zip64: bool


@dataclass(frozen=True)
class _ArchivePlan:
    """One chunk's ZIP archive: framing pieces (relative offsets), where ``data/0`` goes, its CRC fields."""

    size: int
    framing: tuple[tuple[int, bytes], ...]
    data: Segment  # relative to the archive's start
    crc_fields: tuple[int, ...]  # relative offsets of the storage member's two CRC-32 fields


def _local_header(member: _Member, pad: int) -> bytes:
    name = member.name.encode("ascii")
    size32 = 0xFFFFFFFF if member.zip64 else member.size
    extra = struct.pack("<HHQQ", 1, 16, member.size, member.size) if member.zip64 else b""
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": torch.save's alignment padding
    version = 45 if member.zip64 else 20
    fixed = struct.pack(
        "<4sHHHHHIIIHH", _ZIP_LOCAL, version, 0, 0, 0, 0, member.crc or 0, size32, size32, len(name), len(extra)
    )
    return fixed + name + extra


def _central_entry(member: _Member) -> bytes:
    name = member.name.encode("ascii")
    big_size = member.zip64
    big_offset = member.offset >= _ZIP64_AT
    fields: tuple[int, ...] = (member.size, member.size) if big_size else ()
    fields += (member.offset,) if big_offset else ()
    extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    version = 45 if fields else 20
    size32 = 0xFFFFFFFF if big_size else member.size
    offset32 = 0xFFFFFFFF if big_offset else member.offset
    return struct.pack(
        "<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", version, version, 0, 0, 0, 0, member.crc or 0, size32, size32,
        len(name), len(extra), 0, 0, 0, 0, offset32,
    ) + name + extra  # fmt: skip


def _end_records(count: int, cd_start: int, cd_size: int) -> bytes:
    if count < 0xFFFF and cd_start < _ZIP64_AT and cd_size < _ZIP64_AT:
        return struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_start, 0)
    zip64_end = struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, cd_size, cd_start)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, cd_start + cd_size, 1)
    plain = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return zip64_end + locator + plain


def _archive_plan(dtype: DType, sizes: Sequence[int]) -> _ArchivePlan:
    """The ZIP archive ``torch.save`` would write for one contiguous chunk, before its data exists."""
    nbytes = math.prod(sizes) * dtype.itemsize
    records: list[tuple[str, bytes | None, int]] = [
        ("data.pkl", tensor_pickle(dtype, sizes), 0),
        (".format_version", b"1", 0),
        (".storage_alignment", str(_ALIGN).encode(), 0),
        ("byteorder", b"little", 0),
        ("data/0", None, nbytes),
        ("version", b"3\n", 0),
    ]
    framing: list[tuple[int, bytes]] = []
    members: list[_Member] = []
    pos = 0
    for name, content, size in records:
        full = f"{_ARCHIVE}/{name}"
        size = len(content) if content is not None else size
        zip64 = size >= _ZIP64_AT
        fixed = 30 + len(full) + (20 if zip64 else 0) + 4
        pad = (-(pos + fixed)) % _ALIGN
        member = _Member(full, pos, pos + fixed + pad, size, None if content is None else zlib.crc32(content), zip64)
        members.append(member)
        framing.append((pos, _local_header(member, pad)))
        if content is not None:
            framing.append((member.data_start, content))
        pos = member.data_start + size
    central = b"".join(_central_entry(m) for m in members)
    framing.append((pos, central + _end_records(len(members), pos, len(central))))
    storage = members[4]
    central_crc = pos + sum(len(_central_entry(m)) for m in members[:4]) + 16
    crc_fields = (storage.offset + 14, central_crc)  # the CRC-32 of a local header / a central entry
    return _ArchivePlan(pos + len(framing[-1][1]), tuple(framing), (storage.data_start, nbytes), crc_fields)


# -------------------------------------------------------------------------------- data files out


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk to write: a box (``offsets``, ``sizes``) of global tensor ``fqn`` (``shape``, ``dtype``)."""

    fqn: str
    dtype: DType
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def name(self) -> str:
        return chunk_name(self.fqn, self.offsets)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


def bytes_name(fqn: str) -> str:
    """The placement name of a non-tensor value in a ``DistcpLayout`` (never a chunk's name)."""
    return f"{fqn}@bytes"


@dataclass(frozen=True)
class DistcpLayout:
    """Every byte position of one ``.distcp`` file, and the storage facts its ``.metadata`` entries need.

    ``layout.placements`` maps ``chunk_name`` of each chunk to where its raw C-order bytes go, and
    ``bytes_name`` of each value to where its opaque bytes go (values first, then chunks, as torch).
    """

    relative_path: str
    layout: ByteLayout
    chunks: tuple[Chunk, ...]
    byte_items: tuple[BytesItem, ...]
    crc_fields: tuple[tuple[Segment, tuple[int, ...]], ...] = field(repr=False, default=())


def distcp_layout(
    relative_path: str, chunks: Sequence[ChunkSpec], values: Sequence[tuple[str, int]] = ()
) -> DistcpLayout:
    """Lay out one data file: ``values`` (fqn, byte length) as opaque bytes, then each chunk as a torch.save archive."""
    if not _inside_folder(relative_path):
        raise UsageError(f"data file {relative_path!r} is not a path inside the checkpoint folder")
    framing: list[tuple[int, bytes]] = []
    placements: dict[str, tuple[Segment, ...]] = {}
    items: list[BytesItem] = []
    stored: list[Chunk] = []
    crc_fields: list[tuple[Segment, tuple[int, ...]]] = []
    pos = 0
    for fqn, length in values:
        placements[bytes_name(fqn)] = ((pos, length),)
        items.append(BytesItem(fqn, relative_path, pos, length))
        pos += length
    for spec in chunks:
        _check_spec(spec)
        if spec.name in placements:
            raise UsageError(f"chunk {spec.name!r} is written twice into {relative_path}")
        plan = _archive_plan(spec.dtype, spec.sizes)
        framing.extend((pos + offset, data) for offset, data in plan.framing)
        data = (pos + plan.data[0], plan.data[1])
        placements[spec.name] = (data,)
        crc_fields.append((data, tuple(pos + f for f in plan.crc_fields)))
        stored.append(Chunk(spec.fqn, spec.offsets, spec.sizes, relative_path, pos, plan.size))
        pos += plan.size
    layout = ByteLayout(pos, tuple(framing), placements, tuple(placements))
    return DistcpLayout(relative_path, layout, tuple(stored), tuple(items), tuple(crc_fields))


def _check_spec(spec: ChunkSpec) -> None:
    dtypes.torch_name(spec.dtype)
    rank = len(spec.shape)
    if (
        len(spec.offsets) != rank
        or len(spec.sizes) != rank
        or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(spec.offsets, spec.sizes, spec.shape, strict=True))
    ):
        raise UsageError(f"chunk {spec.name!r} of {list(spec.sizes)} does not fit in shape {list(spec.shape)}")


_CRC_BLOCK = 8 << 20


def distcp_finish(planned: DistcpLayout) -> Callable[[int, ByteLayout], None]:
    """A ``write_file`` finish step: the CRC-32 of every written ``data/0``, patched into its ZIP records."""

    def finish(fd: int, _layout: ByteLayout) -> None:
        for (start, length), positions in planned.crc_fields:
            crc = 0
            done = 0
            while done < length:
                block = os.pread(fd, min(_CRC_BLOCK, length - done), start + done)
                if not block:
                    raise OSError(f"short read at {start + done}")
                crc = zlib.crc32(block, crc)
                done += len(block)
            for position in positions:
                pwrite_all(fd, struct.pack("<I", crc), position)

    return finish


def write_distcp(
    folder: str | os.PathLike[str], planned: DistcpLayout, fill: Callable[[int, ByteLayout], None]
) -> None:
    """Write one data file atomically: framing, ``fill`` puts every placement's bytes, then the CRCs."""
    write_file(os.path.join(os.fspath(folder), planned.relative_path), planned.layout, fill, distcp_finish(planned))


# ------------------------------------------------------------------------------ metadata out


def metadata_pickle(
    tensors: Sequence[TensorMeta], byte_items: Sequence[BytesItem], planner_data: Any = None, version: str = DCP_VERSION
) -> bytes:
    """The ``.metadata`` pickle of a checkpoint, naming the globals torch's own has."""
    out = _PickleOut()

    def state() -> None:
        out.out += b"}("
        out.str_("state_dict_metadata")
        out.out += b"}("
        for tensor in tensors:
            out.str_(tensor.fqn)
            out.obj(_META, "TensorStorageMetadata", functools.partial(_tensor_state, out, tensor))
        for item in byte_items:
            out.str_(item.fqn)
            out.obj(_META, "BytesStorageMetadata", None)
        out.out += b"u"
        out.str_("planner_data")
        fqns = [t.fqn for t in tensors] + [b.fqn for b in byte_items]
        out.value(planner_data if planner_data is not None else {fqn: (fqn,) for fqn in fqns})
        out.str_("storage_data")
        out.out += b"}("
        for tensor in tensors:
            for index, chunk in enumerate(tensor.chunks):
                _storage_entry(out, chunk.fqn, chunk.offsets, index, chunk)
        for item in byte_items:
            _storage_entry(out, item.fqn, None, None, item)
        out.out += b"u"
        out.str_("storage_meta")
        out.value(None)
        out.str_("version")
        out.value(version)
        out.out += b"u"

    out.obj(_META, "Metadata", state)
    return out.done()


def _tensor_state(out: _PickleOut, tensor: TensorMeta) -> None:
    def properties() -> None:
        out.out += b"("
        out.global_("torch", dtypes.torch_name(tensor.dtype))
        out.call("torch.serialization", "_get_layout", "torch.strided")
        out.value(tensor.requires_grad)
        out.call(_META, "_MEM_FORMAT_ENCODING", 0)
        out.value(False)
        out.out += b"t"

    out.out += b"}("
    out.str_("properties")
    out.obj(_META, "TensorProperties", properties)
    out.str_("size")
    out.size(tensor.shape)
    out.str_("chunks")
    out.out += b"]("
    for chunk in tensor.chunks:
        out.obj(_META, "ChunkStorageMetadata", functools.partial(_chunk_state, out, chunk))
    out.out += b"eu"


def _chunk_state(out: _PickleOut, chunk: Chunk) -> None:
    out.out += b"}("
    out.str_("offsets")
    out.size(chunk.offsets)
    out.str_("sizes")
    out.size(chunk.sizes)
    out.out += b"u"


def _storage_entry(
    out: _PickleOut, fqn: str, offsets: tuple[int, ...] | None, index: int | None, item: Chunk | BytesItem
) -> None:
    def key() -> None:
        out.out += b"}("
        out.str_("fqn")
        out.str_(fqn)
        out.str_("index")
        out.value(index)
        out.str_("offset")
        if offsets is None:
            out.value(None)
        else:
            out.size(offsets)
        out.out += b"u"

    def info() -> None:
        out.out += b"}("
        out.str_("relative_path")
        out.str_(item.file)
        out.str_("offset")
        out.int_(item.offset)
        out.str_("length")
        out.int_(item.length)
        if item.transforms:  # torch leaves the field out when there are none
            out.str_("transform_descriptors")
            out.value(list(item.transforms))
        out.out += b"u"

    out.obj(_META, "MetadataIndex", key)
    out.obj(_FILESYSTEM, "_StorageInfo", info)


def write_metadata(
    folder: str | os.PathLike[str],
    tensors: Sequence[TensorMeta],
    byte_items: Sequence[BytesItem] = (),
    planner_data: Any = None,
    version: str = DCP_VERSION,
) -> None:
    """Write ``.metadata`` as torch does, last: to ``.metadata.tmp``, synced, then renamed."""
    for tensor in tensors:
        check_chunks(tensor)
    data = metadata_pickle(tensors, byte_items, planner_data, version)
    final = os.path.join(os.fspath(folder), METADATA_NAME)
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ReshardError(f"write failed: {exc.strerror or exc}", final) from exc


def tensors_of(
    layouts: Iterable[DistcpLayout], shapes: Mapping[str, tuple[DType, tuple[int, ...]]]
) -> list[TensorMeta]:
    """The metadata's tensors from the data files' layouts: each fqn's chunks gathered, in first-seen order."""
    gathered: dict[str, list[Chunk]] = {}
    for planned in layouts:
        for chunk in planned.chunks:
            gathered.setdefault(chunk.fqn, []).append(chunk)
    return [TensorMeta(fqn, *shapes[fqn], tuple(chunks)) for fqn, chunks in gathered.items()]


def save_dcp(
    folder: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    files: Mapping[str, Sequence[ChunkSpec | str]],
    values: Mapping[str, bytes] | None = None,
    planner_data: Any = None,
) -> DcpMetadata:
    """Write a DCP checkpoint of in-memory values: per data file its chunks (and fqns of ``values``).

    ``tensors`` holds each global tensor whole (any numpy dtype of the chunks' item size: bf16 may come
    as uint16); each chunk's box is cut from it, and its dtype and shape are the chunk spec's.
    ``values`` are opaque ``torch.save`` bytes of non-tensor entries. Data files first, ``.metadata`` last.
    """
    folder = os.fspath(folder)
    values = values or {}
    os.makedirs(folder, exist_ok=True)
    layouts = []
    for rel, items in files.items():
        chunks = [item for item in items if isinstance(item, ChunkSpec)]
        byte_fqns = [(item, len(values[item])) for item in items if isinstance(item, str)]
        planned = distcp_layout(rel, chunks, byte_fqns)
        contents: dict[str, Any] = {bytes_name(fqn): values[fqn] for fqn, _ in byte_fqns}
        for spec in chunks:
            box = tuple(slice(o, o + s) for o, s in zip(spec.offsets, spec.sizes, strict=True))
            contents[spec.name] = value_bytes(np.ascontiguousarray(tensors[spec.fqn][box]))
        write_distcp(folder, planned, _fill_bytes(contents))
        layouts.append(planned)
    shapes = {
        spec.fqn: (spec.dtype, spec.shape) for items in files.values() for spec in items if isinstance(spec, ChunkSpec)
    }
    metas = tensors_of(layouts, shapes)
    stored = [item for planned in layouts for item in planned.byte_items]
    write_metadata(folder, metas, stored, planner_data)
    return read_dcp_metadata(folder)


def _fill_bytes(contents: Mapping[str, Any]) -> Callable[[int, ByteLayout], None]:
    def fill(fd: int, layout: ByteLayout) -> None:
        for name, segments in layout.placements.items():
            data = memoryview(contents[name]).cast("B")
            ((offset, length),) = segments
            if len(data) != length:
                raise UsageError(f"{name!r} has {len(data)} bytes, its place {length}")
            pwrite_all(fd, data, offset)

    return fill


__all__ = [
    "DATA_SUFFIX",
    "DCP_VERSION",
    "FORMAT",
    "METADATA_NAME",
    "SAFETENSORS",
    "TORCH_SAVE",
    "BytesItem",
    "Chunk",
    "ChunkSpec",
    "ChunkTable",
    "DcpMetadata",
    "DistcpLayout",
    "TensorMeta",
    "bytes_name",
    "check_chunks",
    "chunk_name",
    "collector_paused",
    "distcp_finish",
    "distcp_layout",
    "index_distcp",
    "metadata_pickle",
    "open_distcp",
    "read_bytes_item",
    "read_dcp_metadata",
    "save_dcp",
    "serialization_of",
    "tensor_pickle",
    "tensors_of",
    "write_distcp",
    "write_metadata",
]
