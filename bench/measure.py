"""Run one contestant as its own process and measure its wall time and peak memory.

Why it is built this way:

* **One process per timed run.** Peak RSS is a property of a process, so every operation (reshard,
  MindSpore, ``cp -r``) runs in a fresh child and nothing of an earlier run is resident in it.
* **Two memory probes, the larger one wins.** ``ru_maxrss`` (from ``wait4`` in ``spawn.py``, a
  ~9 MB ``python3 -I -S`` wrapper that forks the contestant: Linux carries the RSS of the forking
  parent into the child's high-water mark, so a ~9 MB floor instead of the benchmark's ~50 MB) is
  the kernel's exact high-water mark, which no polling can miss, but it is per process (for a
  process tree it is the largest single member, not their sum). MindSpore's safetensors converters fork
  worker processes, so a poller also sums the RSS of the child and all its descendants every
  ``POLL_SECONDS``. The reported peak is ``max(ru_maxrss, polled tree sum)``; both are kept in
  the results. The tree sum counts pages shared by forked workers once per worker, so for forking
  contestants it is an upper bound. RSS includes file pages a process has mapped and touched
  (reshard reads sources through ``mmap``), which is the honest measure of what it pins.
* **Cache state is set per run, the same way for every contestant.** ``cold``: ``fsync`` then
  ``posix_fadvise(DONTNEED)`` on every input file, which evicts exactly those files from the page
  cache without root and without disturbing other work on the machine (interpreters and libraries
  stay cached for every contestant alike; dropping the whole cache through
  ``/proc/sys/vm/drop_caches`` would do neither). ``warm``: every input is ``fsync``-ed and read
  once before the run. Either way the output of the previous run is deleted first (its dirty pages
  are discarded, not written back), then the machine *settles*: ``sync`` and a wait until dirty and
  writeback pages are near zero. This disk is mounted with ``discard``: deleting a gigabyte issues
  TRIMs at the next journal commit, and without the settle step they landed in the next timing and
  made the same ``cp -r`` take anywhere from 0.34 s to 2.7 s (with it: 0.34-0.51 s).
  Outputs are not ``fsync``-ed by any contestant (reshard, MindSpore and ``cp`` all leave them to
  the page cache), so timings include writing into the page cache, not to the disk.
* **Two clocks.** ``wall`` is the child's process lifetime as a user sees it (interpreter start and
  imports included). Python children also report ``call``: the time of the operation itself,
  measured inside the child after its imports (MindSpore's import alone takes ~2 s); ``cp`` has no
  imports, so its ``call`` is its ``wall``.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

POLL_SECONDS = 0.010  # RSS sampling period: short enough to see a tensor-sized spike of a 1 s run
TREE_RESCAN_POLLS = 10  # look for new descendant processes every 10 polls (a /proc scan is costly)
READ_CHUNK = 8 * 1024**2  # warm-up reads
RESULT_MARKER = "@@BENCH@@"  # a Python child prints this + JSON on its last stdout line
TAIL_CHARS = 2000  # how much of a failing child's stderr goes into the error message
CACHE_MODES = ("cold", "warm")
SETTLED_DIRTY_BYTES = 16 * 1024**2  # below this the disk is quiet enough to time the next run
SETTLE_POLL_SECONDS = 0.1
SETTLE_MAX_SECONDS = 30.0  # give up waiting (other work on the machine keeps writing)
SETTLE_PAUSE_SECONDS = 0.5  # discards issued by the last commit complete in the background
SPAWN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn.py")


@dataclass
class Measurement:
    """One timed run of one contestant."""

    wall: float  # seconds, process start to exit
    call: float  # seconds of the operation alone (== wall for cp)
    peak_rss: int  # bytes: max(maxrss, rss_tree)
    maxrss: int  # bytes: kernel high-water mark of the largest single process (wait4)
    rss_tree: int  # bytes: largest polled sum over the process tree
    processes: int  # most processes seen at once in the tree
    cpu_pressure: float  # % of the last 10 s some task waited for a CPU, at the start (other load)

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


class ContestantError(RuntimeError):
    """A contestant exited non-zero (the benchmark stops: a failing run has no meaningful time)."""


class _TreePoller(threading.Thread):
    """Samples the summed RSS of the descendants of a process (the wrapper itself excluded)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self._halt = threading.Event()
        self.peak = 0
        self.most = 0
        try:
            self._root = psutil.Process(pid)
        except psutil.Error:
            self._root = None

    def run(self) -> None:
        if self._root is None:
            return
        members: list[psutil.Process] = []
        polls = 0
        while not self._halt.is_set():
            if not members or polls % TREE_RESCAN_POLLS == 0:
                try:
                    members = self._root.children(recursive=True)
                except psutil.Error:
                    return
            total = 0
            for proc in members:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            self.most = max(self.most, len(members))
            polls += 1
            self._halt.wait(POLL_SECONDS)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_measured(
    argv: Sequence[str], log_prefix: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> Measurement:
    """Run ``argv`` to completion under ``spawn.py``; raise ``ContestantError`` if it fails.

    stdout/stderr go to ``log_prefix``.out/.err files (never pipes: a chatty child must not block).
    """
    out_path, err_path, result_path = (log_prefix + ext for ext in (".out", ".err", ".rusage.json"))
    wrapper = [sys.executable, "-I", "-S", SPAWN, result_path, *argv]
    pressure = cpu_pressure()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(wrapper, stdout=out, stderr=err, env=env, cwd=cwd)
        poller = _TreePoller(proc.pid)
        poller.start()
        proc.wait()
        poller.stop()
    if proc.returncode != 0 or not os.path.isfile(result_path):
        raise ContestantError(f"the measuring wrapper failed for {' '.join(argv[:4])} ...: {_tail(err_path)}")
    with open(result_path, encoding="utf-8") as fh:
        spawned = json.load(fh)
    if spawned["exit"] != 0:
        raise ContestantError(f"{' '.join(argv[:4])} ... exited {spawned['exit']}:\n{_tail(err_path)}")
    maxrss = int(spawned["maxrss_kib"]) * 1024
    wall = float(spawned["wall"])
    call = _reported_call_time(out_path)
    return Measurement(
        wall, wall if call is None else call, max(maxrss, poller.peak), maxrss, poller.peak, poller.most, pressure
    )


def cpu_pressure() -> float:
    """``some avg10`` of /proc/pressure/cpu: how busy the machine is with other work (-1: unknown)."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as fh:
            fields = dict(item.split("=") for item in fh.readline().split()[1:])
        return float(fields["avg10"])
    except (OSError, KeyError, ValueError):
        return -1.0


def _tail(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read()[-TAIL_CHARS:].decode("utf-8", "replace")


def _reported_call_time(out_path: str) -> float | None:
    with open(out_path, "rb") as fh:
        text = fh.read().decode("utf-8", "replace")
    at = text.rfind(RESULT_MARKER)
    if at < 0:
        return None
    return float(json.loads(text[at + len(RESULT_MARKER) :].strip().splitlines()[0])["call"])


# ------------------------------------------------------------------------------------ files and cache


def files_under(paths: Iterable[str]) -> list[str]:
    """Every regular file of the given files and folders (recursively)."""
    found: list[str] = []
    for path in paths:
        if os.path.isfile(path):
            found.append(path)
            continue
        for folder, _, names in os.walk(path):
            found.extend(os.path.join(folder, n) for n in sorted(names))
    return found


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in files_under([path]))


def _flush(path: str) -> None:
    """Write a file's dirty pages back (only clean pages can be evicted; and no writeback of an
    earlier step may run during the next timing). Per file, not ``sync``: other work on the
    machine keeps its own dirty pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(paths: Iterable[str]) -> None:
    """Drop these files' pages from the page cache."""
    for path in files_under(paths):
        _flush(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[str]) -> None:
    """Read every byte of these files once, so that they are in the page cache."""
    buf = bytearray(READ_CHUNK)
    for path in files_under(paths):
        _flush(path)
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _dirty_bytes() -> int:
    """Dirty + writeback page-cache bytes of the whole machine (/proc/meminfo)."""
    total = 0
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("Dirty", "Writeback"):
                total += int(rest.split()[0]) * 1024
    return total


