"""``node_strategy.proto``: its schema, and a reader of its bytes that needs no protobuf runtime.

Why a hand-written reader: importing protobuf and building the strategy classes from their
descriptor costs 14-19 ms of every process that reads a protobuf strategy file (upb 7.x, this
project's 2-core machine), and a transform reads one before its first planned read, so those
milliseconds are a cold merge's. A ``ParallelStrategyMap`` is a few small messages per parameter,
which the loop below decodes at about 200 ns a byte (15 µs a parameter; the bench's 228-parameter
file in 3 ms, against 15 ms for the runtime's import and parse). The runtime's C parser takes about
6 ns a byte, so past ``WIRE_LIMIT`` (64 KiB, ~800 parameters) it is faster even with its import
paid, and ``formats.strategy`` hands larger files to it. Everything that writes strategy bytes
(merging per-stage files, the drop-in's outputs) uses the runtime too, so written bytes stay
identical to MindSpore's.

The reader follows protobuf's rules for proto2, so both readers give the same ``StrategyFile``
(``tests/test_strategy_proto.py`` compares them on generated and corrupted files):

* unknown fields and groups are skipped; a known field with another wire type counts as unknown;
* repeated numbers are read packed or not; a singular number given twice keeps the last value;
  a singular message given twice is the merge of both (the concatenation of their bytes);
* ``uint32`` and ``int32`` keep the low 32 bits of the varint, ``int64`` all 64, signed as stored;
* required fields are checked, and the first missing ones are named by the paths protobuf's
  ``FindInitializationErrors`` uses (``parallel_layout_item[0].parallel_layouts.field``);
* a string that is not UTF-8 stays ``bytes`` (the caller refuses it, as it does the runtime's).

Decoded messages are ``types.SimpleNamespace`` objects with the runtime's attribute names, so the
code that turns a message into a ``StrategyFile`` reads both the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

PACKAGE = "mindspore.straspb"
REQUIRED = "LABEL_REQUIRED"
REPEATED = "LABEL_REPEATED"
MESSAGE = "TYPE_MESSAGE"
STRING = "TYPE_STRING"
WIRE_LIMIT = 64 * 1024  # bytes (~800 parameters): larger files are read by the protobuf runtime (module docstring)

# message -> [(field name, number, label, type, message type name or None)] (docs/formats.md §2.1)
SCHEMA: dict[str, list[tuple[str, int, str, str, str | None]]] = {
    "ParallelStrategy": [("dim", 1, REPEATED, "TYPE_UINT32", None)],
    "ParallelStrategys": [
        ("stage", 1, REQUIRED, "TYPE_UINT32", None),
        ("parallel_strategy", 2, REPEATED, MESSAGE, "ParallelStrategy"),
    ],
    "ParallelStrategyItem": [
        ("node_name", 1, REQUIRED, STRING, None),
        ("parallel_strategys", 2, REQUIRED, MESSAGE, "ParallelStrategys"),
    ],
    "DevMatrix": [("dim", 1, REPEATED, "TYPE_UINT32", None)],
    "TensorMap": [("dim", 1, REPEATED, "TYPE_INT32", None)],
    "ParamSplitShape": [("dim", 1, REPEATED, "TYPE_INT64", None)],
    "IndicesOffset": [("dim", 1, REPEATED, "TYPE_INT64", None)],
    "ParallelLayouts": [
        ("dev_matrix", 1, REPEATED, MESSAGE, "DevMatrix"),
        ("tensor_map", 2, REPEATED, MESSAGE, "TensorMap"),
        ("param_split_shape", 3, REPEATED, MESSAGE, "ParamSplitShape"),
        ("indices_offset", 4, REPEATED, MESSAGE, "IndicesOffset"),
        ("field", 5, REQUIRED, "TYPE_INT32", None),
        ("opt_weight_shard_step", 6, REQUIRED, "TYPE_INT32", None),
        ("opt_weight_shard_size", 7, REQUIRED, "TYPE_INT32", None),
    ],
    "ParallelLayoutItem": [
        ("param_name", 1, REQUIRED, STRING, None),
        ("parallel_layouts", 2, REQUIRED, MESSAGE, "ParallelLayouts"),
    ],
    "ParallelGroupRanks": [("dim", 1, REPEATED, "TYPE_UINT32", None)],
    "ParallelGroupItem": [
        ("group_name", 1, REQUIRED, STRING, None),
        ("parallel_group_ranks", 2, REQUIRED, MESSAGE, "ParallelGroupRanks"),
    ],
    "ParallelGroupMap": [
        ("parallel_group_item", 1, REPEATED, MESSAGE, "ParallelGroupItem"),
        ("ckpt_restore_rank_list", 2, REQUIRED, MESSAGE, "ParallelGroupRanks"),
    ],
    "ParallelStrategyMap": [
        ("current_stage", 1, REQUIRED, "TYPE_UINT32", None),
        ("parallel_strategy_item", 2, REPEATED, MESSAGE, "ParallelStrategyItem"),
        ("parallel_layout_item", 3, REPEATED, MESSAGE, "ParallelLayoutItem"),
    ],
}

_VARINT, _FIXED64, _DELIMITED, _GROUP_START, _GROUP_END, _FIXED32 = 0, 1, 2, 3, 4, 5
_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1
_SIGNED = {"TYPE_INT32": 32, "TYPE_INT64": 64}  # every other number of the schema is a uint32
# How a tag is read (``_key_table``): one number, the next of a repeated number, packed numbers,
# a string, the next of a repeated message, the one message of a singular field.
_ONE_NUMBER, _NEXT_NUMBER, _PACKED, _STRING, _NEXT_MESSAGE, _ONE_MESSAGE = range(6)


class WireError(ValueError):
    """The bytes are not a message of the schema (truncated, a bad tag, missing required fields)."""


def decode(data: bytes, message: str = "ParallelStrategyMap") -> SimpleNamespace:
    """``data`` as a ``message`` of ``SCHEMA``, its required fields checked (``WireError`` if not)."""
    decoded, complete = _message(bytes(data), 0, len(data), message)
    if not complete:
        missing = list(_missing(decoded, message, ""))
        raise WireError(f"missing required fields: {', '.join(missing[:3])}")
    return decoded


def _message(data: bytes, pos: int, end: int, message: str) -> tuple[SimpleNamespace, bool]:
    """The message in ``data[pos:end]``, and whether it and every message in it has its required fields."""
    keys = _KEYS[message]
    values: dict[str, Any] = {name: [] for name in _REPEATED[message]}
    seen: set[str] = set()
    complete = True
    parts: dict[str, list[bytes]] = {}  # singular messages: every occurrence, merged at the end
    while pos < end:
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos, end)
        read = keys.get(key)
        if read is None:  # unknown, or a known field with another wire type (protobuf's rule)
            if key >> 3 == 0:
                raise WireError("field number 0")
            pos = _skip(data, pos, end, key & 7, key >> 3)
            continue
        name, how, kind, sub = read
        seen.add(name)
        if how in (_ONE_NUMBER, _NEXT_NUMBER):
            raw, pos = _varint(data, pos, end)
            number = _number(raw, kind)
            if how == _ONE_NUMBER:
                values[name] = number
            else:
                values[name].append(number)
            continue
        length, pos = _varint(data, pos, end)
        stop = pos + length
        if stop > end:
            raise WireError("truncated field")
        if how == _NEXT_MESSAGE:
            item, whole = _message(data, pos, stop, sub)
            values[name].append(item)
            complete = complete and whole
        elif how == _STRING:
            values[name] = _text(data[pos:stop])
        elif how == _PACKED:
            numbers = values[name]
            while pos < stop:
                raw, pos = _varint(data, pos, stop)
                numbers.append(_number(raw, kind))
        else:
            parts.setdefault(name, []).append(data[pos:stop])
        pos = stop
    for name, pieces in parts.items():
        joined = b"".join(pieces)
        values[name], whole = _message(joined, 0, len(joined), _MESSAGE_OF[message][name])
        complete = complete and whole
    for name, default in _SINGULAR[message]:
        values.setdefault(name, default)
    return SimpleNamespace(_seen=seen, **values), complete and _REQUIRED[message] <= seen


def _default(kind: str) -> object:
    """An absent singular field's value, as the runtime gives it (a message: None here)."""
    return None if kind == MESSAGE else "" if kind == STRING else 0


