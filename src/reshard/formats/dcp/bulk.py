"""A large ``.metadata`` read in runs of like records, without the C unpickler walking every chunk.

A checkpoint saved by 4,096 ranks with 5,000 fully sharded parameters lists 20 million chunks and as many
storage entries; unpickling them makes 20 million Python records of each kind (about 6 µs a chunk:
two minutes), which no planning in seconds survives. But the pickle of a chunk list is the same few
dozen opcodes over and over, differing only in the integers (and, for storage entries, in which memo
entry names the tensor and the file): one record's bytes are a template for its neighbours.

``read_bulk`` therefore runs a small pickle machine of its own over the structure (the tensors, their
properties, the planner data: thousands of opcodes), and where a chunk record (``ChunkStorageMetadata``)
or a storage entry (``MetadataIndex`` -> ``_StorageInfo``) begins, it executes that one record with
placeholders for its integers (``_Col``) and for the strings it fetches from the memo (``_Ref``). That
gives a ``Template``: the record's length, which bytes must recur unchanged, and where each field's
integer or memo index sits. The records that follow are then matched as rows of a numpy view of the
file (a record whose bytes differ where the template is fixed ends the run) and their fields read as
columns; memo entries the rows make are kept as ranges, not objects. A run ends at a batch mark
(pickle writes ``APPENDS``/``SETITEMS`` every 1,000 items), a wider integer or a new file name; the
machine takes the next opcodes and starts the next run, from a template it has seen when one fits.

The machine allows exactly what the allowlisting unpickler allows (the same globals, through its
``find_class``) and gives up (``None``) at anything else: an opcode it does not know, a record of
another shape, a structure the columns cannot say, too many short runs. The caller then reads the file
with the unpickler, which says what is wrong when something is; so this path decides nothing about
validity and can only be faster. Protocol 4 and 5 frames are taken out first (``_deframed``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.formats.dcp.records import _FILESYSTEM, _META
from reshard.formats.dcp.runs import (
    GET,
    PUT,
    SINT,
    TEXT,
    UINT,
    GiveUp,
    Rows,
    Template,
    _Col,
    _Ref,
    column_values,
    make_template,
    matching_rows,
    text_values,
)
from reshard.formats.dcp.unpickling import _RECORD_CLASSES, _MetadataUnpickler, _Pickled, _PickleInput

CHUNK_CLASS = _RECORD_CLASSES[(_META, "ChunkStorageMetadata")]
INDEX_CLASS = _RECORD_CLASSES[(_META, "MetadataIndex")]
INFO_CLASS = _RECORD_CLASSES[(_FILESYSTEM, "_StorageInfo")]
_BATCH_MARKS = {"chunk": b"e(", "entry": b"u("}  # APPENDS / SETITEMS, then MARK: one batch ends, the next begins
_TEMPLATES_KEPT = 8  # the templates tried before a new one is recorded
_MAX_INT_BYTES = 8  # a LONG1 wider than int64: given up (the unpickler reads it)


@dataclass(eq=False)  # hashed by identity: a run stands as a key of the storage dict
class Run:
    """Rows of one template: each column's values (int64), and the memo range the rows filled."""

    template: Template
    rows: int
    values: dict[int, np.ndarray]
    memo_start: int
    strings: dict[int, np.ndarray] = field(default_factory=dict)  # a string column's ids (int32) in ``Strings``


def _plain(value: Any) -> Any:
    """A placeholder used as something other than a field's value (a key, a global's name): it must
    then be the same in every row, which its column being fixed says."""
    if isinstance(value, _Ref):
        return value.value
    if isinstance(value, _Col):
        raise GiveUp("an integer of a record used as a key")
    return value


# ------------------------------------------------------------------------------------- machine


