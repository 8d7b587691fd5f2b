"""Where the ``reshard`` command starts: signal handlers first, then the heavy imports, then the command.

Why a module of its own: ``reshard.cli`` imports numpy, rich and every operation, which takes a
second or two on a cold machine, and a Ctrl-C in that time used to print a traceback out of an
import. This module imports nothing heavy; the console script (``reshard.entry:main``),
``python -m reshard`` and ``python -m reshard.cli`` all start here, so an interrupt at any moment
of the command is one line and exit code 128 + signal (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).

The exit status is decided last, with the stop signals blocked (``interrupts.block_and_take``): a
signal that arrives after the work is done but before the process ends still exits 128 + signal,
and the line says that the work was complete.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from reshard import interrupts

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing ``typing`` would delay the read-ahead
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType
    from typing import NoReturn


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run the ``reshard`` command (``argv``: its arguments, default ``sys.argv[1:]``) and end the process.

    The exit status is decided last: the stop signals are blocked, the ``atexit`` functions run and
    the streams are flushed, then a signal that arrived meanwhile turns the status into 128 +
    signal, and the process ends at once (``os._exit``). Python's own shutdown, during which a
    signal is dropped without a word, never runs.
    """
    os._exit(_command(argv))


def _command(argv: Sequence[str] | None) -> int:
    loaded: ModuleType | None = None
    finished = False
    with interrupts.handling():
        try:
            interrupts.reached("startup")
            from reshard import cli

            loaded = cli
            status = _status_of(cli, argv)
            finished = True
            _join_threads()
            interrupts.reached("exit")
            signum = interrupts.block_and_take(_wind_up)
            if signum is None:
                return status
            raise interrupts.Signalled(signum)
        except KeyboardInterrupt as exc:
            signum = interrupts.signal_of(exc)
            if loaded is None:  # interrupted while starting: nothing was read or written
                print(interrupts.line(signum, "no output file was written"), file=sys.stderr)
                status = 128 + signum
            else:
                status = int(loaded.interrupted(exc, finished=finished))
            interrupts.block_and_take(_wind_up)  # the others are ignored since the first one
            return status


def _join_threads() -> None:
    """Wait for threads still running (none, normally), while a signal can still interrupt the wait."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _wind_up() -> None:
    """What Python's shutdown would do that matters here: the ``atexit`` functions, flushed streams."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed reader: cli.main chose the exit code
            stream.flush()


def _status_of(cli: ModuleType, argv: Sequence[str] | None) -> int:
    """``cli.main``'s exit code, argparse's ``SystemExit`` (``--help``, a usage error) included."""
    try:
        return int(cli.main(argv))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


__all__ = ["main"]