def _key_table(fields: list[tuple[str, int, str, str, str | None]]) -> dict[int, tuple[str, int, str, str]]:
    """Each tag (field number and wire type) a message's fields are read from, and how."""
    table: dict[int, tuple[str, int, str, str]] = {}
    for name, number, label, kind, sub in fields:
        if kind in (MESSAGE, STRING):
            how = _STRING if kind == STRING else _NEXT_MESSAGE if label == REPEATED else _ONE_MESSAGE
            table[number << 3 | _DELIMITED] = (name, how, kind, str(sub))
        elif label == REPEATED:
            table[number << 3 | _VARINT] = (name, _NEXT_NUMBER, kind, "")
            table[number << 3 | _DELIMITED] = (name, _PACKED, kind, "")
        else:
            table[number << 3 | _VARINT] = (name, _ONE_NUMBER, kind, "")
    return table


_KEYS = {name: _key_table(fields) for name, fields in SCHEMA.items()}
_REPEATED = {name: [spec[0] for spec in fields if spec[2] == REPEATED] for name, fields in SCHEMA.items()}
_SINGULAR = {
    name: [(spec[0], _default(spec[3])) for spec in fields if spec[2] != REPEATED] for name, fields in SCHEMA.items()
}
_MESSAGE_OF = {
    name: {spec[0]: str(spec[4]) for spec in fields if spec[3] == MESSAGE} for name, fields in SCHEMA.items()
}
_REQUIRED = {name: {spec[0] for spec in fields if spec[2] == REQUIRED} for name, fields in SCHEMA.items()}


