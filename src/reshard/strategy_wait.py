"""Waiting for a job's destination strategy: until every rank's (or stage's) file is there, parses and holds still.

At job start (``reshard.auto``) the destination strategy may be the job's ``strategy`` folder its
ranks are still writing. ``wait_for_strategy`` polls it with backoff (never spinning), says in one
line what is missing (and again every ``RESHARD_AUTO_WAIT_EVERY`` seconds), and returns the
strategy once the files of every rank are there, parse, and have kept their size for a moment
(``RESHARD_AUTO_SETTLE``), merged in memory.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from reshard.errors import LayoutError, ReshardError, UsageError
from reshard.formats.strategy import (
    StrategyFile,
    find_strategy_files,
    is_merged_file,
    merge_in_memory,
    read_strategy,
)
from reshard.layout import device_num, stage_count

SETTLE_VARIABLE = "RESHARD_AUTO_SETTLE"  # seconds a strategy file's size must stay put (default 0.5)
WAIT_EVERY_VARIABLE = "RESHARD_AUTO_WAIT_EVERY"  # seconds between "still waiting" lines (default 30)
DEFAULT_WAIT_EVERY = 30.0  # a person watching a job start sees it is alive, a log stays short
DEFAULT_SETTLE = 0.5
_FIRST_SLEEP, _MAX_SLEEP = 0.05, 2.0
_RANK_FILE = re.compile(r"rank_(\d+)\.(ckpt|json)$")


@dataclass
class _Seen:
    size: int
    mtime_ns: int
    since: float


@dataclass
class StrategyWait:
    """Watches a destination strategy file or folder until it is complete (``poll``)."""

    path: str
    world_size: int | None
    settle: float
    missing: str = "nothing seen yet"
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def poll(self) -> StrategyFile | None:
        """The merged strategy once complete; None (and ``missing`` says why) while it is not."""
        if os.path.isdir(self.path):
            return self._poll_folder()
        if not os.path.exists(self.path):
            self.missing = f"the strategy path {self.path} does not exist yet"
            return None
        if os.path.isfile(self.path) and self._complete(self.path):
            return read_strategy(self.path)
        self.missing = f"the strategy file {self.path} is still being written"
        return None

    def _stable(self, path: str) -> bool:
        """The file kept its size and mtime for ``settle`` seconds (of our watching, or by its mtime)."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        if st.st_size > 0 and time.time() - st.st_mtime >= max(self.settle, 0.0):
            return True  # last written longer ago than the settle time: a file of an earlier start
        now = time.monotonic()
        seen = self._seen.get(path)
        if seen is None or (seen.size, seen.mtime_ns) != (st.st_size, st.st_mtime_ns):
            self._seen[path] = _Seen(st.st_size, st.st_mtime_ns, now)
            return self.settle <= 0 and st.st_size > 0
        return st.st_size > 0 and now - seen.since >= self.settle

    def _complete(self, path: str) -> bool:
        if not self._stable(path):
            return False
        try:
            read_strategy(path)
        except ReshardError:  # half written: it parses once its writer is done
            return False
        return True

    def _poll_folder(self) -> StrategyFile | None:
        if self.world_size is not None:
            return self._poll_ranks(self.world_size)
        return self._poll_stages()

    def _poll_ranks(self, world_size: int) -> StrategyFile | None:
        by_rank = _rank_files(self.path)
        absent = [r for r in range(world_size) if r not in by_rank]
        unfinished = [r for r in range(world_size) if r in by_rank and not self._complete(by_rank[r])]
        if absent or unfinished:
            parts = []
            if absent:
                parts.append(f"missing ranks {ranges(absent)}")
            if unfinished:
                parts.append(f"still being written: ranks {ranges(unfinished)}")
            self.missing = f"{'; '.join(parts)} of {world_size} (ckpt_strategy_rank_<r>.ckpt in {self.path})"
            return None
        sf = merge_in_memory([by_rank[r] for r in range(world_size)], self.path)
        total = ranks_of(sf)
        if total != world_size:
            raise LayoutError(f"world size {world_size}, but the strategy files describe a job of {total} ranks")
        return sf

    def _poll_stages(self) -> StrategyFile | None:
        try:
            candidates = [f for f in find_strategy_files(self.path) if not is_merged_file(f)]
        except UsageError:
            candidates = []
        if not candidates:
            self.missing = f"no strategy files in {self.path} yet"
            return None
        unfinished = [os.path.basename(f) for f in candidates if not self._complete(f)]
        if unfinished:
            self.missing = f"still being written: {', '.join(unfinished)}"
            return None
        stages = {read_strategy(f).stage for f in candidates}
        top = max((s for s in stages if s is not None), default=0)
        gaps = [s for s in range(top + 1) if s not in stages]
        if gaps:
            self.missing = f"no strategy file of stage {ranges(gaps)} in {self.path} yet"
            return None
        return merge_in_memory(candidates, self.path)


