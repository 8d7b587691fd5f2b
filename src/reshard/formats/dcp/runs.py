"""Templates of pickled records, and the rows of a file that repeat one, found and read with numpy.

``bulk``'s machine executes one record with placeholders for what may differ from row to row: its
integers (``_Col``), the strings it fetches from the memo (``_Ref``) and the strings it writes out
(torch writes a tensor's name afresh in every storage entry of a rank). The record's bytes are the
``Template``: between those columns every byte must recur. A template without varying strings has
one length, and its rows are a strided view of the file (``_fixed_rows``). One with varying strings
is cut into segments at each string; its rows are followed segment by segment, each string's
length read from its length field (``_chain``; for many rows, the rows are found by their leading
bytes instead), then every row is checked whole (``_variable_rows``). Either way a row that differs
where the template is fixed ends the run, and the rows matched are exactly what executing them
opcode by opcode would read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_FIRST_ROWS = 64  # rows matched at first; then eight times as many each time all matched


class GiveUp(Exception):
    """Something the runs do not cover: the caller reads the file with the unpickler instead."""


class _Col:
    """An integer of a template record: the rows' values are column ``k``."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


class _Ref:
    """A string of a template record, fetched from the memo or written out by column ``k``."""

    __slots__ = ("k", "value")

    def __init__(self, k: int, value: str) -> None:
        self.k, self.value = k, value


FIXED, UINT, SINT, GET, PUT, TEXT = range(6)  # what the bytes of a template column are


@dataclass
class Column:
    """An argument of the template's opcodes: ``width`` bytes at ``at`` in segment ``segment``
    (for ``TEXT``, its length field: the string follows, and ends the segment when it varies)."""

    at: int
    width: int
    kind: int
    segment: int = 0


@dataclass
class Segment:
    """A stretch of a template between varying strings: its length and the bytes every row repeats."""

    length: int
    fixed: np.ndarray  # offsets in the segment
    values: np.ndarray  # the bytes there


@dataclass
class Template:
    """One record's bytes, which of them recur in every row, and where its fields' columns are."""

    kind: str  # "chunk" | "entry"
    data: np.ndarray  # the record's bytes (uint8)
    columns: list[Column]
    objects: tuple[Any, ...]  # what the record made: the chunk record, or the key and the value
    memo_objects: list[Any]  # what it memoised, in order (memo entries of row r follow from these)
    segments: list[Segment] = field(default_factory=list)
    texts: list[int] = field(default_factory=list)  # the varying strings' columns, in order
    puts: list[int] = field(default_factory=list)  # the columns of explicit memo puts (protocol 2)
    value_refs: frozenset[int] = frozenset()  # GET and TEXT columns whose strings are field values
    opening: list[tuple[int, bytes]] = field(default_factory=list)  # the first segment's fixed stretches
    stretches: list[list[tuple[int, bytes]]] = field(default_factory=list)  # every segment's

    def may_start(self, raw: bytearray, pos: int) -> bool:
        """Whether a row of this template starts at ``pos``: its fixed bytes there, segment after
        segment (a quick test in Python before numpy matches the rows)."""
        at = pos
        for s, stretches in enumerate(self.stretches):
            if not all(raw.startswith(stretch, at + offset) for offset, stretch in stretches):
                return False
            if s < len(self.texts):
                text = self.columns[self.texts[s]]
                size = int.from_bytes(raw[at + text.at : at + text.at + text.width], "little")
                at += self.segments[s].length + size
        return True

    @property
    def length(self) -> int:
        return len(self.data)


def value_refs(objects: tuple[Any, ...]) -> frozenset[int]:
    """The columns of strings that are the records' field values (they may differ by row)."""
    refs: set[int] = set()
    for obj in objects:
        state = getattr(obj, "state", None)
        if isinstance(state, dict):
            refs.update(v.k for v in state.values() if isinstance(v, _Ref))
    return frozenset(refs)


