"""Reading an output's sources ahead of its copy threads, in the order they will read them.

Why: a copy thread that reaches bytes the page cache does not hold waits for the disk, and the
kernel reads ahead only for reads that follow each other; the copy threads of a merge read four
to eight source files at once, one tensor's box at a time, and the strided ones through a map
(page faults). The start-up read-ahead (``reshard.readahead``) reads the sources in file order,
which is not the copy's order once it has read the first of them; reading more of them that way
made the merge slower (cold, medians of 6: 256 / 512 / 1024 MiB read ahead 0.630 / 0.670 /
0.829 s), since its reads and the copy's competed for the disk. Here the plan says which bytes the
copy reads next, so one thread per output file reads exactly those, a bounded distance ahead.

How:

* ``tensor_reads`` (pure): the source file byte ranges each tensor's copies read, as whole boxes:
  a box's extent from its first to its last element in the source's C order (a column split spans
  the rows it crosses, and every page of them holds some of its bytes), through the source
  tensor's segments, adjacent ranges merged.
* ``Prefetcher``: one thread per output file reads tensor after tensor of the work order by
  ``sendfile`` into ``/dev/null`` (large requests, nothing copied into this process), at most
  ``window`` bytes (``WINDOW_BYTES``) ahead of the copy threads: far enough to keep the disk busy,
  near enough that a model larger than the page cache does not lose what was read before the copy
  gets there. A copy thread waits until its tensor was read, so the disk sees one stream in the
  copy's order and the copies run at memory speed.
* The start-up read-ahead's bulk ends when a prefetcher starts (``readahead.stop``).
* A hint, but one the copy threads wait for: a failure of any kind ends the reading thread, and
  from then on each copy thread reads what it needs itself.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from reshard.formats.base import Segment, segment_pieces
from reshard.plan import Copy, Plan, TensorPlan
from reshard.plan.quantized import FP8_BLOCK, QUANTIZE
from reshard.readahead import NullReader

WINDOW_BYTES = 256 * 1024**2  # read at most this far ahead of the copy threads
PIECE_BYTES = 32 * 1024**2  # one read call: ``close`` waits for at most one
FileRange = tuple[str, int, int]  # (source path, file offset, length)
ReadRange = Callable[[str, int, int], None]  # bring (path, offset, length) into the page cache
# (source path, stored tensor name) -> its segments in the file, its shape and its item size, or None
# when the source is not a plain file (decrypted plaintext): nothing to read ahead there
EntryOf = Callable[[str, str], tuple[tuple[Segment, ...], tuple[int, ...], int] | None]
SAME_SHAPE = (FP8_BLOCK, QUANTIZE)  # computed tensors whose boxes are boxes of their stored weight


def box_extent(c: Copy, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``(start, length)`` in bytes of the smallest C-order run of the source tensor holding box ``c``.

    ``shape`` is the source tensor's shape as the copy views it (``c.src_view`` when it has one).
    """
    lengths = c.src_lengths
    if any(n == 0 for n in lengths):
        return 0, 0
    first = last = 0
    for start, n, dim in zip(c.src_start, lengths, shape, strict=True):
        first = first * dim + start
        last = last * dim + start + n - 1
    return first * itemsize, (last - first + 1) * itemsize


def tensor_reads(t: TensorPlan, plan: Plan, entry_of: EntryOf) -> list[FileRange] | None:
    """The file ranges tensor ``t``'s copies read, adjacent ones merged (None: a source that is not
    a plain file, or a tensor computed from an assembled weight).

    A box is measured in its source's own items (a cast reads other bytes than it writes). A tensor
    computed while copying (``--dequantize``, ``--quantize``) reads its stored weight: the box's rows
    where the computed tensor has the weight's shape (FP8 blocks, their quantized values), the whole
    weight otherwise (a quantized weight's scales, MXFP4's unpacked values), and its scale tensor whole.
    """
    ranges: list[FileRange] = []
    for c in t.copies:
        path = plan.sources[c.source]
        q = plan.quantized_by_copy.get((path, c.tensor)) if plan.quantized else None
        if q is not None and (q.assembled is not None or q.scale_assembled is not None):
            return None  # put together from chunks or a model map: no one stored weight to read
        stored = entry_of(path, c.tensor if q is None else q.weight)
        if stored is None:
            return None
        segments, shape, itemsize = stored
        if q is None or q.kind in SAME_SHAPE:
            start, length = box_extent(c, c.src_view or shape, itemsize)
            ranges.extend((path, offset, n) for offset, n in segment_pieces(segments, start, length))
        else:
            ranges.extend((path, offset, n) for offset, n in segments)
        if q is not None and q.target is not None:  # dequantized: its block scales too
            scale = entry_of(q.scale_path, q.scale)
            if scale is None:
                return None
            ranges.extend((q.scale_path, offset, n) for offset, n in scale[0])
    return merged(ranges)