def settle() -> None:
    """``sync`` (commits the deletions and their discards) and wait for writeback to drain."""
    deadline = time.monotonic() + SETTLE_MAX_SECONDS
    os.sync()
    while _dirty_bytes() > SETTLED_DIRTY_BYTES and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_SECONDS)
        os.sync()
    time.sleep(SETTLE_PAUSE_SECONDS)


def prepare_cache(mode: str, inputs: Sequence[str], settle_first: bool = True) -> None:
    """Put ``inputs`` in the requested cache state, written back to disk, on a settled machine.

    ``settle_first=False`` (``--no-settle``) skips the wait for writeback: for the harness's own
    smoke test, whose timings mean nothing, not for numbers anyone reads."""
    if settle_first:
        settle()
    if mode == "cold":
        evict(inputs)
    elif mode == "warm":
        warm(inputs)
    else:
        raise ValueError(f"cache mode must be one of {CACHE_MODES}, not {mode!r}")


PAGE_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
NO_REPORTING_ORDER = "11"  # beyond the largest free block (order 10): no free memory is reported
PREFAULT_SPARE_BYTES = 1024**3  # free memory left untouched by the prefault
PREFAULT_CHUNK = 256 * 1024**2


@contextlib.contextmanager
def steady_host_memory(enabled: bool) -> Iterator[dict[str, Any]]:
    """Hold the VM's free page reporting while timing, and back its free memory once (facts yielded).

    Why: this VM reports freed guest pages to its host (virtio-balloon free page reporting, order 9 =
    2 MiB blocks), which unmaps them. Every run deletes the previous run's output (a gigabyte freed),
    the settle step waits long enough for those pages to be reported, and the next run's writes into
    the page cache then fault each page in on the host again: the same 1 GiB ``pwrite`` into a
    preallocated file took 0.16 to 2.7 s of system time from one run to the next, whichever program
    wrote it, and the benchmark's ratios followed the host, not the programs. With reporting held
    (``page_reporting_order`` above any free block) and free memory touched once, the same write took
    0.17-0.18 s five times in a row. The setting is restored on exit; without root or without the
    module nothing changes (``held`` False), and the facts go into the results' ``meta``.
    """
    facts: dict[str, Any] = {"held": False}
    before = None
    if enabled:
        with contextlib.suppress(OSError):
            with open(PAGE_REPORTING_ORDER, encoding="ascii") as fh:
                before = fh.read().strip()
            with open(PAGE_REPORTING_ORDER, "w", encoding="ascii") as fh:
                fh.write(NO_REPORTING_ORDER)
            facts.update(held=True, order_was=before)
        if facts["held"]:
            facts["prefaulted_bytes"] = _prefault()
    try:
        yield facts
    finally:
        if facts["held"] and before is not None:
            with open(PAGE_REPORTING_ORDER, "w", encoding="ascii") as fh:
                fh.write(before)


def _prefault() -> int:
    """Touch the VM's free memory once (less a spare gigabyte), so that its pages are backed by the host."""
    free = psutil.virtual_memory().free - PREFAULT_SPARE_BYTES
    chunks = []
    try:
        for _ in range(max(0, free) // PREFAULT_CHUNK):
            chunk = bytearray(PREFAULT_CHUNK)
            chunk[:: mmap.PAGESIZE] = b"\x01" * (PREFAULT_CHUNK // mmap.PAGESIZE)  # one write a page
            chunks.append(chunk)
    except MemoryError:
        pass
    touched = len(chunks) * PREFAULT_CHUNK
    chunks.clear()
    return touched


def remove(path: str) -> None:
    """Delete an output of a run (file or folder) if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def cp_argv(src: str, dst: str) -> list[str]:
    """``cp -r`` of a produced output folder to a fresh folder: the reference for the same bytes."""
    return ["cp", "-r", src, dst]


def drop_caches_writable() -> bool:
    """Whether the whole page cache could be dropped here (reported only: we evict per file)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)
