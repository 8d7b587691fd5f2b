"""Run a plan on this machine: headers first, then every box copied straight into place.

Why this shape (see design.md, "Techniques the peers proved"; every choice was measured on a
1.1 GB model against ``cp``, which copies it in ~0.36 s from the page cache here):

* Outputs are preallocated (``posix_fallocate``) with their framing already written
  (``ByteLayout``); tensor bytes go straight to their final offset.
* A box that is one contiguous byte run in its source and in its destination (an unchanged
  tensor in a convert, a replicated parameter, a row split, an optimizer-shard split: most of a
  reshard) is copied kernel-side (``kernelcopy``: ``splice`` through a 1 MiB pipe where the two
  offsets differ within a page, as a tensor moved into a ``.ckpt`` record does, else
  ``copy_file_range``): no page faults, no user-space copy (0.21-0.25 s/GB, faster than ``cp``;
  ``pwrite`` from a fresh map: 0.40 s/GB).
* A column split whose boxes differ from their sources only on dims 0 and 1, with runs long
  enough to pay, is written straight from the sources' maps, rows at a time, by one ``pwritev``
  of its runs (``gather``): no numpy, no staging buffer, 60 MB less peak RSS on a 1 GB merge.
* Other strided boxes are assembled in a reused per-thread staging buffer, row block by
  row block (at most ``max_memory / workers`` bytes), one strided numpy copy per box from the
  memory-mapped source (``assemble.copy_boxes``, which ``verify`` and the drop-in use too), then
  one ``pwrite`` per block (15% faster than filling a map of the output, which faults every fresh
  page). No full tensor exists unless the destination is one. A tensor whose source holds another
  dtype than the plan's (``--dtype``) always takes this path: ``copy_boxes`` casts while it copies.
* After each output tensor the source pages it touched are unmapped again
  (``madvise(MADV_DONTNEED)``; the page cache keeps them), so resident memory stays flat
  whatever the model size.
* Independent output files run on worker threads, and each file fills its tensors on its share
  of the workers by bytes (``tensor_threads``: a one-file output, or a unify's large part beside a
  tiny ``hyper_param`` file, takes them all): numpy copies and the copy syscalls release the GIL.
* With ``hash_outputs`` each plain output is checksummed while it is written: every finished
  tensor range is reported to a ``digest.StreamingDigest``, whose hash thread follows the
  finished prefix of the file, so the checksum is ready moments after the last byte.
* The sources are read ahead in the copy's order (``prefetch``): one thread per output file reads
  each tensor's source bytes by ``sendfile`` into ``/dev/null``, and a copy thread takes its tensor
  once they are in, so the disk sees one stream of large requests, not four copy threads' smaller
  ones (cold merge 0.614 -> 0.543 s). Hints did not pay: a thread issuing
  ``posix_fadvise(WILLNEED)`` for the next 512 MiB of source ranges was slower (transform 8->4: 1.13
  s -> 1.8 s), and hinting the next one to four tensors' ranges gained nothing. Before this module
  runs, the start-up read-ahead reads the first sources in file order (``reshard.readahead``).
* Before a source is read, the record heads its index left cached in its cold stretches are
  dropped again (``pagecache``) where planning's small reads could not go uncached
  (``formats.uncached``), and an output copied from one source alone (a convert) is filled
  in the source's order (``source_order``): the kernel then reads the sources in 4 MiB requests,
  not ~1 MiB ones.
* numpy, ``assemble`` and ``dequant`` load with the first tensor that needs them (a staged box, a
  cast, a computed tensor): a run of byte copies and gathered rows never imports them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reshard import interrupts, readahead
from reshard.execute import kernelcopy, prefetch
from reshard.execute.digest import StreamingDigest, hash_pool
from reshard.execute.options import RunOptions, WriteOptions
from reshard.execute.prefetch import Prefetcher
from reshard.formats import base, registry, uncached
from reshard.formats.base import ByteLayout, TensorIndex, TensorSpec, pwrite_all
from reshard.plan import FilePlan, Plan, TensorPlan
from reshard.plan.validate import validate_plan

if TYPE_CHECKING:
    import numpy as np

_PAGE = mmap.PAGESIZE
# Largest row block a thread assembles at once. Peak RSS grows by about two blocks per thread (the
# staging buffer and the source pages the block read), so the block is bounded whatever the memory
# bound allows: with one block per tensor (up to max_memory / threads), a merge to one full .ckpt on
# 4 threads peaked at 294 MB on a model whose largest tensor is 144 MiB (130 MB on 1 thread).
# At 16 MiB the per-block costs (one pwrite, one numpy call per box) stay negligible.
STAGING_BLOCK_BYTES = 16 * 1024 * 1024


Opener = Callable[[str], TensorIndex]


class SourceCache:
    """Opens each source file once (thread-safe) and releases touched pages."""

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        self._open: dict[str, TensorIndex] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.kernel_copy = hasattr(os, "copy_file_range")  # switched off after the first refusal
        self.copier = kernelcopy.Copier()  # its pipes are closed with the cache
        self._islands_dropped: set[str] = set()

    def get(self, path: str) -> TensorIndex:
        with self._lock:
            if path not in self._open:
                self._open[path] = self._opener(path)
            return self._open[path]

    def shape(self, path: str, name: str) -> tuple[int, ...] | None:
        """Shape of tensor ``name`` in the source file ``path`` (None when it holds no such tensor)."""
        entry = self.get(path).entries.get(name)
        return entry.shape if entry is not None else None

    def release(self, path: str, name: str) -> None:
        """Drop the resident pages of one tensor from this process (the page cache keeps them)."""
        index = self._open.get(path)
        if index is None or not isinstance(index.buffer, mmap.mmap):
            return
        for offset, length in index.entries[name].segments:
            start = offset - offset % _PAGE
            with contextlib.suppress(OSError, ValueError):
                index.buffer.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def drop_islands(self, path: str) -> None:
        """Once per run and source, before it is read: drop the record heads its index and the
        samples the replica check left cached in its cold stretches (``pagecache``); nothing to do
        when every small read went uncached (``formats.uncached``)."""
        if uncached.left_none():
            return
        index = self.get(path)
        with self._lock:
            if not index.file_backed or path in self._islands_dropped:
                return
            self._islands_dropped.add(path)
        from reshard.execute import pagecache  # ctypes loads only for a source read in between
        from reshard.sources.replicas import sampled_ranges

        entries = index.entries.values()
        segments = [segment for entry in entries for segment in entry.segments]
        pagecache.drop_islands(path, segments, [r for e in entries for r in sampled_ranges(e.segments, e.nbytes)])

    def fd(self, path: str) -> int | None:
        """A read-only descriptor of a file-backed source, for kernel-side copies (None otherwise)."""
        index = self.get(path)
        if not index.file_backed or not self.kernel_copy:
            return None
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        for index in self._open.values():
            index.close()
        self._open.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.copier.close()


def byte_layout(file: FilePlan, write: WriteOptions) -> ByteLayout:
    """Every byte position of an output, from its format (``formats.registry``: an unknown one is refused)."""
    specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes) for t in file.tensors]
    return registry.get(file.format).layout(specs, dict(file.metadata), write.chunk_bytes)


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


def _copy_bytes(
    out: _Output,
    dst_segments: tuple[base.Segment, ...],
    dst_start: int,
    sources: SourceCache,
    path: str,
    tensor: str,
    src_start: int,
    length: int,
) -> None:
    """Copy ``length`` tensor bytes from a source tensor into the output, kernel-side when possible.

    ``splice`` and ``copy_file_range`` (``kernelcopy``) move page-cache bytes without mapping them
    into this process (no page faults, measured 1.4x faster than ``pwrite`` from a fresh map);
    sources that are not plain files (decrypted plaintext) or filesystems that refuse both fall back
    to ``pwrite`` from the map.
    """
    index = sources.get(path)
    src_fd = sources.fd(path)
    src_pieces = list(base.segment_pieces(index.entries[tensor].segments, src_start, length))
    dst_pieces = list(base.segment_pieces(dst_segments, dst_start, length))
    view = memoryview(index.buffer).cast("B") if index.buffer else memoryview(b"")
    si = di = 0
    (s_off, s_len), (d_off, d_len) = (src_pieces[0], dst_pieces[0]) if src_pieces else ((0, 0), (0, 0))
    while si < len(src_pieces) and di < len(dst_pieces):
        n = min(s_len, d_len)
        if src_fd is not None:
            try:
                sources.copier.copy(src_fd, out.fd, s_off, d_off, n)
            except OSError as exc:
                if exc.errno not in kernelcopy.REFUSED:
                    raise
                sources.kernel_copy, src_fd = False, None
        if src_fd is None:
            pwrite_all(out.fd, view[s_off : s_off + n], d_off)
        s_off, s_len, d_off, d_len = s_off + n, s_len - n, d_off + n, d_len - n
        if s_len == 0 and (si := si + 1) < len(src_pieces):
            s_off, s_len = src_pieces[si]
        if d_len == 0 and (di := di + 1) < len(dst_pieces):
            d_off, d_len = dst_pieces[di]


def _row_blocks(t: TensorPlan, budget: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """Row ranges of ``t`` of at most ``budget`` bytes, each a multiple of ``align`` rows where one fits."""
    if not t.shape:
        yield 0, 0
        return
    rows = t.shape[0]
    row_bytes = max(1, t.nbytes // rows) if rows else 1
    step = max(1, budget // row_bytes)
    if step > align > 1:
        step -= step % align
    for r0 in range(0, max(rows, 1), step):
        yield r0, min(rows, r0 + step)


@dataclass(frozen=True)
class _Output:
    """The output file being filled (by kernel-side copies and ``pwrite`` at final offsets)."""

    fd: int


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


def _byte_runs(
    out: _Output, t: TensorPlan, segments: tuple[base.Segment, ...], sources: SourceCache, plan: Plan
) -> bool:
    """Copy every box as one byte range, if every box is a byte run in its source and in ``t``.

    Row splits and optimizer-shard splits are contiguous on both sides, so most tensors of a
    reshard take this path: no numpy, no staging, a kernel-side copy per box.
    """
    runs = []
    for c in t.copies:
        if c.src_perm is not None:
            return False  # a transposed box is never one byte run on both sides: staged
        src_shape = c.src_view or sources.get(plan.sources[c.source]).entries[c.tensor].shape
        if not (_contiguous(c.src_start, c.lengths, src_shape) and _contiguous(c.dst_start, c.lengths, t.shape)):
            return False
        runs.append((c, src_shape))
    item = t.dtype.itemsize
    for c, src_shape in runs:
        _copy_bytes(
            out,
            segments,
            _flat_offset(c.dst_start, t.shape) * item,
            sources,
            plan.sources[c.source],
            c.tensor,
            _flat_offset(c.src_start, src_shape) * item,
            math.prod(c.lengths) * item,
        )
    return True


def _fill_tensor(
    out: _Output, t: TensorPlan, segments: tuple[base.Segment, ...], sources: SourceCache, plan: Plan, budget: int
) -> None:
    if t.literal is not None:
        _write_at(out.fd, segments, 0, memoryview(t.literal))
        return
    computed = plan.computed_reads(t) if plan.quantized else []
    made = {q.kind for q in computed}  # how the copies read tensors computed while copying (empty: none)
    cast = bool(made) or _casts(t, sources, plan)  # a tensor computed while copying is never a byte copy
    if t.whole_copy and not cast:  # one unchanged source tensor: a kernel-side copy
        c = t.copies[0]
        _copy_bytes(out, segments, 0, sources, plan.sources[c.source], c.tensor, 0, t.nbytes)
        return
    if t.shape and not cast and _byte_runs(out, t, segments, sources, plan):
        return
    if t.shape and not cast and _gathered(out, t, segments, sources, plan):
        return
    # Strided boxes: assemble row blocks in a reused staging buffer, then one pwrite per block
    # (measured 15% faster than copying into a map of the output, which faults every page). numpy
    # and the box copier load here, with the first such tensor: a run of byte copies (a convert,
    # most of a reshard) never imports them; the dequantizer with the first computed tensor.
    import numpy as np

    from reshard.execute import assemble

    row_bytes = t.nbytes // t.shape[0] if t.shape and t.shape[0] else 0
    align = 1
    if made:
        from reshard.execute import dequant

        budget = dequant.row_block_bytes(made, budget)  # float32 temporaries beside the staging
        align = dequant.row_alignment(computed)  # --quantize computes whole blocks: boxes of whole block rows

    arrays: dict[tuple[int, str], np.ndarray] = {}  # each source tensor's view made once, not per block

    def source_array(source: int, tensor: str) -> np.ndarray:
        key = (source, tensor)
        if key not in arrays:
            index = sources.get(plan.sources[source])
            arrays[key] = index.array(tensor) if cast else index.items(tensor)
        return arrays[key]

    # A byte move copies items as their carrier (bf16 as uint16: no ml_dtypes); a cast needs the numbers;
    # computed tensors come as their target's carrier (``dequant.staging``).
    if made:
        element, read = dequant.staging(t, source_array)
    else:
        element, read = (t.dtype.numpy if cast else t.dtype.carrier), source_array

    blocks = list(_row_blocks(t, budget, align))
    for r0, r1 in blocks:
        interrupts.check()  # a large strided tensor: a deferred signal waits at most one block
        block_shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
        staging = _staging(math.prod(block_shape) * t.dtype.itemsize).view(element).reshape(block_shape)
        assemble.copy_boxes(staging, t, r0, read)
        _write_at(out.fd, segments, r0 * row_bytes, staging.reshape(-1).view(np.uint8).data)
        if len(blocks) > 1:  # the next block reads other source rows: drop this block's pages now
            _release_row_sources(t, sources, plan)


def _gathered(
    out: _Output, t: TensorPlan, segments: tuple[base.Segment, ...], sources: SourceCache, plan: Plan
) -> bool:
    """Write a column split's boxes from the sources' maps by ``pwritev`` (``execute.gather``), if
    ``t`` is one output segment, each source tensor one segment of a map, and the boxes fit."""
    if len(segments) != 1:
        return False
    from reshard.execute import gather  # ctypes and libc's pwritev load with the first strided tensor

    if not gather.available():
        return False
    indexes = [sources.get(plan.sources[c.source]) for c in t.copies]
    entries = [index.entries[c.tensor] for index, c in zip(indexes, t.copies, strict=True)]
    if any(len(e.segments) != 1 or not index.buffer for index, e in zip(indexes, entries, strict=True)):
        return False
    shapes = [c.src_view or e.shape for c, e in zip(t.copies, entries, strict=True)]
    tensor_bands = gather.bands(t, shapes, gather.min_run_bytes())
    if tensor_bands is None:
        return False

    def between_blocks() -> None:
        interrupts.check()
        _release_row_sources(t, sources, plan)

    with gather.addresses_of([index.buffer for index in indexes]) as bases:
        starts = [base_address + e.segments[0][0] for base_address, e in zip(bases, entries, strict=True)]
        gather.write_bands(out.fd, segments[0][0], t.nbytes // t.shape[0], tensor_bands, starts, between_blocks)
    _release_row_sources(t, sources, plan)
    return True


def _release_row_sources(t: TensorPlan, sources: SourceCache, plan: Plan) -> None:
    """Unmap the source pages ``t``'s copies touched so far, except transposed ones (every block reads
    all of their pages again). Keeps resident source pages to about one row block per thread."""
    for c in t.copies:
        if c.src_perm is None:
            sources.release(plan.sources[c.source], c.tensor)


def _casts(t: TensorPlan, sources: SourceCache, plan: Plan) -> bool:
    """Whether a source of ``t`` holds another dtype than the plan's (a ``--dtype`` cast).

    Then no byte is copied as it is: every box goes through the staging buffer, where
    ``assemble.copy_boxes`` converts it (and checks for overflow).
    """
    return any(sources.get(plan.sources[c.source]).entries[c.tensor].dtype != t.dtype for c in t.copies)


_THREAD = threading.local()


def _staging(nbytes: int) -> np.ndarray:
    """This thread's staging buffer (grown as needed, never shrunk: its pages stay faulted in)."""
    import numpy as np

    buf: np.ndarray | None = getattr(_THREAD, "staging", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _THREAD.staging = buf
    return buf[:nbytes]


class Cancelled(Exception):
    """An output abandoned half-way because the run is stopping (another output failed, or a signal).

    Its temporary file is removed like any failed write's; the caller raises the real reason.
    """


def run_file(
    file: FilePlan,
    plan: Plan,
    sources: SourceCache,
    write: WriteOptions,
    run: RunOptions,
    budget: int,
    tensor_workers: int = 1,
    hasher_pool: ThreadPoolExecutor | None = None,
    cancel: threading.Event | None = None,
) -> str | None:
    """Write one output file of the plan atomically (its tensors on ``tensor_workers`` threads).

    Returns the file's checksum (``write.checksum``), hashed while it was written, when
    ``hasher_pool`` is given and the output is not encrypted (else None). Once ``cancel`` is set,
    the file is abandoned before its next tensor (``Cancelled``; no temporary file stays).
    """
    stop = cancel if cancel is not None else threading.Event()
    fmt = registry.get(file.format)
    layout = byte_layout(file, write)
    by_name = {t.name: t for t in file.tensors}
    work = work_order(layout.order, by_name, plan, sources)
    for source in sorted(source_paths(file.tensors, plan)):
        sources.drop_islands(source)  # the kernel then reads it in large requests (``pagecache``)
    encrypted = write.enc_key is not None and fmt.encrypts
    hasher: StreamingDigest | None = None  # follows the file while it is written (plain outputs)
    checksum: str | None = None
    position = {name: k for k, name in enumerate(work)}  # for ``ahead``, the sources read in the copy's order

    def one(out: _Output, lay: ByteLayout, name: str) -> None:
        interrupts.check()  # no lock is held here: the main thread raises a deferred signal
        if ahead is not None:
            ahead.take(position[name])  # returns once its bytes are in the page cache (or the file is given up)
        if stop.is_set() or interrupts.requested():
            raise Cancelled(file.path)
        t = by_name[name]
        segments = lay.placements[name]
        _fill_tensor(out, t, segments, sources, plan, budget)
        sealed = lay.seal(out.fd, name)  # a .distcp archive's CRC-32s, once its chunk is in
        if hasher is not None:
            for offset, length in (*segments, *sealed):
                hasher.finished(offset, length)
        for c in t.copies:
            sources.release(plan.sources[c.source], c.tensor)
        if run.progress is not None:
            run.progress(t.nbytes)

    def fill_tensors(fd: int, lay: ByteLayout) -> None:
        out = _Output(fd)
        if tensor_workers > 1 and len(lay.order) > 1:  # tensors fill disjoint byte ranges
            with ThreadPoolExecutor(tensor_workers, thread_name_prefix="reshard-tensor") as pool:
                try:
                    for future in [pool.submit(one, out, lay, name) for name in work]:
                        future.result()
                except BaseException:  # a failed tensor or Ctrl-C: the queued tensors give up at once
                    stop.set()
                    if ahead is not None:
                        ahead.close()  # and so do those waiting for their bytes
                    raise
        else:
            for name in work:
                one(out, lay, name)
        _before_commit(run)  # the file is renamed into place after fill (and finish)

    def fill(fd: int, lay: ByteLayout) -> None:
        nonlocal hasher
        base.preallocate(fd, lay.size)  # write_file did it already; the encrypted path's plaintext needs it
        interrupts.reached("file")  # a test-only pause point (reshard.interrupts): the temporary file exists
        if hasher_pool is None or encrypted:
            fill_tensors(fd, lay)
            return
        hasher = StreamingDigest(fd, hasher_pool, write.checksum)
        for offset, length in _final_framing(lay):  # written by write_file before fill (but what seal writes)
            hasher.finished(offset, length)
        try:
            fill_tensors(fd, lay)
        except BaseException:
            hasher.abandon()
            raise

    def finish(fd: int, lay: ByteLayout) -> None:
        nonlocal checksum
        try:  # every format's last step (a .ckpt's crc trailer only with write_crc; a .distcp's ZIP CRCs always)
            fmt.finish(fd, lay, write.write_crc)
        except BaseException:
            if hasher is not None:
                hasher.abandon()
            raise
        if hasher is not None:  # the trailer is in the file now: hash up to its real end
            checksum = hasher.result(os.fstat(fd).st_size)

    with _reading_ahead(work, by_name, plan, sources) as ahead:
        if encrypted:  # plaintext temp file, then records
            assert write.enc_key is not None
            fmt.write_encrypted(file.path, layout, fill, write.enc_key, write.enc_mode)
        else:
            base.write_file(file.path, layout, fill, finish)
    if run.on_file_written is not None:
        run.on_file_written(file, checksum)
    return checksum


def _before_commit(run: RunOptions) -> None:
    """Wait for what must pass before an output goes into place (a check running beside the copy)."""
    if run.before_commit is not None:
        run.before_commit()


@contextlib.contextmanager
def _reading_ahead(
    work: Sequence[str], by_name: dict[str, TensorPlan], plan: Plan, sources: SourceCache
) -> Iterator[Prefetcher | None]:
    """A ``Prefetcher`` of the file's sources in work order while the file is written, closed after
    (None: ``_prefetcher`` cannot say which bytes a tensor reads)."""
    ahead = _prefetcher(work, by_name, plan, sources)
    try:
        yield ahead
    finally:
        if ahead is not None:
            ahead.close()


def _prefetcher(
    work: Sequence[str], by_name: dict[str, TensorPlan], plan: Plan, sources: SourceCache
) -> Prefetcher | None:
    """A started ``Prefetcher`` of the file's sources in work order, or None where it cannot say
    which file bytes a tensor reads (a source that is not a plain file, a weight assembled from
    chunks)."""

    def entry_of(path: str, tensor: str) -> tuple[tuple[base.Segment, ...], tuple[int, ...], int] | None:
        index = sources.get(path)
        entry = index.entries.get(tensor) if index.file_backed else None
        return (entry.segments, entry.shape, entry.dtype.itemsize) if entry is not None else None

    reads = []
    planned: set[prefetch.FileRange] = set()  # a quantized weight's values and scales read it once
    for name in work:
        ranges = prefetch.tensor_reads(by_name[name], plan, entry_of)
        if ranges is None:
            return None
        reads.append([r for r in ranges if r not in planned])
        planned.update(ranges)
    if not any(reads):
        return None
    readahead.stop()  # the start-up read-ahead read in file order: from here on, the copy's order
    return Prefetcher(reads).start()


def work_order(
    order: Sequence[str], by_name: dict[str, TensorPlan], plan: Plan, sources: SourceCache | None = None
) -> list[str]:
    """The order a file's tensors are filled in: the layout's, except that the tensors computed from one
    stored weight are taken one after the other, where the first of them stands, and that a file copied
    from one source file alone is filled in that source's order (``source_order``).

    Why: a ``--quantize`` output holds every F32 scale tensor before every F8 weight, and each scale
    tensor reads its whole weight. In file order a run read its whole input from the disk first, with
    half a core busy, and computed the values afterwards from the page cache: cold, the sum of the two.
    Taken weight by weight, the reading and the computing overlap: the bench's 2 GiB bf16 quantized
    cold, medians of 5, 2.02 -> 1.28 s (``cp -r`` of the input 0.83 s). The checksum of the file can
    only follow once every scale is in, near the end (0.08 s of that run).
    """
    if not plan.quantized:
        return source_order(order, by_name, plan, sources) if sources is not None else list(order)
    weight_of: dict[str, tuple[str, str] | None] = {}
    together: dict[tuple[str, str], list[str]] = {}
    for name in order:
        reads = plan.computed_reads(by_name[name])
        weight_of[name] = (reads[0].path, reads[0].weight) if reads else None
        if reads:
            together.setdefault((reads[0].path, reads[0].weight), []).append(name)
    work: list[str] = []
    for name in order:
        weight = weight_of[name]
        if weight is None:
            work.append(name)
        elif together[weight][0] == name:
            work.extend(together[weight])
    return work


def source_paths(tensors: Iterable[TensorPlan], plan: Plan) -> set[str]:
    """The source files the copies of ``tensors`` read."""
    return {plan.sources[c.source] for t in tensors for c in t.copies}


def single_source(order: Sequence[str], by_name: dict[str, TensorPlan], plan: Plan) -> str | None:
    """The one source file every copy of the file reads (a convert: one rank file to one file of
    another format), or None when it reads several, or none."""
    paths = source_paths((by_name[name] for name in order), plan)
    return paths.pop() if len(paths) == 1 else None


def source_order(order: Sequence[str], by_name: dict[str, TensorPlan], plan: Plan, sources: SourceCache) -> list[str]:
    """``order``, sorted by where each tensor's bytes stand in the source, when every copy of the file
    reads one and the same source file (``single_source``).

    Why: the output's order is not the source's (a safetensors file sorts its names, a ``.ckpt``
    keeps the writer's order), and the kernel reads ahead only for reads that follow each other. In
    the output's order a convert of 8 ``.ckpt`` rank files read its sources in ~1 MiB requests; in
    the source's order, with the index's islands dropped first (``pagecache``), in up to 4 MiB ones
    (cold, medians of 6: 0.644 -> 0.564 s, ``cp -r`` 0.526 s; either change alone gained nothing).
    Writes land anywhere in the preallocated file either way. Outputs read from several sources (a
    merge, a reshard) keep the output's order: each output tensor reads all of them, and sorting by
    one of them gained nothing.
    """
    path = single_source(order, by_name, plan)
    if path is None:
        return list(order)
    entries = sources.get(path).entries

    def at(name: str) -> int:
        copies = by_name[name].copies
        segments = entries[copies[0].tensor].segments if copies else ()
        return segments[0][0] if segments else -1  # literals and empty tensors first

    return sorted(order, key=at)


def _final_framing(lay: ByteLayout) -> Iterator[base.Segment]:
    """The framing's byte ranges, less the fields ``ByteLayout.seal`` writes later (final only then)."""
    holes = sorted(lay.sealed())
    k = 0
    for offset, data in lay.framing:
        start, end = offset, offset + len(data)
        while k < len(holes) and holes[k][0] < start:
            k += 1
        j = k
        while j < len(holes) and holes[j][0] < end:
            hole, size = holes[j]
            if hole > start:
                yield start, hole - start
            start = max(start, hole + size)
            j += 1
        if start < end:
            yield start, end - start


_SIGNAL_POLL_SECONDS = 0.05  # how soon the waiting thread notices a deferred stop signal


def _run_files_fail_fast(
    files: Sequence[FilePlan], workers: int, write: Callable[[FilePlan, threading.Event], object]
) -> None:
    """Write ``files`` on ``workers`` threads, starting each only while no output has failed.

    At most ``workers`` outputs are in flight: an output starts when another finishes. After the
    first failure (or Ctrl-C/SIGTERM in the waiting thread) nothing new starts, the outputs still
    running give up before their next tensor (``Cancelled``, temporary file removed), and the first
    error is raised. At terabyte scale, submitting every output up front would write the whole job
    before the error could return (and roll-back would delete it all again).

    The waiting thread takes finished outputs from a ``SimpleQueue`` rather than
    ``concurrent.futures.wait``, and looks for a stop signal (``interrupts.check``) every
    ``_SIGNAL_POLL_SECONDS`` and between outputs, where it holds no lock: the command's signals are
    deferred during a run (``run_plan``), because one raised inside the pool's or a future's locking
    could leave a lock held, and the worker needing it would block forever.
    """
    cancel = threading.Event()
    finished: queue.SimpleQueue[Future[object]] = queue.SimpleQueue()
    queued = iter(files)
    failure: BaseException | None = None
    with ThreadPoolExecutor(workers, thread_name_prefix="reshard-file") as pool:
        try:
            running = 0
            for f in itertools.islice(queued, workers):
                pool.submit(write, f, cancel).add_done_callback(finished.put)
                running += 1
            while running:
                try:
                    done = finished.get(timeout=_SIGNAL_POLL_SECONDS)
                except queue.Empty:
                    interrupts.check()
                    continue
                interrupts.check()
                running -= 1
                if failure is None and done.exception() is not None:
                    failure = done.exception()
                    cancel.set()
                if failure is None:
                    for f in itertools.islice(queued, 1):
                        pool.submit(write, f, cancel).add_done_callback(finished.put)
                        running += 1
        except BaseException:  # Ctrl-C / SIGTERM while waiting: start nothing more, abandon the rest
            cancel.set()
            raise
    if failure is not None:
        raise failure


def run_plan(plan: Plan, opener: Opener, write: WriteOptions | None = None, run: RunOptions | None = None) -> None:
    """Execute every output of ``plan``; text outputs (index JSON) are written last."""
    write, run = write or WriteOptions(), run or RunOptions()
    reading = opener
    if plan.quantized:  # tensors computed while copying: their readers (numpy) load with them
        from reshard.execute import dequant

        reading = dequant.wrapped_opener(plan, opener)
    sources = SourceCache(reading)
    try:
        validate_plan(plan, lambda i, name: sources.shape(plan.sources[i], name))  # before any byte
        if plan.quantized:
            dequant.check_scales(plan, opener)
    except BaseException:
        sources.close()
        raise
    # Workers go to output files first; each file fills its tensors on its share of the workers
    # (a merge to one full file, a unify's one large part beside a small one: tensors in parallel).
    threads = computing_threads(run.workers) if plan.quantized else run.workers
    workers = max(1, min(threads, len(plan.files) or 1))
    total = sum(f.nbytes for f in plan.files)
    # at most threads + workers threads fill tensors at once (each file's share rounds up to one)
    budget = max(_PAGE, min(STAGING_BLOCK_BYTES, run.max_memory // (threads + workers)))
    if run.on_start is not None:
        run.on_start(total)
    with interrupts.deferred(), contextlib.ExitStack() as stack:
        stack.callback(sources.close)
        hashers = stack.enter_context(hash_pool()) if run.hash_outputs else None
        if workers == 1:
            for f in plan.files:
                run_file(f, plan, sources, write, run, budget, threads, hashers)
        else:
            _run_files_fail_fast(
                plan.files,
                workers,
                lambda f, cancel: run_file(
                    f, plan, sources, write, run, budget, tensor_threads(f.nbytes, total, threads), hashers, cancel
                ),
            )
    write_texts(plan)


def computing_threads(workers: int) -> int:
    """Threads of a run that computes tensors (``--dequantize``, ``--quantize``): at most one per core.

    Its threads are busy with numpy, not waiting on the disk: more of them than cores only take the
    GIL and the output's inode lock from each other. On 2 cores, the bench's 2 GiB dequantize to one
    file, cold, medians of 5: 4 threads 1.37 s, 2 threads 1.23 s (warm 1.09 -> 1.04 s, 0.1 s less
    system time).
    """
    return max(1, min(workers, os.cpu_count() or 1))


def tensor_threads(file_bytes: int, total_bytes: int, workers: int) -> int:
    """Threads that fill one output's tensors: the file's share of the run's bytes, of its workers.

    Files of equal size take one thread each (a transform 8 -> 4 ranks: four files at once); a file
    holding most of the bytes takes most of the workers. Before, every file of a several-file output
    got one thread, so a unify (one 1.1 GB part beside a 200-byte ``hyper_param`` file) copied all of
    its bytes on one thread while the others idled: 0.8 s against ``cp``'s 0.33 s on a warm cache.
    """
    if total_bytes <= 0:
        return 1
    return max(1, min(workers, round(workers * file_bytes / total_bytes)))


def write_texts(plan: Plan) -> None:
    """The plan's text outputs (index JSON), once every file they describe is written."""
    interrupts.reached("texts")  # a test-only pause point (reshard.interrupts)
    for text in plan.texts:
        base.write_whole(text.path, text.text)


__all__ = [
    "Cancelled",
    "Opener",
    "SourceCache",
    "byte_layout",
    "computing_threads",
    "run_file",
    "run_plan",
    "single_source",
    "source_order",
    "source_paths",
    "tensor_threads",
    "work_order",
    "write_texts",
]
