"""``bench/big_run.py`` (a model larger than RAM, docs/benchmarks.md) keeps working: a tiny model
end to end (inputs written slice by slice, the transform verified, ``cp -r`` timed, everything
deleted), and a disk too small is refused before anything is written.

Speed is never asserted here: the recorded run is docs/benchmarks.md's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIG_RUN = ROOT / "bench" / "big_run.py"

pytest.importorskip("psutil")


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(BIG_RUN), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_tiny_model_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = _run(
        ["--size", "48M", "--hidden", "96", "--work", str(work), "--no-settle", "--json", str(tmp_path / "r.json")]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["tensors_verified"] > 100  # every output tensor was compared with the formula
    assert 0.9 < result["output_bytes"] / result["input_bytes"] < 1.1
    assert result["reshard"]["wall"] > 0 and result["cp"]["wall"] > 0 and result["reshard"]["peak_rss"] > 0
    assert not work.exists()  # everything it made is deleted


def test_refuses_a_disk_too_small(tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = _run(["--size", "48M", "--hidden", "96", "--work", str(work), "--headroom", "1000000T"])
    assert proc.returncode == 1 and "not enough free disk" in proc.stderr and proc.stderr.count("\n") == 1
    assert not work.exists()


def test_refuses_an_existing_folder(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    proc = _run(["--size", "48M", "--hidden", "96", "--work", str(tmp_path)])
    assert proc.returncode == 1 and "exists" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"
