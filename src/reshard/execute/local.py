"""Run a plan on this machine: headers first, then every box copied straight into place.

Why this shape (see design.md, "Techniques the peers proved"):

* Sources are memory-mapped (``TensorIndex`` views), so a copy reads only the bytes it needs and
  never a whole file. After each output tensor the source pages it touched are handed back to the
  kernel (``madvise(MADV_DONTNEED)``), so resident memory does not grow with the model.
* Outputs are preallocated with their framing already written (``FileLayout``); tensor bytes go
  in with ``os.pwrite`` at their final offset. A tensor that is one unchanged source tensor (a
  convert, a replicated parameter, a row split) is written straight from the source map: one
  kernel copy, no staging. Anything else is assembled in a staging buffer of at most
  ``max_memory / workers`` bytes (row blocks along dim 0), one strided numpy copy per box, then
  written — so no full tensor ever exists unless the destination is that full tensor's block.
* Independent output files run on worker threads: numpy copies and ``pwrite`` release the GIL.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from reshard.formats import base, ckpt, safetensors
from reshard.formats.base import FileLayout, TensorIndex, TensorSpec, pwrite_all
from reshard.plan import FilePlan, Plan, TensorPlan

DEFAULT_MAX_MEMORY = 1024**3  # bytes in flight across all workers (staging buffers)
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Options:
    workers: int = 1
    max_memory: int = DEFAULT_MAX_MEMORY
    crc_check: bool = False  # write crc trailers on .ckpt outputs
    chunk_bytes: int = ckpt.SLICE_BYTES
    progress: Callable[[int], None] | None = None  # called with bytes written (from worker threads)
    on_start: Callable[[int], None] | None = None  # called once with the bytes the run will write
    enc_key: bytes | None = field(default=None, repr=False)  # encrypt .ckpt outputs (never printed)
    enc_mode: str = "AES-GCM"
    on_file_written: Callable[[FilePlan], None] | None = None  # after each output is renamed into place


Opener = Callable[[str], TensorIndex]


class SourceCache:
    """Opens each source file once (thread-safe) and releases touched pages."""

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        self._open: dict[str, TensorIndex] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> TensorIndex:
        with self._lock:
            if path not in self._open:
                self._open[path] = self._opener(path)
            return self._open[path]

    def release(self, path: str, name: str) -> None:
        """Drop the resident pages of one tensor from this process (the page cache keeps them)."""
        index = self._open.get(path)
        if index is None or not isinstance(index.buffer, mmap.mmap):
            return
        for offset, length in index.entries[name].segments:
            start = offset - offset % _PAGE
            with contextlib.suppress(OSError, ValueError):
                index.buffer.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def close(self) -> None:
        for index in self._open.values():
            index.close()
        self._open.clear()


def file_layout(file: FilePlan, options: Options) -> FileLayout:
    specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes) for t in file.tensors]
    if file.format == "ckpt":
        return ckpt.ckpt_layout(specs, chunk_bytes=options.chunk_bytes)
    return safetensors.safetensors_layout(specs, dict(file.metadata) or None)


def _write_at(fd: int, segments: tuple[base.Segment, ...], start: int, data: memoryview) -> None:
    """Write ``data`` at tensor byte offset ``start`` of a tensor stored in ``segments``."""
    pos = 0
    for offset, length in segments:
        if start >= pos + length:
            pos += length
            continue
        if not data:
            return
        skip = max(0, start - pos)
        n = min(length - skip, len(data))
        pwrite_all(fd, data[:n], offset + skip)
        data = data[n:]
        start += n
        pos += length


def _row_blocks(t: TensorPlan, budget: int) -> Iterator[tuple[int, int]]:
    if not t.shape:
        yield 0, 0
        return
    rows = t.shape[0]
    row_bytes = max(1, t.nbytes // rows) if rows else 1
    step = max(1, budget // row_bytes)
    for r0 in range(0, max(rows, 1), step):
        yield r0, min(rows, r0 + step)


def _box(first: int, rows: int, starts: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of a box: ``rows`` rows from ``first`` on dim 0, then ``starts``/``lengths``."""
    return (slice(first, first + rows), *(slice(s, s + n) for s, n in zip(starts, lengths, strict=True)))


class _Output:
    """The output file being filled: ``pwrite`` for raw runs, a shared writable map for boxes."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.map = mmap.mmap(fd, size) if size else None

    def tensor(self, t: TensorPlan, segment: base.Segment) -> np.ndarray:
        """A writable numpy view of a tensor stored in one segment of the output."""
        return np.ndarray(t.shape, dtype=t.dtype.numpy, buffer=self.map, offset=segment[0])  # type: ignore[arg-type]

    def release(self, segments: tuple[base.Segment, ...]) -> None:
        """Unmap written pages from this process: they stay dirty in the page cache, RSS stays flat."""
        if self.map is None:
            return
        for offset, length in segments:
            start = offset - offset % _PAGE
            with contextlib.suppress(OSError, ValueError):
                self.map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()


def _contiguous(start: tuple[int, ...], lengths: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a box is one contiguous byte run of a C-order tensor of ``shape``."""
    k = len(shape)
    while k > 0 and lengths[k - 1] == shape[k - 1]:
        k -= 1  # trailing full dims
    return all(n == 1 for n in lengths[: max(k - 1, 0)])