def _row_hashes(raw: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row's bytes and length (a lookup key only: matches are checked)."""
    width = raw.shape[1]
    hashes = sizes.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    if width:
        padded = np.zeros((len(raw), -(-width // 8) * 8), dtype=np.uint8)
        padded[:, :width] = raw
        words = padded.view("<u8")
        for j in range(words.shape[1]):  # the words a row has (not its padding: widths differ)
            mixed = (hashes ^ words[:, j]) * np.uint64(0x100000001B3)
            mixed ^= mixed >> np.uint64(29)
            hashes = np.where(sizes > 8 * j, mixed, hashes)
    return hashes


class Strings:
    """The strings the memo holds: an id for each distinct one, and which memo indexes hold which.

    Memo indexes only grow as the machine goes, so the index column stays sorted as it is appended
    to, and a run's references are looked up all at once (``searchsorted``)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._keys = np.zeros(1024, dtype=np.int64)
        self._values = np.zeros(1024, dtype=np.int32)
        self._count = 0
        self._hashed = 0  # how many names the hash table has
        self._table = (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int32))
        self._canonical = np.zeros((0, 0), dtype=np.uint8)
        self._lengths = np.zeros(0, dtype=np.int64)

    def id(self, name: str) -> int:
        found = self._ids.get(name)
        if found is None:
            found = self._ids[name] = len(self.names)
            self.names.append(name)
        return found

    def ids_of_texts(self, raw: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The id of each row's string (its bytes zero-padded in ``raw``, its length in ``sizes``), -1
        for one not known yet: found by a hash of the bytes, then checked byte for byte."""
        if not len(raw) or not self.names:
            return np.full(len(raw), -1, dtype=np.int32)
        hashes = _row_hashes(raw, sizes)
        table = self._hash_table()
        at = np.minimum(np.searchsorted(table[0], hashes), len(table[0]) - 1)
        ids = np.where(table[0][at] == hashes, table[1][at], -1).astype(np.int32)
        hit = np.flatnonzero(ids >= 0)
        if len(hit):
            width = raw.shape[1]
            canonical, lengths = self._padded(width)
            same = (lengths[ids[hit]] == sizes[hit]) & (canonical[ids[hit], :width] == raw[hit]).all(axis=1)
            ids[hit[~same]] = -1
        return ids

    def _hash_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The hashes of the names known when it was last made (again once they doubled: a name
        added since is found by ``id``, after it is decoded)."""
        if len(self.names) > 2 * self._hashed:
            encoded = [n.encode("utf-8", "surrogatepass") for n in self.names]
            width = max(map(len, encoded), default=0)
            raw = np.zeros((len(encoded), width), dtype=np.uint8)
            for i, b in enumerate(encoded):
                raw[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
            sizes = np.array(list(map(len, encoded)), dtype=np.int64)
            hashes = _row_hashes(raw, sizes)
            order = np.argsort(hashes, kind="stable")
            self._table = (hashes[order], order.astype(np.int32))
            self._canonical, self._lengths, self._hashed = raw, sizes, len(self.names)
        return self._table

    def _padded(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        canonical = self._canonical
        if canonical.shape[1] < width:
            canonical = np.pad(canonical, ((0, 0), (0, width - canonical.shape[1])))
        return canonical, self._lengths

    def known(self, name: str) -> int | None:
        return self._ids.get(name)

    def held(self, index: int, name: str) -> None:
        """Memo entry ``index`` holds ``name`` (indexes come in increasing order)."""
        self.held_many(np.array([index], dtype=np.int64), np.array([self.id(name)], dtype=np.int32))

    def held_many(self, indexes: np.ndarray, ids: np.ndarray) -> None:
        """Memo entries ``indexes`` (increasing) hold the strings ``ids``."""
        if not len(indexes):
            return
        if self._count and indexes[0] <= self._keys[self._count - 1]:
            raise GiveUp("memo indexes out of order")
        need = self._count + len(indexes)
        if need > len(self._keys):
            size = max(need, 2 * len(self._keys))
            self._keys = np.concatenate([self._keys[: self._count], np.zeros(size - self._count, dtype=np.int64)])
            self._values = np.concatenate([self._values[: self._count], np.zeros(size - self._count, dtype=np.int32)])
        self._keys[self._count : need], self._values[self._count : need] = indexes, ids
        self._count = need

    def lookup(self, index: int) -> str | None:
        keys = self.keys()
        at = int(np.searchsorted(keys, index))
        return self.names[int(self._values[at])] if at < len(keys) and keys[at] == index else None

    def keys(self) -> np.ndarray:
        return self._keys[: self._count]

    def ids(self) -> np.ndarray:
        return self._values[: self._count]


def _deframed(raw: bytearray) -> bytearray:
    """``raw`` with its protocol 4/5 ``FRAME`` headers taken out in place (frames sit between opcodes,
    so what is left is the same pickle, unframed); a stream that is not framed is left as it is."""
    if len(raw) < 2 or raw[0] != 0x80 or raw[1] < 4:
        return raw
    read, write = 2, 2
    while read < len(raw) and raw[read] == 0x95:
        size = int.from_bytes(raw[read + 1 : read + 9], "little")
        start = read + 9
        if size > len(raw) - start:
            raise GiveUp("a frame past the end")
        raw[write : write + size] = raw[start : start + size]
        write += size
        read = start + size
    tail = len(raw) - read  # the last opcodes, too few for a frame of their own
    raw[write : write + tail] = raw[read:]
    del raw[write + tail :]
    return raw


class Machine:
    """The pickle machine: a stack, marks, a memo (objects, and ranges the runs filled)."""

    def __init__(self, raw: bytearray, max_runs: int) -> None:
        self.raw = raw
        self.data = np.frombuffer(raw, dtype=np.uint8)
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[int, Any] = {}
        self.memo_count = 0
        self.ranges: list[Run] = []  # runs that memoised, in memo order
        self.strings = Strings()
        self.runs = 0
        self.max_runs = max_runs
        self.templates: dict[str, list[Template]] = {"chunk": [], "entry": []}
        self.recording: list[tuple[int, int, int]] | None = None  # (at, width, kind) of each argument
        self.record_start = 0
        self.globals = _MetadataUnpickler(_PickleInput(b""), len(raw))  # for its find_class
        self.handlers = self._handlers()

    # ---- the loop

    def load(self) -> Any:
        pos, raw, handlers = 0, self.raw, self.handlers
        while True:
            op = raw[pos]
            if op == 0x2E:  # STOP
                if len(self.stack) != 1 or self.marks:
                    raise GiveUp("stack not one value at STOP")
                return self.stack[0]
            handler = handlers.get(op)
            if handler is None:
                raise GiveUp(f"opcode {op:#04x}")
            pos = handler(pos)

    def _argument(self, pos: int, width: int, kind: int) -> int:
        """Bytes ``pos + 1 ..`` as an unsigned (or, ``_SINT``, signed) integer, noted when recording."""
        chunk = self.raw[pos + 1 : pos + 1 + width]
        if len(chunk) < width:
            raise GiveUp("truncated")
        if self.recording is not None:
            self.recording.append((pos + 1 - self.record_start, width, kind))
        return int.from_bytes(chunk, "little", signed=kind == SINT)

    def _handlers(self) -> dict[int, Callable[[int], int]]:
        h: dict[int, Callable[[int], int]] = {
            0x80: lambda p: p + 2,  # PROTO
            0x28: self._mark,
            0x29: lambda p: self._push(p, ()),
            0x5D: lambda p: self._push(p, []),
            0x7D: lambda p: self._push(p, {}),
            0x4E: lambda p: self._push(p, None),
            0x88: lambda p: self._push(p, True),
            0x89: lambda p: self._push(p, False),
            0x74: self._tuple,
            0x85: lambda p: self._tuple_n(p, 1),
            0x86: lambda p: self._tuple_n(p, 2),
            0x87: lambda p: self._tuple_n(p, 3),
            0x61: self._append,
            0x65: self._appends,
            0x73: self._setitem,
            0x75: self._setitems,
            0x62: self._build,
            0x81: self._newobj,
            0x52: self._reduce,
            0x63: self._global,
            0x93: self._stack_global,
            0x94: self._memoize,
            0x71: lambda p: self._put(p, 1),
            0x72: lambda p: self._put(p, 4),
            0x68: lambda p: self._get(p, 1),
            0x6A: lambda p: self._get(p, 4),
            0x4B: lambda p: self._int(p, 1, UINT),
            0x4D: lambda p: self._int(p, 2, UINT),
            0x4A: lambda p: self._int(p, 4, SINT),
            0x8A: self._long1,
            0x8C: lambda p: self._text(p, 1),
            0x58: lambda p: self._text(p, 4),
            0x8D: lambda p: self._text(p, 8),
            0x30: self._pop,
        }
        return h

    # ---- opcodes

    def _push(self, pos: int, value: Any) -> int:
        self.stack.append(value)
        return pos + 1

    def _mark(self, pos: int) -> int:
        self.marks.append(len(self.stack))
        return pos + 1

    def _since_mark(self) -> list[Any]:
        if not self.marks:
            raise GiveUp("no mark")
        k = self.marks.pop()
        items = self.stack[k:]
        del self.stack[k:]
        return items

    def _tuple(self, pos: int) -> int:
        self.stack.append(tuple(map(_keep_column, self._since_mark())))
        return pos + 1

    def _tuple_n(self, pos: int, n: int) -> int:
        if len(self.stack) - n < (self.marks[-1] if self.marks else 0):
            raise GiveUp("tuple across a mark")
        items = self.stack[-n:]
        del self.stack[-n:]
        self.stack.append(tuple(map(_keep_column, items)))
        return pos + 1

    def _top(self, kind: type) -> Any:
        if not self.stack or type(self.stack[-1]) is not kind:
            raise GiveUp(f"no {kind.__name__} to add to")
        return self.stack[-1]

    def _append(self, pos: int) -> int:
        value = self.stack.pop()
        self._top(list).append(value)
        return pos + 1

    def _appends(self, pos: int) -> int:
        items = self._since_mark()
        self._top(list).extend(items)
        return pos + 1

    def _setitem(self, pos: int) -> int:
        if len(self.stack) < 3:
            raise GiveUp("setitem")
        value, key = self.stack.pop(), self.stack.pop()
        self._top(dict)[_plain(key)] = value
        return pos + 1

    def _setitems(self, pos: int) -> int:
        items = self._since_mark()
        if len(items) % 2:
            raise GiveUp("setitems of an odd count")
        target = self._top(dict)
        for k in range(0, len(items), 2):
            target[_plain(items[k])] = items[k + 1]
        return pos + 1

    def _build(self, pos: int) -> int:
        state = self.stack.pop()
        obj = self.stack[-1] if self.stack else None
        if not isinstance(obj, _Pickled) or hasattr(obj, "state"):
            raise GiveUp("build")
        obj.state = state
        return pos + 1

    def _newobj(self, pos: int) -> int:
        args, cls = self.stack.pop(), self.stack.pop()
        if args != () or not (isinstance(cls, type) and issubclass(cls, _Pickled)):
            raise GiveUp("newobj")
        self.stack.append(object.__new__(cls))
        return pos + 1

    def _reduce(self, pos: int) -> int:
        args, func = self.stack.pop(), self.stack.pop()
        if type(args) is not tuple or not callable(func) or isinstance(func, type):
            raise GiveUp("reduce")
        try:
            self.stack.append(func(*args))
        except (TypeError, ValueError) as exc:
            raise GiveUp("reduce") from exc
        return pos + 1

    def _find(self, module: Any, name: Any) -> Any:
        if type(module) is not str or type(name) is not str:
            raise GiveUp("global")
        try:
            return self.globals.find_class(module, name)
        except pickle.UnpicklingError as exc:
            raise GiveUp("refused global") from exc

    def _global(self, pos: int) -> int:
        first = self.raw.find(b"\n", pos + 1)
        second = self.raw.find(b"\n", first + 1) if first > 0 else -1
        if second < 0:
            raise GiveUp("global")
        module, name = bytes(self.raw[pos + 1 : first]), bytes(self.raw[first + 1 : second])
        self.stack.append(self._find(module.decode("ascii"), name.decode("ascii")))
        return second + 1

    def _stack_global(self, pos: int) -> int:
        name, module = _plain(self.stack.pop()), _plain(self.stack.pop())
        self.stack.append(self._find(module, name))
        return pos + 1

    def _memoize(self, pos: int) -> int:
        self._remember(self.memo_count)
        return pos + 1

    def _put(self, pos: int, width: int) -> int:
        index = self._argument(pos, width, PUT)
        self._remember(index)
        return pos + 1 + width

    def _remember(self, index: int) -> None:
        if not self.stack:
            raise GiveUp("memo of nothing")
        if index != self.memo_count:  # pickle.dump counts on; anything else is read by the unpickler
            raise GiveUp("memo out of order")
        value = self.memo[index] = self.stack[-1]
        self.memo_count += 1
        if type(value) is str and self.recording is None:
            self.strings.held(index, value)

    def _get(self, pos: int, width: int) -> int:
        index = self._argument(pos, width, GET)
        value = self.recall(index)
        if self.recording is not None and isinstance(value, str):
            value = _Ref(len(self.recording) - 1, value)
        elif self.recording is None:
            trigger = self._trigger(value, pos + 1 + width)
            if trigger:
                return self._bulk(pos, trigger)
        self.stack.append(value)
        return pos + 1 + width

    def _int(self, pos: int, width: int, kind: int) -> int:
        value = self._argument(pos, width, kind)
        self.stack.append(_Col(len(self.recording) - 1) if self.recording is not None else value)
        return pos + 1 + width

    def _long1(self, pos: int) -> int:
        width = self.raw[pos + 1]  # when recording, one of the fixed bytes: rows of another width differ
        if width > _MAX_INT_BYTES:
            raise GiveUp("a wide integer")
        value = self._argument(pos + 1, width, SINT)
        self.stack.append(_Col(len(self.recording) - 1) if self.recording is not None else value)
        return pos + 2 + width

    def _text(self, pos: int, width: int) -> int:
        size = int.from_bytes(self.raw[pos + 1 : pos + 1 + width], "little")
        start = pos + 1 + width
        if size > len(self.raw) - start:
            raise GiveUp("truncated")
        try:
            text = bytes(self.raw[start : start + size]).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise GiveUp("text") from exc
        if self.recording is not None:
            self._argument(pos, width, TEXT)
            self.stack.append(_Ref(len(self.recording) - 1, text))
        else:
            self.stack.append(text)
        return start + size

    def _pop(self, pos: int) -> int:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise GiveUp("pop")
        self.stack.pop()
        return pos + 1

    # ---- the memo

    def recall(self, index: int) -> Any:
        if index in self.memo:
            return self.memo[index]
        run = self._range_of(index)
        if run is None:
            raise GiveUp("memo index never put")
        objects = run.template.memo_objects
        value = objects[(index - run.memo_start) % len(objects)]
        if isinstance(value, _Ref):  # a string of its own in each row
            value = self.strings.lookup(index)
        if not _constant(value):
            raise GiveUp("a row's own object named again")
        return value

    def _range_of(self, index: int) -> Run | None:
        lo, hi = 0, len(self.ranges)
        while lo < hi:  # the last range starting at or before index
            mid = (lo + hi) // 2
            if self.ranges[mid].memo_start <= index:
                lo = mid + 1
            else:
                hi = mid
        if not lo:
            return None
        run = self.ranges[lo - 1]
        end = run.memo_start + run.rows * len(run.template.memo_objects)
        return run if index < end else None

    # ---- runs

    def _trigger(self, value: Any, after: int) -> str:
        """The kind of run that starts here: a chunk record in a tensor's ``chunks`` list, a storage
        entry in ``storage_data`` (the same classes elsewhere, as in a SavePlan, are read one by one)."""
        container: type
        if value is CHUNK_CLASS:
            kind, container, name = "chunk", list, "chunks"
        elif value is INDEX_CLASS:
            kind, container, name = "entry", dict, "storage_data"
        else:
            return ""
        if self.raw[after : after + 2] != b")\x81":
            return ""
        stack = self.stack
        for at in (self.marks[-1] - 1 if self.marks else -1, len(stack) - 1):  # in a batch, or alone
            if at >= 1 and type(stack[at]) is container and stack[at - 1] == name:
                return kind
        return ""

    def _bulk(self, pos: int, kind: str) -> int:
        """The run of records of ``kind`` starting at ``pos``: one stack value (and, for storage
        entries, None as its dict value) standing for all its rows."""
        self.runs += 1
        if self.runs > self.max_runs:
            raise GiveUp("too many short runs")
        template, rows = None, None
        for known in self.templates[kind]:
            if known.may_start(self.raw, pos):
                rows = matching_rows(self.data, pos, known, self.memo_count, self.raw)
                if rows.count:
                    template = known
                    break
        if template is None:
            template = self._record(pos, kind)
            rows = matching_rows(self.data, pos, template, self.memo_count, self.raw)
            if not rows.count:
                raise GiveUp("a record that does not repeat its own template")
            kept = self.templates[kind]
            kept.insert(0, template)
            del kept[_TEMPLATES_KEPT:]
        assert rows is not None
        rows = self._across_batches(template, rows, _BATCH_MARKS[kind])
        self.stack.append(self._run(template, rows))
        if kind == "entry":
            self.stack.append(None)
        return rows.end

    def _across_batches(self, template: Template, rows: Rows, mark: bytes) -> Rows:
        """``rows`` and the rows of the same template in the batches after it: pickle ends a batch of
        1 000 items with APPENDS (SETITEMS) and opens the next with MARK, which, between two runs of one
        list (dict), leave the stack and the marks as they were; so the rows stand as one run."""
        parts = [rows]
        per_row = len(template.memo_objects)
        while self.raw.startswith(mark, rows.end) and template.may_start(self.raw, rows.end + 2):
            counted = self.memo_count + sum(p.count for p in parts) * per_row
            rows = matching_rows(self.data, rows.end + 2, template, counted, self.raw)
            if not rows.count:
                break
            parts.append(rows)
        if len(parts) == 1:
            return parts[0]
        joined = [np.concatenate([p.starts[s] for p in parts]) for s in range(len(parts[0].starts))]
        blocks = [np.concatenate([p.blocks[s] for p in parts]) for s in range(len(parts[0].blocks))]
        return Rows(joined, parts[-1].end, blocks)

    def _record(self, pos: int, kind: str) -> Template:
        """Execute one record at ``pos`` with placeholders: its template."""
        depth, memo_before, marks = len(self.stack), self.memo_count, len(self.marks)
        width = 1 if kind == "chunk" else 2
        self.recording, self.record_start = [], pos
        try:
            at = pos
            while True:
                op = self.raw[at]
                at = self.handlers[op](at) if op in self.handlers else _unknown(op)
                if op == 0x62 and len(self.stack) == depth + width:
                    break
                if len(self.stack) < depth or not marks <= len(self.marks) <= marks + 64:
                    raise GiveUp("record")
            arguments = self.recording
        finally:
            self.recording = None
        objects = tuple(self.stack[depth:])
        del self.stack[depth:]
        memo_objects = [self.memo.pop(i) for i in range(memo_before, self.memo_count)]
        self.memo_count = memo_before
        return make_template(kind, self.data[pos:at].copy(), arguments, objects, memo_objects)

    def _run(self, template: Template, rows: Rows) -> Run:
        columns = template.columns
        values = {k: column_values(rows.blocks, c) for k, c in enumerate(columns) if c.kind in (UINT, SINT, GET)}
        run = Run(template, rows.count, values, self.memo_count)
        for k in template.texts:
            run.strings[k] = text_values(self.data, rows, template, k, self.strings)
        self._memoised(run)
        for k in template.value_refs:
            if columns[k].kind == GET:
                run.strings[k] = self._strings(values[k])
        return run

    def _memoised(self, run: Run) -> None:
        """The memo entries ``run``'s rows made: a range; the strings among them known by index."""
        objects, rows, start = run.template.memo_objects, run.rows, self.memo_count
        per_row = len(objects)
        held: list[tuple[np.ndarray, np.ndarray]] = []
        for j, value in enumerate(objects):
            if type(value) is str:
                if rows > 1:
                    raise GiveUp("the same string memoised by every row")
                held.append((np.array([start + j]), np.array([self.strings.id(value)], dtype=np.int32)))
            elif isinstance(value, _Ref) and value.k in run.strings:
                held.append((start + j + per_row * np.arange(rows, dtype=np.int64), run.strings[value.k]))
        if held:
            keys = np.concatenate([k for k, _ in held])
            order = np.argsort(keys, kind="stable")
            self.strings.held_many(keys[order], np.concatenate([i for _, i in held])[order])
        if per_row:
            self.ranges.append(run)
            self.memo_count += rows * per_row

    def _strings(self, indexes: np.ndarray) -> np.ndarray:
        """The ids (in ``strings``) of the strings that memo ``indexes`` name; not all strings: GiveUp."""
        keys, ids = self.strings.keys(), self.strings.ids()
        at = np.minimum(np.searchsorted(keys, indexes), max(len(keys) - 1, 0))
        if not len(keys) or not (keys[at] == indexes).all():
            raise GiveUp("a memo reference that is not a string")
        return ids[at]


def _unknown(op: int) -> int:
    raise GiveUp(f"opcode {op:#04x}")


def _keep_column(value: Any) -> Any:
    """What a tuple holds: integers of a record stay placeholders (a ``torch.Size``'s), strings become
    plain (fixed in every row)."""
    return value.value if isinstance(value, _Ref) else value


def _constant(value: Any) -> bool:
    return value is None or type(value) in (str, int, bool, float)


def read_bulk(raw: bytearray, max_runs: int) -> tuple[Any, Strings]:
    """The top ``Metadata`` record of a ``.metadata``'s bytes (deframed in place), chunk lists and the
    storage dict holding ``Run`` values for their runs, and the strings the runs' columns name by id;
    ``GiveUp`` when the runs do not cover it."""
    machine = Machine(_deframed(raw), max_runs)
    try:
        return machine.load(), machine.strings
    except (IndexError, KeyError, AttributeError, RecursionError) as exc:
        raise GiveUp(type(exc).__name__) from exc


__all__ = ["CHUNK_CLASS", "INDEX_CLASS", "INFO_CLASS", "GiveUp", "Machine", "Run", "Strings", "read_bulk"]
