"""Every stop signal (SIGINT from Ctrl-C, SIGTERM from schedulers and ``timeout``, SIGHUP from a
closed terminal), at every moment of a command, is one line on stderr and exit code 128 + signal:
no temporary file is left, the finished outputs stay journaled, ``--resume`` finishes the job with
the bytes of an uninterrupted run, and a signal after the output was committed says so.

The signals land exactly where they should: the command pauses at a named point
(``RESHARD_TEST_PAUSE_AT``, test-only, ``reshard.interrupts``), writes a marker, and the test
signals it then. (The earlier version of these tests signalled as soon as a temporary file showed
up; on a loaded machine the signal could come after the run, or into a process that had inherited
SIGINT as ignored, and the test failed by chance.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

from reshard import cli, interrupts, manifest
from tests.trust_helpers import CLI_TIMEOUT, SMALL, make_big_job, temp_files, tree

SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
RESUMABLE = re.compile(
    r"^reshard: interrupted \((SIG[A-Z]+)\): (\d+) of (\d+) files completed; "
    r"run the same command with --resume to continue$"
)
COMPLETE = re.compile(
    r"^reshard: interrupted \((SIG[A-Z]+)\): 16 of 16 files completed; "
    r"the output is complete \(--resume has nothing to do\)$"
)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small 8 -> 16 rank transform (16 output files) and the tree of its uninterrupted result."""
    return make_big_job(str(tmp_path_factory.mktemp("sig")), workers=2, shape=SMALL)


def run_paused(
    args: Sequence[str], point: str, signum: int, marker: str, module: str = "reshard.cli"
) -> subprocess.CompletedProcess[str]:
    """Run the command paused at ``point`` and deliver ``signum`` once it waits there.

    The child gets the signal's default disposition whatever the test runner inherited (a suite
    started in the background of a script has SIGINT ignored, and so would reshard, as it should).
    """
    env = {**os.environ, interrupts.PAUSE_ENV: point, interrupts.MARKER_ENV: marker}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL),
    )
    deadline = time.monotonic() + CLI_TIMEOUT
    while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    paused = os.path.exists(marker)
    if paused:
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=CLI_TIMEOUT)
    assert paused, f"the command never reached {point!r}: {proc.returncode} {out} {err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(proc: subprocess.CompletedProcess[str], signum: int) -> str:
    assert proc.returncode == 128 + signum, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"reshard: interrupted ({signal.Signals(signum).name}): "), lines[0]
    return lines[0]


