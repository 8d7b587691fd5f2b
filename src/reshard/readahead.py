"""Reading the start of a run's sources ahead while the process starts.

Why: a run spends its first tenths of a second on the CPU (the interpreter, reshard's imports, the
arguments, the index, the plan) while the disk would idle, then its copy waits on the disk. Reading
the first ``BUDGET`` bytes of the sources into the page cache meanwhile overlaps the two.

How, and why it is safe:

* One daemon thread, started as soon as the sources are known (``cli.early`` reads them off the
  command's words) and before the heavy imports; a failure of any kind ends it quietly (a hint).
  Nothing is copied into this process, and the files are opened read-only and closed at once.
* Headers first: the first ``HEAD_BYTES`` of every file are hinted (``posix_fadvise(WILLNEED)``)
  before any file is read on. The planner reads every source's header (a safetensors file's JSON, a
  ``.ckpt``'s first records) before it copies a byte, and those reads queued behind the whole of
  ``rank_0``'s and ``rank_1``'s bytes (cold, median of 5: merge 1.040 -> 1.002 s, unify 0.989 ->
  0.960 s on the first machine).
* Strategy files before anything (``small``): the planner reads each whole in one go, and that
  read queued behind the bulk too (the strategy's load of a cold bf16 merge 20-59 ms).
* Then the files are read whole, one after another in natural order (``rank_2`` before
  ``rank_10``), by ``sendfile`` into ``/dev/null``: the kernel reads them as it reads for ``cp``,
  in large folios, 4 MiB requests on this machine's disk, a few at a time. This replaced hinting the
  bulk with ``WILLNEED`` (Linux 6.18): those hints read in small folios, ~0.5-1 MiB requests, and
  queued all 128 MiB at once, so the index's own small reads waited behind them (a cold index of 8
  ``.ckpt`` rank files 120 ms with the hints running, 35 ms without). Cold, interleaved, medians of
  5 against the hints (``cp -r`` 0.537 s): merge 0.684 -> 0.627 s, transform 8 -> 4 0.645 -> 0.560
  s, unify 0.742 -> 0.705 s; in the trial before (8 MiB calls), split 0.677 -> 0.652 s, convert
  0.567 -> 0.525 s, transform of safetensors 0.715 -> 0.679 s (docs/benchmarks.md, "Reading the
  sources in large requests").
* Bounded, and ended early: the bulk stops when the executor starts reading in the copy's own
  order (``stop``, when ``execute.prefetch`` starts), so a larger budget only reads on while the run
  plans. While the bulk ran on into the copy, 256 MiB measured best (128 / 256 / 384 MiB: 0.674 /
  0.655 / 0.683 s; 1 GiB 0.83 s, its reads and the copy's competing); since it stops there, 256 /
  512 / 1024 MiB all gave a cold merge 0.57-0.58 s, and 512 MiB keeps a slow plan of a large model
  from filling the page cache in an order the copy may not want. Each source path gets an equal
  share. Reading the files' first pieces in turn instead of file by file was slower (0.666 s).
* The bulk makes way for an index (``paused``): a ``.ckpt`` index reads one small record head
  after another, and each of those reads queued behind the bulk's 4 MiB requests. A cold index of
  8 rank files took 32 ms alone and 130-160 ms beside the bulk, on the run's critical path; so
  ``sources.files.indexed`` holds the bulk between two of its reads while it indexes.
* Where ``sendfile`` cannot write to ``/dev/null`` (not Linux), the rest is hinted as before:
  in pieces of what the device reads in one go, since Linux caps each ``WILLNEED`` call at the
  larger of the device's read-ahead window and its largest request (``read_ahead_kb``,
  ``max_sectors_kb`` under ``/sys/dev/block/<major>:<minor>/queue``) and silently drops the rest
  (``hint_bytes``; ``FALLBACK_HINT_BYTES`` where sysfs does not say).
* Reads and hints go in pieces of at least ``READ_BYTES`` / ``FALLBACK_HINT_BYTES``: every call
  releases and retakes the GIL, which the main thread holds while it imports, so a call costs up to
  a switch interval (5 ms) however little it asks for.

Only the standard library is imported, so the thread starts before numpy is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

BUDGET = 512 * 1024**2  # bytes read ahead in all
HEAD_BYTES = 256 * 1024  # the start of every file, hinted before any file whole: where its header is
SMALL_FILE_BYTES = 16 * 1024**2  # the most of one strategy file hinted
SMALL_FILES = 64  # the most strategy files hinted (a folder of per-stage files)
READ_BYTES = 32 * 1024**2  # one sendfile call into /dev/null
HINT_BYTES = 16 * 1024**2  # the most one fadvise call asks for
FALLBACK_HINT_BYTES = 1024**2  # one call where sysfs does not give the device's limit (and the least)
SYSFS_BLOCK = "/sys/dev/block"  # <major>:<minor> -> the device (a partition's queue is its disk's)
SUFFIXES = (".ckpt", ".safetensors", ".distcp")
MAX_DEPTH = 3  # a source folder's files: rank_<r>/x.ckpt, a Checkpoint 2.0's iteration/rank_<r>/x
_BULK_MAY_READ = threading.Event()  # cleared while an index runs (``paused``)
_BULK_MAY_READ.set()
_pausers = 0  # indexes running now
_pausers_lock = threading.Lock()
_generation = 0  # ``stop`` ends the bulk of every read-ahead started before it
Advise = Callable[[int, int, int], None]  # (fd, offset, length)
Read = Callable[[int, int, int], None]  # (fd, offset, length): bring those bytes into the page cache


def start(
    paths: Iterable[str | os.PathLike[str] | None],
    budget: int = BUDGET,
    small: Iterable[object] = (),
) -> threading.Thread | None:
    """Read the first ``budget`` bytes of the checkpoint files under ``paths`` into the page cache;
    first of all the ``small`` files (strategy files, or the files of a strategy folder) whole, of
    which anything but a path (None, a loaded strategy) is passed over.

    Returns the thread (tests join it), or None when there is nothing to read or the platform has
    no ``posix_fadvise``. Paths that are not there, or not readable, are skipped without a word.
    """
    given = [os.fspath(p) for p in paths if p]
    extra = [os.fspath(p) for p in small if isinstance(p, (str, os.PathLike)) and p]
    if not given or budget <= 0 or not hasattr(os, "posix_fadvise"):
        return None
    args = (given, budget, _generation, extra)  # a ``stop`` from here on ends this one's bulk
    thread = threading.Thread(target=_hint_quietly, args=args, name="reshard-readahead", daemon=True)
    thread.start()
    return thread


def checkpoint_files(path: str) -> list[str]:
    """The checkpoint files a source path holds, in natural order (a file is its own list)."""
    if os.path.isfile(path):
        return [path]
    return sorted(_walk(path, MAX_DEPTH), key=_natural)


def hint(
    paths: list[str],
    budget: int,
    advise: Advise | None = None,
    read: Read | None = None,
    generation: int | None = None,
    small: Sequence[str] = (),
) -> int:
    """Read the sources ahead; returns the bytes asked for. Each path gets an equal share of
    ``budget``: first the start of each of its files is hinted (``advise(fd, offset, length)``,
    default ``posix_fadvise(WILLNEED)``, ``HEAD_BYTES`` each), then the files are read whole in turn
    from where their start ended (``read``, default ``sendfile`` into ``/dev/null``, which falls back
    to hints)."""
    advise = advise or _willneed
    for name in small_files(small):  # read in one go by the planner, a few ms each behind the bulk
        _each_piece(name, SMALL_FILE_BYTES, advise, hint_bytes)
    share = budget // len(paths)
    total = 0
    with contextlib.ExitStack() as stack:
        if read is None:
            read = stack.enter_context(NullReader())
        bulk = _when_unpaused(read, _generation if generation is None else generation)
        for path in paths:
            names = checkpoint_files(path)
            left = share
            heads: dict[str, int] = {}
            for name in names:
                if left <= 0:
                    break
                heads[name] = _each_piece(name, min(left, HEAD_BYTES), advise, hint_bytes)
                left -= heads[name]
            for name in names:
                if left <= 0 or name not in heads:
                    break
                left -= _each_piece(name, left, bulk, lambda device: READ_BYTES, start=heads[name])
            total += share - left
    return total


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Hold the bulk reads while the caller's small reads go first (they resume when the last
    holder leaves). The read under way finishes first: at most ``READ_BYTES``."""
    global _pausers
    with _pausers_lock:
        _pausers += 1
        _BULK_MAY_READ.clear()
    try:
        yield
    finally:
        with _pausers_lock:
            _pausers -= 1
            if not _pausers:
                _BULK_MAY_READ.set()