def make_template(
    kind: str, data: np.ndarray, arguments: list[tuple[int, int, int]], objects: tuple[Any, ...], memo: list[Any]
) -> Template:
    """The template of one recorded record: ``arguments`` are its opcodes' (offset, width, kind)."""
    refs = value_refs(objects)
    columns = [Column(at, width, kind_) for at, width, kind_ in arguments]
    template = Template(kind, data, columns, objects, memo, value_refs=refs)
    template.puts = [k for k, c in enumerate(columns) if c.kind == PUT]
    if template.puts and len(template.puts) != len(memo):
        raise GiveUp("memo puts and MEMOIZE in one record")
    varying = refs | {k for k, c in enumerate(columns) if c.kind in (UINT, SINT, PUT)}
    template.texts = [k for k in sorted(varying, key=lambda k: columns[k].at) if columns[k].kind == TEXT]
    mask = np.ones(len(data), dtype=bool)
    for k in varying:
        mask[columns[k].at : columns[k].at + columns[k].width] = False
    seg_starts = [0] + [_text_end(data, columns[k]) for k in template.texts]
    seg_ends = [columns[k].at + columns[k].width for k in template.texts] + [len(data)]
    for start, end in zip(seg_starts, seg_ends, strict=True):
        fixed = np.flatnonzero(mask[start:end])
        template.segments.append(Segment(end - start, fixed, data[start:end][fixed]))
    for k, c in enumerate(columns):
        segment = int(np.searchsorted(seg_starts, c.at, side="right")) - 1
        kind_ = c.kind if k in varying or c.kind not in (GET, TEXT) else FIXED
        columns[k] = Column(c.at - seg_starts[segment], c.width, kind_, segment)
    template.memo_objects = [_memo_value(v, varying) for v in memo]
    template.stretches = [_stretches(data[a:b], mask[a:b]) for a, b in zip(seg_starts, seg_ends, strict=True)]
    template.opening = template.stretches[0]
    return template


def _stretches(data: np.ndarray, fixed: np.ndarray) -> list[tuple[int, bytes]]:
    """The runs of fixed bytes of ``data``: (offset, bytes) each."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], fixed.astype(np.int8), [0]))))
    return [(int(a), data[a:b].tobytes()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _memo_value(value: Any, varying: frozenset[int] | set[int]) -> Any:
    """A memoised string of a record: its own per row (a varying column), else the same in every row."""
    if isinstance(value, _Ref) and value.k not in varying:
        return value.value
    return value


def _text_end(data: np.ndarray, column: Column) -> int:
    """Where a string's bytes end in the template (its length field is at ``column.at``)."""
    size = int.from_bytes(data[column.at : column.at + column.width].tobytes(), "little")
    return column.at + column.width + size


# ------------------------------------------------------------------------------------------ rows


def _ints(raw: np.ndarray, kind: int) -> np.ndarray:
    """(rows, width) little-endian bytes as int64: unsigned, or (``SINT``) two's complement."""
    width = raw.shape[1]
    raw = np.ascontiguousarray(raw)
    if width in (1, 2, 4) and kind != SINT:
        return raw.view(f"<u{width}").ravel().astype(np.int64)
    if width == 4:
        return raw.view("<i4").ravel().astype(np.int64)
    padded = np.zeros((len(raw), 8), dtype=np.uint8)  # LONG1: up to 8 bytes
    padded[:, :width] = raw
    if 0 < width < 8:
        padded[raw[:, width - 1] >= 0x80, width:] = 0xFF
    return padded.view("<i8").ravel().copy()


def gather(data: np.ndarray, starts: np.ndarray, width: int | np.ndarray) -> np.ndarray:
    """``data[s + o]`` for each start ``s`` and offset ``o`` (``width``: the offsets, or their count),
    as a (rows, offsets) array; zeros past the end."""
    offsets = np.arange(width, dtype=np.int64) if isinstance(width, int) else width
    if not len(starts) or not len(offsets):
        return np.zeros((len(starts), len(offsets)), dtype=np.uint8)
    if isinstance(width, int) and int(starts.max()) + width <= len(data) and int(starts.min()) >= 0:
        return sliding_window_view(data, width)[starts]  # a row copied at a time, no index per byte
    index = starts[:, None] + offsets[None, :]
    if int(starts.max()) + int(offsets.max()) < len(data):
        return data[index]
    inside = index < len(data)
    out = data[np.minimum(index, len(data) - 1)]
    out[~inside] = 0
    return out


