"""Strided boxes written straight from the sources' maps: row runs gathered by ``pwritev``, no numpy.

Why: a box of a column split (tensor parallelism on dim 1) is one run of bytes per row in its
source and in the output, never one run in all. The staging path (``execute.assemble``) copies such
boxes with numpy into a buffer, then writes the buffer. That loads numpy on a copy thread in the
middle of a merge (about 45 ms of CPU on this 2-core machine) and leaves numpy's teardown (13 ms)
to the end of a drop-in caller's script, and a staging buffer and numpy per thread in memory. A
merge, a unify or a split of plain tensors moves bytes of a known item size: no numeric type is
needed. Measured on the bench's 1.13 GB fp32 model (1536-byte runs), warm, medians of 10: drop-in
merge 0.460 -> 0.417 s, CLI merge 0.462 -> 0.445 s, peak RSS 140 -> 80 MB; cold within noise or
better (split 0.617 -> 0.601 s, unify 0.628 -> 0.611 s, medians of 6).

How:

* ``bands`` (pure): a tensor whose boxes differ from their sources only on dims 0 and 1 (the dims
  after them whole on both sides, no transposition, no reshaped view) is cut into bands of rows
  tiled by the same boxes; each box gives every row of its band one ``Run`` of bytes, ``stride``
  bytes apart in its source. Any other tensor gets None and is staged as before, and so do runs
  too short to pay (``min_run_bytes``): a vector entry costs the kernel more than numpy's copy of
  a short run.
* ``write_bands``: rows at a time, one ``iovec`` array (built at C speed from ``range`` objects,
  not a Python object per run) points at the runs in the maps, in output order, and one
  ``pwritev`` writes them to the output's contiguous bytes. ``ctypes`` calls it: ``os.pwritev``
  wants a Python buffer per run, and building 100 000 of them took as long as the copy itself.
  Each call's source rows are mapped in first with one ``madvise(MADV_POPULATE_READ)``, where the
  kernel's copy would fault them in 16 pages at a time (warm merge 0.43 -> 0.40 s).
* The maps' addresses come from the buffer protocol (``PyObject_GetBuffer``), held while the
  tensor is written, so nothing can close a map under the kernel's reads.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import itertools
import math
import mmap
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.execute import libc
from reshard.plan import Copy, TensorPlan

# Runs of at least LONG_RUN_BYTES (on average) are gathered: faster than staging them (64 MiB of
# float32 column halves, warm: 2 KiB runs 13.2 against 15.6 ms, 16 KiB 8.7 against 12.6 ms). Shorter
# ones down to MIN_RUN_BYTES only while numpy is not loaded: each vector entry costs more than
# numpy's copy of it (768-byte runs 21.7 against 16.1 ms, 256-byte 45 against 15 ms), but less than
# loading numpy for them (its import about 45 ms of CPU, its teardown 13 ms).
LONG_RUN_BYTES = 2048
MIN_RUN_BYTES = 768
MADV_POPULATE_READ = 22  # Linux's value; Python's mmap module names it from 3.13 on
IOV_MAX = 1024  # Linux's UIO_MAXIOV: the most vector entries one pwritev takes
BLOCK_BYTES = 8 * 1024**2  # output bytes between ``between_blocks`` calls (page release, Ctrl-C)


@dataclass(frozen=True)
class Run:
    """Box ``copy``'s bytes in each row of a band: ``length`` bytes from ``offset`` (the band's first
    row's, in its source tensor's bytes), the next row's ``stride`` bytes further."""

    copy: int  # position in the tensor's copies
    offset: int
    stride: int
    length: int


@dataclass(frozen=True)
class Band:
    """Rows ``[first, end)`` of the output tensor; each row is ``runs`` one after the other."""

    first: int
    end: int
    runs: tuple[Run, ...]


def bands(t: TensorPlan, src_shapes: Sequence[tuple[int, ...]], min_run: int = LONG_RUN_BYTES) -> list[Band] | None:
    """``t``'s rows as bands of runs, or None where this path does not apply (see the module doc) or
    its runs average less than ``min_run`` bytes (``min_run_bytes``). ``src_shapes``: each copy's
    source tensor shape as the copy views it (its ``src_view`` if any), in ``t.copies``' order."""
    if len(t.shape) < 2 or not t.copies or t.nbytes == 0:
        return None
    boxes = []
    for k, (c, src_shape) in enumerate(zip(t.copies, src_shapes, strict=True)):
        if c.src_perm is not None or len(src_shape) != len(t.shape):
            return None
        if any(n != s or n != d for n, s, d in zip(c.lengths[2:], src_shape[2:], t.shape[2:], strict=True)):
            return None  # a split on a later dim: runs shorter than a row of dim 1
        boxes.append((k, c, src_shape))
    edges = sorted({0, t.shape[0], *(c.dst_start[0] for _, c, _ in boxes)} | {_end(c) for _, c, _ in boxes})
    out = []
    for first, end in itertools.pairwise(edges):
        runs = _band_runs(t, first, [b for b in boxes if b[1].dst_start[0] <= first < _end(b[1])])
        if runs is None:
            return None
        out.append(Band(first, end, runs))
    vectors = sum((b.end - b.first) * len(b.runs) for b in out)
    return out if vectors and t.nbytes // vectors >= min_run else None


def _end(c: Copy) -> int:
    return c.dst_start[0] + c.lengths[0]


