"""Helpers for the tests of what a run leaves in the page cache and in its maps."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any


class CountingMap:
    """A file's map that counts the reads made through it (a reader's ``map_file`` returns it)."""

    def __init__(self, inner: mmap.mmap) -> None:
        self.inner = inner
        self.reads = 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return self.inner[key]

    def __len__(self) -> int:
        return len(self.inner)

    def close(self) -> None:
        self.inner.close()


def evict(path: str | Path) -> None:
    """Drop a file's pages from the page cache (written out first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


__all__ = ["CountingMap", "evict"]
