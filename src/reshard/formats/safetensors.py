"""The safetensors format: a strict mmap reader and a streaming, byte-identical writer.

File layout: ``u64 little-endian header length N``, ``N`` bytes of UTF-8 JSON (space padded), then
the data area. The JSON object maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (offsets
relative to the data area) and may hold a ``"__metadata__"`` str->str object.

Why hand-written instead of ``safetensors.numpy``:

* the executor needs *byte positions*: it writes the header first and then fills tensor data in
  place, in any order, straight from source mmaps; the library only writes whole in-memory dicts;
* we validate every header field before trusting any data (the library does the same, but its
  numpy binding copies every tensor and reports problems as ``SafetensorError`` / ``ValueError``
  instead of one clear line naming the file).

Reader rules, matching safetensors 0.8 (established by experiment, see the tests): file >= 8 bytes;
header length <= 100 MB and inside the file; header valid UTF-8 JSON object (JSON whitespace around
it is fine); ``__metadata__`` absent, ``null`` or a str->str object; every entry has a known dtype,
a shape of non-negative ints and ``data_offsets = [begin, end]`` with ``end - begin`` equal to the
tensor size; sorted by ``(begin, end)`` the entries tile the data area exactly from 0 to its end
(no gap, no overlap, no trailing bytes). Extra fields in an entry are ignored, as by the library.
Stricter than the library: duplicate JSON keys (the library silently keeps the last one) and
strings with lone surrogates are rejected; dtype codes the library knows but reshard does not carry
(``C64``, ``F8_E8M0``, ...) raise ``UnsupportedError``.

Entries of the returned index are in data order (``(begin, end)``, ties between empty tensors by
header position), which for files written by the library or by us is also the header order.
MindSpore's own reader needs the header in that order (docs/formats.md §7.18); ``require_data_order=True``
enforces it for files that must load in MindSpore.

Writer rules, matching ``safetensors.numpy.save_file`` 0.8 byte for byte: tensors ordered by dtype
code descending in the library's enum order (which is itemsize non-increasing, so every tensor is
aligned), then by name; header ``{"__metadata__":{...},"name":{"dtype":..,"shape":[..],
"data_offsets":[b,e]},...}`` with no spaces, non-ASCII kept as UTF-8, padded with spaces to a
multiple of 8; ``metadata=None`` omits ``__metadata__`` while ``{}`` writes it empty. The library
emits metadata keys in a random order (a Rust ``HashMap``), so no writer can match it for two or
more keys; we keep the caller's insertion order, which makes our output deterministic and equal to
the library's up to that permutation (same size, same offsets). One deliberate difference: for no
tensors and ``metadata={}`` the library writes the invalid header ``{},"__metadata__":{}}`` (it
cannot read it back); we write ``{"__metadata__":{}}``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reshard import dtypes
from reshard.dtypes import DType
from reshard.errors import FormatError, UnsupportedError, UsageError
from reshard.formats.base import (
    ByteLayout,
    TensorEntry,
    TensorIndex,
    TensorSpec,
    fill_from_values,
    map_file,
    write_file,
)
from reshard.text import first_line

if TYPE_CHECKING:
    import numpy as np

FORMAT = "safetensors"
METADATA_KEY = "__metadata__"
INT4_MARKER = "Int4"  # metadata value MindSpore writes for each qint4x2 tensor (docs/formats.md §1.11)

_LEN_BYTES = 8  # the u64 header length prefix
_HEADER_ALIGN = 8  # the library pads the header with spaces to a multiple of 8
_MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE: larger headers are refused
_MAX_NBYTES = 2**63 - 1  # numpy cannot describe arrays beyond intp; nor can any real file
_JSON_SEPARATORS = (",", ":")  # serde_json's compact form

# The library's Dtype enum, in declaration order (from its own error message, safetensors 0.8).
# ``save_file`` sorts tensors by this order, descending, then by name.
_LIBRARY_DTYPE_ORDER: tuple[str, ...] = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
)  # fmt: skip
_DTYPE_RANK = {code: rank for rank, code in enumerate(_LIBRARY_DTYPE_ORDER)}


# --------------------------------------------------------------------------------------- reader


def read_safetensors(path: str | os.PathLike[str], *, require_data_order: bool = False) -> TensorIndex:
    """Index a ``.safetensors`` file over a read-only mmap; ``array(name)`` is a zero-copy view.

    Every header field is validated before the index is returned (module docstring); any violation
    raises ``FormatError`` naming the file. ``require_data_order`` additionally demands that the
    header lists the tensors in data order, as MindSpore's reader does.
    """
    path = os.fspath(path)
    buffer, closer, size = map_file(path)
    try:
        header_len = _header_length(buffer, size, path)
        header = _parse_header(bytes(buffer[_LEN_BYTES : _LEN_BYTES + header_len]), path)
        metadata = _metadata(header.pop(METADATA_KEY, None), path)
        data_start = _LEN_BYTES + header_len
        entries = _entries(header, metadata, size - data_start, data_start, path)
        if require_data_order and list(entries) != list(header):
            raise FormatError("header does not list the tensors in data order (MindSpore rejects it)", path)
    except BaseException:
        closer()
        raise
    return TensorIndex(path, FORMAT, buffer, entries, metadata, closer, file_backed=True)


def _header_length(buffer: Any, size: int, path: str) -> int:
    if size < _LEN_BYTES:
        raise FormatError(f"file of {size} bytes is too small for a safetensors header", path)
    (length,) = struct.unpack("<Q", buffer[:_LEN_BYTES])
    if length > _MAX_HEADER_BYTES:
        raise FormatError(f"header length {length} exceeds the {_MAX_HEADER_BYTES}-byte limit", path)
    if _LEN_BYTES + length > size:
        raise FormatError(f"header length {length} runs past the end of the file ({size} bytes)", path)
    return int(length)


def _parse_header(raw: bytes, path: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"header is not valid UTF-8 (byte {exc.start})", path) from None
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"header is not valid JSON: {first_line(exc)}", path) from None
    if not isinstance(header, dict):
        raise FormatError(f"header is a JSON {type(header).__name__}, not an object", path)
    return header


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _metadata(raw: Any, path: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise FormatError(f"{METADATA_KEY} is a JSON {type(raw).__name__}, not an object", path)
    for key, value in raw.items():
        if not isinstance(value, str):
            raise FormatError(f"{METADATA_KEY}[{key!r}] is not a string", path)
        _check_text(key, "metadata key", path)
        _check_text(value, f"{METADATA_KEY}[{key!r}]", path)
    return dict(raw)


def _check_text(text: str, what: str, path: str) -> None:
    """JSON escapes can smuggle lone surrogates into Python strings; UTF-8 (and the library) can't."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"{what} {text!r} is not valid Unicode", path) from None


