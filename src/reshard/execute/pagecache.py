"""Dropping the small reads planning left cached inside a cold source, before the source is read.

Why: indexing a ``.ckpt`` reads one small head per record, all over the file, and the replica check
reads three 4 KiB samples of every replicated tensor (``sources.replicas``); on a cold page cache each
of those reads leaves a page or two cached between the tensors' bytes. The kernel's read-ahead
reads an uncached range in large folios, 4 MiB a request on this machine's disk, but splits its
requests wherever a page is already cached. The copies that follow read each source mostly in order
(a merge or a reshard in the output's order, which follows the ranks' own; a convert in the source's,
``local.source_order``): one rank file read in order after its index went in ~0.7 MiB requests
instead of ~3.7 MiB, in 0.18 s instead of 0.10 s (docs/benchmarks.md, "Reading the sources in large
requests"). Dropping those islands first gives the read-ahead whole ranges again; the copy reads the
heads' pages with them. Cold, medians of 8: a merge of 8 rank files 0.717 -> 0.663 s, a transform
8 -> 4 0.691 -> 0.616 s (``cp -r`` 0.523 s); the replica check's samples dropped too (medians of 5), a unify
of 8 safetensors rank files 0.705 -> 0.581 s and a transform of them 0.689 -> 0.561 s.

Where those reads go uncached (``formats.uncached``: ``RWF_DONTCACHE``, Linux 6.14 and later) they
leave no islands, and the executor does not call this module (``uncached.left_none``).

What is dropped: the pages around a gap between two tensors' bytes (where a head stands) or a sample
read, when some are cached while a page further on is not, i.e. islands in a cold stretch. In a
warm file that page is cached too, and nothing is dropped (eight probe pages spread over the file
are asked first: when all are cached, the rest is not asked). Which pages are cached, ``mincore``
says, asked for a few pages at a time on a mapping of the file that is never touched (~2 µs, nothing
read). Python has no binding for it: it is called through ``ctypes``, loaded only for a source
that has gaps (a ``.ckpt``; a safetensors file has none). Linux answers truthfully only for files
the caller owns or may write; for other files, and where ``mincore`` is missing, nothing is dropped.

Tried first and not kept: reading the heads past the page cache (``O_DIRECT``) while indexing. It
left no islands, but made every run's index 10-20 ms slower on a cold cache, behind the start-up
read-ahead, and the merge lost that again (cold, medians of 6: 0.674 -> 0.709 s).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import mmap
import os
import types
from collections.abc import Iterable, Sequence
from typing import Any

PAGE = mmap.PAGESIZE
MAX_GAP_BYTES = 64 * 1024  # a gap longer than this is not a record head: left alone
SAMPLES = 8  # probe pages asked first: when all are cached the file is taken as warm
ISLAND_REACH = 64 * 1024  # how far past a head its index read may have cached pages (seen: 2-6 pages)
_PROT_READ, _MAP_SHARED = 1, 1
_VECTOR_PAGES = 64  # pages one reused mincore vector holds
_CACHED_BIT = bytes(value & 1 for value in range(256))  # mincore's byte per page: bit 0 says cached

Range = tuple[int, int]  # (offset, length) in bytes


def head_gaps(segments: Iterable[Range], size: int) -> list[tuple[Range, int]]:
    """The page ranges around the gaps between consecutive byte runs of a file (where record heads
    stand), each with the page that tells whether the stretch is cold: ``[((offset, length), probe)]``.

    A range runs from the gap's first page to ``probe``, the first page boundary ``ISLAND_REACH``
    bytes into the next run: the index's read of a head (and the kernel's read-around it) cached
    pages into the next run too. A run too short to hold its probe page joins the range of the gap
    before it to the next one. Pure: ``segments`` are a file's tensor byte runs in any order; gaps
    longer than ``MAX_GAP_BYTES`` and the file's own head are left out.
    """
    runs = sorted((offset, length) for offset, length in segments if length > 0)
    gaps: list[tuple[Range, int]] = []
    first: int | None = None  # where the open range starts (carried over short runs between heads)
    for (a_offset, a_length), (b_offset, b_length) in itertools.pairwise(runs):
        gap_start, gap_end = a_offset + a_length, b_offset
        if not 0 < gap_end - gap_start <= MAX_GAP_BYTES:
            first = None
            continue
        first = gap_start - gap_start % PAGE if first is None else first
        island = _island(first, gap_end, min(b_offset + b_length, size))
        if island is None:
            continue  # the next run is too short to tell by: the range goes on past its next head
        gaps.append(island)
        first = None
    return gaps


def read_ranges(ranges: Iterable[Range], size: int) -> list[tuple[Range, int]]:
    """The page ranges of small reads made inside the tensors' bytes (the replica check's samples),
    each with its probe page ``ISLAND_REACH`` bytes past its end (as ``head_gaps``). Pure; ranges
    whose probe page lies past the file's end are left out."""
    found = (_island(offset - offset % PAGE, offset + length, size) for offset, length in ranges if length > 0)
    return [island for island in found if island is not None]


