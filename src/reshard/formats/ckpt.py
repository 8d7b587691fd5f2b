"""MindSpore ``.ckpt`` files: a hand-written protobuf wire-format reader and writer (docs/formats.md §1.1-§1.9).

A ``.ckpt`` is a concatenation of one-Value ``Checkpoint`` messages (one per parameter, or per
512 MiB chunk of a large parameter), optionally followed by a 17-byte CRC trailer. Why not the
protobuf runtime? It can only parse a whole message from one bytes object, i.e. hold the entire
multi-GB file in memory and copy every tensor into Python ``bytes`` (which is what MindSpore does,
docs/formats.md §7.1). The schema is tiny (three fields per message), so instead:

* the reader walks the wire format over a read-only mmap and records, per parameter, only the
  byte *segments* of its content: no tensor byte is copied, and a file bigger than RAM is fine;
* the writer computes every framing byte (keys, lengths, dims, type) by arithmetic from the
  shapes (``ckpt_layout``) so the executor can fill tensor data in place; its output is
  byte-identical to MindSpore's ``save_checkpoint`` tensor path (ascending field order, unpacked
  proto2 dims, one record per ``SLICE_BYTES`` chunk with the full dims in every chunk).

Deliberate choices, each checked against MindSpore 2.10:

* MindSpore's synchronous save silently *drops* empty tensors (zero chunks of an empty byte
  string); we write one record with empty content instead, as its async path does, and its
  ``load_checkpoint`` reads that back. Strings are never chunked (MindSpore's loader would
  decode only the last chunk's length) and are stored as ``np.array(s).tobytes()`` (so ``""``
  is four zero bytes: MindSpore cannot load empty ``str`` content).
* The reader is stricter than MindSpore where that costs nothing: chunk sizes must add up to the
  shape, ``verify_crc=True`` without a trailer is an error (MindSpore only warns), and malformed
  bytes raise ``FormatError`` with the byte offset. Unknown fields are skipped (forward
  compatible). Non-consecutive repeats of a tag overwrite the earlier entry but keep its
  position, like MindSpore's dict assignment.
* ``MapTensor`` entries (embedding hash maps, docs/formats.md §1.8) are refused with ``UnsupportedError``.

A run opens each source three times (planning, the replica check, the executor), so the index of
a plain file is remembered for the process while the file is provably unchanged (``index_memo``).
Its magic, trailer and record heads are read with small reads that leave no page cached
(``uncached``): the heads of small records share one read, and no read-ahead runs past them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import (
    CryptoError,
    FormatError,
    IntegrityError,
    ReshardError,
    UnsupportedError,
    UsageError,
)
from reshard.formats import crypto, uncached
from reshard.formats.base import (
    ByteLayout,
    Segment,
    TensorEntry,
    TensorIndex,
    TensorSpec,
    atomic_path,
    drop_resident,
    fill_from_values,
    map_file,
    pwrite_all,
    write_file,
)
from reshard.formats.ckpt_twins import Recorder, Twins
from reshard.formats.index_memo import IndexMemo

if TYPE_CHECKING:
    import numpy as np

SLICE_BYTES = 512 * 1024 * 1024  # MindSpore SLICE_SIZE (512 * 1024 KiB): tensor-path chunk size
CRC_MARK = b"crc_num"  # trailer = mark + crc32 as a 10-byte big-endian integer (docs/formats.md §1.6)
CRC_DIGITS = 10
CRC_TRAILER_BYTES = len(CRC_MARK) + CRC_DIGITS
CRC_BLOCK_BYTES = 4 * 1024 * 1024  # crc block: read back, or checked and unmapped; bounded memory, large reads

# Protobuf wire types and the field numbers of checkpoint.proto (docs/formats.md §1.1).
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
MAX_VARINT_BYTES = 10  # a 64-bit value needs at most 10 groups of 7 bits
RECORD_HEAD_PREFETCH_BYTES = 4096  # one small read covers a record head (name, dims, type, lengths)
HEAD_SLACK_BYTES = 512  # a record head starting this far before the end of a read is parsed from it
CHECKPOINT_VALUE = 1
VALUE_TAG, VALUE_TENSOR, VALUE_MAPTENSOR = 1, 2, 3
TENSOR_DIMS, TENSOR_TYPE, TENSOR_CONTENT = 1, 2, 3
_FIXED_SIZES = {FIXED64: 8, FIXED32: 4}


# --------------------------------------------------------------------------------------- reader


@dataclass(frozen=True)
class _Chunk:
    """One ``Checkpoint.Value`` record: a whole tensor or one chunk of it."""

    tag: str
    dims: tuple[int, ...]
    type_name: str
    content: Segment
    offset: int  # where the record starts, for error messages


class _Scanner:
    """Protobuf wire-format primitives over a buffer; every error names the byte offset.

    ``fd`` (a descriptor of the mapped file, if it is one) lets ``prefetch`` read a record's head
    with one small ``pread`` and parse it from those bytes; the map is touched only for a head that
    runs past them. Why: a fault on a cold map reads the device's whole read-ahead window around it
    (8 MiB on this machine's disk), so walking the record heads through the map read every byte of
    every source before planning could even start (0.89 s for 1.2 GB of 8 rank files; with a 4 KiB
    ``pread`` per record, 0.16 s). And a fault on a cached large folio maps all of it: parsing the
    heads through the map after a ``pread`` still raised a convert's peak RSS from 46 to 126 MiB
    once the read-ahead read its sources in large folios (cd56d71), and a warm one's to 380 MiB.
    Positions stay file offsets: ``base`` is where the bytes being parsed start.
    """

    def __init__(self, buf: Any, path: str, fd: int | None = None) -> None:
        self.map = buf
        self.buf: Any = buf
        self.base = 0
        self.size = len(buf)
        self.path = path
        self.fd = fd

    def prefetch(self, pos: int) -> None:
        """Read the record head at ``pos`` to parse it from there (else from the map)."""
        self.use_map()
        if self.fd is not None:
            try:
                self.buf, self.base = uncached.read(self.fd, RECORD_HEAD_PREFETCH_BYTES, pos), pos
            except OSError:
                self.fd = None  # the map reports real read errors

    def holds(self, pos: int) -> bool:
        """Whether the bytes read last reach ``HEAD_SLACK_BYTES`` past ``pos`` (a head there fits)."""
        return self.buf is not self.map and self.base <= pos and pos + HEAD_SLACK_BYTES <= self.base + len(self.buf)

    def use_map(self) -> None:
        """Parse from the map again (a head that ran past the bytes read)."""
        self.buf, self.base = self.map, 0

    def error(self, message: str, offset: int) -> FormatError:
        return FormatError(f"{message} at byte {offset}", self.path)

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        if pos < end:  # most varints of a record head are one byte (keys, name lengths): no loop
            first = self.buf[pos - self.base]
            if first < 0x80:
                return first, pos + 1
        result = 0
        for i in range(MAX_VARINT_BYTES):
            if pos + i >= end:
                raise self.error("truncated varint", pos)
            byte = self.buf[pos + i - self.base]
            result |= (byte & 0x7F) << (7 * i)
            if byte < 0x80:
                if result >> 64:
                    raise self.error("varint exceeds 64 bits", pos)
                return result, pos + i + 1
        raise self.error("varint longer than 10 bytes", pos)

    def key(self, pos: int, end: int) -> tuple[int, int, int]:
        """(field number, wire type, position after the key)."""
        key, after = self.varint(pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise self.error("field number 0", pos)
        return field, wire, after

    def delimited(self, pos: int, end: int) -> tuple[int, int]:
        """(start, stop) of a length-delimited payload whose length varint is at ``pos``."""
        length, start = self.varint(pos, end)
        if length > end - start:
            if start + length > self.size:
                raise self.error(
                    f"truncated (or damaged): a field of {length} bytes runs past the end of the file "
                    f"({self.size} bytes)",
                    pos,
                )
            raise self.error(f"length {length} runs past the end of its message", pos)
        return start, start + length

    def skip(self, wire: int, pos: int, end: int, at: int) -> int:
        """Skip the payload of an unknown field (forward compatibility)."""
        if wire == VARINT:
            return self.varint(pos, end)[1]
        if wire == LEN:
            return self.delimited(pos, end)[1]
        if wire in _FIXED_SIZES:
            if pos + _FIXED_SIZES[wire] > end:
                raise self.error("truncated fixed-size field", pos)
            return pos + _FIXED_SIZES[wire]
        raise self.error(f"unsupported wire type {wire}", at)

    def payload(self, wire: int, pos: int, end: int, what: str, at: int) -> tuple[int, int]:
        """(start, stop) of field ``what``, which must be length-delimited (its key was at ``at``)."""
        if wire != LEN:
            raise self.error(f"{what} has wire type {wire}, expected {LEN}", at)
        return self.delimited(pos, end)

    def text(self, start: int, stop: int, what: str) -> str:
        try:
            if stop - self.base > len(self.buf):
                raise IndexError(stop)  # past the head's bytes: ``_records`` parses it from the map
            return bytes(self.buf[start - self.base : stop - self.base]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8", start) from None


def read_ckpt(
    path: str | os.PathLike[str],
    *,
    verify_crc: bool = False,
    dec_key: bytes | None = None,
    dec_mode: str = "AES-GCM",
) -> TensorIndex:
    """Index a ``.ckpt`` file (zero-copy over an mmap; decrypted into a temp file with ``dec_key``).

    The magic, the trailer and the record heads are read with small ``pread``s (``uncached``), not
    through the map: a first fault on a map reads the device's read-ahead window around it (8 MiB
    here), twice a file, ahead of the index's small reads."""
    path = os.fspath(path)
    buf, closer, size = map_file(path)
    try:
        with _prefetch_fd(path) as fd:
            mode = crypto.encrypted_mode(_bytes_at(buf, fd, 0, 4))
            if mode is not None and dec_key is None:
                hint = "give the key (--dec-key-file or --dec-key-env; dec_key in Python)"
                raise FormatError(f"encrypted ({mode}); {hint}", path)
            if dec_key is not None:
                if mode is None:
                    raise CryptoError("dec_key given but the file is not an encrypted checkpoint", path)
                plain, plain_closer, size = _decrypt(buf, dec_key, dec_mode, path)
                closer()
                buf, closer, fd = plain, plain_closer, None
            entries = _entries(path, buf, size, fd, verify_crc, decrypted=dec_key is not None)
    except BaseException:
        closer()
        raise
    return TensorIndex(path, "ckpt", buf, entries, _closer=closer, file_backed=dec_key is None)