def column_values(blocks: list[np.ndarray], column: Column) -> np.ndarray:
    """A column's integers, a row each, from the rows' segments (``Rows.blocks``)."""
    return _ints(blocks[column.segment][:, column.at : column.at + column.width], column.kind)


@dataclass
class Rows:
    """The rows a template matched: each segment's start in the file, per row; and where they end."""

    starts: list[np.ndarray]
    end: int
    blocks: list[np.ndarray]  # each segment's bytes, (rows, segment length)

    @property
    def count(self) -> int:
        return len(self.starts[0])


def matching_rows(data: np.ndarray, pos: int, template: Template, memo_next: int, raw: bytearray) -> Rows:
    """The rows from ``pos`` that repeat ``template`` (its fixed bytes, and explicit memo puts that
    count on from ``memo_next``); none when the first differs. ``data`` is ``raw`` as a numpy array."""
    if len(template.segments) == 1:
        return _fixed_rows(data, pos, template, memo_next)
    return _variable_rows(data, pos, template, memo_next, raw)


def _puts_hold(blocks: list[np.ndarray], template: Template, first_row: int, memo_next: int) -> Any:
    per_row = len(template.memo_objects)
    ok = np.ones(len(blocks[0]), dtype=bool)
    for j, k in enumerate(template.puts):
        first = memo_next + first_row * per_row + j
        ok &= column_values(blocks, template.columns[k]) == first + per_row * np.arange(len(ok))
    return ok


def _fixed_rows(data: np.ndarray, pos: int, template: Template, memo_next: int) -> Rows:
    length, total = template.length, 0
    left = (len(data) - pos) // length
    batch = min(left, _FIRST_ROWS)
    segment = template.segments[0]
    while batch:
        start = pos + total * length
        block = data[start : start + batch * length].reshape(batch, length)
        good = (block[:, segment.fixed] == segment.values).all(axis=1)
        if template.puts:
            good &= _puts_hold([block], template, total, memo_next)
        matched = batch if good.all() else int(np.argmin(good))
        total += matched
        if matched < batch:
            break
        left -= batch
        batch = min(left, batch * 8)
    starts = pos + length * np.arange(total, dtype=np.int64)
    return Rows([starts], pos + total * length, [data[pos : pos + total * length].reshape(total, length)])


def _chain(raw: bytearray, pos: int, template: Template, count: int) -> np.ndarray:
    """Where ``count`` rows from ``pos`` would start if each were ``template``'s: each row's strings'
    lengths read from their length fields (rows past the run's end are nonsense; ``_follow`` says so)."""
    fields = []  # (offset of the length field from its segment's start, its width, the segment's length)
    for s, k in enumerate(template.texts):
        column = template.columns[k]
        fields.append((column.at, column.width, template.segments[s].length))
    last = template.segments[-1].length
    starts: list[int] = []
    at, end = pos, len(raw)
    for _ in range(count):
        row = at
        for offset, width, length in fields:
            if at + offset + width > end:
                return np.array(starts, dtype=np.int64)
            size = raw[at + offset] if width == 1 else int.from_bytes(raw[at + offset : at + offset + width], "little")
            at += length + size
        at += last
        if at > end:
            break
        starts.append(row)
    return np.array(starts, dtype=np.int64)


def _candidates(data: np.ndarray, start: int, end: int, prefix: bytes) -> np.ndarray:
    """Where ``prefix`` occurs in ``data[start:end]`` (absolute offsets)."""
    region = data[start:end]
    n = len(region) - len(prefix) + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    found = np.flatnonzero((region[:n] == prefix[0]) & (region[1 : n + 1] == prefix[1]))
    for i in range(2, len(prefix)):
        found = found[region[found + i] == prefix[i]]
    return found.astype(np.int64) + start


def _row_starts(data: np.ndarray, raw: bytearray, at: int, template: Template, batch: int) -> np.ndarray:
    """Up to about ``batch`` places rows may start at from ``at``: followed one by one (few rows), or
    (many) found by the template's leading bytes and kept while each starts where the last one ends."""
    opening = template.opening[0] if template.opening and template.opening[0][0] == 0 else None
    if batch <= _FIRST_ROWS or opening is None or len(opening[1]) < 3:
        return _chain(raw, at, template, batch)
    found = _candidates(data, at, min(len(data), at + batch * template.length * 2), opening[1][:16])
    if not len(found) or found[0] != at:
        return np.zeros(0, dtype=np.int64)
    return found


