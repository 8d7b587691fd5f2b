"""The allowlisting unpicklers: ``.metadata`` and each chunk's ``data.pkl`` read without ``pickle.load``.

A pickle can run any code and these files come from users: ``find_class`` allows exactly the globals
DCP and ``torch.save`` name, each mapped to an inert stand-in; any other global is one ``FormatError``.
A pickle can also ask for memory: ``opcodes.check_opcodes`` reads every opcode first (no length or
memo index beyond what the file holds), and the stand-ins build nothing larger than their arguments
(``torch.Size`` takes a tuple as it is, a layout name and a dtype are shared values, the path parts
joined are charged against the pickle's size), so a hostile pickle of a few KiB allocates a few
hundred KiB at most before it is refused.
"""

from __future__ import annotations

import itertools
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard import dtypes
from reshard.errors import FormatError
from reshard.formats.dcp.opcodes import check_opcodes
from reshard.formats.dcp.records import _FILESYSTEM, _META, _PLANNER
from reshard.text import first_line

# ------------------------------------------------------------------- allowlisting unpicklers


class _Pickled:
    """An instance of an allowed class: NEWOBJ makes it (``object.__new__``) and BUILD hands it its
    pickled state, which it keeps as is (no copy into a ``__dict__``); no code of ours or torch's runs
    but this one assignment."""

    __slots__ = ("state",)
    global_name = ""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _no_state(self: Any, state: Any) -> None:
    """The BUILD opcode on a stand-in: refused (a shared dtype or storage class would change for every
    later read; a rebuilt tensor would take a size that ``_int_tuple`` never checked)."""
    raise ValueError(f"state given to a {type(self).__name__}, which no DCP pickle does")


# slots: no ``__dict__`` a BUILD opcode could write into; ``__setstate__``: not the one dataclasses add
@dataclass(frozen=True, slots=True)
class _TorchDtype:
    name: str
    __setstate__ = _no_state


@dataclass(frozen=True, slots=True)
class _StorageClass:
    dtype_name: str | None  # None: torch.storage.UntypedStorage (sizes in bytes)
    __setstate__ = _no_state


@dataclass(frozen=True, slots=True)
class _Storage:
    storage_class: _StorageClass
    key: str
    numel: int
    __setstate__ = _no_state


@dataclass(frozen=True, slots=True)
class _Rebuilt:
    storage: _Storage
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype_name: str
    __setstate__ = _no_state


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
    if type(values) not in _SEQUENCES:  # tuple() of a string or a dict would build a tuple per character or key
        raise ValueError(f"a size that is a {type(values).__name__}, not a sequence of integers")
    items = tuple(values)
    if items and set(map(type, items)) != _INT_ONLY:
        raise ValueError(f"a size of non-integers {items!r}")
    return items


_INT_ONLY = {int}
_SEQUENCES = (tuple, list)


def _int_tuples(values: list[Any]) -> list[tuple[int, ...]]:
    """Many ``_int_tuple`` at once (checked in bulk when they are tuples already, as torch.Size makes them)."""
    if set(map(type, values)) <= {tuple} and set(map(type, itertools.chain.from_iterable(values))) <= _INT_ONLY:
        return values
    return [_int_tuple(v) for v in values]


def _size(values: Any) -> Any:
    """``torch.Size(values)``: torch pickles its tuple of ints, taken as it is (its items are checked
    where used as a shape, offsets or sizes); a string or a dict would become a tuple per character."""
    if type(values) is not tuple:
        raise ValueError(f"torch.Size of a {type(values).__name__}")
    return values


_LAYOUT_NAMES = 64  # "torch.strided", "torch.sparse_coo", ...


def _layout(name: Any) -> str:
    if type(name) is not str or len(name) > _LAYOUT_NAMES:
        raise ValueError("a tensor layout that is not a short name")
    return name


def _enum_value(value: Any) -> Any:
    return value


_TORCH_DTYPE_NAMES = frozenset(d.numpy_name for d in dtypes.ALL if d not in (dtypes.INT4, dtypes.STR))
_TORCH_DTYPES = {name: _TorchDtype(name) for name in _TORCH_DTYPE_NAMES}  # one value each, however often named

_METADATA_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    (_META, "_MEM_FORMAT_ENCODING"): _enum_value,
    (_PLANNER, "WriteItemType"): _enum_value,
}
_PATH_CLASSES = frozenset(("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's ``.metadata``: the DCP classes as inert records, ``torch.Size`` as tuples."""

    def __init__(self, file: _PickleInput, pickle_size: int | None = None) -> None:
        super().__init__(file)
        # what the joined path parts may add up to: no more than the pickle (``bulk`` reads it itself)
        self._path_chars = file.size if pickle_size is None else pickle_size

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORD_CLASSES:
            return _RECORD_CLASSES[(module, name)]
        if (module, name) in _METADATA_FUNCTIONS:
            return _METADATA_FUNCTIONS[(module, name)]
        if module == "pathlib" and name in _PATH_CLASSES:
            return self._path
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
        raise _Refused(f"{module}.{name}")

    def _path(self, *parts: Any) -> str:
        """``pathlib.Path(*parts)`` as the text; one part named a thousand times would otherwise make
        a string a thousand times its size, so the joined parts are charged against the pickle's size."""
        if any(type(p) is not str for p in parts):
            raise ValueError("a path of parts that are not strings")
        self._path_chars -= sum(map(len, parts)) + len(parts)
        if self._path_chars < 0:
            raise ValueError("paths longer, together, than the pickle holding them")
        return "/".join(parts)

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
_STORAGE_CLASS_OF = {cls: _StorageClass(name) for cls, name in _DTYPE_OF_STORAGE.items()}
_UNTYPED_STORAGE = _StorageClass(None)


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
            return _UNTYPED_STORAGE
        if module == "torch" and name in _STORAGE_CLASS_OF:
            return _STORAGE_CLASS_OF[name]
        if module == "torch" and name in _TORCH_DTYPES:
            return _TORCH_DTYPES[name]
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
    """Unpickle ``data`` from a ``_PickleInput``, its opcodes checked first (``opcodes``)."""
    try:
        check_opcodes(data)
        return unpickler(_PickleInput(data)).load()
    except _Refused as exc:
        raise FormatError(
            f"{what} names {exc}, which a DCP checkpoint never does: refused, nothing run", path
        ) from None
    except _UNPICKLE_ERRORS as exc:
        raise FormatError(f"{what} is not a DCP pickle: {first_line(exc)}", path) from None


class _PickleInput:
    """The pickle's bytes as the file the C unpickler reads. With ``peek`` it takes them in blocks of
    128 KiB (over ``io.BytesIO`` it calls ``read`` once per opcode: 3x slower); ``read`` never hands
    out more than there is, so a length field of a corrupt pickle allocates nothing."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0
        self.size = len(data)

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


__all__ = []
