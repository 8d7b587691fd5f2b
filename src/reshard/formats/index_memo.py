"""Indexes remembered for the process, while their files are provably unchanged.

A run opens each ``.ckpt`` source three times (planning, the replica check, the executor), and
indexing one walks every record head. The index of a plain file is therefore kept and used again
while the file is provably the same: same inode, size, mtime and ctime, and a ctime at least
``SETTLED_SECONDS`` old when it was indexed, so that any later write (which sets the ctime to the
clock's present, and no user can set it back) changes the key. A file still being written is indexed
afresh every time. At most ``MEMO_TENSORS`` entries are kept, the oldest files forgotten first.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.formats.base import TensorEntry

SETTLED_SECONDS = 2.0  # a file whose ctime is older is remembered (the clock a write stamps is coarse)
MEMO_TENSORS = 200_000  # tensor entries remembered at most (the oldest files are forgotten first)

FileIdentity = tuple[str, int, int, int, int, int]  # path, device, inode, size, mtime, ctime (ns)


class IndexMemo:
    """Indexes of settled plain files, by file identity (see the module docstring)."""

    def __init__(self) -> None:
        self._indexes: dict[FileIdentity, dict[str, TensorEntry]] = {}
        self._tensors = 0
        self._lock = threading.Lock()

    @staticmethod
    def identity(path: str) -> FileIdentity | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def recall(self, identity: FileIdentity | None) -> dict[str, TensorEntry] | None:
        """A copy of the remembered index (callers may change their dict), or None."""
        with self._lock:
            entries = self._indexes.get(identity) if identity is not None else None
        return dict(entries) if entries is not None else None

    def keep(self, identity: FileIdentity | None, entries: dict[str, TensorEntry], path: str) -> None:
        """Remember ``entries`` if the file was settled before and unchanged while it was indexed."""
        if identity is None or len(entries) > MEMO_TENSORS:
            return
        if time.time_ns() - identity[5] < SETTLED_SECONDS * 1e9 or self.identity(path) != identity:
            return  # written lately (a later write could carry the same stamps), or changed meanwhile
        with self._lock:
            while self._indexes and self._tensors + len(entries) > MEMO_TENSORS:
                self._tensors -= len(self._indexes.pop(next(iter(self._indexes))))
            self._indexes[identity] = dict(entries)
            self._tensors += len(entries)

    def clear(self) -> None:
        with self._lock:
            self._indexes.clear()
            self._tensors = 0


__all__ = ["MEMO_TENSORS", "SETTLED_SECONDS", "FileIdentity", "IndexMemo"]
