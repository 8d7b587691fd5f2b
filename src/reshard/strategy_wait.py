"""Waiting for a job's destination strategy: until every pipeline stage's file is there, parses and holds still.

At job start (``reshard.auto``) the destination strategy may be the job's ``strategy`` folder its
ranks are still writing. ``wait_for_strategy`` polls it with backoff (never spinning), says in one
line what is missing (and again every ``RESHARD_AUTO_WAIT_EVERY`` seconds), and returns the
strategy once the folder describes the whole job, merged in memory: with a world size, one
complete file of each of its pipeline stages (MindSpore writes a file per rank, but the ranks of a
stage write the same layouts, and a folder of one file per stage is what every other command
merges); a file counts once it parses and has kept its size for a moment (``RESHARD_AUTO_SETTLE``).
What is missing is said in those terms: the stage whose file is not there, and which ranks' files
would do.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from reshard.errors import FormatError, LayoutError, ReshardError, UsageError
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
_SHOWN_STAGES = 4  # a line names the ranks of at most this many missing stages (the first ones and the last)
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
        return self._read_complete(path) is not None

    def _read_complete(self, path: str) -> StrategyFile | None:
        """The file read once it has settled and parses; None while it is still being written."""
        if not self._stable(path):
            return None
        try:
            return read_strategy(path)
        except ReshardError:  # half written: it parses once its writer is done
            return None

    def _poll_folder(self) -> StrategyFile | None:
        if self.world_size is not None:
            return self._poll_ranks(self.world_size)
        return self._poll_stages()

    def _poll_ranks(self, world_size: int) -> StrategyFile | None:
        """Complete once the files there describe every pipeline stage of ``world_size`` ranks.

        MindSpore writes a file per rank, a job's folder may keep one per stage (``merge-strategies``
        and every other command merge such a folder), and every rank of a stage writes the same
        layouts: one complete file of each stage is enough, and a missing one is named by its stage.
        """
        named = _rank_files(self.path)
        if named:
            files = _Candidates({r: path for r, path in named.items() if r < world_size}, by_rank=True)
        else:  # per-stage files named otherwise (stage_0.ckpt, ...), or one merged file alone
            unmerged, merged = _per_stage_candidates(self.path)
            if not unmerged and len(merged) == 1:
                return self._merged_alone(merged[0], world_size)
            files = _Candidates(dict(enumerate(unmerged)), by_rank=False)
        read = {key: sf for key, path in files.paths.items() if (sf := self._read_complete(path)) is not None}
        unfinished = [key for key in sorted(files.paths) if key not in read]
        if not read:
            self.missing = f"no strategy file yet of this job of {world_size} ranks ({files.where(self.path)})"
            self.missing += files.still_written(unfinished)
            return None
        per_stage = device_num(read[min(read)])
        if world_size % per_stage:
            raise LayoutError(
                f"world size {world_size}, but the strategy files describe pipeline stages of {per_stage} ranks",
                read[min(read)].path,
            )
        stages = world_size // per_stage
        seen = _stages_of(read.values(), stages, world_size)
        absent = [s for s in range(stages) if s not in seen]
        if absent:
            self.missing = files.missing_stages(absent, stages, per_stage, self.path)
            self.missing += files.still_written(
                [k for k in unfinished if not files.by_rank or k // per_stage in absent]
            )
            return None
        return _of_world(merge_in_memory([files.paths[key] for key in sorted(read)], self.path), world_size)

    def _merged_alone(self, path: str, world_size: int) -> StrategyFile | None:
        """A folder holding nothing but one merged file is that file (as ``load_strategy`` reads it)."""
        sf = self._read_complete(path)
        if sf is None:
            self.missing = f"the strategy file {path} is still being written"
            return None
        return _of_world(sf, world_size)

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


def _per_stage_candidates(folder: str) -> tuple[list[str], list[str]]:
    """The strategy files of a folder a merge takes (``find_strategy_files``), and the merged ones apart."""
    try:
        found = find_strategy_files(folder)
    except UsageError:
        return [], []
    merged = [f for f in found if is_merged_file(f)]
    return [f for f in found if f not in merged], merged


def _of_world(sf: StrategyFile, world_size: int) -> StrategyFile:
    total = ranks_of(sf)
    if total != world_size:
        raise LayoutError(f"world size {world_size}, but the strategy files describe a job of {total} ranks", sf.path)
    return sf


def _stages_of(files: Iterable[StrategyFile], stages: int, world_size: int) -> set[int]:
    """The pipeline stages the files hold; a file without a stage, or of a stage past ``stages``, is refused."""
    seen: set[int] = set()
    for sf in files:
        if sf.stage is None:
            raise FormatError("strategy file is empty (no strategy items)", sf.path)
        if sf.stage >= stages:
            raise LayoutError(
                f"world size {world_size} makes {stages} pipeline stage{'s' if stages > 1 else ''}, "
                f"but this file is of stage {sf.stage}",
                sf.path,
            )
        seen.add(sf.stage)
    return seen


@dataclass(frozen=True)
class _Candidates:
    """The files a folder offers, by rank (``…rank_<r>.ckpt``) or, when none is named so, by position."""

    paths: dict[int, str]
    by_rank: bool

    def where(self, folder: str) -> str:
        return f"ckpt_strategy_rank_<r>.ckpt in {folder}" if self.by_rank else f"in {folder}"

    def missing_stages(self, absent: Sequence[int], stages: int, per_stage: int, folder: str) -> str:
        """``no strategy file yet of pipeline stage 1 of 2 (one file of any of ranks 2-3: …)``."""
        what = f"no strategy file yet of pipeline stage{'s' if len(absent) > 1 else ''} {ranges(absent)} of {stages}"
        if not self.by_rank:
            return f"{what} ({self.where(folder)})"
        runs = [ranges(range(s * per_stage, (s + 1) * per_stage)) for s in absent]
        ranks = ", ".join(runs if len(runs) <= _SHOWN_STAGES else [*runs[: _SHOWN_STAGES - 1], "…", runs[-1]])
        each = "each stage's" if len(absent) > 1 else "the"
        return f"{what} ({each} file of any one of its ranks {ranks}: {self.where(folder)})"

    def still_written(self, keys: Sequence[int]) -> str:
        """``; still being written: ranks 7`` (or the files' names), or nothing."""
        if not keys:
            return ""
        if self.by_rank:
            return f"; still being written: rank{'s' if len(keys) > 1 else ''} {ranges(keys)}"
        return f"; still being written: {', '.join(os.path.basename(self.paths[k]) for k in keys)}"


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
            say(f"waiting for the destination strategy (up to {timeout:g} s): {watch.missing}")
            next_line = now + every
        elif now >= next_line:
            say(f"still waiting for the destination strategy after {now - started:.0f} s: {watch.missing}")
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
