"""Format-neutral pieces shared by every reader and writer.

Readers produce a ``TensorIndex``: for every tensor its dtype, shape and the byte *segments* of
its raw little-endian C-order content inside one buffer (a read-only mmap of the file, or the
decrypted plaintext). A tensor has one segment unless the format chunks it (``.ckpt`` splits
tensors over 512 MiB into several records), so ``array()`` is a zero-copy view in the common case.

Writers are split in two steps, which is what lets the executor write a multi-GB output without
building it in memory: ``layout(specs) -> ByteLayout`` computes the final size, the framing bytes
(headers, protobuf keys, lengths) at their offsets, and where each tensor's bytes go; then
``write_file`` preallocates a temporary file, writes the framing, lets a ``fill`` callback put
tensor bytes in place, runs an optional ``finish`` step (crc trailer) and renames atomically.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import FormatError, MissingTensorError, ReshardError, UsageError

if TYPE_CHECKING:
    import numpy as np

Segment = tuple[int, int]  # (offset, length) in bytes


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: where its raw bytes are, in tensor byte order."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.segments)

    @property
    def is_string(self) -> bool:
        return self.dtype is dtypes.STR


@dataclass
class TensorIndex:
    """The tensors of one checkpoint file, in file order, over a read-only buffer."""

    path: str
    format: str  # the format's name in ``formats.registry`` ("ckpt", "safetensors", ...)
    buffer: Any  # mmap.mmap | bytes | memoryview: supports the buffer protocol
    entries: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    _closer: Callable[[], None] | None = None
    # True when segment offsets are offsets in the file at ``path`` itself (not in decrypted
    # plaintext): executors may then copy bytes kernel-side (``splice``, ``copy_file_range``) from the file.
    file_backed: bool = False

    def __enter__(self) -> TensorIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            with contextlib.suppress(BufferError):  # live numpy views keep the map alive
                closer()

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``.

        Raises:
            MissingTensorError: The file holds no tensor of that name (a ``UsageError`` and a ``KeyError``),
                naming the closest names it does hold.
        """
        try:
            return self.entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            pass
        import difflib

        close = difflib.get_close_matches(name, list(self.entries), n=3) if isinstance(name, str) else []
        hint = (
            f" (did you mean {', '.join(map(repr, close))}?)"
            if close
            else f" (its {len(self.entries)} names are in .entries)"
        )
        raise MissingTensorError(f"no tensor named {name!r} in this checkpoint{hint}", self.path) from None

    def raw(self, name: str) -> memoryview | bytes:
        """The raw bytes of a tensor: a zero-copy memoryview when it is one segment."""
        entry = self.entry(name)
        view = memoryview(self.buffer)
        if len(entry.segments) == 1:
            offset, length = entry.segments[0]
            return view[offset : offset + length]
        return b"".join(view[o : o + n] for o, n in entry.segments)

    def array(self, name: str) -> np.ndarray:
        """A read-only numpy array of the tensor (zero-copy unless chunked)."""
        entry = self.entry(name)
        if entry.is_string:
            raise UsageError(f"{name!r} is a string, not a tensor", self.path)
        import numpy as np  # numpy loads with the first array: a byte move never needs one

        data = np.frombuffer(self.raw(name), dtype=entry.dtype.numpy)
        return data.reshape(entry.shape)

    def items(self, name: str) -> np.ndarray:
        """The tensor's elements as their ``DType.carrier``: what a byte move copies, no ``ml_dtypes`` needed.

        Identical to ``array`` for numpy's builtin dtypes; bf16/fp8 come as unsigned integers of their size.
        """
        entry = self.entry(name)
        if entry.is_string:
            raise UsageError(f"{name!r} is a string, not a tensor", self.path)
        import numpy as np

        return np.frombuffer(self.raw(name), dtype=entry.dtype.carrier).reshape(entry.shape)

    def value(self, name: str) -> np.ndarray | str:
        """A tensor as numpy, or a string entry as ``str``."""
        entry = self.entry(name)
        if entry.is_string:
            return decode_string(bytes(self.raw(name)), self.path)
        return self.array(name)


def decode_string(raw: bytes, path: str | None = None) -> str:
    """MindSpore stores strings as UTF-32-LE code points (``np.array(s).tobytes()``)."""
    if len(raw) % 4:
        raise FormatError("string entry length is not a multiple of 4", path)
    try:
        return raw.decode("utf-32-le").rstrip("\x00")
    except UnicodeDecodeError as exc:
        raise FormatError(f"string entry is not valid UTF-32: {exc.reason}", path) from None


