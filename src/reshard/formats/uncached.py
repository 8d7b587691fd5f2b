"""Small reads that leave nothing in the page cache: a ``.ckpt`` index's record heads, the replica check's samples.

Why: the kernel's read-ahead reads an uncached range in large requests (4 MiB on this machine's
disk), but splits them wherever a page is already cached. Planning reads one small head per record
and three small samples per replicated tensor, all over the rank files. Read through the page cache,
each left a page or two cached between bytes that the start-up read-ahead (resuming after the index)
and then the copy read in order: the read-ahead's 32 MiB reads took 18-20 ms after the index of the
bench's 8 rank files, against 8-12 ms before it, and ``execute.pagecache`` had to find those islands
again and drop them before the copy, about 2 ms a file on the run's way to its first copy.

Linux 6.14 and later read with ``RWF_DONTCACHE`` through the page cache and drop what the read
brought in once it is copied out (a page cached before stays cached), at the latency of a plain
read. Pages read ahead past the bytes asked for would stay, so the callers read through a
descriptor advised ``POSIX_FADV_RANDOM`` (``read_nothing_ahead``). ``read`` asks for the flag and falls back to a plain
``pread`` where the kernel does not know it (``EINVAL``, ``ENOSYS``, or a platform without
``preadv2``: then it is not asked again) or the file system does not take it (``EOPNOTSUPP``).
``left_none`` says whether every read so far went uncached; the executor looks for islands only
when some did not. Cold, interleaved, medians of 16 against the islands dropped: merge of the
bench's 8 rank files 0.559 -> 0.541 s (8 rounds: transform 8 -> 4 0.504 -> 0.495 s, convert 0.494
-> 0.477 s, unify 0.524 -> 0.511 s).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)  # Linux's value; Python names it from 3.14 on
_NEVER = (errno.EINVAL, errno.ENOSYS)  # the kernel does not know the flag, or preadv2 itself
_REFUSED = (*_NEVER, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP))  # the file system says no


class _Tally:
    """Whether the kernel takes the flag at all, and how many reads went through the page cache."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernel_takes = hasattr(os, "preadv")
        self.cached_reads = 0


_TALLY = _Tally()


def read(fd: int, length: int, offset: int) -> bytes | bytearray:
    """Up to ``length`` bytes of ``fd`` at ``offset`` (fewer at the end of the file), leaving no page
    in the page cache that was not there before where the kernel allows (see the module docstring)."""
    if _TALLY.kernel_takes:
        buffer = bytearray(length)
        try:
            got = os.preadv(fd, [buffer], offset, RWF_DONTCACHE)
        except NotImplementedError:  # a platform without preadv2 (macOS): flags are refused before any call
            _TALLY.kernel_takes = False
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            if exc.errno in _NEVER:  # a kernel before 6.14 (or before preadv2): no file will take it
                _TALLY.kernel_takes = False
        else:
            del buffer[got:]
            return buffer
    with _TALLY.lock:
        _TALLY.cached_reads += 1
    return os.pread(fd, length, offset)


def read_nothing_ahead(fd: int) -> None:
    """Advise ``fd`` to read only the bytes asked for (``POSIX_FADV_RANDOM``): ``read`` drops the
    pages it asked for, not those the kernel reads ahead of them. A hint; refused, nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def left_none() -> bool:
    """Whether every ``read`` of this process so far left nothing cached."""
    with _TALLY.lock:
        return _TALLY.kernel_takes and _TALLY.cached_reads == 0


__all__ = ["RWF_DONTCACHE", "left_none", "read", "read_nothing_ahead"]
