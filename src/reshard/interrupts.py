"""Process control of the ``reshard`` command: every stop signal is one exception, and test-only pauses.

Why it is built this way:

* SIGINT (Ctrl-C), SIGTERM (schedulers, ``timeout``) and SIGHUP (a closed terminal) all raise
  ``Signalled``, a ``KeyboardInterrupt``: the operations already turn a ``KeyboardInterrupt`` into
  "keep the finished outputs journaled, remove the temporary files" (``manifest.run_recorded``),
  so every stop signal gets that clean-up, and the command prints one line and exits 128 + signal.
* Only the command installs the handlers (``handling``, from ``reshard.entry`` before anything heavy
  is imported, and around ``cli.main``); a library user's process keeps Python's own signal
  semantics, and ``handling`` puts back whatever handlers it replaced.
* A disposition inherited as ignored stays ignored: ``nohup`` ignores SIGHUP, and a shell script
  starts ``reshard ... &`` with SIGINT ignored, on purpose, as for every program.
* After the first signal the others are ignored: the clean-up (joining the copy threads, removing
  temporary files, journaling) takes moments, and a second Ctrl-C must not cut it short and leave a
  traceback and temporary files behind. ``kill -9`` still stops the process at once.
* ``block_and_take`` is the command's last word: it blocks the stop signals and returns one that
  arrived before, so a signal is either reported (with exit code 128 + signal) or arrives once
  reshard has decided how it ends. Python itself drops a signal that arrives while the
  interpreter shuts down (the handler never runs, the exit code stays 0): blocking first closes
  that window.

Test-only pause points (never set these outside the test suite): with ``RESHARD_TEST_PAUSE_AT=POINT``
(or ``POINT:N``, the N-th time the point is reached) the process writes the file named by
``RESHARD_TEST_PAUSE_MARKER`` when it reaches the point, then waits there until a stop signal
arrives (at most ``PAUSE_LIMIT_SECONDS``), so a test can deliver a signal exactly there. A thread
other than the main one resumes once the signal has arrived (the main thread raises the
exception). ``import:MODULE`` pauses as the import of ``MODULE`` (``numpy``, say) begins. The
points are listed in ``POINTS``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: this module loads before the read-ahead starts
if TYPE_CHECKING:
    from types import FrameType, ModuleType
    from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None
)

PAUSE_ENV = "RESHARD_TEST_PAUSE_AT"
MARKER_ENV = "RESHARD_TEST_PAUSE_MARKER"
PAUSE_LIMIT_SECONDS = 120.0  # a test that never signals must not hang the suite
POINTS = {
    "startup": "the command has started, its handlers are installed, nothing else is imported yet",
    "import:MODULE": "the import of MODULE begins (reshard.cli, numpy, rich, ...)",
    "parse": "the command's modules are imported; the arguments are about to be parsed",
    "planned": "the operation's plan is made; the destination is not touched yet",
    "file": "an output file is being written (its temporary file exists); file:N is the N-th to start",
    "texts": "every output file is in place; the finishing files (indexes, .metadata, markers) are not written yet",
    "before-manifest": "every output file is in place and journaled; the manifest is not written yet",
    "manifest": "the manifest's temporary file is written, not yet renamed into place",
    "committed": "the manifest is in place and the journal removed: the run is complete",
    "exit": "the command has finished; its exit status is not decided yet",
}


class Signalled(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM or SIGHUP), raised like Ctrl-C so that the same clean-up runs:
    temporary files removed, finished outputs journaled for ``--resume``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind an interrupt (a plain ``KeyboardInterrupt`` is Ctrl-C)."""
    return exc.signum if isinstance(exc, Signalled) else int(signal.SIGINT)


DETAIL_ATTRIBUTE = "reshard_interrupted_detail"


def explain(exc: BaseException, detail: str) -> None:
    """Attach to an interrupt what the interrupted operation leaves and how to go on: the detail ``line``
    prints, in place of the count of the run it was in (``auto_transform`` runs one transform per rank,
    and its restart, not ``--resume``, goes on)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, DETAIL_ATTRIBUTE, detail)


def explained(exc: BaseException) -> str | None:
    """The detail ``explain`` attached, or None."""
    detail = getattr(exc, DETAIL_ATTRIBUTE, None)
    return detail if isinstance(detail, str) else None


def line(signum: int, detail: str) -> str:
    """The one line every interruption prints."""
    return f"reshard: interrupted ({signal.Signals(signum).name}): {detail}"


_ARRIVED: list[int] = []  # signals this process got (wakes the pause points; a list: no lock in a handler)
_DEPTH: list[bool] = []  # ``handling`` blocks entered and not left (the outermost one resets the state)
_COMPLETED: list[Any] = []  # what the last completed run wrote (``note_completed``)


def note_completed(progress: Any) -> None:
    """Record that a run's output is complete (``manifest.run_recorded``): a signal that arrives
    afterwards, while the command reports or exits, says so instead of "nothing was written".
    Only inside a command (``handling``): a library caller's runs leave no trace here."""
    if _DEPTH:
        _COMPLETED[:] = [progress]


def completed_run() -> Any:
    """What ``note_completed`` recorded last in this command (None: no run completed)."""
    return _COMPLETED[-1] if _COMPLETED else None


def _raise_signalled(signum: int, _frame: FrameType | None) -> None:
    _ARRIVED.append(signum)
    for other in STOP_SIGNALS:  # a second signal while cleaning up must not cut the clean-up short
        with contextlib.suppress(ValueError, OSError):
            signal.signal(other, signal.SIG_IGN)
    if _DEFERRING:
        _DEFERRED.append(signum)  # raised at the next safe point (``check``) or at the end of the block
        return
    raise Signalled(signum)