def _entries(
    path: str, buf: Any, size: int, fd: int | None, verify_crc: bool, decrypted: bool
) -> dict[str, TensorEntry]:
    """The tensors of the (plain or decrypted) bytes ``buf``: remembered, or indexed afresh."""
    try:
        end = _payload_end(buf, size, verify_crc, path, fd)
        identity = None if decrypted else _MEMO.identity(path)
        entries = _MEMO.recall(identity)
        if entries is None:  # fd is None for decrypted bytes (a temporary file): no twins there
            entries = _TWINS.checked(fd, size, end) or _index_offered(path, buf, size, end, fd, verify_crc)
            _MEMO.keep(identity, entries, path)
        drop_resident(buf)
        return entries
    except FormatError as exc:
        if not decrypted:
            raise
        # CBC has no authentication: a wrong key usually only shows up as garbage plaintext.
        raise CryptoError(f"decrypted bytes are not a checkpoint (wrong key or mode?): {exc.detail}", path) from None


def _index_offered(
    path: str, buf: Any, size: int, end: int, fd: int | None, verify_crc: bool
) -> dict[str, TensorEntry]:
    """The file indexed record by record (a crc check has just read it whole: its heads parse from the map);
    a plain file's layout is offered to its twins."""
    recorder = Recorder() if fd is not None else None
    entries = _index(_Scanner(buf, path, None if verify_crc else fd), end, recorder)
    if recorder is not None:
        _TWINS.offer(size, end, recorder.layout(entries))
    return entries


