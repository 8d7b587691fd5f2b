"""One run per destination: an exclusive lock file inside it.

Two runs writing into one folder at once leave a mix of both whose manifest lists sizes that do
not match the files. So a run holds ``DST/.reshard-lock`` for its whole duration:

* ``flock(LOCK_EX | LOCK_NB)`` on the file. The kernel releases it when the holder exits in any
  way (``kill -9`` included), so a lock file left by a dead run is simply taken over.
* The file holds the holder's pid, host and start time (JSON), so the run that is refused can
  name it in its one-line error.
* A lock that is held although its recorded pid is dead on this host (a descriptor inherited by
  some other process) is stale too: the file is replaced by a new one.
* On filesystems without ``flock`` (some network mounts) the recorded pid decides: a live pid on
  this host, or a lock of another host, refuses; a dead pid on this host is taken over.
* The holder removes the file when it releases the lock (before closing it); a run that opened
  the old file in between notices that the path now names another file and tries again.

The lock file is never an output: it is not in the manifest, it is gone after the run, and it does
not make a destination count as "not empty".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from typing import Any

from reshard.errors import UsageError

LOCK_NAME = ".reshard-lock"
_PROBE_RETRIES, _PROBE_WAIT_SECONDS = 3, 0.02
_ATTEMPTS = 5  # the lock file replaced under us (a holder releasing, a stale file) this many times: give up
# A holder records its facts right after it takes the lock: a run refused in between waits this long for
# them, so its one line names the holder (two runs started together met that gap in CI).
_RECORD_WAIT_SECONDS, _RECORD_POLL_SECONDS = 0.5, 0.01


def lock_path(root: str) -> str:
    return os.path.join(root, LOCK_NAME)


def host_name() -> str:
    """This machine's name, as ``socket.gethostname`` gives it (both read ``uname``; ``socket`` and
    ``datetime`` are not imported for one name and one time stamp: 3 ms of every run's start)."""
    return os.uname().nodename


def _holder_facts() -> dict[str, Any]:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return {"pid": os.getpid(), "host": host_name(), "started": started}


def read_holder(path: str) -> dict[str, Any] | None:
    """The facts a lock file records (None when absent, empty or unreadable)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _recorded_holder(path: str) -> dict[str, Any] | None:
    """The facts of the lock file's holder, waiting up to ``_RECORD_WAIT_SECONDS`` for a holder that has
    taken the lock but not yet written them."""
    deadline = time.monotonic() + _RECORD_WAIT_SECONDS
    while (holder := read_holder(path)) is None and time.monotonic() < deadline:
        time.sleep(_RECORD_POLL_SECONDS)
    return holder


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another reshard run (it has not recorded itself yet)"
    return (
        f"another reshard run (pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"started {holder.get('started', '?')})"
    )


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _dead_here(holder: dict[str, Any] | None) -> bool:
    """The holder ran on this host and its process is gone."""
    if not holder:
        return False
    return holder.get("host") == host_name() and not _pid_alive(holder.get("pid"))


def is_held(root: str) -> dict[str, Any] | None:
    """The holder's facts when a live run holds ``root``'s lock, else None (no lock, or a stale one)."""
    path = lock_path(root)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(path)
        return None if _dead_here(holder) else (holder or {})
    except OSError:  # no flock here: the recorded pid decides
        holder = read_holder(path)
        return holder if holder and not _dead_here(holder) else None
    finally:
        os.close(fd)
    return None


def _flock_patiently(fd: int) -> None:
    """``flock(LOCK_EX | LOCK_NB)``, tried a few times: ``is_held`` probes with a brief shared lock."""
    for _ in range(_PROBE_RETRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(_PROBE_WAIT_SECONDS)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


class DestinationLock:
    """The exclusive lock of one destination folder (which must exist) for one run."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = lock_path(root)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``UsageError`` naming the holder."""
        for _ in range(_ATTEMPTS):
            fd = self._open()
            try:
                taken = self._try_lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if taken and self._still_the_file(fd):
                self._fd = fd
                self._record(fd)
                return
            os.close(fd)
        raise UsageError(f"{describe(read_holder(self.path))} keeps replacing the lock file {LOCK_NAME}", self.root)

    def try_acquire(self) -> bool:
        """Take the lock if no live run holds it: False while one does (``auto_transform`` then waits).

        Raises:
            UsageError: The lock file cannot be created, or keeps being replaced.
        """
        for _ in range(_ATTEMPTS):
            try:
                self.acquire()
                return True
            except UsageError:
                if is_held(self.root) is not None:
                    return False  # a live holder: the caller waits and tries again
        self.acquire()  # not held, yet refused every time: raise its one-line reason
        return True

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UsageError(f"cannot create the lock file {LOCK_NAME}: {exc.strerror or exc}", self.root) from None

    def _try_lock(self, fd: int) -> bool:
        """True when ``fd`` is locked now; False to try again (a stale file was removed)."""
        try:
            _flock_patiently(fd)
            return True
        except BlockingIOError:
            holder = _recorded_holder(self.path)
            if _dead_here(holder):  # held through an inherited descriptor of a dead run: replace the file
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                return False
            raise UsageError(
                f"{describe(holder)} is writing into this destination; wait for it to finish or stop it", self.root
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            holder = read_holder(self.path)  # no flock on this filesystem: trust the recorded pid
            if holder and not _dead_here(holder) and holder.get("pid") != os.getpid():
                raise UsageError(
                    f"{describe(holder)} holds {LOCK_NAME} here (this filesystem has no flock; "
                    "remove the file if that run is gone)",
                    self.root,
                ) from None
            return True

    def _still_the_file(self, fd: int) -> bool:
        """Whether the path still names the file we locked (a releasing holder unlinks it first)."""
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except OSError:
            return False

    def _record(self, fd: int) -> None:
        data = json.dumps(_holder_facts()).encode() + b"\n"
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)

    def release(self) -> None:
        """Remove the lock file, then let go (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if self._still_the_file(fd):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(fd)


__all__ = ["LOCK_NAME", "DestinationLock", "describe", "host_name", "is_held", "lock_path", "read_holder"]
