"""Progress on stderr while a command writes (or ``verify`` compares), and the consoles of stdout.

Two renderings of one thing, bytes done out of bytes planned: a rich bar on a terminal, and for a
log or a pipe a plain line every few seconds and one at the end, so that a job's log shows the run
went on without a bar's control characters. Both count in binary units, like the summary line.

Why here and not with the executors: how progress looks is the command's business; an executor
only calls ``on_start(total)`` and ``progress(nbytes)`` (``reshard.execute.options.RunOptions``).
rich is imported only when a bar or a table is drawn (40 ms a run that prints neither saves).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from reshard.text import format_size


def console() -> Any:
    """A rich console on stdout whose closed reader is a ``BrokenPipeError`` (rich is imported here)."""
    from rich.console import Console

    rich_raises_broken_pipe()
    return Console(stderr=False, highlight=False)


def rich_raises_broken_pipe() -> None:
    """rich answers a closed stdout with ``SystemExit(1)``; reshard wants its own quiet exit (141)."""
    from rich.console import Console

    def on_broken_pipe(self: Console) -> None:
        raise BrokenPipeError

    Console.on_broken_pipe = on_broken_pipe  # type: ignore[method-assign]


def _speed_column() -> Any:
    """Transfer speed in MiB/s or GiB/s (rich's own column counts in MB/s), matching the summary."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BinarySpeed(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{format_size(int(speed))}/s", style="progress.data.speed")

    return BinarySpeed()


class ProgressBar:
    """A rich progress bar over bytes written (or compared, for verify), on stderr, for a terminal (binary
    units, like the summary)."""

    def __init__(self, description: str = "writing") -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        self.description = description
        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(binary_units=True),
            _speed_column(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self.task: Any = None

    def start(self, total: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task(self.description, total=total)

    def advance(self, nbytes: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=nbytes)

    def stop(self) -> None:
        self.progress.stop()

    def finish(self) -> None:
        """The bar goes before the command's own output."""
        self.stop()


class ProgressLines:
    """Progress for logs (stderr is a pipe or a file): a plain line every few seconds and one at the end,
    ``reshard: 1.23 GiB / 4.00 GiB (30%), 850.00 MiB/s, ETA 0:03``."""

    def __init__(self, every: float = 5.0, label: str = "") -> None:
        self.every, self.label = every, label
        self.lock = threading.Lock()
        self.total = self.done = 0
        self.started = self.last = 0.0
        self.running = False

    def start(self, total: int) -> None:
        self.total, self.done, self.running = total, 0, True
        self.started = self.last = time.monotonic()

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.done += nbytes
            now = time.monotonic()
            if self.running and now - self.last >= self.every:
                self.last = now
                self._print(now)

    def stop(self) -> None:
        """A run that failed ends with its error line alone."""
        with self.lock:
            self.running = False

    def finish(self) -> None:
        """The last line, once everything was written."""
        with self.lock:
            if self.running:
                self.running = False
                self._print(time.monotonic())

    def _print(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        percent = 100 * self.done // self.total if self.total else 100
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        print(
            f"reshard: {self.label}{format_size(self.done)} / {format_size(self.total)} ({percent}%), "
            f"{format_size(int(rate))}/s, ETA {clock(left)}",
            file=sys.stderr,
            flush=True,
        )


def clock(seconds: float) -> str:
    """``0:03``, ``12:40``, ``1:02:03``."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


_BARS: list[ProgressBar | ProgressLines] = []  # this command's; cleared by ``reset`` before each run


def hooks(show: bool | None, silent: bool, what: str = "writing") -> dict[str, Any]:
    """``--progress``: a bar on a terminal, plain lines in a log; by default a bar on a terminal only.

    ``show``: ``--progress`` (True), ``--no-progress`` (False) or neither (None). ``silent``:
    ``--quiet`` or a dry run. ``what`` names the work on the bar (``verify``: comparing). Returns the
    ``on_start`` and ``progress`` callbacks of the run options (none: no progress).
    """
    terminal = sys.stderr.isatty()
    if silent or show is False or not (show or terminal):
        return {}
    label = "" if what == "writing" else f"{what} "  # transform's log lines stay as documented
    bar: ProgressBar | ProgressLines = ProgressBar(what) if terminal else ProgressLines(label=label)
    _BARS.append(bar)
    return {"on_start": bar.start, "progress": bar.advance}


def end() -> None:
    """The bar goes (or the last progress line prints) before the command's own output."""
    for bar in _BARS:
        bar.finish()


def stop_all() -> None:
    """After a command, whatever happened: no bar stays on the terminal."""
    for bar in _BARS:
        bar.stop()


def reset() -> None:
    _BARS.clear()


__all__ = [
    "ProgressBar",
    "ProgressLines",
    "clock",
    "console",
    "end",
    "hooks",
    "reset",
    "rich_raises_broken_pipe",
    "stop_all",
]