def _entries(
    header: dict[str, Any], metadata: dict[str, str], data_len: int, data_start: int, path: str
) -> dict[str, TensorEntry]:
    """Validate every entry, then check that they tile the data area; return them in data order."""
    parsed = [
        (*_entry_fields(name, info, data_len, path), pos, name) for pos, (name, info) in enumerate(header.items())
    ]
    parsed.sort(key=lambda item: (item[2], item[3], item[4]))  # (begin, end, header position)
    entries: dict[str, TensorEntry] = {}
    expected = 0  # where the next tensor must begin: the previous one's end
    for dtype, shape, begin, end, _pos, name in parsed:
        if begin != expected:
            raise FormatError(
                f"tensor {name!r} at data offset {begin} {_tiling_problem(begin, expected, entries)}", path
            )
        expected = end
        if dtype is dtypes.INT8 and metadata.get(name) == INT4_MARKER:
            dtype = dtypes.INT4
        entries[name] = TensorEntry(name, dtype, shape, ((data_start + begin, end - begin),))
    if expected != data_len:
        raise FormatError(f"data area has {data_len - expected} trailing bytes not covered by any tensor", path)
    return entries


def _tiling_problem(begin: int, expected: int, previous: dict[str, TensorEntry]) -> str:
    if begin > expected:
        return f"leaves a gap of {begin - expected} bytes after offset {expected}"
    return f"overlaps tensor {next(reversed(previous))!r}" if previous else "overlaps another tensor"