def _bytes_at(buf: Any, fd: int | None, offset: int, length: int) -> bytes:
    """``length`` bytes of the file at ``offset``: by a small read where there is a descriptor, else
    (decrypted bytes, or a read that failed: the map reports real errors) from the buffer."""
    if fd is not None:
        with contextlib.suppress(OSError):
            return bytes(uncached.read(fd, length, offset))
    return bytes(buf[offset : offset + length])


@contextlib.contextmanager
def _prefetch_fd(path: str) -> Iterator[int | None]:
    """A read-only descriptor for the small reads of an index (``_Scanner.prefetch``, ``_bytes_at``),
    advised to read nothing ahead; None where the file cannot be opened (the map reports it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        uncached.read_nothing_ahead(fd)
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CkptProbe:
    """What a ``.ckpt`` file's first and last bytes say about it, before it is parsed."""

    cipher: str | None  # the encryption mode its record magic names, None for a plain file
    crc_trailer: bool  # a plain file ending with MindSpore's crc trailer (docs/formats.md §1.6)


def ends_with_crc_trailer(tail: bytes | memoryview) -> bool:
    """Whether ``tail``, the last ``CRC_TRAILER_BYTES`` (or fewer) of a file, is a crc trailer."""
    return len(tail) == CRC_TRAILER_BYTES and bytes(tail[: len(CRC_MARK)]) == CRC_MARK


