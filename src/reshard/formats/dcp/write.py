"""Writing DCP: torch.save archives laid out before any data, CRC-32s patched after, ``.metadata`` last."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import ReshardError, UsageError
from reshard.formats.base import (
    ByteLayout,
    Segment,
    pwrite_all,
    value_bytes,
    write_file,
)
from reshard.formats.dcp.metadata import _inside_folder, check_chunks, read_dcp_metadata
from reshard.formats.dcp.records import (
    _FILESYSTEM,
    _META,
    _ZIP_LOCAL,
    DCP_VERSION,
    METADATA_NAME,
    BytesItem,
    Chunk,
    DcpMetadata,
    TensorMeta,
    chunk_name,
)
from reshard.formats.dcp.unpickling import _STORAGE_CLASSES

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


def archive_size(dtype: DType, sizes: Sequence[int]) -> int:
    """The bytes of the ZIP archive ``torch.save`` writes for one contiguous chunk (``distcp_layout``'s)."""
    return _archive_plan(dtype, tuple(sizes)).size


@functools.lru_cache(maxsize=4096)
def _archive_plan(dtype: DType, sizes: tuple[int, ...]) -> _ArchivePlan:
    """The ZIP archive ``torch.save`` would write for one contiguous chunk, before its data exists.

    Cached: it depends on the dtype and sizes only, and a checkpoint of thousands of ranks has
    millions of chunks of a few sizes (one archive plan was 0.17 ms of Python).
    """
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
        plan = _archive_plan(spec.dtype, tuple(spec.sizes))
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
        for data, positions in planned.crc_fields:
            patch_crc(fd, data, positions)

    return finish


def patch_crc(fd: int, data: tuple[int, int], positions: Sequence[int]) -> None:
    """The CRC-32 of the written ``data`` segment (offset, length) of the file open as ``fd``, written at
    each of ``positions`` (its archive's local header and central directory entry)."""
    start, length = data
    crc = 0
    for at in range(start, start + length, _CRC_BLOCK):
        crc = _crc_of(fd, at, min(_CRC_BLOCK, start + length - at), crc)
    for position in positions:
        pwrite_all(fd, struct.pack("<I", crc), position)


def _crc_of(fd: int, start: int, length: int, crc: int) -> int:
    """``zlib.crc32`` of bytes ``[start, start + length)`` of the file, read through a map of that window
    (no copy into a buffer: ``pread`` of each block cost 0.2 s of system time per GiB), unmapped after."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        window = mmap.mmap(fd, start + length - base, access=mmap.ACCESS_READ, offset=base)
    except (OSError, ValueError):  # not mappable: read it
        block = os.pread(fd, length, start)
        if len(block) != length:
            raise OSError(f"short read at {start + len(block)}") from None
        return zlib.crc32(block, crc)
    with window, memoryview(window) as whole, whole[start - base :] as piece:
        return zlib.crc32(piece, crc)


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
    "ChunkSpec",
    "DistcpLayout",
    "archive_size",
    "bytes_name",
    "distcp_finish",
    "distcp_layout",
    "metadata_pickle",
    "patch_crc",
    "save_dcp",
    "tensor_pickle",
    "tensors_of",
    "write_distcp",
    "write_metadata",
]