def _rank_files(folder: str) -> dict[int, str]:
    """``{rank: path}`` of the ``*rank_<r>.ckpt|json`` strategy files in ``folder`` (hidden ones left out)."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            match = _RANK_FILE.search(name)
            if match and not name.startswith(".") and os.path.isfile(os.path.join(folder, name)):
                found.setdefault(int(match.group(1)), os.path.join(folder, name))
    return found


def ranks_of(sf: StrategyFile) -> int:
    return device_num(sf) * stage_count(sf)


def ranges(values: Sequence[int]) -> str:
    """``0, 2-5, 7``: sorted numbers with runs folded."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def backoff() -> Iterator[float]:
    """Sleeps growing from 50 ms to 2 s: waiting never spins."""
    delay = _FIRST_SLEEP
    while True:
        yield delay
        delay = min(_MAX_SLEEP, delay * 1.5)


def wait_for_strategy(path: str, world_size: int | None, timeout: float, say: Callable[[str], None]) -> StrategyFile:
    """The destination strategy once complete, waiting up to ``timeout`` seconds.

    Raises:
        UsageError: Not complete in time; the line names what is missing.
    """
    watch = StrategyWait(path, world_size, _settle())
    started = time.monotonic()
    deadline, every = started + timeout, _wait_every()
    next_line: float | None = None  # when the next "still waiting" line is due (None: none said yet)
    for delay in backoff():
        sf = watch.poll()
        if sf is not None:
            return sf
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            raise UsageError(f"timed out after {timeout:g} s waiting for the destination strategy: {watch.missing}")
        if next_line is None:
            say(f"waiting for the destination strategy ({watch.missing}); up to {timeout:g} s")
            next_line = now + every
        elif now >= next_line:
            say(f"still waiting for the destination strategy after {now - started:.0f} s ({watch.missing})")
            next_line = now + every
        time.sleep(max(0.0, min(delay, left, next_line - now)))
    raise AssertionError("unreachable")


def _wait_every() -> float:
    """Seconds between "still waiting" lines (``RESHARD_AUTO_WAIT_EVERY``, default 30)."""
    text = os.environ.get(WAIT_EVERY_VARIABLE)
    try:
        return max(0.01, float(text)) if text else DEFAULT_WAIT_EVERY
    except ValueError:
        raise UsageError(f"{WAIT_EVERY_VARIABLE} must be a number of seconds, not {text!r}") from None


def _settle() -> float:
    text = os.environ.get(SETTLE_VARIABLE)
    if not text:
        return DEFAULT_SETTLE
    try:
        return max(0.0, float(text))
    except ValueError:
        raise UsageError(f"{SETTLE_VARIABLE} must be a number of seconds, not {text!r}") from None


__all__ = [
    "DEFAULT_SETTLE",
    "DEFAULT_WAIT_EVERY",
    "SETTLE_VARIABLE",
    "WAIT_EVERY_VARIABLE",
    "StrategyWait",
    "backoff",
    "ranges",
    "ranks_of",
    "wait_for_strategy",
]
