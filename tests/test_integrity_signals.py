"""SIGTERM and SIGHUP (what schedulers, ``timeout`` and a closed terminal send) are handled like
Ctrl-C: no temporary file is left, the finished outputs stay journaled, one line says how many
files were completed and that ``--resume`` continues, and the exit code is 128 + the signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from reshard import cli, manifest
from tests.trust_helpers import CLI_TIMEOUT, make_big_job, run_cli, temp_files, tree

POLL_SECONDS = 0.001
LINE = re.compile(
    r"^reshard: interrupted \((SIG[A-Z]+)\): (\d+) of (\d+) files completed; "
    r"run the same command with --resume to continue$"
)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    job = make_big_job(str(tmp_path_factory.mktemp("sig")), workers=2)
    return job


def _signal_mid_write(args: list[str], dst: str, signum: int) -> subprocess.CompletedProcess[str]:
    """Start the CLI and send ``signum`` as soon as an output is being written (a temp file exists)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + CLI_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.isdir(dst) and temp_files(dst):
            proc.send_signal(signum)
            break
        time.sleep(POLL_SECONDS)
    out, err = proc.communicate(timeout=CLI_TIMEOUT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_run_cleans_up_and_resume_finishes(big: dict[str, Any], tmp_path, signum: int) -> None:
    dst = str(tmp_path / "out")
    proc = _signal_mid_write([*big["args"], "--dst", dst], dst, signum)
    assert proc.returncode == 128 + signum, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    match = LINE.match(lines[0])
    assert match, lines[0]
    assert match.group(1) == signal.Signals(signum).name
    completed, total = int(match.group(2)), int(match.group(3))
    assert total == 16 and completed < 16
    assert not temp_files(dst)
    journaled = manifest.read_journal(dst)
    assert len(journaled) == completed
    assert not os.path.exists(os.path.join(dst, manifest.MANIFEST_NAME))
    resumed = run_cli(*big["args"], "--dst", dst, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert tree(dst) == big["reference"]


def test_sigterm_while_the_main_thread_copies(big: dict[str, Any], tmp_path) -> None:
    """One worker: the main thread itself is inside a copy when the signal lands."""
    dst = str(tmp_path / "out")
    args = [*big["args"][:-1], "1", "--dst", dst]
    assert big["args"][-2:] == ["--workers", "2"]
    proc = _signal_mid_write(args, dst, signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr
    assert LINE.match(proc.stderr.strip()), proc.stderr
    assert not temp_files(dst)
    assert run_cli(*big["args"], "--dst", dst, "--resume").returncode == 0
    assert tree(dst) == big["reference"]


def test_interrupt_before_any_output_says_nothing_was_written(capsys: pytest.CaptureFixture[str]) -> None:
    """A signal while planning (no run recorded yet): 143 and one line."""
    assert cli.interrupted(cli.Signalled(signal.SIGTERM)) == 143
    assert capsys.readouterr().err == "reshard: interrupted (SIGTERM): no output file was written\n"
    assert cli.interrupted(KeyboardInterrupt()) == 130


def test_no_manifest_run_says_resume_cannot_continue(big: dict[str, Any], tmp_path) -> None:
    dst = str(tmp_path / "out")
    proc = _signal_mid_write([*big["args"], "--dst", dst, "--no-manifest"], dst, signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr
    assert "files completed; without a manifest (--no-manifest) --resume cannot" in proc.stderr
    assert not temp_files(dst)