_DEFERRING: list[bool] = []  # ``deferred`` blocks the main thread is in
_DEFERRED: list[int] = []  # a signal that arrived in one, not raised yet


def requested() -> bool:
    """Whether a stop signal arrived inside a ``deferred`` block and is still to be raised (any thread)."""
    return bool(_DEFERRED)


def check() -> None:
    """A safe point: in the main thread, raise the stop signal a ``deferred`` block held back."""
    if _DEFERRED and threading.current_thread() is threading.main_thread():
        raise Signalled(_DEFERRED.pop())


def deferred() -> contextlib.AbstractContextManager[None]:
    """Within the block a stop signal is recorded instead of raised wherever the main thread is.

    Why: an exception raised by a signal handler can land between a lock's acquire and the ``try``
    that releases it (inside ``concurrent.futures``, a ``Condition``, a ``with lock:``); a worker
    thread then waits for that lock forever and the run hangs instead of stopping. The executor
    runs in such a block and calls ``check`` where no lock is held (before each tensor, while it
    waits for output files); worker threads see ``requested`` and give up. A signal still pending
    when the block ends is raised then, in place of any other exception the stopping caused. Only
    the command's handlers defer (``handling``): in a library caller's process Ctrl-C stays
    Python's immediate ``KeyboardInterrupt``.
    """
    return _Deferred()


class _Deferred(contextlib.AbstractContextManager[None]):
    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            _DEFERRING.append(True)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not self._main:
            return
        _DEFERRING.pop()
        if _DEFERRED and not isinstance(exc, Signalled):
            raise Signalled(_DEFERRED.pop()) from None


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Within the block every stop signal raises ``Signalled``; the previous handlers come back after.

    Only the main thread can install handlers: elsewhere the block runs with Python's own. A signal
    inherited as ignored stays ignored.
    """
    previous: dict[int, Any] = {}
    outermost = not _DEPTH
    if outermost:
        _ARRIVED.clear()
        _DEFERRED.clear()
        _COMPLETED.clear()
    _DEPTH.append(True)
    try:
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if current is signal.SIG_IGN or current is _raise_signalled:  # inherited as ignored; an outer block
                continue
            previous[signum] = current
            signal.signal(signum, _raise_signalled)
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        _DEPTH.pop()
        if outermost:
            _COMPLETED.clear()  # the command is over: its notes mean nothing to the next one
        for replaced, handler in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(replaced, handler if handler is not None else signal.SIG_DFL)


def block_and_take(then: Callable[[], None] = lambda: None) -> int | None:
    """Block the stop signals in this thread, run ``then``, return a signal that arrived (None: none did).

    A signal whose handler is due runs it as the signals are blocked (``Signalled`` is raised); one
    that arrives once they are blocked stays pending and is returned here. The process is meant to
    end right after (``reshard.entry``): a later signal is discarded with it.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    then()
    if not hasattr(signal, "sigpending"):
        return None
    pending = [s for s in STOP_SIGNALS if s in signal.sigpending()]
    return int(pending[0]) if pending else None


# ---------------------------------------------------------------------------- test-only pause points


def _spec(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    point, _, count = text.rpartition(":")
    return (point, int(count)) if count.isdigit() else (text, 1)


_PAUSE = _spec(os.environ.get(PAUSE_ENV))
_REACHED: dict[str, int] = {}
_REACHED_LOCK = threading.Lock()


def reached(point: str) -> None:
    """A named point of the run (``POINTS``); pauses there when ``RESHARD_TEST_PAUSE_AT`` names it."""
    if _PAUSE is None or _PAUSE[0] != point:
        return
    with _REACHED_LOCK:
        _REACHED[point] = _REACHED.get(point, 0) + 1
        due = _REACHED[point] == _PAUSE[1]
    if due:
        _pause(point)


def _pause(point: str) -> None:
    marker = os.environ.get(MARKER_ENV)
    if marker:
        with open(f"{marker}.part", "w", encoding="utf-8") as fh:
            fh.write(f"{point} {os.getpid()} {threading.current_thread().name}\n")
        os.replace(f"{marker}.part", marker)  # the test sees the whole marker or none
    deadline = time.monotonic() + PAUSE_LIMIT_SECONDS
    while not _ARRIVED and time.monotonic() < deadline:
        time.sleep(0.002)  # the main thread's handler raises out of this sleep (unless deferred)
    check()  # a deferred signal lands here too, exactly at the point


class _PauseAtImport:
    """``import:MODULE``: pause as the import of MODULE begins (then let the real finders find it).

    A meta path finder (``importlib.abc.MetaPathFinder``'s protocol; importing that module would
    cost the start-up it guards)."""

    def __init__(self, module: str) -> None:
        self.module = module

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname == self.module:
            sys.meta_path.remove(self)
            reached(f"import:{fullname}")
        return None


if _PAUSE is not None and _PAUSE[0].startswith("import:"):
    sys.meta_path.insert(0, _PauseAtImport(_PAUSE[0].partition(":")[2]))


__all__ = [
    "DETAIL_ATTRIBUTE",
    "MARKER_ENV",
    "PAUSE_ENV",
    "PAUSE_LIMIT_SECONDS",
    "POINTS",
    "STOP_SIGNALS",
    "Signalled",
    "block_and_take",
    "check",
    "completed_run",
    "deferred",
    "explain",
    "explained",
    "handling",
    "line",
    "note_completed",
    "reached",
    "requested",
    "signal_of",
]
