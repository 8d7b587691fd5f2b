"""Profiles of slow reshard runs: where the time goes, as a short "top entries" text.

The benchmark profiles an operation when reshard is slower than 1.25x ``cp -r`` of its output
(``run.py --profile``). The tool is py-spy when it is installed (``pip install py-spy``): it
samples every thread of the real process from outside, including time blocked in system calls
(``--idle``: ``pwrite``, page faults on ``mmap`` reads, which is where an IO-bound executor spends
its time), at full speed. Without py-spy, ``cProfile`` runs the same command with one worker
(cProfile only sees the thread it runs in), which is slower and less faithful; the report says
which tool was used.
"""

from __future__ import annotations

import io
import json
import os
import pstats
import re
import shutil
import subprocess
from collections import Counter
from typing import Any

PYSPY_RATE = 250  # samples per second: ~1000 samples for a 4 s run
TOP = 15
# Leaves of a thread that waits for another thread (the main thread on the pool, idle pool
# workers): not work, so left out of the percentages (blocking IO in a worker is kept).
WAITING_LEAVES = (
    "Condition.wait (threading.py",
    "Event.wait (threading.py",
    "Thread.join (threading.py",
    "Thread._wait_for_tstate_lock (threading.py",
    "_worker (concurrent/futures/thread.py:81)",
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")


def _short(path: str) -> str:
    """``reshard/execute/local.py`` rather than a site-packages or checkout prefix."""
    for marker in ("/src/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _parse(frame: str) -> tuple[str, str]:
    """(function with file, function with file:line) of one py-spy frame."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame, frame
    where = f"{m['func']} ({_short(m['file'])}"
    return where + ")", where + (f":{m['line']})" if m["line"] else ")")


def summarize_collapsed(text: str) -> dict[str, Any]:
    """Top functions by own samples (with line) and by inclusive samples, from py-spy raw output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = waiting = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames and frames[0].startswith("thread ("):
            threads[frames[0]] += count
            frames = frames[1:]
        if not frames:
            continue
        leaf = _parse(frames[-1])[1]
        if leaf.startswith(WAITING_LEAVES):
            waiting += count
            continue
        total += count
        own[leaf] += count
        for func in {_parse(f)[0] for f in frames}:
            inclusive[func] += count
    return {
        "samples": total,
        "waiting_samples": waiting,
        "threads": len(threads),
        "own": [(f, n / total) for f, n in own.most_common(TOP)] if total else [],
        "inclusive": [(f, n / total) for f, n in inclusive.most_common(TOP)] if total else [],
    }


def profile_reshard(
    child: str, cli_args: list[str] | dict[str, Any], log_prefix: str, env: dict[str, str], python: str
) -> dict[str, Any]:
    """Run ``rs_child.py`` with ``cli_args`` (or a drop-in call) once under a profiler, in the
    interpreter ``python``; the caller deletes the output."""
    if shutil.which("py-spy"):
        raw = log_prefix + ".pyspy.txt"
        argv = [
            "py-spy",
            "record",
            "--idle",
            "--threads",
            "--rate",
            str(PYSPY_RATE),
            "--format",
            "raw",
            "-o",
            raw,
            "--",
            python,
            child,
            json.dumps(cli_args),
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
        if proc.returncode == 0 and os.path.isfile(raw):
            with open(raw, encoding="utf-8") as fh:
                return {"tool": f"py-spy --idle --threads, {PYSPY_RATE} Hz", **summarize_collapsed(fh.read())}
    stats_path = log_prefix + ".pstats"
    code = (
        f"import cProfile, json, sys; sys.path.insert(0, {os.path.dirname(child)!r}); import rs_child; "
        f"run = rs_child.load(json.loads(sys.argv[1])); cProfile.run('run()', {stats_path!r})"
    )
    job = [*cli_args, "--workers", "1"] if isinstance(cli_args, list) else cli_args
    subprocess.run([python, "-c", code, json.dumps(job)], capture_output=True, text=True, env=env, check=True)
    tool = "cProfile, --workers 1" if isinstance(cli_args, list) else "cProfile, main thread only"
    return {"tool": f"{tool} (py-spy not installed)", "text": cprofile_text(stats_path)}


def cprofile_text(stats_path: str) -> str:
    text = io.StringIO()
    stats = pstats.Stats(stats_path, stream=text)
    stats.sort_stats("tottime").print_stats(TOP)
    return text.getvalue()


def format_profile(p: dict[str, Any]) -> str:
    """Plain text for the report: the two top lists, percentages of all samples."""
    if "text" in p:
        return f"({p['tool']})\n{p['text']}"
    lines = [
        f"({p['tool']}: {p['samples']} busy samples over {p['threads']} threads, "
        f"{p['waiting_samples']} samples of threads waiting on other threads left out)",
        "own time:",
    ]
    lines += [f"  {share * 100:5.1f}%  {func}" for func, share in p["own"]]
    lines.append("inclusive:")
    lines += [f"  {share * 100:5.1f}%  {func}" for func, share in p["inclusive"]]
    return "\n".join(lines)