def resume_finishes(job: dict[str, Any], dst: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``--resume`` (in this process: the command's code, without a second interpreter start-up)
    finishes with the bytes of an uninterrupted run; returns what it printed."""
    capsys.readouterr()
    assert cli.main([*job["args"], "--dst", dst, "--resume"]) == 0, capsys.readouterr().err
    assert tree(dst) == job["reference"]
    printed = capsys.readouterr()
    return printed.out + printed.err


# Points of a run where the work is not complete: the line counts what is journaled.
UNFINISHED = ["planned", "file:1", "file:16", "before-manifest", "manifest"]


@pytest.mark.parametrize("point", UNFINISHED)
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_signal_during_a_run_keeps_finished_files_and_resume_finishes(
    job: dict[str, Any], tmp_path, capsys: pytest.CaptureFixture[str], point: str, signum: int
) -> None:
    dst = str(tmp_path / "out")
    proc = run_paused([*job["args"], "--dst", dst], point, signum, str(tmp_path / "marker"))
    line = one_line(proc, signum)
    assert not os.path.exists(dst) or not temp_files(dst)
    assert not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME))
    if point == "planned":
        assert line.endswith("): no output file was written"), line
        assert not os.path.exists(dst) or not manifest.read_journal(dst)
    else:
        match = RESUMABLE.match(line)
        assert match, line
        completed, total = int(match.group(2)), int(match.group(3))
        assert total == 16 and completed == len(manifest.read_journal(dst))
        assert completed == 16 if point in ("before-manifest", "manifest") else completed < 16
    resume_finishes(job, dst, capsys)


@pytest.mark.parametrize("point", ["committed", "exit"])
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_signal_after_the_output_is_committed_says_it_is_complete(
    job: dict[str, Any], tmp_path, capsys: pytest.CaptureFixture[str], point: str, signum: int
) -> None:
    """The work is done, yet the signal is not lost: 128 + signal, and the line says nothing is left."""
    dst = str(tmp_path / "out")
    proc = run_paused([*job["args"], "--dst", dst], point, signum, str(tmp_path / "marker"))
    assert COMPLETE.match(one_line(proc, signum)), proc.stderr
    assert tree(dst) == job["reference"]  # manifest in place, journal gone, nothing temporary
    before = {name: os.stat(os.path.join(dst, name)).st_mtime_ns for name in job["reference"]}
    resumed = resume_finishes(job, dst, capsys)
    assert "kept 16" in resumed or "nothing to do" in resumed
    rewritten = [
        n for n in before if n != manifest.MANIFEST_NAME and os.stat(os.path.join(dst, n)).st_mtime_ns != before[n]
    ]
    assert not rewritten


def test_sigterm_while_the_main_thread_copies(
    job: dict[str, Any], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One worker: the main thread itself is inside a file's write when the signal lands."""
    dst = str(tmp_path / "out")
    assert job["args"][-2:] == ["--workers", "2"]
    args = [*job["args"][:-1], "1", "--dst", dst]
    proc = run_paused(args, "file:3", signal.SIGTERM, str(tmp_path / "marker"))
    match = RESUMABLE.match(one_line(proc, signal.SIGTERM))
    assert match and int(match.group(2)) == 2 == len(manifest.read_journal(dst)), proc.stderr
    assert not temp_files(dst)
    resume_finishes(job, dst, capsys)


def test_no_manifest_run_says_resume_cannot_continue(job: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    proc = run_paused([*job["args"], "--dst", dst, "--no-manifest"], "file:4", signal.SIGTERM, str(tmp_path / "m"))
    assert "files completed; without a manifest (--no-manifest) --resume cannot" in one_line(proc, signal.SIGTERM)
    assert not temp_files(dst)


def test_no_manifest_run_interrupted_after_its_last_file_is_complete(job: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    proc = run_paused([*job["args"], "--dst", dst, "--no-manifest"], "exit", signal.SIGHUP, str(tmp_path / "m"))
    assert COMPLETE.match(one_line(proc, signal.SIGHUP)), proc.stderr


# Start-up: before any of reshard's heavy modules is imported, inside the import of one (the operations'
# API; numpy loads only with the first array a run makes), and while the arguments are parsed; through
# each way the command starts.
STARTUP = ["startup", "import:reshard.cli", "import:reshard.api", "import:rich", "parse"]


@pytest.mark.parametrize("point", STARTUP)
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_signal_while_starting_is_one_line(tmp_path, point: str, signum: int) -> None:
    proc = run_paused(["inspect", str(tmp_path)], point, signum, str(tmp_path / "marker"))
    assert one_line(proc, signum).endswith("): no output file was written"), proc.stderr


@pytest.mark.parametrize("module", ["reshard", "reshard.entry", "reshard.cli"])
def test_every_way_of_starting_installs_the_handlers_first(tmp_path, module: str) -> None:
    """``python -m reshard``, the console script's module and ``python -m reshard.cli``."""
    if module == "reshard.entry":  # what the console script runs: reshard.entry:main
        code = "import sys; from reshard.entry import main; sys.exit(main())"
        args: list[str] = ["-c", code, "inspect", str(tmp_path)]
        marker = str(tmp_path / "marker")
        env = {**os.environ, interrupts.PAUSE_ENV: "import:reshard.api", interrupts.MARKER_ENV: marker}
        # SIGINT's default disposition, as run_paused gives: a suite run in the background inherits it ignored
        proc = subprocess.Popen(
            [sys.executable, *args],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        while not os.path.exists(marker) and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=CLI_TIMEOUT)
        result = subprocess.CompletedProcess(proc.args, proc.returncode, "", err)
    else:
        result = run_paused(
            ["inspect", str(tmp_path)], "import:reshard.api", signal.SIGINT, str(tmp_path / "m"), module
        )
    assert one_line(result, signal.SIGINT).endswith("): no output file was written")


def test_interrupt_before_any_output_says_nothing_was_written(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.interrupted(interrupts.Signalled(signal.SIGTERM)) == 143
    assert capsys.readouterr().err == "reshard: interrupted (SIGTERM): no output file was written\n"
    assert cli.interrupted(KeyboardInterrupt()) == 130


def test_an_inherited_ignored_sigint_stays_ignored(tmp_path) -> None:
    """``reshard ... &`` in a script (SIGINT ignored by the shell, on purpose) keeps ignoring it."""
    marker = str(tmp_path / "marker")
    env = {**os.environ, interrupts.PAUSE_ENV: "parse", interrupts.MARKER_ENV: marker}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", "inspect", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    while not os.path.exists(marker) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # still paused: the signal was ignored
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=CLI_TIMEOUT)
    assert proc.returncode == 143, err