def _missing(decoded: SimpleNamespace, message: str, prefix: str) -> Iterator[str]:
    """Paths of the required fields missing in ``decoded`` and in every message it holds (only
    walked when one is missing)."""
    for name, _, label, _, _ in SCHEMA[message]:
        if label == REQUIRED and name not in decoded._seen:
            yield prefix + name
    for name, _, label, kind, sub in SCHEMA[message]:
        if kind != MESSAGE:
            continue
        value = getattr(decoded, name)
        if label == REPEATED:
            for k, item in enumerate(value):
                yield from _missing(item, str(sub), f"{prefix}{name}[{k}].")
        elif value is not None:
            yield from _missing(value, str(sub), f"{prefix}{name}.")


def _number(raw: int, kind: str) -> int:
    bits = _SIGNED.get(kind)
    if bits is None:
        return raw & _MASK32
    value = raw & ((1 << bits) - 1)
    return value - (1 << bits) if value >> (bits - 1) else value


def _text(payload: bytes) -> str | bytes:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return payload


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    if pos < end and data[pos] < 0x80:  # most keys, lengths and dims are one byte
        return data[pos], pos + 1
    value = shift = 0
    for at in range(pos, min(end, pos + 10)):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _MASK64, at + 1
        shift += 7
    raise WireError("truncated varint" if end - pos < 10 else "varint longer than 10 bytes")


def _skip(data: bytes, pos: int, end: int, wire: int, number: int) -> int:
    """The position after an unknown field's value (a group: after its end tag)."""
    if wire == _VARINT:
        return _varint(data, pos, end)[1]
    if wire in (_FIXED64, _FIXED32):
        stop = pos + (8 if wire == _FIXED64 else 4)
    elif wire == _DELIMITED:
        length, pos = _varint(data, pos, end)
        stop = pos + length
    elif wire == _GROUP_START:
        while True:
            key, pos = _varint(data, pos, end)
            if key >> 3 == 0:
                raise WireError("field number 0")
            if key & 7 == _GROUP_END:
                if key >> 3 != number:
                    raise WireError("group ends with another field number")
                return pos
            pos = _skip(data, pos, end, key & 7, key >> 3)
    else:
        raise WireError(f"wire type {wire}" + (" outside a group" if wire == _GROUP_END else ""))
    if stop > end:
        raise WireError("truncated field")
    return stop


__all__ = [
    "MESSAGE",
    "PACKAGE",
    "REPEATED",
    "REQUIRED",
    "SCHEMA",
    "STRING",
    "WIRE_LIMIT",
    "WireError",
    "decode",
]