def probe_ckpt(path: str | os.PathLike[str]) -> CkptProbe:
    """Is this ``.ckpt`` encrypted (and how), does it carry a crc trailer? Two small reads.

    An encrypted file never counts as having a trailer: what MindSpore appends after encrypted
    records carries no checksum (``crypto`` explains). Raises ``OSError`` when the file cannot be
    read; the callers decide what that means for them.
    """
    with open(path, "rb") as fh:
        cipher = crypto.encrypted_mode(fh.read(4))
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - CRC_TRAILER_BYTES))
        tail = fh.read(CRC_TRAILER_BYTES)
    return CkptProbe(cipher, cipher is None and ends_with_crc_trailer(tail))


# Few files decrypted at once: each holds a 64 MiB record of plaintext until its tag checks out (and
# the record's ciphertext pages), and planning indexes 8 files on threads (sources.files.INDEX_THREADS):
# 8 at once were 1 GiB of RSS. OpenSSL decrypts at GB/s, so the threads mostly overlap disk waits: one
# at a time on a small machine (2 cores: 1), up to 3 on a large one (about 70 MiB each), whose disks
# serve several reads at once.
_DECRYPTING = threading.BoundedSemaphore(max(1, min(3, (os.cpu_count() or 1) // 4)))


def _decrypt(buf: Any, key: bytes, mode: str, path: str) -> tuple[Any, Callable[[], None], int]:
    """Plaintext of an encrypted file in an anonymous temp file, memory-mapped.

    The map keeps the (already unlinked) temp file alive until it is closed.
    """
    dropped = 0

    def done(end: int) -> None:  # the ciphertext decrypted so far leaves RSS (the page cache keeps it)
        nonlocal dropped
        upto = end - end % mmap.PAGESIZE
        drop_resident(buf, dropped, upto - dropped)
        dropped = upto

    import tempfile  # only an encrypted source or output needs it (``random`` and more: 2 ms of every start)

    try:
        with tempfile.TemporaryFile() as tmp, _DECRYPTING:
            crypto.decrypt_stream(buf, tmp, key, mode, path, done)
            tmp.flush()
            size = os.fstat(tmp.fileno()).st_size
            if size == 0:
                return b"", lambda: None, 0
            plain = mmap.mmap(tmp.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ReshardError(f"cannot buffer the decrypted checkpoint: {exc.strerror or exc}", path) from None
    return plain, plain.close, size


def _payload_end(buf: Any, size: int, verify_crc: bool, path: str, fd: int | None = None) -> int:
    """Where the protobuf bytes end: before the CRC trailer if there is one (checked on request)."""
    tail_start = max(0, size - CRC_TRAILER_BYTES)
    tail = _bytes_at(buf, fd, tail_start, size - tail_start)
    if ends_with_crc_trailer(tail):
        end = size - CRC_TRAILER_BYTES
        if verify_crc:
            stored = int.from_bytes(tail[-CRC_DIGITS:], "big")
            actual = _crc_of_buffer(buf, end)
            if stored != actual:
                raise IntegrityError(f"crc mismatch: trailer says {stored}, content has {actual}", path)
        return end
    if verify_crc:
        raise IntegrityError("a crc check was requested but the file has no crc trailer", path)
    return size


def _crc_of_buffer(buf: Any, end: int) -> int:
    """crc32 of ``buf[:end]``, block by block; each block's pages are unmapped once read, so checking
    every source's trailer (on by default) never holds more than a block per file in RSS."""
    crc = 0
    with memoryview(buf) as view:
        for start in range(0, end, CRC_BLOCK_BYTES):
            stop = min(end, start + CRC_BLOCK_BYTES)
            crc = zlib.crc32(view[start:stop], crc)
            drop_resident(buf, start, stop - start)
    return crc


_MEMO = IndexMemo()  # see the module docstring
_TWINS = Twins()  # the record layouts of files indexed, for their twins (formats.ckpt_twins)


def _index(scan: _Scanner, end: int, recorder: Recorder | None = None) -> dict[str, TensorEntry]:
    """All tensors of the file: consecutive records with one tag joined, file order kept (the bytes
    outside tensor contents to ``recorder``)."""
    chunks = list(_records(scan, end, recorder))
    if not chunks:
        raise FormatError("no parameters in the checkpoint (empty or not a .ckpt)", scan.path)
    entries: dict[str, TensorEntry] = {}
    for tag, group in itertools.groupby(chunks, key=lambda chunk: chunk.tag):
        entries[tag] = _entry(scan, list(group))  # a repeated tag overwrites, keeping its slot
    return entries


def _records(scan: _Scanner, end: int, recorder: Recorder | None) -> Iterator[_Chunk]:
    """The ``Checkpoint.value`` records of the top-level message, in file order."""
    pos = 0
    while pos < end:
        chunk, after = _record_from_bytes_read(scan, pos, end)
        if recorder is not None:  # the record's bytes around its content, from the bytes just parsed
            content, length = chunk.content if chunk is not None else (after, 0)
            recorder.take(scan.buf, scan.base, pos, content)
            recorder.take(scan.buf, scan.base, content + length, after)
        if chunk is not None:
            yield chunk
        pos = after


def _record_from_bytes_read(scan: _Scanner, pos: int, end: int) -> tuple[_Chunk | None, int]:
    """``_record`` at ``pos``, parsed from the bytes read for an earlier head where they hold it (the
    heads of small records share one read), else from a read at ``pos``, else from the map (a head
    longer than a read: a very long name)."""
    if not scan.holds(pos):
        scan.prefetch(pos)
    try:
        return _record(scan, pos, end)
    except IndexError:  # the head ran past the bytes read
        pass
    if scan.base != pos and scan.buf is not scan.map:
        scan.prefetch(pos)
        try:
            return _record(scan, pos, end)
        except IndexError:
            pass
    scan.use_map()
    return _record(scan, pos, end)


def _record(scan: _Scanner, at: int, end: int) -> tuple[_Chunk | None, int]:
    """The top-level field at ``at``: a ``Checkpoint.value`` record (None for another field, skipped),
    and where the next field starts."""
    field, wire, pos = scan.key(at, end)
    if field != CHECKPOINT_VALUE:
        return None, scan.skip(wire, pos, end, at)
    start, pos = scan.payload(wire, pos, end, "Checkpoint.value", at)
    return _value(scan, start, pos, at), pos


def _value(scan: _Scanner, pos: int, end: int, record: int) -> _Chunk:
    """Parse one ``Checkpoint.Value`` (its record starts at ``record``): tag + tensor, no MapTensor."""
    tag: str | None = None
    tensor: tuple[tuple[int, ...], str, Segment] | None = None
    while pos < end:
        at = pos
        field, wire, pos = scan.key(pos, end)
        if field == VALUE_TAG:
            start, pos = scan.payload(wire, pos, end, "Value.tag", at)
            tag = scan.text(start, pos, "parameter name")
        elif field == VALUE_TENSOR:
            start, pos = scan.payload(wire, pos, end, "Value.tensor", at)
            tensor = _tensor(scan, start, pos)
        elif field == VALUE_MAPTENSOR:
            raise UnsupportedError(f"MapTensor entry (MapParameter) at byte {at} is not supported", scan.path)
        else:
            pos = scan.skip(wire, pos, end, at)
    if tag is None:
        raise scan.error("Value without a tag", record)
    if tensor is None:
        raise scan.error(f"Value {tag!r} without a tensor", record)
    dims, type_name, content = tensor
    return _Chunk(tag, dims, type_name, content, record)


def _tensor(scan: _Scanner, pos: int, end: int) -> tuple[tuple[int, ...], str, Segment]:
    """Parse one ``TensorProto``: dims (unpacked or packed), tensor_type, content segment."""
    message = pos
    dims: list[int] = []
    type_name: str | None = None
    content: Segment | None = None
    while pos < end:
        at = pos
        field, wire, pos = scan.key(pos, end)
        if field == TENSOR_DIMS and wire == VARINT:
            dim, pos = scan.varint(pos, end)
            dims.append(_dim(scan, dim, at))
        elif field == TENSOR_DIMS and wire == LEN:  # packed encoding: legal protobuf for any writer
            start, pos = scan.delimited(pos, end)
            while start < pos:
                dim, after = scan.varint(start, pos)
                dims.append(_dim(scan, dim, start))
                start = after
        elif field == TENSOR_DIMS:
            raise scan.error(f"TensorProto.dims has wire type {wire}", at)
        elif field == TENSOR_TYPE:
            start, pos = scan.payload(wire, pos, end, "TensorProto.tensor_type", at)
            type_name = scan.text(start, pos, "tensor_type")
        elif field == TENSOR_CONTENT:
            start, pos = scan.payload(wire, pos, end, "TensorProto.tensor_content", at)
            content = (start, pos - start)
        else:
            pos = scan.skip(wire, pos, end, at)
    if type_name is None:
        raise scan.error("TensorProto without tensor_type", message)
    if content is None:
        raise scan.error("TensorProto without tensor_content", message)
    return tuple(dims), type_name, content


def _dim(scan: _Scanner, raw: int, at: int) -> int:
    if raw >> 63:  # int64 two's complement: a negative dimension
        raise scan.error(f"negative dimension {raw - (1 << 64)}", at)
    return raw


def _entry(scan: _Scanner, chunks: list[_Chunk]) -> TensorEntry:
    """Join the chunks of one parameter and check that their sizes add up to the shape."""
    first = chunks[0]
    where = f"parameter {first.tag!r} at byte {first.offset}"
    try:
        dtype = dtypes.from_ms_name(first.type_name, scan.path)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc.detail}", scan.path) from None
    for chunk in chunks[1:]:
        if (chunk.dims, chunk.type_name) != (first.dims, first.type_name):
            raise scan.error(f"chunk of {first.tag!r} disagrees on dims or type", chunk.offset)
    segments = tuple(chunk.content for chunk in chunks)
    nbytes = sum(length for _, length in segments)
    _check_size(scan, where, dtype, first.dims, nbytes)
    return TensorEntry(first.tag, dtype, first.dims, segments)


def _check_size(scan: _Scanner, where: str, dtype: DType, dims: tuple[int, ...], nbytes: int) -> None:
    if dtype is dtypes.STR:
        if nbytes % 4:
            raise FormatError(f"{where}: string content of {nbytes} bytes is not UTF-32", scan.path)
        return
    expected = math.prod(dims) * dtype.itemsize
    if nbytes != expected:
        raise FormatError(f"{where}: {nbytes} content bytes, but {dtype} {list(dims)} needs {expected}", scan.path)


# --------------------------------------------------------------------------------------- writer


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _delimited(field: int, payload: bytes) -> bytes:
    return _key(field, LEN) + _varint(len(payload)) + payload


def _record_head(tag: bytes, dims: Sequence[int], type_name: bytes, nbytes: int) -> bytes:
    """Every byte of one record before its ``nbytes`` of content (docs/formats.md §1.2)."""
    tensor_head = b"".join(_key(TENSOR_DIMS, VARINT) + _varint(dim) for dim in dims)
    tensor_head += _delimited(TENSOR_TYPE, type_name) + _key(TENSOR_CONTENT, LEN) + _varint(nbytes)
    tensor_len = len(tensor_head) + nbytes
    value_head = _delimited(VALUE_TAG, tag) + _key(VALUE_TENSOR, LEN) + _varint(tensor_len)
    value_len = len(value_head) + tensor_len
    return _key(CHECKPOINT_VALUE, LEN) + _varint(value_len) + value_head + tensor_head


def _chunk_lengths(spec: TensorSpec, chunk_bytes: int) -> list[int]:
    """Content bytes per record: full chunks then the rest; empty tensors and strings: one record."""
    if spec.dtype is dtypes.STR or spec.nbytes == 0:
        return [spec.nbytes]
    full, rest = divmod(spec.nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def _check_spec(spec: TensorSpec) -> None:
    if not spec.dtype.in_ckpt:
        raise UnsupportedError(
            f"tensor {spec.name!r}: dtype {spec.dtype} has no MindSpore 2.10 tensor type, so a .ckpt "
            "file cannot hold it (write .safetensors instead)"
        )
    if spec.dtype is dtypes.STR:
        if spec.nbytes % 4:
            raise UsageError(f"string {spec.name!r}: {spec.nbytes} bytes is not UTF-32")
        return
    if any(dim < 0 for dim in spec.shape):
        raise UsageError(f"tensor {spec.name!r}: negative dimension in {list(spec.shape)}")
    expected = math.prod(spec.shape) * spec.dtype.itemsize
    if spec.nbytes != expected:
        raise UsageError(f"tensor {spec.name!r}: nbytes {spec.nbytes} != {expected} for its shape")


def _utf8_name(name: str) -> bytes:
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"parameter name {name!r} cannot be encoded as UTF-8") from None


def ckpt_layout(specs: Sequence[TensorSpec], *, chunk_bytes: int = SLICE_BYTES) -> ByteLayout:
    """Exact byte layout of MindSpore's ``save_checkpoint`` output for ``specs`` (no data needed)."""
    if chunk_bytes <= 0:
        raise UsageError(f"chunk_bytes must be positive, got {chunk_bytes}")
    framing: list[tuple[int, bytes]] = []
    placements: dict[str, tuple[Segment, ...]] = {}
    pos = 0
    for spec in specs:
        if spec.name in placements:
            raise UsageError(f"parameter {spec.name!r} appears twice")
        _check_spec(spec)
        dims = (0,) if spec.dtype is dtypes.STR else spec.shape
        tag, type_name = _utf8_name(spec.name), spec.dtype.ms_name.encode("ascii")
        heads: dict[int, bytes] = {}  # all full chunks share one head
        segments = []
        for length in _chunk_lengths(spec, chunk_bytes):
            if length not in heads:
                heads[length] = _record_head(tag, dims, type_name, length)
            head = heads[length]
            framing.append((pos, head))
            pos += len(head)
            segments.append((pos, length))
            pos += length
        placements[spec.name] = tuple(segments)
    return ByteLayout(pos, tuple(framing), placements, tuple(placements))


def crc_finish(fd: int, layout: ByteLayout) -> None:
    """``write_file`` finish step: crc32 of the written bytes (read back in blocks) as a trailer."""
    crc, pos = 0, 0
    while pos < layout.size:
        block = os.pread(fd, min(CRC_BLOCK_BYTES, layout.size - pos), pos)
        if not block:
            raise IntegrityError(f"file ends at byte {pos}, layout says {layout.size}")
        crc = zlib.crc32(block, crc)
        pos += len(block)
    pwrite_all(fd, CRC_MARK + crc.to_bytes(CRC_DIGITS, "big"), layout.size)


SaveValue: TypeAlias = "np.ndarray | str"  # what save_ckpt accepts per parameter (numpy loads with the first save)


def _prepare(name: str, value: SaveValue) -> tuple[TensorSpec, np.ndarray]:
    """The spec and the exact content bytes/array MindSpore would store for ``value``."""
    import numpy as np

    if not isinstance(name, str):
        raise UsageError(f"parameter names must be strings, got {name!r}")
    if isinstance(value, np.ndarray) and value.dtype.kind == "U" and value.ndim == 0:
        value = str(value)
    if isinstance(value, str):
        content = np.frombuffer(np.array(value).tobytes(), np.uint8)  # "" -> 4 zero bytes, as MindSpore
        return TensorSpec(name, dtypes.STR, (0,), content.size), content
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    try:
        dtype = dtypes.from_numpy(arr.dtype)
    except FormatError as exc:
        raise UsageError(f"parameter {name!r}: {exc.detail}") from None
    if dtype is dtypes.STR:
        raise UsageError(f"parameter {name!r}: only 0-d string arrays can be saved")
    return TensorSpec(name, dtype, tuple(int(d) for d in arr.shape)), arr


def save_ckpt(
    path: str | os.PathLike[str],
    tensors: Mapping[str, SaveValue] | Sequence[tuple[str, SaveValue]],
    *,
    write_crc: bool = False,
    chunk_bytes: int = SLICE_BYTES,
    enc_key: bytes | None = None,
    enc_mode: str = "AES-GCM",
) -> None:
    """Write ``tensors`` (in order) as MindSpore's ``save_checkpoint`` would, atomically.

    Values are numpy arrays (bf16/fp8 from ``ml_dtypes``) or strings. Python scalars follow numpy
    (``2.5`` -> Float64), not ``append_dict`` (Float32): pass ``np.float32(2.5)`` for that.
    """
    if write_crc and enc_key is not None:
        raise UsageError("a crc trailer and encryption are mutually exclusive (as in MindSpore)", path)
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    specs, values = [], {}
    for name, value in items:
        if name in values:
            raise UsageError(f"parameter {name!r} appears twice", path)
        spec, values[name] = _prepare(name, value)
        specs.append(spec)
    layout = ckpt_layout(specs, chunk_bytes=chunk_bytes)
    fill = fill_from_values(values)
    if enc_key is None:
        write_file(path, layout, fill, crc_finish if write_crc else None)
    else:
        write_encrypted(os.fspath(path), layout, fill, enc_key, enc_mode)


def write_encrypted(
    path: str, layout: ByteLayout, fill: Callable[[int, ByteLayout], None], key: bytes, mode: str
) -> None:
    """Plaintext into an anonymous temp file beside the output, then encrypted into place."""
    import tempfile

    crypto.check_key(key, mode, path)
    with atomic_path(path) as tmp:
        try:
            with tempfile.TemporaryFile(dir=os.path.dirname(tmp)) as plain:
                fd = plain.fileno()
                os.ftruncate(fd, layout.size)
                for offset, data in layout.framing:
                    pwrite_all(fd, data, offset)
                fill(fd, layout)
                plain.seek(0)
                with open(tmp, "wb") as out:
                    crypto.encrypt_stream(plain, out, key, mode)
        except OSError as exc:
            raise ReshardError(f"write failed: {exc.strerror or exc}", path) from exc  # errno kept: a full disk


class CkptFormat:
    """MindSpore's ``.ckpt`` as a ``formats.protocol.Format``: crc trailers and encryption included."""

    name = "ckpt"
    suffixes: tuple[str, ...] = (".ckpt",)
    encrypts = True

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        """``verify_crc`` checks a plain file's crc trailer when it has one (files without are accepted, as
        MindSpore does); ``read_ckpt(verify_crc=True)`` is the strict form that demands one."""
        crc = verify_crc and _has_crc_trailer(path)
        return read_ckpt(path, verify_crc=crc, dec_key=dec_key, dec_mode=dec_mode)

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        return ckpt_layout(specs, chunk_bytes=chunk_bytes)  # a .ckpt holds no file metadata

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        if write_crc:
            crc_finish(fd, layout)

    def write_encrypted(
        self, path: str, layout: ByteLayout, fill: Callable[[int, ByteLayout], None], key: bytes, mode: str
    ) -> None:
        write_encrypted(path, layout, fill, key, mode)


def _has_crc_trailer(path: str) -> bool:
    try:
        return probe_ckpt(path).crc_trailer
    except OSError:
        return False  # read_ckpt reports the problem


CKPT = CkptFormat()

__all__ = [
    "CKPT",
    "CRC_TRAILER_BYTES",
    "SLICE_BYTES",
    "CkptFormat",
    "CkptProbe",
    "ckpt_layout",
    "crc_finish",
    "ends_with_crc_trailer",
    "probe_ckpt",
    "read_ckpt",
    "save_ckpt",
    "write_encrypted",
]
