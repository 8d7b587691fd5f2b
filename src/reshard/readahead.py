"""Reading the start of a run's sources ahead while the process starts.

Why: a run spends its first quarter second on the CPU (the interpreter, numpy and reshard's
imports, the arguments, the plan) while the disk idles, then its copy waits on the disk. Hinting the
kernel to read the first ``BUDGET`` bytes of the sources meanwhile overlaps the two: on a cold page
cache it took 0.05-0.1 s off every operation of the bench's 1.2 GB model (docs/benchmarks.md). That
was measured with 16 MiB hints of which the kernel read 8 MiB each (see below), so 128 MiB in all;
256 MiB actually read was 0.06 s slower on the merge (the planner's header reads queue behind them).

How, and why it is safe:

* ``posix_fadvise(WILLNEED)`` only: the kernel reads into its page cache in the background;
  nothing is copied into this process, and the files are opened read-only and closed at once.
* One daemon thread, started after the arguments are parsed (the sources are then known, not
  guessed) and before the heavy imports; a failure of any kind ends it quietly (a hint).
* Bounded: larger budgets measured slower, as the planner's own header reads and the first copies
  queued behind the hinted bytes. The files are taken in natural order (``rank_2`` before
  ``rank_10``), the order the executor mostly reads them in.
* Headers first: the first ``HEAD_BYTES`` of every file are hinted before any file is hinted whole.
  The planner reads every source's header (a safetensors file's JSON, a ``.ckpt``'s first records)
  before it copies a byte, and those reads queued behind the whole of ``rank_0``'s and ``rank_1``'s
  hinted bytes. Cold, interleaved, median of 5 against the commit before (docs/benchmarks.md): a
  merge of 8 ``.ckpt`` ranks 1.040 -> 1.002 s, a unify of 8 safetensors ranks 0.989 -> 0.960 s, a
  transform 8->4 of them 0.925 -> 0.914 s (``cp -r`` 0.682 s).
* One hint reads at most what the device reads in one go: Linux caps each ``WILLNEED`` call at the
  larger of the device's read-ahead window and its largest request (``read_ahead_kb``,
  ``max_sectors_kb`` under ``/sys/dev/block/<major>:<minor>/queue``) and silently drops the rest.
  With 16 MiB hints on this machine's disk (8 MiB window) half of the budget was never read; on a
  default device (128 KiB window, 1.25 MiB requests) it would have been about a tenth. So each
  file is hinted in pieces of its device's limit (``hint_bytes``); where sysfs does not say (an
  overlay or network filesystem) the pieces are ``FALLBACK_HINT_BYTES``. Pieces are not made
  smaller than that: every call releases and retakes the GIL, which the main thread holds while it
  imports, so a call costs up to a switch interval (5 ms) however little it asks for.

Only the standard library is imported, so the thread starts before numpy is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator

BUDGET = 128 * 1024**2  # bytes hinted in all
HEAD_BYTES = 256 * 1024  # the start of every file, hinted before any file whole: where its header is
HINT_BYTES = 16 * 1024**2  # the most one fadvise call asks for
FALLBACK_HINT_BYTES = 1024**2  # one call where sysfs does not give the device's limit (and the least)
SYSFS_BLOCK = "/sys/dev/block"  # <major>:<minor> -> the device (a partition's queue is its disk's)
SUFFIXES = (".ckpt", ".safetensors", ".distcp")
MAX_DEPTH = 3  # a source folder's files: rank_<r>/x.ckpt, a Checkpoint 2.0's iteration/rank_<r>/x
_DIGITS = re.compile(r"(\d+)")
Advise = Callable[[int, int, int], None]  # (fd, offset, length)


def start(paths: Iterable[str | os.PathLike[str] | None], budget: int = BUDGET) -> threading.Thread | None:
    """Hint the kernel to read the first ``budget`` bytes of the checkpoint files under ``paths``.

    Returns the thread (tests join it), or None when there is nothing to read or the platform has
    no ``posix_fadvise``. Paths that are not there, or not readable, are skipped without a word.
    """
    given = [os.fspath(p) for p in paths if p]
    if not given or budget <= 0 or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_hint_quietly, args=(given, budget), name="reshard-readahead", daemon=True)
    thread.start()
    return thread


def checkpoint_files(path: str) -> list[str]:
    """The checkpoint files a source path holds, in natural order (a file is its own list)."""
    if os.path.isfile(path):
        return [path]
    return sorted(_walk(path, MAX_DEPTH), key=_natural)


def hint(paths: list[str], budget: int, advise: Advise | None = None) -> int:
    """Issue the read hints (``advise(fd, offset, length)``, default ``posix_fadvise(WILLNEED)``); returns
    the bytes hinted. Each path gets an equal share of ``budget``: first the start of each of its files
    (``HEAD_BYTES``), then the files whole in turn, from where their start ended."""
    share = budget // len(paths)
    total = 0
    for path in paths:
        names = checkpoint_files(path)
        left = share
        heads: dict[str, int] = {}
        for name in names:
            if left <= 0:
                break
            heads[name] = _hint_file(name, min(left, HEAD_BYTES), advise or _willneed)
            left -= heads[name]
        for name in names:
            if left <= 0 or name not in heads:
                break
            left -= _hint_file(name, left, advise or _willneed, start=heads[name])
        total += share - left
    return total


def _hint_quietly(paths: list[str], budget: int) -> None:
    with contextlib.suppress(Exception):  # a hint: the run reads what it needs either way
        hint(paths, budget)


def _hint_file(name: str, left: int, advise: Advise, start: int = 0) -> int:
    """Hint up to ``left`` bytes of ``name`` from ``start``, one device read a call; the bytes hinted."""
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        stat = os.fstat(fd)
        end = min(stat.st_size, start + left)
        piece = hint_bytes(stat.st_dev)
        for offset in range(start, end, piece):
            advise(fd, offset, min(piece, end - offset))
        return max(0, end - start)
    finally:
        os.close(fd)


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
    return [int(part) if part.isdigit() else part for part in _DIGITS.split(path)]


__all__ = [
    "BUDGET",
    "FALLBACK_HINT_BYTES",
    "HEAD_BYTES",
    "HINT_BYTES",
    "SUFFIXES",
    "SYSFS_BLOCK",
    "checkpoint_files",
    "hint",
    "hint_bytes",
    "start",
]