def merged(ranges: Iterable[FileRange]) -> list[FileRange]:
    """``ranges`` sorted, with overlapping or adjacent ranges of one file joined."""
    out: list[FileRange] = []
    for path, offset, length in sorted(ranges):
        if out and out[-1][0] == path and offset <= out[-1][1] + out[-1][2]:
            last = out[-1]
            out[-1] = (path, last[1], max(last[2], offset + length - last[1]))
        else:
            out.append((path, offset, length))
    return out


class Prefetcher:
    """Reads each tensor's ranges, in work order, ahead of the copy threads and within ``window`` bytes.

    A copy thread calls ``take(k)`` before it copies the ``k``-th tensor of the work order: it
    returns once the tensor's bytes were read (or the read-ahead ended), so the copy finds them in
    the page cache; one stream of large requests in the copy's order, where four copy threads
    reading for themselves queued four streams of smaller ones (cold, medians of 10: merge
    0.614 -> 0.543 s; ``cp -r`` 0.449 s). ``close()`` once the file is done or abandoned: a read
    under way stops within ``PIECE_BYTES``.

    ``reader`` (tests) makes the function that reads ``(path, offset, length)``, and is entered and
    left on the reading thread; default: ``sendfile`` into ``/dev/null``.
    """

    def __init__(
        self,
        reads: Sequence[Sequence[FileRange]],
        window: int = WINDOW_BYTES,
        reader: Callable[[], contextlib.AbstractContextManager[ReadRange]] | None = None,
    ) -> None:
        self._reads = reads
        self._window = window
        self._reader = reader or _sendfile_reader
        self._ends = list(itertools.accumulate(sum(length for _, _, length in ranges) for ranges in reads))
        self._taken_up_to = -1  # the furthest work order position a copy thread took
        self._claimed = 0  # the next position the reading thread takes on
        self._read: set[int] = set()  # positions whose bytes are in
        self._reading = True
        self._closed = False
        self._moved = threading.Condition()
        self._thread = threading.Thread(target=self._run_quietly, name="reshard-prefetch", daemon=True)

    def start(self) -> Prefetcher:
        self._thread.start()
        return self

    def take(self, position: int) -> None:
        """A copy thread takes the tensor at ``position``: wait until its bytes were read ahead."""
        with self._moved:
            if position > self._taken_up_to:
                self._taken_up_to = position
                self._moved.notify_all()
            while position not in self._read and self._reading and not self._closed:
                self._moved.wait()

    def close(self) -> None:
        with self._moved:
            self._closed = True
            self._moved.notify_all()

    def _claim(self) -> int | None:
        """The next position to read, once it is within the window (None: stop)."""
        with self._moved:
            while not self._closed and self._claimed < len(self._reads):
                k, taken = self._claimed, self._taken_up_to
                before = self._ends[taken - 1] if taken >= 1 else 0
                if k <= taken + 1 or self._ends[k] - before <= self._window:
                    self._claimed += 1
                    return k
                self._moved.wait()
            return None

    def _done(self, position: int) -> None:
        with self._moved:
            self._read.add(position)
            self._moved.notify_all()

    def _run_quietly(self) -> None:
        try:
            with contextlib.suppress(Exception), self._reader() as read:
                while (k := self._claim()) is not None:
                    for path, offset, length in self._reads[k]:
                        for start in range(offset, offset + length, PIECE_BYTES):
                            if self._closed:
                                return
                            read(path, start, min(PIECE_BYTES, offset + length - start))
                    self._done(k)
        finally:
            with self._moved:
                self._reading = False  # the copy threads read what is left themselves
                self._moved.notify_all()


@contextlib.contextmanager
def _sendfile_reader() -> Iterator[ReadRange]:
    """Reads file ranges into the page cache by ``sendfile`` into ``/dev/null`` (``NullReader``),
    each source opened once, all closed together."""
    fds: dict[str, int] = {}

    def read(path: str, offset: int, length: int) -> None:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        null(fds[path], offset, length)

    try:
        with NullReader() as null:
            yield read
    finally:
        for fd in fds.values():
            os.close(fd)


__all__ = [
    "PIECE_BYTES",
    "SAME_SHAPE",
    "WINDOW_BYTES",
    "EntryOf",
    "FileRange",
    "Prefetcher",
    "ReadRange",
    "box_extent",
    "merged",
    "tensor_reads",
]