def _entry_fields(name: str, info: Any, data_len: int, path: str) -> tuple[DType, tuple[int, ...], int, int]:
    _check_text(name, "tensor name", path)
    if not isinstance(info, dict):
        raise FormatError(f"tensor {name!r}: entry is a JSON {type(info).__name__}, not an object", path)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise FormatError(f"tensor {name!r}: missing field {field!r}", path)
    dtype = _dtype(info["dtype"], name, path)
    shape = _int_list(info["shape"], None, f"tensor {name!r}: shape", path)
    begin, end = _int_list(info["data_offsets"], 2, f"tensor {name!r}: data_offsets", path)
    if begin > end:
        raise FormatError(f"tensor {name!r}: data_offsets begin {begin} > end {end}", path)
    if end > data_len:
        raise FormatError(
            f"tensor {name!r}: data ends at {end}, past the {data_len}-byte data area (truncated file?)", path
        )
    nonzero = math.prod(d for d in shape if d)
    if nonzero * dtype.itemsize > _MAX_NBYTES:
        raise FormatError(f"tensor {name!r}: shape {list(shape)} is too large", path)
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise FormatError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but {dtype.st_code} "
            f"shape {list(shape)} needs {nbytes}",
            path,
        )
    return dtype, shape, begin, end


def _dtype(code: Any, name: str, path: str) -> DType:
    if not isinstance(code, str):
        raise FormatError(f"tensor {name!r}: dtype is not a string", path)
    if code in _DTYPE_RANK and code not in _SUPPORTED_CODES:
        raise UnsupportedError(f"tensor {name!r}: safetensors dtype {code} is not supported by reshard", path)
    try:
        return dtypes.from_st_code(code, path)
    except FormatError as exc:
        raise FormatError(f"tensor {name!r}: {exc.detail}", path) from None


def _int_list(value: Any, length: int | None, what: str, path: str) -> tuple[int, ...]:
    # ``type(v) is int`` rejects JSON true/false, which Python would treat as 1/0.
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise FormatError(f"{what} is not a list of non-negative integers", path)
    if length is not None and len(value) != length:
        raise FormatError(f"{what} has {len(value)} values, expected {length}", path)
    return tuple(value)


_SUPPORTED_CODES = frozenset(d.st_code for d in dtypes.ALL if d.st_code is not None)


# --------------------------------------------------------------------------------------- writer


def int4_metadata(specs: Sequence[TensorSpec]) -> dict[str, str]:
    """The ``"<name>": "Int4"`` metadata markers MindSpore writes for qint4x2 tensors."""
    return {spec.name: INT4_MARKER for spec in specs if spec.dtype is dtypes.INT4}


def safetensors_layout(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> ByteLayout:
    """Every byte position of the file ``safetensors.numpy.save_file`` would write for ``specs``.

    ``INT4`` specs are stored as ``I8`` (add ``int4_metadata(specs)`` to ``metadata`` to mark them).
    Strings and dtypes safetensors cannot hold raise ``UnsupportedError``.
    """
    _check_specs(specs)
    meta = _check_metadata(metadata)
    ordered = sorted(specs, key=lambda s: (-_DTYPE_RANK[_st_code(s)], s.name))
    header: dict[str, Any] = {} if meta is None else {METADATA_KEY: meta}
    placements: dict[str, tuple[tuple[int, int], ...]] = {}
    offset = 0
    for spec in ordered:
        header[spec.name] = {
            "dtype": _st_code(spec),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        placements[spec.name] = ((offset, spec.nbytes),)
        offset += spec.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=_JSON_SEPARATORS).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGN)
    data_start = _LEN_BYTES + len(text)
    placements = {name: ((data_start + o, n),) for name, ((o, n),) in placements.items()}
    framing = ((0, struct.pack("<Q", len(text)) + text),)
    return ByteLayout(data_start + offset, framing, placements, tuple(placements))


