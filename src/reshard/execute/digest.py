"""Checksums of output files (XXH128, BLAKE3 or SHA-256): computed while a file is written, or read back.

What the manifest's checksum is for: telling a complete, intact output from a truncated, damaged or
half-copied one (a killed copy to another node, a disk error, a resumed run's leftovers). The manifest
sits beside the files it lists and is not signed, so whoever can change a file can change its line
too: a cryptographic hash there guards against nothing a 128-bit checksum does not.

Why XXH128 by default: on this project's 2-core machine BLAKE3 hashes 4.8 GB/s per core and XXH128
(xxHash's XXH3, 128 bits) 31 GB/s. A copy runs at disk speed with both cores busy (the kernel's page
copies, the planner, numpy's casts), so every second of hashing is a second of someone's CPU: BLAKE3
cost a 2 GB dequantizing run 0.4 s of its 3.2 CPU-s and about 0.2 s of its wall time, XXH128 0.07 s
(docs/benchmarks.md). XXH128 is the canonical XXH3 128-bit hash, printed big-endian, the form
``xxhsum -H2`` checks on the command line. BLAKE3 (``b3sum``) and SHA-256 (``sha256sum``) stay one
option away (``--checksum``, ``WriteOptions(checksum=...)``), and a manifest names its algorithm in each line, so a
manifest written with any of them is checked with it.

Why hash while writing: hashing a finished file is a second pass that starts only when the copy
has ended; for a one-file output (a merge to full weights, a unify part) that tail is as long as
the pass. Hashes must see the bytes in order, but the executor fills a file in (roughly) file
order, so ``StreamingDigest`` follows the longest finished prefix of the file: the executor reports
each byte range it completed, and a hash thread reads the newly finished prefix back from the page
cache (GIL released) while later ranges are still being copied. On a cold cache the copy waits for
the disk and the hashing fills that wait.

Why it reads with ``pread`` into a small buffer: a ``HASH_READ_BYTES`` (512 KiB) buffer stays in the
core's 1 MiB L2 cache, so the kernel's copy leaves the bytes where the hash reads them at once.
Reading the output through a map instead (no copy, but a page fault per 64 KiB of pages the executor
had just written, and the hash reading them from memory) took 0.10 s of CPU per 1.13 GB file
against 0.07 s (a freshly written 1.13 GB file, cached; 8 MiB reads: 0.085 s). A cold merge of the
bench's model used 17 ms less CPU (user + system, medians of 12); its wall time did not change.

Ranges never reported (padding the layout leaves as zeros) are covered at the end: ``result``
marks the whole file finished, since every write has happened by then.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reshard.errors import UsageError

HASH_READ_BYTES = 512 * 1024  # one read: in the core's L2 cache when the hash reads it (module docstring)
ALGORITHMS = ("xxh128", "blake3", "sha256")
DEFAULT_ALGORITHM = "xxh128"

_THREAD = threading.local()


def _buffer() -> memoryview:
    """This hash thread's reused read buffer."""
    view: memoryview | None = getattr(_THREAD, "buffer", None)
    if view is None:
        view = memoryview(bytearray(HASH_READ_BYTES))
        _THREAD.buffer = view
    return view


def check_algorithm(algorithm: str) -> None:
    """Refuse an unknown checksum name (without importing any hash library)."""
    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown checksum {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")


def new_hash(algorithm: str) -> Any:
    """A fresh hash object of ``algorithm`` (one of ``ALGORITHMS``); its library is imported here, so only
    runs that checksum their outputs load it (not --help, plan, inspect, --no-manifest)."""
    check_algorithm(algorithm)
    if algorithm == "xxh128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    import hashlib  # OpenSSL: 3 ms (cold 11 ms) of a start that hashes with XXH128 and needs none of it

    return hashlib.sha256()


def file_digest(path: str, algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
    """(size, hex checksum) of a file, read in large blocks into one reused buffer."""
    digest = new_hash(algorithm)
    size = 0
    view = _buffer()
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(view):
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


@contextlib.contextmanager
def hash_pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for hashing (one per core: several files hash at once, each one in order)."""
    pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="reshard-hash")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class StreamingDigest:
    """Checksum of the file open as ``fd``, hashed as its byte ranges are reported finished.

    ``finished(offset, length)`` may be called from any thread, in any order; ``result(size)``
    waits for the hash of the first ``size`` bytes. ``abandon()`` stops hashing (the write failed);
    call one of the two before closing ``fd``.
    """

    def __init__(self, fd: int, pool: ThreadPoolExecutor, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self._fd = fd
        self._pool = pool
        self._sha = new_hash(algorithm)
        self._pending: list[tuple[int, int]] = []  # heap of finished (start, end) beyond the frontier
        self._frontier = 0  # bytes [0, frontier) are finished
        self._hashed = 0  # bytes [0, hashed) are hashed
        self._running = False  # a drain task is queued or running
        self._stopped = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def finished(self, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` hold their final content."""
        if length <= 0:
            return
        with self._changed:
            heapq.heappush(self._pending, (offset, offset + length))
            while self._pending and self._pending[0][0] <= self._frontier:
                self._frontier = max(self._frontier, heapq.heappop(self._pending)[1])
            if self._frontier > self._hashed and not self._running and not self._stopped:
                self._running = True
                try:
                    self._pool.submit(self._drain)
                except BaseException:  # e.g. SIGTERM raised here: no drain will clear the flag
                    self._running = False
                    raise

    def _drain(self) -> None:
        """Hash the finished prefix until it is caught up (one task per file at a time: in order)."""
        try:
            while True:
                with self._changed:
                    start, end = self._hashed, self._frontier
                    if start >= end or self._stopped:
                        self._running = False
                        self._changed.notify_all()
                        return
                self._hash_range(start, end)
                with self._changed:
                    self._hashed = end
        except BaseException as exc:  # reported by result(); the drain stops
            with self._changed:
                self._error, self._running = exc, False
                self._changed.notify_all()

    def _hash_range(self, start: int, end: int) -> None:
        """Hash ``[start, end)``, read into this thread's buffer a ``HASH_READ_BYTES`` at a time."""
        buffer = _buffer()
        while start < end:
            view = buffer[: min(end - start, len(buffer))]
            n = os.preadv(self._fd, [view], start)
            if n <= 0:
                raise OSError(f"output ended at byte {start} while hashing it")
            self._sha.update(view[:n])
            start += n

    def result(self, size: int) -> str:
        """Hex checksum of the file's first ``size`` bytes, once every write has been made."""
        self.finished(0, size)
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or (self._hashed >= size and not self._running))
            if self._error is not None:
                raise self._error
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Stop hashing and wait for the hash thread to let go of the descriptor."""
        with self._changed:
            self._stopped = True
            self._changed.wait_for(lambda: not self._running)


__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "HASH_READ_BYTES",
    "StreamingDigest",
    "check_algorithm",
    "file_digest",
    "hash_pool",
    "new_hash",
]