def _island(first: int, end: int, limit: int) -> tuple[Range, int] | None:
    """The range from page ``first`` to the probe page, the first page boundary ``ISLAND_REACH`` bytes
    past ``end``, with that page; None when the probe page does not end by ``limit``."""
    probe = -(-(end + ISLAND_REACH) // PAGE) * PAGE
    return ((first, probe - first), probe) if probe + PAGE <= limit else None


def islands(gaps: Iterable[tuple[Range, int]], cached: Any) -> list[Range]:
    """The ranges to drop: some page of it cached while its probe page is not (an island in a cold
    stretch). ``cached(offset, length)`` returns one flag per page (``Residency.flags``)."""
    drop: list[Range] = []
    for (offset, length), probe in gaps:
        flags = cached(offset, probe + PAGE - offset)
        if flags and not flags[-1] and any(flags[:-1]):
            drop.append((offset, length))
    return drop


def cold_somewhere(gaps: Sequence[tuple[Range, int]], cached: Any, samples: int = SAMPLES) -> bool:
    """Whether any of ``samples`` probe pages spread evenly over ``gaps`` is not cached: a warm file is
    told by a few ``mincore`` calls, not one a gap. ``cached`` as in ``islands``."""
    last = len(gaps) - 1
    picks = sorted({round(i * last / max(1, samples - 1)) for i in range(samples)}) if gaps else []
    return any(_cold(cached(gaps[k][1], PAGE)) for k in picks)  # the first and the last gap included


def _cold(flags: Sequence[int]) -> bool:
    """Whether the one page asked about is not cached (an unanswered ask says nothing)."""
    return len(flags) == 1 and not flags[0]


def drop_islands(path: str, segments: Iterable[Range], reads: Iterable[Range] = ()) -> int:
    """Drop the islands of the cold stretches of ``path`` from the page cache: around its record heads
    (the gaps between ``segments``) and the small ``reads`` made inside them; the bytes dropped (0
    where the page cache cannot be asked). A hint: nothing is read, written or required."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        gaps = sorted(head_gaps(segments, size) + read_ranges(reads, size))
        residency = Residency.of(fd) if gaps else None  # nothing read in between: no ctypes
        if residency is None:
            return 0
        try:
            drop = islands(gaps, residency.flags) if cold_somewhere(gaps, residency.flags) else []
        finally:
            residency.close()
        for offset, length in drop:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return sum(length for _, length in drop)
    finally:
        os.close(fd)


class Residency:
    """Which pages of one file the page cache holds, asked of ``mincore`` a few pages at a time.

    A few pages a call: asking for a whole file walks every page of it in the kernel (0.8 ms per
    64 MiB here, seconds for a terabyte of sources), where a gap needs three.
    """

    def __init__(self, libc: Any, address: int, size: int) -> None:
        self._libc = libc
        self._address = address
        self.size = size
        self._mincore = libc.mincore
        self._vector = (libc.c_ubyte * _VECTOR_PAGES)()  # reused: an island's ask is a few pages

    @classmethod
    def of(cls, fd: int) -> Residency | None:
        """The residency of the open file ``fd``; None where ``mincore`` cannot be called or would
        not tell the truth (a file this process neither owns nor may write)."""
        stat = os.fstat(fd)
        if stat.st_size <= 0 or not _told_truthfully(fd, stat.st_uid):
            return None
        libc = _libc()
        if libc is None:
            return None
        address = libc.mmap(None, stat.st_size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address is None or address == libc.map_failed:
            return None
        return cls(libc, address, stat.st_size)

    def pages(self, offset: int, length: int) -> list[bool]:
        """Whether each page of ``[offset, offset + length)`` (page-aligned offset) is cached, for the
        part within the file ([] when asking fails)."""
        return [bool(flag) for flag in self.flags(offset, length)]

    def flags(self, offset: int, length: int) -> bytes:
        """``pages`` as one byte per page, 1 when cached (the drop asks thousands of times a run: a
        list of bools per call cost it 7 of its 20 ms on 8 rank files)."""
        length = min(length, self.size - offset)
        if length <= 0:
            return b""
        count = -(-length // PAGE)
        vector = self._vector if count <= _VECTOR_PAGES else (self._libc.c_ubyte * count)()
        if self._mincore(self._address + offset, length, vector) != 0:
            return b""
        return bytes(vector)[:count].translate(_CACHED_BIT)

    def close(self) -> None:
        if self._address:
            self._libc.munmap(self._address, self.size)
            self._address = 0


def _told_truthfully(fd: int, owner: int) -> bool:
    """Whether Linux's ``mincore`` reports the page cache for this file (since 5.0): the caller owns
    it, is root, or may write it."""
    return os.geteuid() in (0, owner) or os.access(f"/proc/self/fd/{fd}", os.W_OK)


@functools.cache
def _libc() -> Any:
    """libc's ``mmap``, ``munmap`` and ``mincore``, typed (``execute.libc``; None where any is missing)."""
    import ctypes

    from reshard.execute import libc

    size_t, void_p, c_int = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    mapper = libc.function("mmap", [void_p, size_t, c_int, c_int, c_int, ctypes.c_long], void_p)
    unmapper = libc.function("munmap", [void_p, size_t], c_int)
    mincore = libc.function("mincore", [void_p, size_t, void_p], c_int)
    if mapper is None or unmapper is None or mincore is None:
        return None
    return types.SimpleNamespace(
        mmap=mapper,
        munmap=unmapper,
        mincore=mincore,
        c_ubyte=ctypes.c_ubyte,
        map_failed=ctypes.c_void_p(-1).value,  # MAP_FAILED, as the typed mmap returns it
    )


__all__ = [
    "ISLAND_REACH",
    "MAX_GAP_BYTES",
    "PAGE",
    "SAMPLES",
    "Range",
    "Residency",
    "cold_somewhere",
    "drop_islands",
    "head_gaps",
    "islands",
    "read_ranges",
]