def _st_code(spec: TensorSpec) -> str:
    code = spec.dtype.st_code
    if code is None or code not in _DTYPE_RANK:
        raise UnsupportedError(f"tensor {spec.name!r}: dtype {spec.dtype} cannot be stored in safetensors")
    return code


def _check_specs(specs: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec.name, str):
            raise UsageError(f"tensor name {spec.name!r} is not a string")
        _check_usage_text(spec.name, "tensor name")
        if spec.name == METADATA_KEY:
            raise UsageError(f"tensor name {METADATA_KEY!r} is reserved by safetensors")
        if spec.name in seen:
            raise UsageError(f"tensor name {spec.name!r} appears twice")
        seen.add(spec.name)
        _st_code(spec)
        if any(type(d) is not int or d < 0 for d in spec.shape):
            raise UsageError(f"tensor {spec.name!r}: shape {spec.shape} is not non-negative ints")
        if spec.nbytes != math.prod(spec.shape) * spec.dtype.itemsize:
            raise UsageError(f"tensor {spec.name!r}: nbytes {spec.nbytes} does not match its shape and dtype")


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise UsageError(f"safetensors metadata must map str to str, got {key!r}: {value!r}")
        _check_usage_text(key, "metadata key")
        _check_usage_text(value, "metadata value")
    return dict(metadata)


def _check_usage_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} {text!r} is not valid Unicode") from None


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` like ``safetensors.numpy.save_file``: atomically, without a file-sized buffer.

    Unlike the library, non-contiguous arrays are written in logical C order (the library copies
    their raw memory) and big-endian arrays are converted to little-endian.
    """
    values = {name: _little_endian(value) for name, value in tensors.items()}
    specs = [TensorSpec.of(name, value) for name, value in values.items()]
    write_file(path, safetensors_layout(specs, metadata), fill_from_values(values))


def _little_endian(value: Any) -> Any:
    if isinstance(value, str):
        return value  # rejected by the layout with UnsupportedError
    import numpy as np  # numpy loads with the first array written: a byte move never needs one

    array = np.asarray(value)
    if array.dtype.byteorder == ">":
        return array.astype(array.dtype.newbyteorder("<"))
    return array


class SafetensorsFormat:
    """``.safetensors`` as a ``formats.protocol.Format``: no trailer, never encrypted."""

    name = FORMAT
    suffixes: tuple[str, ...] = (".safetensors",)
    encrypts = False

    def read(
        self, path: str, *, verify_crc: bool = True, dec_key: bytes | None = None, dec_mode: str = "AES-GCM"
    ) -> TensorIndex:
        return read_safetensors(path)  # no integrity data, never encrypted: the options do not apply

    def layout(self, specs: Sequence[TensorSpec], metadata: Mapping[str, str], chunk_bytes: int) -> ByteLayout:
        return safetensors_layout(specs, dict(metadata) or None)  # one segment per tensor: nothing is chunked

    def finish(self, fd: int, layout: ByteLayout, write_crc: bool) -> None:
        return None  # no trailer

    def write_encrypted(
        self, path: str, layout: ByteLayout, fill: Callable[[int, ByteLayout], None], key: bytes, mode: str
    ) -> None:
        raise UnsupportedError("only .ckpt outputs can be encrypted", path)


SAFETENSORS = SafetensorsFormat()

__all__ = [
    "FORMAT",
    "INT4_MARKER",
    "METADATA_KEY",
    "SAFETENSORS",
    "SafetensorsFormat",
    "int4_metadata",
    "read_safetensors",
    "safetensors_layout",
    "save_safetensors",
]
