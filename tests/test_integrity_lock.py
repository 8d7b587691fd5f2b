"""One run per destination: a second run into a folder another run is writing exits 2 naming the
holder (pid, host, start time); a lock left by ``kill -9`` is taken over; the lock file is never an
output and never left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from reshard import api, lock, manifest
from reshard.errors import UsageError
from reshard.execute.digest import file_digest
from tests.trust_helpers import CLI_TIMEOUT, make_big_job, run_cli, temp_files, tree

HOLDER = re.compile(r"another reshard run \(pid (\d+) on host (\S+), started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)")


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    job = make_big_job(str(tmp_path_factory.mktemp("lock")), workers=1)
    return job


def _start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_temp_file(proc: subprocess.Popen[str], dst: str) -> None:
    deadline = time.monotonic() + CLI_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline and not (os.path.isdir(dst) and temp_files(dst)):
        time.sleep(0.001)
    assert proc.poll() is None, "the first run ended before it could be caught writing"


def _assert_intact(dst: str, reference: dict[str, str]) -> None:
    """The destination is exactly one complete run: files as the reference, sizes and hashes as the manifest."""
    assert tree(dst) == reference
    for entry in manifest.read_manifest(dst)["outputs"]:
        path = os.path.join(dst, entry["path"])
        assert file_digest(path) == (entry["bytes"], entry["xxh128"])


def test_second_run_while_the_first_writes_exits_2_naming_it(big: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    first = _start([*big["args"], "--dst", dst])
    _wait_for_temp_file(first, dst)
    os.kill(first.pid, signal.SIGSTOP)  # paused mid-write, holding the lock (a slow disk, a big job)
    try:
        second = run_cli(*big["args"], "--dst", dst, "--overwrite")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=CLI_TIMEOUT)
    assert first.returncode == 0, first_err
    assert second.returncode == 2, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    match = HOLDER.search(second.stderr)
    assert match, second.stderr
    assert int(match.group(1)) == first.pid and match.group(2) == socket.gethostname()
    _assert_intact(dst, big["reference"])


def test_two_runs_started_together_leave_one_intact_output(big: dict[str, Any], tmp_path) -> None:
    """Today's failure: both exited 0 and left a mix. Now the one that gets the lock writes; the other
    exits 2 naming it (the holder is paused once it writes, so the two runs surely overlap)."""
    dst = str(tmp_path / "out")
    runs = {p.pid: p for p in (_start([*big["args"], "--dst", dst]) for _ in range(2))}
    deadline = time.monotonic() + CLI_TIMEOUT
    holder = None
    while holder is None and time.monotonic() < deadline:
        facts = lock.read_holder(lock.lock_path(dst))
        if facts and facts.get("pid") in runs:
            holder = runs[facts["pid"]]
        time.sleep(0.001)
    assert holder is not None
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        (other,) = [p for p in runs.values() if p is not holder]
        _, other_err = other.communicate(timeout=CLI_TIMEOUT)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    _, holder_err = holder.communicate(timeout=CLI_TIMEOUT)
    assert holder.returncode == 0, holder_err
    assert other.returncode == 2, other_err
    match = HOLDER.search(other_err)
    assert match and int(match.group(1)) == holder.pid, other_err
    _assert_intact(dst, big["reference"])


def test_lock_left_by_kill_9_is_taken_over(big: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    first = _start([*big["args"], "--dst", dst])
    _wait_for_temp_file(first, dst)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=CLI_TIMEOUT)
    assert os.path.exists(lock.lock_path(dst))  # left behind, recording a dead pid
    assert lock.is_held(dst) is None
    proc = run_cli(*big["args"], "--dst", dst, "--resume")
    assert proc.returncode == 0, proc.stderr
    _assert_intact(dst, big["reference"])


HOLD = textwrap.dedent("""
    import fcntl, json, os, socket, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": int(sys.argv[2]), "host": socket.gethostname(), "started": "x"}).encode())
    print("held", flush=True)
    time.sleep(120)
""")


def _holder(path: str, recorded_pid: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path, str(recorded_pid)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_held_lock_of_a_live_run_refuses_the_api_before_anything_is_written(big: dict[str, Any], tmp_path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    holder = _holder(str(dst / lock.LOCK_NAME), os.getppid())  # a live pid
    try:
        with pytest.raises(UsageError, match=r"another reshard run \(pid \d+ on host"):
            api.transform(big["r8"], str(dst), big["s8"], big["s16"])
        plan = api.transform(big["r8"], str(dst), big["s8"], big["s16"], destination=api.Destination(dry_run=True)).plan
        for executor in ("local", "ray"):  # also past the destination check, on both executors
            with pytest.raises(UsageError, match="another reshard run"):
                api.execute(plan, root=str(dst), executor=executor)
        assert sorted(os.listdir(dst)) == [lock.LOCK_NAME]  # nothing written, nothing removed
    finally:
        holder.kill()
        holder.wait()


def test_held_lock_whose_recorded_pid_is_dead_is_stale(big: dict[str, Any], tmp_path) -> None:
    """A descriptor inherited by another process keeps the flock; the recorded holder is gone."""
    dst = tmp_path / "out"
    dst.mkdir()
    holder = _holder(str(dst / lock.LOCK_NAME), _dead_pid())
    try:
        proc = run_cli(*big["args"], "--dst", str(dst))
        assert proc.returncode == 0, proc.stderr
        _assert_intact(str(dst), big["reference"])
    finally:
        holder.kill()
        holder.wait()


def test_lock_file_is_no_output_and_is_gone_after_the_run(big: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    os.makedirs(dst)
    with open(lock.lock_path(dst), "w") as fh:  # a stale lock file alone: the destination counts as empty
        json.dump({"pid": _dead_pid(), "host": socket.gethostname(), "started": "x"}, fh)
    proc = run_cli(*big["args"], "--dst", dst)
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(lock.lock_path(dst))
    assert lock.LOCK_NAME not in json.dumps(manifest.read_manifest(dst))
    _assert_intact(dst, big["reference"])


def test_failed_run_leaves_no_lock_and_no_folder(big: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    proc = run_cli(*big["args"], "--dst", dst, "--checksum", "sha256", "--enc-key-env", "NO_SUCH_VAR")
    assert proc.returncode == 2
    assert not os.path.exists(dst)


def test_a_run_refused_before_the_holder_recorded_itself_still_names_it(tmp_path) -> None:
    """A holder writes its facts just after it takes the lock; a run refused in that gap waits for them
    (briefly) so its one line says which run holds the folder."""
    import fcntl
    import threading

    path = lock.lock_path(str(tmp_path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    facts = {"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-12-06 14:00:00 UTC"}
    recorder = threading.Timer(0.1, lambda: os.write(fd, json.dumps(facts).encode()))
    recorder.start()
    try:
        with pytest.raises(UsageError) as refused:
            lock.DestinationLock(str(tmp_path)).acquire()
    finally:
        recorder.join()
        os.close(fd)
    match = HOLDER.search(str(refused.value))
    assert match and int(match.group(1)) == os.getpid(), str(refused.value)