def stop() -> None:
    """End the bulk of the read-ahead under way (its read in progress finishes first): the executor's
    own read-ahead (``execute.prefetch``) reads in the copy's order from here on."""
    global _generation
    with _pausers_lock:
        _generation += 1


class _Stopped(Exception):
    """The bulk was ended by ``stop``."""


def _when_unpaused(read: Read, generation: int) -> Read:
    def read_when_unpaused(fd: int, offset: int, length: int) -> None:
        _BULK_MAY_READ.wait()
        if _generation != generation:
            raise _Stopped
        read(fd, offset, length)

    return read_when_unpaused


def _hint_quietly(paths: list[str], budget: int, generation: int, small: list[str]) -> None:
    with contextlib.suppress(Exception):  # a hint: the run reads what it needs either way
        hint(paths, budget, generation=generation, small=small)


def small_files(paths: Sequence[str]) -> list[str]:
    """The files ``paths`` name: a file itself, a folder's own files (per-stage strategy files), at
    most ``SMALL_FILES`` in all."""
    found: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
        elif os.path.isdir(path):
            with contextlib.suppress(OSError):
                found += sorted((e.path for e in os.scandir(path) if e.is_file()), key=_natural)
    return found[:SMALL_FILES]


def _each_piece(name: str, left: int, call: Advise, piece_bytes: Callable[[int], int], start: int = 0) -> int:
    """``call(fd, offset, length)`` over up to ``left`` bytes of ``name`` from ``start``, in pieces of
    ``piece_bytes(st_dev)``; the bytes asked for."""
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        stat = os.fstat(fd)
        end = min(stat.st_size, start + left)
        _in_pieces(fd, start, end, piece_bytes(stat.st_dev), call)
        return max(0, end - start)
    finally:
        os.close(fd)