def encode_string(value: str) -> bytes:
    """``np.array(s).tobytes()``: an empty string is one NUL code point (MindSpore cannot load 0 bytes)."""
    return value.encode("utf-32-le") if value else bytes(4)


def segment_pieces(segments: tuple[Segment, ...], start: int, length: int) -> Iterator[Segment]:
    """File (offset, length) pieces of tensor bytes ``[start, start + length)`` stored in ``segments``."""
    pos = 0
    for offset, seg_len in segments:
        if length <= 0:
            return
        if start < pos + seg_len:
            skip = max(0, start - pos)
            n = min(seg_len - skip, length)
            yield offset + skip, n
            start += n
            length -= n
        pos += seg_len


@dataclass(frozen=True)
class TensorSpec:
    """What a writer needs to know about one output tensor before any data exists."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int = -1  # computed from shape unless given (strings)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)

    @classmethod
    def of(cls, name: str, value: np.ndarray | str) -> TensorSpec:
        """The spec of an in-memory value (numpy array or python string)."""
        if isinstance(value, str):
            return cls(name, dtypes.STR, (0,), len(encode_string(value)))
        import numpy as np

        arr = np.asarray(value)
        return cls(name, dtypes.from_numpy(arr.dtype), tuple(int(d) for d in arr.shape))


@dataclass(frozen=True)
class ByteLayout:
    """Every byte position of an output file, decided before any tensor data is read."""

    size: int
    framing: tuple[tuple[int, bytes], ...]  # (offset, bytes) of headers / protobuf framing
    placements: dict[str, tuple[Segment, ...]]  # tensor name -> file segments, tensor byte order
    order: tuple[str, ...]  # tensor names in the order the format stores them

    def sealed(self) -> tuple[Segment, ...]:
        """Bytes inside the framing that ``seal`` writes, not final before it (none for most formats)."""
        return ()

    def seal(self, fd: int, name: str) -> tuple[Segment, ...]:
        """Write what tensor ``name``'s written bytes decide (a .distcp archive's ZIP CRC-32s) into the file
        open as ``fd``, and return the segments written: those bytes are final now, so a file is hashed
        while it is written. Nothing for most formats."""
        return ()


def value_bytes(value: np.ndarray | str) -> bytes | memoryview:
    """Raw content of an in-memory value as the formats store it."""
    if isinstance(value, str):
        return encode_string(value)
    import numpy as np

    arr = np.ascontiguousarray(value)
    if arr.dtype.byteorder == ">":  # files are little-endian
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8).data if arr.size else b""


def fill_from_values(values: Mapping[str, np.ndarray | str]) -> Callable[[int, ByteLayout], None]:
    """A ``fill`` callback for ``write_file`` that copies in-memory values into place."""

    def fill(fd: int, layout: ByteLayout) -> None:
        for name, segments in layout.placements.items():
            data = value_bytes(values[name])
            pos = 0
            for offset, length in segments:
                pwrite_all(fd, memoryview(data)[pos : pos + length], offset)
                pos += length

    return fill


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``os.pwrite`` until every byte is written (short writes happen on large buffers)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


TEMP_SUFFIX = ".reshard-tmp"  # temporary outputs are named .<name>.<random>.reshard-tmp
JOURNAL_NAME = ".reshard-journal"  # a run's record of its finished outputs, in its destination (reshard.manifest)
_TEMP_ATTEMPTS = 100  # random names tried before giving up (a clash is already a 1 in 2**32 event)
_NEW_FILE_MODE = 0o666  # what open() asks for: the kernel takes the umask away, as for any new file


def _create_temp(directory: str, name: str) -> str:
    """Create an empty, unique temporary file for output ``name`` in ``directory``; return its path.

    Unlike ``tempfile.mkstemp`` (mode 0o600) it is created with the mode ``open()`` gives a new file:
    0o666 less the process's umask, applied by the kernel, so nothing has to read or change the
    umask (changing it would race with every other thread creating files). The random part comes
    from ``os.urandom``, as ``secrets.token_hex`` takes it (``secrets`` loads OpenSSL through ``hmac``).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_TEMP_ATTEMPTS):
        tmp = os.path.join(directory, f".{name}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
        try:
            os.close(os.open(tmp, flags, _NEW_FILE_MODE))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", directory)


def stale_temps(final: str) -> list[str]:
    """Temporary files beside ``final`` that an earlier attempt at writing it left
    (``.<name>.<random>.reshard-tmp``): a worker killed mid-write cannot remove its own."""
    directory = os.path.dirname(os.path.abspath(final))
    pattern = re.compile(rf"\.{re.escape(os.path.basename(final))}\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if pattern.fullmatch(n))


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temporary path next to ``final``; rename onto it only if the block succeeds.

    The temporary name starts with a dot and ends in ``TEMP_SUFFIX`` so that an interrupted run
    never leaves a file that looks complete.
    """
    final = os.fspath(final)
    directory = os.path.dirname(os.path.abspath(final))
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = _create_temp(directory, os.path.basename(final))
    except OSError as exc:
        raise UsageError(f"cannot write here: {exc.strerror}", final) from None
    try:
        yield tmp
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_whole(path: str | os.PathLike[str], data: bytes | memoryview | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically. Raises ``OSError`` for the caller to word."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)


def holds(path: str | os.PathLike[str], data: bytes | str) -> bool:
    """Whether ``path`` is a file holding exactly ``data`` (text as UTF-8): ``write_whole`` would change
    nothing there (a resumed run leaves such a finishing file as it is)."""
    want = data.encode("utf-8") if isinstance(data, str) else data
    try:
        if os.path.getsize(path) != len(want):
            return False
        with open(path, "rb") as fh:
            return fh.read() == want
    except OSError:
        return False


def write_file(
    path: str | os.PathLike[str],
    layout: ByteLayout,
    fill: Callable[[int, ByteLayout], None],
    finish: Callable[[int, ByteLayout], None] | None = None,
) -> None:
    """Write ``layout`` to ``path`` atomically: preallocate, framing, ``fill`` data, ``finish``."""
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_RDWR)
        try:
            _write_with_errors(fd, layout, fill, finish, os.fspath(path))
        finally:
            os.close(fd)


def _write_with_errors(
    fd: int,
    layout: ByteLayout,
    fill: Callable[[int, ByteLayout], None],
    finish: Callable[[int, ByteLayout], None] | None,
    path: str,
) -> None:
    try:
        os.ftruncate(fd, layout.size)
        preallocate(fd, layout.size)
        for offset, data in layout.framing:
            pwrite_all(fd, data, offset)
        fill(fd, layout)
        if finish is not None:
            finish(fd, layout)
    except OSError as exc:
        raise ReshardError(f"write failed: {exc.strerror or exc}", path) from exc  # errno kept: a full disk


def drop_resident(buffer: Any, start: int = 0, length: int | None = None) -> None:
    """Unmap the pages a scan touched (they stay in the page cache): keeps RSS flat.

    Scanning a ``.ckpt`` index faults in pages all over the file (fault-around maps 64 KiB per
    fault); with hundreds of source files open at once that would add up to gigabytes of RSS.
    ``start`` (page-aligned) and ``length`` limit it to a part of the map, e.g. a checksummed block.
    """
    if isinstance(buffer, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):
            if length is None:
                buffer.madvise(mmap.MADV_DONTNEED)
            else:
                buffer.madvise(mmap.MADV_DONTNEED, start, length)


def preallocate(fd: int, size: int) -> None:
    """Reserve the file's blocks up front: a full disk fails here, before any data is copied, and
    filling a preallocated file through a map is ~1.6x faster than faulting in a sparse one."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # filesystem without fallocate: sparse file, still correct
        raise


def map_file(path: str | os.PathLike[str]) -> tuple[Any, Callable[[], None], int]:
    """Read-only memory map of a whole file: (buffer, closer, size). Empty files give ``b""``."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise FormatError(f"cannot open: {exc.strerror}", path) from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return b"", lambda: None, 0
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise FormatError(f"cannot map: {exc.strerror}", path) from None
    finally:
        os.close(fd)
    return mm, mm.close, size


__all__ = [
    "JOURNAL_NAME",
    "TEMP_SUFFIX",
    "ByteLayout",
    "Segment",
    "TensorEntry",
    "TensorIndex",
    "TensorSpec",
    "atomic_path",
    "decode_string",
    "drop_resident",
    "encode_string",
    "fill_from_values",
    "holds",
    "map_file",
    "preallocate",
    "pwrite_all",
    "segment_pieces",
    "stale_temps",
    "value_bytes",
    "write_file",
    "write_whole",
]