def _variable_rows(data: np.ndarray, pos: int, template: Template, memo_next: int, raw: bytearray) -> Rows:
    starts: list[list[np.ndarray]] = [[] for _ in template.segments]
    blocks: list[list[np.ndarray]] = [[] for _ in template.segments]
    batch, total, at = _FIRST_ROWS, 0, pos
    while at < len(data):
        found = _row_starts(data, raw, at, template, batch)
        if not len(found):
            break
        segs, ends, ok, parts = _follow(data, found, template)
        ok &= np.concatenate(([at], ends[:-1])) == found  # each row where the one before it ends
        if template.puts:
            ok &= _puts_hold(parts, template, total, memo_next)
        matched = len(ok) if ok.all() else int(np.argmin(ok))
        for s, column in enumerate(segs):
            starts[s].append(column[:matched])
            blocks[s].append(parts[s][:matched])
        total += matched
        if not matched:
            break
        at = int(ends[matched - 1])
        if matched < len(ok):
            break
        batch *= 8
    joined = [np.concatenate(s) if s else np.zeros(0, dtype=np.int64) for s in starts]
    lengths = [segment.length for segment in template.segments]
    kept = [np.concatenate(b) if b else np.zeros((0, n), dtype=np.uint8) for b, n in zip(blocks, lengths, strict=True)]
    return Rows(joined, at, kept)


def _follow(
    data: np.ndarray, found: np.ndarray, template: Template
) -> tuple[list[np.ndarray], np.ndarray, Any, list[np.ndarray]]:
    """Each candidate row followed segment by segment: the segments' starts, the rows' ends, whether
    every fixed byte is where the template has it, and the segments' bytes."""
    ok = np.ones(len(found), dtype=bool)
    segs, parts, at = [], [], found
    for s, segment in enumerate(template.segments):
        segs.append(at)
        block = gather(data, at, segment.length)
        parts.append(block)
        ok &= (block[:, segment.fixed] == segment.values).all(axis=1)
        if s < len(template.texts):
            text = template.columns[template.texts[s]]
            at = at + segment.length + _ints(block[:, text.at : text.at + text.width], UINT)
    ends = at + template.segments[-1].length
    return segs, ends, ok & (ends <= len(data)), parts


def text_values(data: np.ndarray, rows: Rows, template: Template, k: int, known: Any) -> np.ndarray:
    """The ids (in ``known``, a ``bulk.Strings``) of the strings varying column ``k`` writes out, a row each."""
    column = template.columns[k]
    at = rows.starts[column.segment] + column.at
    sizes = column_values(rows.blocks, Column(column.at, column.width, UINT, column.segment))
    widest = int(sizes.max()) if len(sizes) else 0
    raw = gather(data, at + column.width, widest)
    raw[np.arange(widest)[None, :] >= sizes[:, None]] = 0
    ids = known.ids_of_texts(raw, sizes)
    if (ids < 0).any():  # strings not seen before: each distinct one read once
        new = np.flatnonzero(ids < 0)
        keyed = np.concatenate([raw[new], sizes[new].astype("<u4").view(np.uint8).reshape(-1, 4)], axis=1)
        void = np.ascontiguousarray(keyed).view(np.dtype((np.void, keyed.shape[1]))).ravel()
        _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
        try:
            names = [raw[new[i], : sizes[new[i]]].tobytes().decode("utf-8", "surrogatepass") for i in first.tolist()]
        except UnicodeDecodeError as exc:
            raise GiveUp("text") from exc
        ids[new] = np.array([known.id(n) for n in names], dtype=np.int32)[inverse.ravel()]
    return ids


__all__ = [
    "FIXED",
    "GET",
    "PUT",
    "SINT",
    "TEXT",
    "UINT",
    "Column",
    "GiveUp",
    "Rows",
    "Segment",
    "Template",
    "column_values",
    "gather",
    "make_template",
    "matching_rows",
    "text_values",
    "value_refs",
]