def _in_pieces(fd: int, start: int, end: int, piece: int, call: Advise) -> None:
    for offset in range(start, end, piece):
        call(fd, offset, min(piece, end - offset))


class NullReader:
    """Reads file pieces into the page cache by ``sendfile`` into ``/dev/null``; where that is refused
    (not Linux), hints them instead, in the device's pieces."""

    def __enter__(self) -> NullReader:
        self._null: int | None = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._null is not None:
            os.close(self._null)
            self._null = None

    def __call__(self, fd: int, offset: int, length: int) -> None:
        end = offset + length
        while self._null is not None and offset < end:
            try:
                sent = os.sendfile(self._null, fd, offset, end - offset)
            except OSError:
                self._close()  # refused: hint the rest
                break
            if sent <= 0:
                return  # the file ended
            offset += sent
        if offset < end:
            _in_pieces(fd, offset, end, hint_bytes(os.fstat(fd).st_dev), _willneed)


@functools.cache
def hint_bytes(device: int) -> int:
    """Bytes one ``WILLNEED`` hint reads on ``device`` (an ``st_dev``): the larger of its read-ahead
    window and its largest request, within ``[FALLBACK_HINT_BYTES, HINT_BYTES]``."""
    node = os.path.join(SYSFS_BLOCK, f"{os.major(device)}:{os.minor(device)}")
    for queue in (os.path.join(node, "queue"), os.path.join(node, "..", "queue")):
        window, request = _kib(queue, "read_ahead_kb"), _kib(queue, "max_sectors_kb")
        if window or request:
            return max(FALLBACK_HINT_BYTES, min(HINT_BYTES, max(window, request)))
    return FALLBACK_HINT_BYTES


def _kib(queue: str, name: str) -> int:
    """A sysfs size in KiB, as bytes (0 when the file is not there or not a number)."""
    try:
        with open(os.path.join(queue, name), encoding="ascii") as fh:
            return int(fh.read().strip()) * 1024
    except (OSError, ValueError):
        return 0


def _willneed(fd: int, offset: int, length: int) -> None:
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)


def _walk(folder: str, depth: int) -> Iterator[str]:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_file() and entry.name.endswith(SUFFIXES):
            yield entry.path
        elif depth > 1 and entry.is_dir(follow_symlinks=False):
            yield from _walk(entry.path, depth - 1)


def _natural(path: str) -> list[object]:
    """Sort key: runs of decimal digits compare as numbers (``rank_2`` before ``rank_10``); it starts
    with text (empty when the path starts with a digit), so two keys never compare a number with text."""
    key: list[object] = []
    for digits, run in itertools.groupby(path, str.isdecimal):
        text = "".join(run)
        if digits and not key:
            key.append("")
        key.append(int(text) if digits else text)
    return key or [""]


__all__ = [
    "BUDGET",
    "FALLBACK_HINT_BYTES",
    "HEAD_BYTES",
    "HINT_BYTES",
    "READ_BYTES",
    "SMALL_FILES",
    "SMALL_FILE_BYTES",
    "SUFFIXES",
    "SYSFS_BLOCK",
    "NullReader",
    "checkpoint_files",
    "hint",
    "hint_bytes",
    "paused",
    "small_files",
    "start",
    "stop",
]