def _flat_offset(start: tuple[int, ...], shape: tuple[int, ...]) -> int:
    offset = 0
    for s, d in zip(start, shape, strict=True):
        offset = offset * d + s
    return offset


def _copy_boxes(dst: np.ndarray, t: TensorPlan, rows: tuple[int, int], sources: SourceCache, plan: Plan) -> None:
    """Copy every box of ``t`` that falls in dst rows ``rows`` into ``dst`` (which holds those rows)."""
    r0, r1 = rows
    for c in t.copies:
        lo, hi = max(r0, c.dst_start[0]), min(r1, c.dst_start[0] + c.lengths[0])
        if lo >= hi:
            continue
        src = sources.get(plan.sources[c.source]).array(c.tensor)
        shift = lo - c.dst_start[0]
        src_sel = _box(c.src_start[0] + shift, hi - lo, c.src_start[1:], c.lengths[1:])
        np.copyto(dst[_box(lo - r0, hi - lo, c.dst_start[1:], c.lengths[1:])], src[src_sel])


def _pwrite_runs(out: _Output, t: TensorPlan, segment: base.Segment, sources: SourceCache, plan: Plan) -> bool:
    """Write every box with one ``pwrite`` straight from the source map, if all boxes are byte runs.

    Row splits (and optimizer-shard splits) are contiguous in source and destination: the kernel
    copies them from the source pages into the output's page cache, the fastest path measured.
    """
    runs = []
    for c in t.copies:
        src = sources.get(plan.sources[c.source]).array(c.tensor)
        if not (_contiguous(c.src_start, c.lengths, src.shape) and _contiguous(c.dst_start, c.lengths, t.shape)):
            return False
        runs.append((c, src))
    item = t.dtype.itemsize
    for c, src in runs:
        begin = _flat_offset(c.src_start, src.shape) * item
        raw = memoryview(src.reshape(-1).view(np.uint8))[begin : begin + math.prod(c.lengths) * item]
        pwrite_all(out.fd, raw, segment[0] + _flat_offset(c.dst_start, t.shape) * item)
    return True


def _fill_tensor(out: _Output, t: TensorPlan, segments: tuple[base.Segment, ...], sources: SourceCache,
                 plan: Plan, budget: int) -> None:
    if t.literal is not None:
        _write_at(out.fd, segments, 0, memoryview(t.literal))
        return
    if t.whole_copy:  # one unchanged source tensor: a kernel copy from the source map
        c = t.copies[0]
        index = sources.get(plan.sources[c.source])
        _write_at(out.fd, segments, 0, memoryview(index.raw(c.tensor)).cast("B"))
        return
    if len(segments) == 1 and t.shape:  # boxes straight into the output: one copy per byte
        if not _pwrite_runs(out, t, segments[0], sources, plan):
            _copy_boxes(out.tensor(t, segments[0]), t, (0, t.shape[0]), sources, plan)
        return
    for r0, r1 in _row_blocks(t, budget):  # chunked .ckpt tensor (> 512 MiB): stage row blocks
        block_shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
        staging = np.empty(block_shape, dtype=t.dtype.numpy)
        if t.shape:
            _copy_boxes(staging, t, (r0, r1), sources, plan)
        row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
        _write_at(out.fd, segments, r0 * row_bytes, memoryview(staging.reshape(-1).view(np.uint8)))


def run_file(file: FilePlan, plan: Plan, sources: SourceCache, options: Options, budget: int) -> None:
    """Write one output file of the plan atomically."""
    layout = file_layout(file, options)
    by_name = {t.name: t for t in file.tensors}

    def fill(fd: int, lay: FileLayout) -> None:
        base.preallocate(fd, lay.size)  # write_file did it already; the encrypted path's plaintext needs it
        out = _Output(fd, lay.size)
        try:
            for name in lay.order:
                t = by_name[name]
                _fill_tensor(out, t, lay.placements[name], sources, plan, budget)
                out.release(lay.placements[name])
                for c in t.copies:
                    sources.release(plan.sources[c.source], c.tensor)
                if options.progress is not None:
                    options.progress(t.nbytes)
        finally:
            out.close()

    finish = ckpt.crc_finish if (options.crc_check and file.format == "ckpt") else None
    if options.enc_key is not None and file.format == "ckpt":  # plaintext temp file, then records
        ckpt.write_encrypted(file.path, layout, fill, options.enc_key, options.enc_mode)
    else:
        base.write_file(file.path, layout, fill, finish)
    if options.on_file_written is not None:
        options.on_file_written(file)


def run_plan(plan: Plan, opener: Opener, options: Options | None = None) -> None:
    """Execute every output of ``plan``; text outputs (index JSON) are written last."""
    options = options or Options()
    workers = max(1, min(options.workers, len(plan.files) or 1))
    budget = max(_PAGE, options.max_memory // workers)
    if options.on_start is not None:
        options.on_start(sum(f.nbytes for f in plan.files))
    sources = SourceCache(opener)
    try:
        if workers == 1:
            for f in plan.files:
                run_file(f, plan, sources, options, budget)
        else:
            with ThreadPoolExecutor(workers) as pool:
                for future in [pool.submit(run_file, f, plan, sources, options, budget) for f in plan.files]:
                    future.result()
    finally:
        sources.close()
    for text in plan.texts:
        with base.atomic_path(text.path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text.text)


__all__ = ["DEFAULT_MAX_MEMORY", "Options", "SourceCache", "run_plan"]
