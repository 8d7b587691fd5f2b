"""Rank files that share a record layout: one is indexed, each other one is checked against it byte for byte.

Why: the ranks of one pipeline stage save the same parameters, in the same order, with slices of
the same shape, so their ``.ckpt`` files differ only in tensor data. Every byte outside the
tensors' contents (record keys and lengths, names, dims, type names) is the same, at the same
offset. Indexing a file walks one record head after another, and each read waits for the one
before it (the next record's place is in this one's head), then parses each head in Python, one
thread at a time. A file whose bytes outside the contents equal an indexed file's has exactly that
file's index: the parser reads no other bytes, so it would decide the same at every step. So that
file is checked, not parsed: the same small reads, none waiting for another, and a comparison of
bytes each.

How:

* ``Recorder`` keeps, while a file is indexed (``formats.ckpt``), every byte range that is not a
  tensor's content, with its bytes, taken from the bytes the index parsed anyway. A range it cannot
  take from there (a field after a tensor's content, outside the bytes read) leaves the file
  without a layout to offer: it is never a model for others.
* ``Twins.offer`` remembers an indexed file's layout by its size and where its records end (before
  a crc trailer); ``Twins.checked`` reads another file's ranges at the same offsets (``uncached``,
  grouped into reads of ``READ_BYTES`` as the index groups heads) and returns the index when every
  byte is equal, else None, and the file is indexed as any other.
* Nothing is trusted that was not compared: a remembered layout only says where to look, so a
  stale one (the model file changed since) costs a wasted check, never a wrong index. At most
  ``KEPT_LAYOUTS`` layouts are kept, the oldest forgotten first.

``sources.files.indexed`` indexes the first file of each size before the others, so that the others
find their layout.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard.formats import uncached

if TYPE_CHECKING:
    from reshard.formats.base import TensorEntry

READ_BYTES = 4096  # one read covers the ranges that start within it (the index reads heads this way)
KEPT_LAYOUTS = 64  # layouts remembered at most (one per pipeline stage and file size)
PIECE_BYTES = 64 * 1024  # a longer range outside the contents (a skipped field) leaves no layout

Piece = tuple[int, bytes]  # (file offset, the bytes there)


@dataclass(frozen=True)
class Layout:
    """An indexed file's bytes outside tensor contents, grouped into the reads that check them."""

    reads: tuple[tuple[int, int, tuple[Piece, ...]], ...]  # (offset, length, the pieces inside)
    entries: Mapping[str, TensorEntry]


class Recorder:
    """The byte ranges outside tensor contents of one file being indexed (see the module docstring)."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.complete = True

    def take(self, buf: Any, base: int, start: int, stop: int) -> None:
        """Keep the file's bytes ``[start, stop)``, which the index parsed from ``buf`` (file offset ``base``)."""
        if start >= stop or not self.complete:
            return
        if start < base or stop - base > len(buf) or stop - start > PIECE_BYTES:
            self.complete = False  # not among the bytes parsed: this file offers no layout
            return
        self.pieces.append((start, bytes(buf[start - base : stop - base])))

    def layout(self, entries: Mapping[str, TensorEntry]) -> Layout | None:
        if not self.complete or not self.pieces:
            return None
        reads: list[tuple[int, int, tuple[Piece, ...]]] = []
        group: list[Piece] = []
        for piece in sorted(self.pieces):
            if group and piece[0] + len(piece[1]) - group[0][0] > READ_BYTES:
                reads.append(_read_of(group))
                group = []
            group.append(piece)
        reads.append(_read_of(group))
        return Layout(tuple(reads), dict(entries))


def _read_of(group: list[Piece]) -> tuple[int, int, tuple[Piece, ...]]:
    start = group[0][0]
    return start, max(offset + len(data) for offset, data in group) - start, tuple(group)


class Twins:
    """Layouts of indexed files by (file size, end of records); checks of other files against them."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[int, int], Layout] = {}
        self._lock = threading.Lock()

    def offer(self, size: int, end: int, layout: Layout | None) -> None:
        if layout is None:
            return
        with self._lock:
            self._layouts.pop((size, end), None)
            while len(self._layouts) >= KEPT_LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[(size, end)] = layout

    def checked(self, fd: int | None, size: int, end: int) -> dict[str, TensorEntry] | None:
        """The index of the file open on ``fd`` if its bytes match a remembered layout, else None."""
        with self._lock:
            layout = self._layouts.get((size, end))
        if layout is None or fd is None:
            return None
        try:
            for offset, length, pieces in layout.reads:
                data = uncached.read(fd, length, offset)
                for at, expected in pieces:
                    if data[at - offset : at - offset + len(expected)] != expected:
                        return None
        except OSError:
            return None  # the index reads it again and reports what is wrong
        return dict(layout.entries)


__all__ = ["KEPT_LAYOUTS", "PIECE_BYTES", "READ_BYTES", "Layout", "Recorder", "Twins"]
