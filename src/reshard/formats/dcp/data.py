"""Reading a ``.distcp`` data file: each chunk a zero-copy tensor (both of torch's serializations), values as bytes."""

from __future__ import annotations

import functools
import io
import json
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from reshard import dtypes
from reshard.errors import FormatError, UnsupportedError
from reshard.formats.base import (
    Segment,
    TensorEntry,
    TensorIndex,
    map_file,
)
from reshard.formats.dcp.metadata import read_dcp_metadata
from reshard.formats.dcp.names import UNFINISHED
from reshard.formats.dcp.records import (
    _MAX_PICKLE_MEMBER,
    _ZIP_LOCAL,
    FORMAT,
    METADATA_NAME,
    SAFETENSORS,
    SHARDING_INFO_KEY,
    TORCH_SAVE,
    Chunk,
    DcpMetadata,
    TensorMeta,
)
from reshard.formats.dcp.unpickling import _int_tuple, _Rebuilt, _TensorUnpickler, _unpickle
from reshard.text import first_line

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
        with _FileBytes(path, size) as heads:
            entries = _index_chunks(meta, relative_path, heads, size, path)
    except BaseException:
        closer()
        raise
    return TensorIndex(path, FORMAT, buffer, entries, {}, closer, file_backed=True)


def _index_chunks(meta: DcpMetadata, relative_path: str, heads: Any, size: int, path: str) -> dict[str, TensorEntry]:
    chunks = [(t, t.table.chunk(t.fqn, int(row))) for t, rows in meta.chunks_in(relative_path) for row in rows]
    blobs: dict[int, _SafetensorsBlob] = {}
    entries: dict[str, TensorEntry] = {}
    for tensor, chunk in chunks:
        if chunk.offset + chunk.length > size:
            raise FormatError(f"{chunk.name!r} runs past the end of the file (truncated)", path)
        if heads[chunk.offset : chunk.offset + 4] == _ZIP_LOCAL:
            segment = _torch_save_segment(heads, tensor, chunk, path)
        else:
            if chunk.offset not in blobs:
                blobs[chunk.offset] = _safetensors_blob(heads, chunk.offset, size, path)
            segment = blobs[chunk.offset].segment(tensor, chunk, path)
        entries[chunk.name] = TensorEntry(chunk.name, tensor.dtype, chunk.sizes, (segment,))
    return entries


class _FileBytes:
    """A data file's bytes for indexing, each slice one ``pread``: the file's map is not touched.

    Why: indexing reads a few records at each chunk's start and end. Through the map, on a cold cache
    each fault read the whole read-around window (8 MiB here) synchronously, 264 MiB of a 1 GiB
    torch_save checkpoint before the first byte was copied (so the map was read ``MADV_RANDOM``); and
    a touch of a page cached in a large folio (the start-up read-ahead reads so) maps all of the folio:
    a dequantize of a 2-file DCP peaked at 189 MiB RSS while indexing, 74 MiB with the reads.
    """

    def __init__(self, path: str, size: int) -> None:
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = size

    def __enter__(self) -> _FileBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, _ = key.indices(self._size)
        return os.pread(self._fd, stop - start, start) if stop > start else b""


def open_distcp(path: str | os.PathLike[str]) -> TensorIndex:
    """Index one ``.distcp`` file by its path alone (as every other reader is opened): its folder's
    ``.metadata`` says what it holds. The metadata of the last few folders is kept, keyed by its
    size and modification time, so opening each of a checkpoint's files reads the pickle once."""
    path = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(path)
    try:
        stat = os.stat(os.path.join(folder, METADATA_NAME))
    except FileNotFoundError:
        raise FormatError(f"no {METADATA_NAME} beside it: {UNFINISHED}", path) from None
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
        self._buffer = buffer
        self._start = start
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        stop = min(self._length, self._pos + len(target))
        data = self._buffer[self._start + self._pos : self._start + stop] if stop > self._pos else b""
        target[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the archive")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


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


__all__ = ["index_distcp", "open_distcp", "read_bytes_item", "serialization_of"]
