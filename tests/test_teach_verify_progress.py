"""``verify`` shows its progress on long runs: a bar of bytes compared with an ETA when stderr is a
terminal, nothing on a pipe unless ``--progress`` asks for plain lines, and through the API the
same ``on_start`` / ``progress`` hooks a transform's ``RunOptions`` has, adding up exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard import demo, verify
from tests.trust_helpers import run_cli


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("teach-verify") / "demo"
    demo.main(str(folder))
    return folder


def _sides(d: Path) -> list[str]:
    return [
        str(d / "ckpt_8ranks"),
        str(d / "ckpt_4ranks"),
        "--a-strategy",
        str(d / "strategy_8"),
        "--b-strategy",
        str(d / "strategy_4"),
    ]


def test_the_api_reports_every_byte_compared(demo_dir: Path) -> None:
    totals: list[int] = []
    steps: list[int] = []
    report = verify.verify(
        str(demo_dir / "full" / "model.ckpt"),
        str(demo_dir / "ckpt_8ranks"),
        b_strategy=str(demo_dir / "strategy_8"),
        max_memory=64 * 1024,  # small blocks: a large tensor is reported as it goes, not at its end
        on_start=totals.append,
        progress=steps.append,
    )
    assert report.ok
    assert len(totals) == 1 and totals[0] == sum(steps) > 0
    assert len(steps) > len(report.results)  # block by block
    assert all(step > 0 for step in steps)


def test_names_on_one_side_only_are_not_counted(demo_dir: Path, tmp_path: Path) -> None:
    from reshard.formats.ckpt import save_ckpt
    from reshard.sources import open_checkpoint

    full = demo_dir / "full" / "model.ckpt"
    with open_checkpoint(str(full)) as index:
        names = sorted(index)
        kept = {name: index.array(name).copy() for name in names[: len(names) // 2]}
    partial = tmp_path / "half.ckpt"
    save_ckpt(str(partial), kept)
    totals: list[int] = []
    steps: list[int] = []
    report = verify.verify(str(full), str(partial), on_start=totals.append, progress=steps.append)
    assert not report.ok and report.missing
    assert totals == [sum(a.nbytes for a in kept.values())] and sum(steps) == totals[0]


def test_no_progress_on_a_pipe_by_default(demo_dir: Path) -> None:
    proc = run_cli("verify", *_sides(demo_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no bar, no escape codes, no lines
    assert proc.stdout.startswith("SAME: 119 match")


def test_progress_flag_on_a_pipe_prints_plain_lines(demo_dir: Path) -> None:
    proc = run_cli("verify", *_sides(demo_dir), "--progress", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True  # stdout holds the report only
    lines = proc.stderr.splitlines()
    assert lines and lines[-1].startswith("reshard: comparing ") and "(100%)" in lines[-1], proc.stderr
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr


@pytest.mark.parametrize("flag", ["--quiet", "--no-progress"])
def test_quiet_or_no_progress_silences_it(demo_dir: Path, flag: str) -> None:
    proc = run_cli("verify", *_sides(demo_dir), "--progress" if flag == "--quiet" else "--json", flag)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _on_a_terminal(args: list[str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal: (exit code, stdout, what the terminal got)."""
    master, slave = os.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "reshard.cli", *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    out, _ = proc.communicate(timeout=300)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_a_bar_on_a_terminal(demo_dir: Path) -> None:
    code, out, terminal = _on_a_terminal(["verify", *_sides(demo_dir)])
    assert code == 0 and out.startswith("SAME: 119 match")
    assert "comparing" in terminal and "MiB" in terminal  # the bar: bytes compared, speed, ETA
    code, out, terminal = _on_a_terminal(["verify", *_sides(demo_dir), "--no-progress"])
    assert code == 0 and "comparing" not in terminal
