"""Every opcode of a pickle read before the C unpickler runs it, so nothing it allocates outgrows the file.

The C unpickler trusts two kinds of numbers in its input: a memo index (``LONG_BINPUT`` grows the memo
array to twice the index and zero-fills it: 9 bytes asked for 2 GiB) and a counted length
(``BINBYTES``/``BINBYTES8`` allocate the whole length before reading a byte of it). ``check_opcodes``
walks the opcodes (runs of fixed-size ones matched by one regular expression, at C speed; the few with
a counted or line argument one by one: ~0.15 s for an 18 MB ``.metadata`` of 11 million opcodes) and
refuses an opcode that neither ``pickle.dump`` of DCP's records nor ``torch.save`` writes (sets and
bytearrays, out-of-band buffers, extension codes), a length beyond the bytes left and a
memo index beyond half the bytes read so far (each memoised value takes two bytes at least), and an
integer wider than 9 bytes (DCP's offsets and sizes are int64; wider ones would let a dict of
integers of one hash take quadratic time: at most 2 048 integers of up to 9 bytes share a hash). Every
opcode left builds at most one object of a fixed size (the largest, an empty dict, 64 bytes), so what
the unpickler builds stays within ~80 bytes per byte of the pickle; the allowlisted callables
(``unpickling``) build nothing larger than their arguments.
"""

from __future__ import annotations

import pickle
import re

_ZERO = b"()012NR]abdelostu}Q\x81\x85\x86\x87\x88\x89\x92\x93\x94"  # no argument
_ONE = b"Khq\x80"  # BININT1, BINGET, BINPUT (an index under 256), PROTO
_FIXED_RUN = re.compile(
    rb"(?:[%s]++|[%s].|M..|[Jj]....|G........)*+" % (re.escape(_ZERO), re.escape(_ONE)),
    re.DOTALL,
)

_STOP, _LONG_BINPUT, _PUT = ord("."), ord("r"), ord("p")
_ONE_LINE = frozenset(b"FSVgP")  # FLOAT, STRING, UNICODE, GET, PERSID: a line of text
_INT_LINES = frozenset(b"IL")  # INT, LONG: the digits of an integer on a line
_INT_BYTES = 9  # the widest integer, in bytes (LONG1's length; INT and LONG lines the same)
_TWO_LINES = frozenset(b"ci")  # GLOBAL, INST: a module line and a name line
# opcode -> (bytes of its length field, what it is): the argument is that many bytes after the field
_COUNTED: dict[int, tuple[int, str]] = {
    0x8C: (1, "SHORT_BINUNICODE"),
    ord("X"): (4, "BINUNICODE"),
    0x8D: (8, "BINUNICODE8"),
    ord("U"): (1, "SHORT_BINSTRING"),
    ord("T"): (4, "BINSTRING"),
    ord("C"): (1, "SHORT_BINBYTES"),
    ord("B"): (4, "BINBYTES"),
    0x8E: (8, "BINBYTES8"),
    0x8A: (1, "LONG1"),  # also at most _INT_BYTES
    0x95: (8, "FRAME"),  # the frame's bytes are opcodes: walked on from just after the length
}


def check_opcodes(data: bytes) -> None:
    """Raise ``pickle.UnpicklingError`` unless every opcode of ``data`` up to its STOP is one DCP and
    ``torch.save`` write, with every length and memo index inside what the file holds."""
    pos, size, run = 0, len(data), _FIXED_RUN.match
    while True:
        pos = run(data, pos).end()  # type: ignore[union-attr]  # the pattern matches the empty string
        if pos >= size:
            raise pickle.UnpicklingError("pickle data was truncated (no STOP opcode)")
        op = data[pos]
        if op == _STOP:
            return
        if op in _COUNTED:
            pos = _after_counted(data, pos, op)
        elif op == _LONG_BINPUT:
            pos = _after_long_binput(data, pos)
        elif op == _PUT:
            pos = _after_put(data, pos)
        elif op in _ONE_LINE:
            pos = _after_line(data, pos + 1)
        elif op in _INT_LINES:
            pos = _after_int_line(data, pos)
        elif op in _TWO_LINES:
            pos = _after_line(data, _after_line(data, pos + 1))
        else:
            raise pickle.UnpicklingError(f"opcode {op:#04x} at byte {pos}, which no DCP pickle writes")


def _after_counted(data: bytes, pos: int, op: int) -> int:
    width, name = _COUNTED[op]
    start = pos + 1 + width
    if start > len(data):
        raise pickle.UnpicklingError("pickle data was truncated")
    length = int.from_bytes(data[pos + 1 : start], "little")
    if name == "LONG1" and length > _INT_BYTES:
        raise pickle.UnpicklingError(f"an integer of {length} bytes at byte {pos}, wider than any DCP pickle holds")
    if length > len(data) - start:
        raise pickle.UnpicklingError(f"{name} at byte {pos} declares {length} bytes where {len(data) - start} are left")
    return start if name == "FRAME" else start + length


def _after_long_binput(data: bytes, pos: int) -> int:
    if pos + 5 > len(data):
        raise pickle.UnpicklingError("pickle data was truncated")
    _check_memo_index(int.from_bytes(data[pos + 1 : pos + 5], "little"), pos)
    return pos + 5


def _after_int_line(data: bytes, pos: int) -> int:
    end = _after_line(data, pos + 1)
    text = data[pos + 1 : end - 1].rstrip(b"L")
    if len(text) > 24 or (text.lstrip(b"+-").isdigit() and int(text).bit_length() > _INT_BYTES * 8):
        raise pickle.UnpicklingError(
            f"an integer of {len(text)} characters at byte {pos}, wider than any DCP pickle holds"
        )
    return end


def _after_put(data: bytes, pos: int) -> int:
    end = _after_line(data, pos + 1)
    digits = data[pos + 1 : end - 1]
    if not digits.isdigit() or len(digits) > 20:
        raise pickle.UnpicklingError(f"PUT at byte {pos} without a memo index")
    _check_memo_index(int(digits), pos)
    return end


def _check_memo_index(index: int, pos: int) -> None:
    if index > pos // 2:
        raise pickle.UnpicklingError(f"memo index {index} at byte {pos}, more values than the bytes before it hold")


def _after_line(data: bytes, pos: int) -> int:
    end = data.find(b"\n", pos)
    if end < 0:
        raise pickle.UnpicklingError("pickle data was truncated (a line without its end)")
    return end + 1


__all__ = ["check_opcodes"]
