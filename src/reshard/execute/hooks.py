"""The hook an executor calls once an output is renamed into place (``RunOptions.on_file_written``).

Why it is built this way:

* The run-recording layer (``manifest.run_recorded``) needs that moment for its own bookkeeping
  (the journal line of the file, for ``--resume`` and the manifest), and a caller of the API may
  have given a hook of its own (a progress display, a "stop after this file"). ``FileWritten`` calls
  both, reshard's first: by the time the caller's hook runs, the file is journaled, so whatever that
  hook raises stops a run whose finished files are kept for ``resume``, as an interruption does.
* The caller's hook is called once per output, one call at a time and in the order the outputs were
  journaled (a lock around both calls), so it need not be thread-safe although the local executor
  finishes files on several threads. Once it has raised, it is not called again: the run is stopping,
  and the outputs other threads finish meanwhile are journaled all the same.
* ``raised`` remembers what the caller's hook raised, so the recording layer can tell a stop the
  caller asked for (finished files kept) from a failure of the run (rolled back).
* ``full_disk`` is a test-only stand-in for a disk another writer fills part way
  (``RESHARD_TEST_ENOSPC_AFTER=N``); no user sets it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.plan import FilePlan

Written = Callable[["FilePlan", "str | None"], None]

ENOSPC_AFTER_ENV = "RESHARD_TEST_ENOSPC_AFTER"  # test-only: outputs written before the disk "fills"


class FileWritten:
    """``own(file, digest)`` (reshard's bookkeeping), then ``user(file, digest)`` (the caller's hook)."""

    def __init__(self, own: Written, user: Written | None) -> None:
        self._own = own
        self._user = user
        self._order = threading.Lock()
        self.raised: BaseException | None = None  # what the caller's hook raised, if it did

    def __call__(self, file: FilePlan, digest: str | None = None) -> None:
        if self._user is None:
            self._own(file, digest)
            return
        with self._order:
            self._own(file, digest)
            if self.raised is not None:
                return
            try:
                self._user(file, digest)
            except BaseException as exc:
                self.raised = exc
                raise

    def stopped_by_user(self, exc: BaseException) -> bool:
        """Whether ``exc`` is what the caller's hook raised (a stop it asked for, not a failure)."""
        return self.raised is not None and exc is self.raised


def full_disk(written: Written) -> Written:
    """``written`` as it is, or (test hook ``RESHARD_TEST_ENOSPC_AFTER=N``) failing the output after
    the N-th with ENOSPC, as a disk another writer fills would; no user sets it."""
    limit = os.environ.get(ENOSPC_AFTER_ENV)
    if limit is None:
        return written
    count = 0
    counting = threading.Lock()

    def hooked(file: FilePlan, digest: str | None = None) -> None:
        nonlocal count
        with counting:
            count += 1
            full = count > int(limit)
        if full:
            with contextlib.suppress(OSError):
                os.unlink(file.path)  # as if its last bytes never fit
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.path)
        written(file, digest)

    return hooked


__all__ = ["ENOSPC_AFTER_ENV", "FileWritten", "Written", "full_disk"]