def _band_runs(t: TensorPlan, first: int, covering: list[tuple[int, Copy, tuple[int, ...]]]) -> tuple[Run, ...] | None:
    """The runs of row ``first`` from the boxes covering it, left to right; None unless they tile it."""
    inner = math.prod(t.shape[2:]) * t.dtype.itemsize  # bytes per element of dim 1
    column = 0
    runs = []
    for k, c, src_shape in sorted(covering, key=lambda box: box[1].dst_start[1]):
        if c.dst_start[1] != column:
            return None  # a gap or an overlap: not a tiling (the staging path copies what is there)
        column += c.lengths[1]
        row = c.src_start[0] + first - c.dst_start[0]
        offset = (row * src_shape[1] + c.src_start[1]) * inner
        runs.append(Run(k, offset, src_shape[1] * inner, c.lengths[1] * inner))
    return tuple(runs) if column == t.shape[1] and len(runs) <= IOV_MAX else None


def min_run_bytes() -> int:
    """The shortest average run worth gathering now: ``MIN_RUN_BYTES`` until numpy is loaded, then
    ``LONG_RUN_BYTES``."""
    return LONG_RUN_BYTES if "numpy" in sys.modules else MIN_RUN_BYTES


def write_bands(
    fd: int,
    offset: int,
    row_bytes: int,
    tensor_bands: Sequence[Band],
    addresses: Sequence[int],
    between_blocks: Callable[[], None],
) -> None:
    """Write the bands to ``fd``, row 0 at ``offset``; ``addresses[k]``: where copy ``k``'s source
    tensor starts in memory. ``between_blocks()`` runs after every ``BLOCK_BYTES`` or so."""
    written = 0
    for band in tensor_bands:
        width = len(band.runs)
        rows_per_call = max(1, min(IOV_MAX // width, BLOCK_BYTES // max(row_bytes, 1)))
        for r0 in range(band.first, band.end, rows_per_call):
            rows = min(rows_per_call, band.end - r0)
            vector = array.array("Q", bytes(16 * width * rows))
            for j, run in enumerate(band.runs):
                first = addresses[run.copy] + run.offset + (r0 - band.first) * run.stride
                vector[2 * j :: 2 * width] = array.array("Q", range(first, first + rows * run.stride, run.stride))
                vector[2 * j + 1 :: 2 * width] = array.array("Q", [run.length]) * rows
                _map_in(first, (rows - 1) * run.stride + run.length)
            _pwritev_all(fd, vector, offset + r0 * row_bytes)
            written += rows * row_bytes
            if written >= BLOCK_BYTES:
                between_blocks()
                written = 0


@contextlib.contextmanager
def addresses_of(buffers: Sequence[Any]) -> Iterator[list[int]]:
    """The memory address of each buffer (a map, ``bytes``), held exported until the block ends."""
    views: list[_PyBuffer] = []
    try:
        for buffer in buffers:
            view = _PyBuffer()
            if _GET_BUFFER(ctypes.py_object(buffer), ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
                raise BufferError("no buffer")
            views.append(view)
        yield [view.buf or 0 for view in views]
    finally:
        for view in views:
            _RELEASE_BUFFER(ctypes.byref(view))


def available() -> bool:
    """Whether this platform gives ``pwritev`` (Linux, the BSDs, macOS 11+) and 64-bit ``iovec``
    entries (a pointer and a length of 8 bytes each, as the ``array("Q")`` vectors are built)."""
    return _PWRITEV is not None and ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t) == 8


def _pwritev_all(fd: int, vector: array.array[int], offset: int) -> None:
    """``pwritev`` until every entry is written (a short write continues from where it stopped)."""
    count = len(vector) // 2
    first = 0
    while first < count:
        address = vector.buffer_info()[0] + 16 * first
        done = _PWRITEV(fd, address, min(count - first, IOV_MAX), offset)
        if done < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            raise OSError(code, os.strerror(code))
        if done == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while first < count and done >= vector[2 * first + 1]:
            done -= vector[2 * first + 1]
            first += 1
        if done:  # part of an entry: the rest of it goes first in the next call
            vector[2 * first] += done
            vector[2 * first + 1] -= done


def _map_in(address: int, length: int) -> None:
    """Map the pages of ``[address, address + length)`` into this process in one call, where the
    kernel's copy would fault them in 16 at a time: ``MADV_POPULATE_READ`` (Linux 5.14+; elsewhere,
    or refused, nothing is done and the copy faults them in)."""
    global _POPULATE
    if not _POPULATE or _MADVISE is None:
        return
    start = address - address % _PAGE
    if _MADVISE(start, address + length - start, MADV_POPULATE_READ) != 0:
        _POPULATE = False  # an older kernel: not asked again


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the buffer protocol's view of an object's memory)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PWRITEV = libc.function("pwritev", [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long], ctypes.c_ssize_t)
_MADVISE = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int)
_POPULATE = sys.platform.startswith("linux")
_PAGE = mmap.PAGESIZE
_GET_BUFFER = ctypes.pythonapi.PyObject_GetBuffer
_GET_BUFFER.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_GET_BUFFER.restype = ctypes.c_int
_RELEASE_BUFFER = ctypes.pythonapi.PyBuffer_Release
_RELEASE_BUFFER.argtypes = [ctypes.POINTER(_PyBuffer)]
_RELEASE_BUFFER.restype = None

__all__ = [
    "BLOCK_BYTES",
    "IOV_MAX",
    "LONG_RUN_BYTES",
    "MIN_RUN_BYTES",
    "Band",
    "Run",
    "addresses_of",
    "available",
    "bands",
    "min_run_bytes",
    "write_bands",
]
